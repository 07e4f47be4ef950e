"""Scoring token windows against exact communication's log-probs: the per-position negative
log-likelihood, KL and top-1 agreement of a model's current communication (``models.calibrate``,
the accuracy benchmarks)."""

from __future__ import annotations

__all__ = ["metrics_fns", "score_windows"]


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
