"""The Llama of ``examples/explicit_llama.py`` sharded by annotations alone (GSPMD, Auto axes).

How the JAX model zoo (bonsai) and MaxText write models: the weights are placed with
``NamedSharding`` (the same :class:`examples.explicit_llama.Sharding` and loader), activations
are pinned with ``jax.lax.with_sharding_constraint``, and XLA's SPMD partitioner inserts the
collectives after tracing. No out_sharding, no reshard, no shard_map, no jax_flashcomm import:
``jax_flashcomm.rewrite`` finds the collectives (``examples/rewrite_llama.py --style gspmd``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from examples.explicit_llama import (Dims, activation, embed_tokens, layer_attention,
                                     local_heads, post_norm, qk_heads, rms_norm, scale_and_mask)

__all__ = ["logits"]


def _attention(w, x, cfg, n, tp, pin, row_out, window, theta):
    b, s, _ = x.shape
    dh, (q, kv) = cfg.head_dim, local_heads(cfg, n)
    qkv = jnp.einsum("bsd,de->bse", x, w["qkv"])
    if "qkv_bias" in w:
        qkv = qkv + w["qkv_bias"]
    qkv = pin(jnp.reshape(qkv, (b, s, n, q + 2 * kv, dh)), P(None, None, tp))
    positions = jnp.arange(s)
    qh, kh = qk_heads(w, qkv[:, :, :, :q], qkv[:, :, :, q:q + kv], cfg, positions, theta)
    vh = qkv[:, :, :, q + kv:]
    qg = pin(jnp.reshape(qh, (b, s, n, kv, q // kv, dh)), P(None, None, tp))
    scores = jnp.einsum("bsnkgh,btnkh->bnkgst", qg, kh, preferred_element_type=jnp.float32)
    scores = scale_and_mask(scores, cfg, positions, window)
    probs = jax.nn.softmax(scores, axis=-1).astype(vh.dtype)
    out = jnp.einsum("bnkgst,btnkh->bsnkgh", probs, vh)
    out = pin(jnp.reshape(out, (b, s, n * q * dh)), P(None, None, tp))
    return pin(jnp.einsum("bse,ed->bsd", out, w["o"]), row_out)


def _mlp(w, x, cfg, n, tp, pin, row_out):
    b, s, _ = x.shape
    gate_up = pin(jnp.reshape(jnp.einsum("bsd,de->bse", x, w["gate_up"]), (b, s, n, 2, -1)),
                  P(None, None, tp))
    h = activation(cfg, gate_up[:, :, :, 0]) * gate_up[:, :, :, 1]
    h = pin(jnp.reshape(h, (b, s, -1)), P(None, None, tp))
    return pin(jnp.einsum("bsf,fd->bsd", h, w["down"]), row_out)


def logits(dims: Dims, mesh, weights: dict, tokens: jax.Array, *,
           sequence_parallel: bool = False) -> jax.Array:
    """f32 logits ``(B, S, V)`` of ``tokens (B, S)``, the math of
    :func:`examples.explicit_llama.logits`.

    Args:
      dims: :func:`examples.explicit_llama.load`'s first result.
      mesh: the mesh (Auto axes) the weights were loaded on.
      weights: the loader's second result.
      tokens: token ids, replicated.
      sequence_parallel: the residual stream pinned sharded over the sequence between blocks.
    """
    cfg, n, tp = dims.config, dims.tp, dims.axis

    def pin(x, spec):
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    row_out = P(None, tp, None) if sequence_parallel else P()
    x = pin(embed_tokens(weights, tokens, cfg), row_out)
    gather = (lambda h: pin(h, P())) if sequence_parallel else (lambda h: h)
    for i, w in enumerate(weights["layers"]):
        h = gather(rms_norm(x, w["attn_norm"], cfg.rms_eps))
        x = x + post_norm(w, "post_attn_norm", _attention(
            w, h, cfg, n, tp, pin, row_out, *layer_attention(cfg, i)), cfg)
        h = gather(rms_norm(x, w["mlp_norm"], cfg.rms_eps))
        x = x + post_norm(w, "post_mlp_norm", _mlp(w, h, cfg, n, tp, pin, row_out), cfg)
    h = gather(rms_norm(x, weights["norm"], cfg.rms_eps))
    return jnp.einsum("bsd,vd->bsv", h, weights["lm_head"], preferred_element_type=jnp.float32)
