"""Tensor-parallel attention with query-split Flash-RS (Flash-Overlap, arXiv 2604.24013, Fig. 8).

Sequence-parallel in and out, heads sharded over the TP axis in between:

    x (B, S/N, D)  --all_gather_matmul(w_qkv)-->  q, k, v (B, S, h, dh)   [ring AG + dot]
    for each query block b (S/N rows):  o_b = attention(q_b, k, v) @ w_o   [partial (B, S/N, D)]
    ring reduce-scatter of the o_b over the TP axis                       [-> (B, S/N, D)]

Instead of the whole attention, then the output projection, then a reduce-scatter that waits
for both, the output projection and the reduce-scatter are decomposed over query chunks: the
partial output of query block b (attention of those queries and its projection) is computed in
the ring step that forwards the running sum of the block before it, and the block that stays on
this rank is computed last. Gradients come from autodiff of the ring (the transpose of a
``ppermute`` is the reverse ``ppermute``) and from the custom VJP of ``all_gather_matmul``.
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm.collective_matmul import _resolve_ring, all_gather_matmul
from jax_flashcomm.rings import _axis_size, _rs_ring

__all__ = ["tp_attention", "TPAttention"]


def _attend(q, k, v, q_start, causal):
    """softmax(q k^T / sqrt(dh)) v for queries at positions q_start + [0, q.shape[1])."""
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    if causal:
        qpos = q_start + jnp.arange(q.shape[1])
        kpos = jnp.arange(k.shape[1])
        scores = jnp.where(qpos[:, None] >= kpos[None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    return jnp.einsum("bhqk,bkhd->bqhd", probs, v)


def tp_attention(x, w_qkv, w_o, axis_name, *, num_heads, causal=True, decomposed=True,
                 bidirectional=False, transport="auto", p2p_timeout_ms=60_000):
    """One TP attention block on local shards (call inside ``jax.shard_map``).

    ``x``: ``(B, S/N, D)``, this rank's sequence positions. ``w_qkv``: ``(D, 3 * h * dh)``, the
    q, k and v columns of this rank's ``h = num_heads`` heads (in that order). ``w_o``:
    ``(h * dh, D)``, the rows of the output projection for these heads. Returns this rank's
    ``(B, S/N, D)`` positions of the block's output (before any residual).
    ``decomposed=False`` is the unfused reference: all_gather, dot, attention, dot,
    psum_scatter. ``transport``, ``p2p_timeout_ms``: how the rings' chunks move
    (:func:`jax_flashcomm.all_gather_matmul`).
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
    n = _axis_size(axis_name, "tp_attention")
    s_local = x.shape[1]
    b = x.shape[0]
    if decomposed:
        ring = _resolve_ring(transport, axis_name, "tp_attention", p2p_timeout_ms)
        qkv = all_gather_matmul(x, w_qkv, axis_name, axis=1, bidirectional=bidirectional,
                                transport=transport, p2p_timeout_ms=p2p_timeout_ms)
    else:
        qkv = lax.all_gather(x, axis_name, axis=1, tiled=True) @ w_qkv
    q, k, v = (a.reshape(b, n * s_local, num_heads, dh) for a in jnp.split(qkv, 3, axis=-1))

    def block(start, size):  # this rank's partial output for query rows [start, start + size)
        qb = lax.dynamic_slice_in_dim(q, start, size, axis=1)
        o = _attend(qb, k, v, start, causal)
        return o.reshape(b, size, num_heads * dh) @ w_o

    if not decomposed:
        return lax.psum_scatter(block(0, n * s_local), axis_name, scatter_dimension=1, tiled=True)
    return _rs_ring(block, axis_name, n, s_local, 1, bidirectional, ring)


class TPAttention(nnx.Module):
    """Sequence-parallel in/out TP attention block (query-split Flash-RS), over one mesh axis.

    ``__call__(x)``: ``x`` is ``(B, S, D)`` sharded ``P(batch_axis, axis_name, None)``; returns
    the same layout. ``w_qkv`` ``(D, N * 3 * h * dh)`` holds, for each rank of ``axis_name`` in
    turn, the q, k and v columns of its ``h = num_heads / N`` heads; ``w_o`` ``(num_heads * dh,
    D)`` is sharded by rows the same way. ``transport``: how the rings' chunks move ("auto",
    "xla" or "p2p", :func:`jax_flashcomm.all_gather_matmul`).
    """

    def __init__(self, d_model: int, num_heads: int, head_dim: int, *, mesh,
                 axis_name: str = "tp", batch_axis: str | None = None, causal: bool = True,
                 decomposed: bool = True, bidirectional: bool = False,
                 transport: str = "auto", dtype=jnp.float32, rngs: nnx.Rngs):
        n = mesh.shape[axis_name]
        if num_heads % n:
            raise ValueError(f"TPAttention: num_heads={num_heads} is not divisible by the size "
                             f"{n} of mesh axis {axis_name!r}")
        self.mesh, self.axis_name, self.batch_axis = mesh, axis_name, batch_axis
        self.local_heads = num_heads // n
        self.causal, self.decomposed, self.bidirectional = causal, decomposed, bidirectional
        self.transport = transport
        init = jax.nn.initializers.lecun_normal()
        put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
        self.w_qkv = nnx.Param(put(init(rngs.params(), (d_model, 3 * num_heads * head_dim),
                                        dtype), P(None, axis_name)))
        self.w_o = nnx.Param(put(init(rngs.params(), (num_heads * head_dim, d_model), dtype),
                                 P(axis_name, None)))

    def __call__(self, x):
        fn = partial(tp_attention, axis_name=self.axis_name, num_heads=self.local_heads,
                     causal=self.causal, decomposed=self.decomposed,
                     bidirectional=self.bidirectional, transport=self.transport)
        xspec = P(self.batch_axis, self.axis_name, None)
        return jax.shard_map(fn, mesh=self.mesh, out_specs=xspec,
                             in_specs=(xspec, P(None, self.axis_name), P(self.axis_name, None)),
                             )(x, self.w_qkv[...], self.w_o[...])
