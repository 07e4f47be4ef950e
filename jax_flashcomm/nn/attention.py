"""Attention math shared by every TP attention in the package, and the query-split ring block.

:func:`attend` is causal GQA attention by positions; :class:`jax_flashcomm.nn.TPAttention` (the
package's TP attention layer) and :func:`tp_attention` both run it.

:func:`tp_attention` is one TP attention block with query-split Flash-RS (Flash-Overlap, arXiv
2604.24013, Fig. 8), sequence-parallel in and out, heads sharded over the TP axis in between:

    x (B, S/N, D)  --all_gather_matmul(w_qkv)-->  q, k, v (B, S, h, dh)   [ring AG + dot]
    for each query block b (S/N rows):  o_b = attention(q_b, k, v) @ w_o   [partial (B, S/N, D)]
    ring reduce-scatter of the o_b over the TP axis                       [-> (B, S/N, D)]

Instead of the whole attention, then the output projection, then a reduce-scatter that waits
for both, the output projection and the reduce-scatter are decomposed over query chunks: the
partial output of query block b is computed in the ring step that forwards the running sum of
the block before it, and the block that stays on this rank is computed last. Gradients come
from autodiff of the ring and from the custom VJP of ``all_gather_matmul``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.collective_matmul import all_gather_matmul, ring_spec
from jax_flashcomm.config import config_from, option
from jax_flashcomm.planner import plan
from jax_flashcomm._rings import rs_ring

__all__ = ["attend", "tp_attention"]


def attend(q, k, v, qpos, kpos, *, causal: bool = True, scale: float | None = None,
           window=None):
    """``softmax(q k^T * scale) v``, each group of query heads sharing one KV head.

    Args:
      q: ``(B, S, hq, dh)`` queries; ``k``, ``v``: ``(B, T, hkv, dh)`` with ``hq % hkv == 0``.
      qpos, kpos: ``(S,)`` and ``(T,)`` positions; with ``causal`` a query sees the keys at
        positions up to its own.
      scale: the score scale, ``1 / sqrt(dh)`` by default.
      window: None, or a sliding window (an int or a traced int32 scalar): a query also sees
        only the keys less than ``window`` positions behind it.

    Returns:
      ``(B, S, hq, dh)`` in ``v``'s dtype (scores and softmax in f32).
    """
    b, s, hq, dh = q.shape
    hkv = k.shape[2]
    qg = q.reshape(b, s, hkv, hq // hkv, dh)
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(dh) if scale is None else scores * scale
    if causal:
        scores = jnp.where(kpos[None, :] <= qpos[:, None], scores, -jnp.inf)
    if window is not None:
        scores = jnp.where(qpos[:, None] - kpos[None, :] < window, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v)
    return out.reshape(b, s, hq, dh)


def tp_attention(x: jax.Array, w_qkv: jax.Array, w_o: jax.Array, axis_name, *, num_heads: int,
                 causal: bool = True, decomposed: bool = True, bidirectional: bool = False,
                 transport: str = option("transport"),
                 p2p_timeout_ms: int = option("p2p_timeout_ms")) -> jax.Array:
    """One TP attention block on local shards (call inside ``jax.shard_map``).

    The block is exact. The attention math is :func:`attend`, the one
    :class:`~jax_flashcomm.nn.TPAttention` runs.

    Args:
      x: ``(B, S/N, D)``, this rank's sequence positions.
      w_qkv: ``(D, 3 * h * dh)``, the q, k and v columns of this rank's ``h = num_heads``
        heads (in that order).
      w_o: ``(h * dh, D)``, the rows of the output projection for these heads.
      axis_name: the TP mesh axis (or a tuple of axes).
      num_heads: ``h``, this rank's heads.
      causal: mask keys after each query's position.
      decomposed: False is the unfused reference: all_gather, dot, attention, dot,
        psum_scatter.
      bidirectional: split every ring chunk over both directions.
      transport, p2p_timeout_ms: how the rings' chunks move (the options of
        :func:`jax_flashcomm.all_gather_matmul`).

    Returns:
      This rank's ``(B, S/N, D)`` positions of the block's output (before any residual).

    Raises:
      ValueError: weights whose shapes do not match ``x`` and ``num_heads``.
    """
    if x.ndim != 3:
        raise ValueError(f"tp_attention: x must be (batch, seq, d_model), got shape {x.shape}")
    if w_qkv.ndim != 2 or w_qkv.shape[0] != x.shape[-1]:
        raise ValueError(f"tp_attention: w_qkv must be (d_model={x.shape[-1]}, 3*heads*dh), "
                         f"got shape {w_qkv.shape}")
    if not isinstance(num_heads, int) or num_heads < 1 or w_qkv.shape[1] % (3 * num_heads):
        raise ValueError(f"tp_attention: w_qkv.shape[1]={w_qkv.shape[1]} is not 3 * num_heads "
                         f"({num_heads}) * head_dim")
    dh = w_qkv.shape[1] // (3 * num_heads)
    if w_o.shape != (num_heads * dh, x.shape[-1]):
        raise ValueError(f"tp_attention: w_o must be (heads*dh={num_heads * dh}, "
                         f"d_model={x.shape[-1]}), got shape {w_o.shape}")
    config = config_from(None, dict(bits=None, transport=transport,
                                    p2p_timeout_ms=p2p_timeout_ms), "tp_attention")
    axes = _axes.normalize_axes(axis_name, "tp_attention")
    n = _axes.axis_size(axes)
    s_local = x.shape[1]
    b = x.shape[0]
    if decomposed:
        ring = ring_spec(plan("matmul_reduce_scatter", axes, x.shape, x.dtype, n, config,
                              where="tp_attention"))
        qkv = all_gather_matmul(x, w_qkv, axis_name, axis=1, bidirectional=bidirectional,
                                config=config)
    else:
        qkv = lax.all_gather(x, axis_name, axis=1, tiled=True) @ w_qkv
    q, k, v = (a.reshape(b, n * s_local, num_heads, dh) for a in jnp.split(qkv, 3, axis=-1))

    def block(start, size):  # this rank's partial output for query rows [start, start + size)
        qb = lax.dynamic_slice_in_dim(q, start, size, axis=1)
        o = attend(qb, k, v, start + jnp.arange(size), jnp.arange(k.shape[1]), causal=causal)
        return o.reshape(b, size, num_heads * dh) @ w_o

    if not decomposed:
        return lax.psum_scatter(block(0, n * s_local), axis_name, scatter_dimension=1, tiled=True)
    return rs_ring(block, axis_name, n, s_local, 1, bidirectional, ring)
