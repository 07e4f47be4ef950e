"""What the accuracy benchmarks share (:mod:`benchmarks.accuracy`,
:mod:`benchmarks.layer_sensitivity`): scoring token windows against exact communication's
log-probs, and the wire bytes per element of a setting."""

from __future__ import annotations

__all__ = ["wire", "metrics_fns", "score_windows"]


def wire(config) -> dict:
    """Wire bytes per element, averaged over the two phases (a bf16 ring moves 2.0), and the
    ratio to a bf16 ring (padding to whole groups left out: it is the same for every row of a
    message size and below 0.5% here except per-tensor)."""
    from jax_flashcomm.codec import spec

    if config is None:
        return {"bytes_per_element": 2.0, "vs_bf16_ring": 1.0}
    per = (spec.wire_bytes_per_element(config.phase1_bits, config.group_size,
                                       config.phase1_spikes)
           + spec.wire_bytes_per_element(config.phase2_bits, config.group_size,
                                         config.phase2_spikes)) / 2
    return {"bytes_per_element": per, "vs_bf16_ring": per / 2.0}


def metrics_fns():
    """jit: ``log_probs(logits)`` of the next token at every position but the last of one
    window, and ``compare(logp, tokens, ref_logp)``: ``(nll, kl, top1_equal)`` per position,
    KL(ref || logp)."""
    import jax
    import jax.numpy as jnp

    @jax.jit
    def log_probs(logits):
        return jax.nn.log_softmax(logits[0, :-1].astype(jnp.float32), axis=-1)

    @jax.jit
    def compare(logp, tokens, ref_logp):
        nll = -jnp.take_along_axis(logp, tokens[0, 1:, None], axis=-1)[:, 0]
        kl = jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), axis=-1)
        top1 = jnp.argmax(logp, axis=-1) == jnp.argmax(ref_logp, axis=-1)
        return nll, kl, top1

    return log_probs, compare


def score_windows(model, mesh, windows, reference=None) -> dict:
    """Scores every window with ``model``'s current communication: per position ``nll``, ``kl``
    and ``top1`` (numpy, all windows concatenated) against ``reference`` (exact's list of
    log-prob arrays), or, when ``reference`` is None, against itself, returning its log-probs
    as ``logps`` to be the reference of later calls."""
    import numpy as np

    from models.engine import Engine

    engine = Engine(model, mesh, cache_len=max(len(windows[0]), 64))
    log_probs, compare = metrics_fns()
    nll, kl, top1, logps = [], [], [], []
    for i, w in enumerate(windows):
        tokens = np.asarray([w], np.int32)
        logp = log_probs(engine.score(tokens))
        if reference is None:
            logps.append(np.asarray(logp))
        n, k, t = compare(logp, tokens, logp if reference is None else reference[i])
        nll.append(np.asarray(n, np.float64))
        kl.append(np.asarray(k, np.float64))
        top1.append(np.asarray(t))
    nll, kl, top1 = (np.concatenate(a) for a in (nll, kl, top1))
    return {"nll": nll, "kl": kl, "top1": top1, "logps": logps}
