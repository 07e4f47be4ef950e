"""Tensor-parallel transformer blocks (Flax NNX): RMSNorm, RoPE, GQA attention with a KV cache
(optional q/k/v biases, QK-norm, a sliding window), the gated MLP (SwiGLU or GeGLU).
``__call__`` runs on local shards inside ``jax.shard_map``; parameters are at global shape with
``out_sharding`` metadata (see :mod:`jax_flashcomm.nn.linear`).

Head layout over ``tp`` ranks: each rank owns ``n_heads / tp`` consecutive query heads and, in
``kv_local`` slots, the KV heads those queries read (:func:`kv_heads`): ``n_kv_heads / tp`` of
them when ``tp`` divides ``n_kv_heads``; otherwise each KV head is replicated over the ranks
whose queries use it (vLLM's layout when ``tp`` is a multiple of ``n_kv_heads``, and also e.g.
12 query / 2 KV heads over 3 ranks, where the middle rank holds both). The q, k and v
projections are one column-parallel matmul whose columns are, per rank, that rank's q, k and v
heads (one ring in the sequence-parallel layout); gate and up of the MLP likewise.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_flashcomm.fused_norm import rms_norm
from jax_flashcomm.nn.attention import attend
from jax_flashcomm.nn.comm import TPComm
from jax_flashcomm.nn.linear import ColumnParallelLinear, RowParallelLinear, init_param

__all__ = ["ACTIVATIONS", "RMSNorm", "TPAttention", "TPMLP", "kv_heads", "check_heads",
           "padded_ffn", "rope"]

#: The gated MLP's activations by name: SwiGLU's SiLU and GeGLU's tanh-approximated GELU.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Raise a clear ValueError unless ``tp`` ranks can split these heads.

    Args:
      n_heads: query heads.
      n_kv_heads: KV heads (divides ``n_heads``).
      tp: the TP size: it must divide ``n_heads``.

    Raises:
      ValueError: the heads do not split over ``tp`` ranks (the message lists the sizes that
        do).
    """
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise ValueError(f"the TP size must be a positive int, got {tp!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    if n_heads % tp:
        sizes = [d for d in range(1, n_heads + 1) if n_heads % d == 0]
        raise ValueError(f"TP size {tp} does not divide the {n_heads} query heads "
                         f"({n_kv_heads} KV heads): use one of {sizes}")


def kv_heads(n_heads: int, n_kv_heads: int, tp: int) -> list[int]:
    """For each KV slot (``tp * kv_local`` of them, rank-major), the checkpoint KV head it holds.

    A rank's ``n_heads / tp`` query heads are cut into ``kv_local`` equal runs of consecutive
    heads that share one KV head (the run length is ``gcd(n_heads / tp, n_heads / n_kv_heads)``);
    slot ``j`` of the rank holds the KV head of run ``j``.

    Args:
      n_heads: the checkpoint's query heads.
      n_kv_heads: the checkpoint's KV heads.
      tp: the TP size (valid for these heads: :func:`check_heads`).

    Returns:
      ``range(n_kv_heads)`` when ``tp`` divides ``n_kv_heads``; each head replicated over
      ``tp / n_kv_heads`` consecutive ranks when ``tp`` is a multiple of it; in general the list
      above.
    """
    check_heads(n_heads, n_kv_heads, tp)
    q_local, group = n_heads // tp, n_heads // n_kv_heads
    run = math.gcd(q_local, group)
    return [(r * q_local + j * run) // group for r in range(tp) for j in range(q_local // run)]


def padded_ffn(ffn_dim: int, tp: int) -> int:
    """The MLP width rounded up to a multiple of ``tp`` (padding units are zero: exact).

    Args:
      ffn_dim: the MLP's hidden width.
      tp: the TP size.

    Returns:
      The padded width.
    """
    return -(-ffn_dim // tp) * tp


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding, rotate-half layout (Hugging Face Llama). Angles in f32.

    Args:
      x: ``(B, S, h, dh)`` queries or keys (``dh`` even).
      positions: ``(S,)`` integer positions.
      theta: the RoPE base (e.g. 10000.0).

    Returns:
      ``x`` rotated, same shape and dtype.
    """
    dh = x.shape[-1]
    inv_freq = 1.0 / (theta ** (jnp.arange(0, dh, 2, dtype=jnp.float32) / dh))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[None, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (x.astype(jnp.float32) * cos + rotated * sin).astype(x.dtype)


class RMSNorm(nnx.Module):
    """``x / rms(x) * scale`` over the last axis, in f32; replicated scale.

    Args:
      dim: the size of the last axis.
      eps: added to the mean square.
      dtype: the scale's dtype.
      rngs: any ``nnx.Rngs`` initializes the scale to ones; None to zeros (weights to load).
    """

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32,
                 rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.scale = init_param(rngs, (dim,), dtype, (None,), scale=1.0)

    def __call__(self, x):
        return rms_norm(x, self.scale[...], self.eps)


class TPAttention(nnx.Module):
    """Causal GQA self-attention, heads sharded over ``comm.axis_name``, RoPE, optional KV cache.

    ``__call__(x, start, cache=None, *, decode=False, sp=False, window=None, theta=None)`` on
    local shards: ``x`` is ``(B, S, D)`` replicated (or with ``sp=True`` this rank's
    ``(B, S / N, D)``), ``start`` the position of its first token. ``cache`` is ``(k, v)``, each
    ``(B, T, kv_local, dh)``: prefill (``decode=False``) attends over its own keys and writes
    them at ``[start, start + S)``; ``decode=True`` writes then attends over the cache up to each
    query's position. ``window`` (a sliding window, see :func:`~jax_flashcomm.nn.attention.attend`)
    and ``theta`` (the RoPE base, default ``rope_theta``) may be traced, so layers that differ
    only in them share one scanned block. Returns ``(y, cache)`` with ``y`` of ``x``'s layout
    (the all-reduced or reduce-scattered output).

    Args:
      d_model: the model width.
      n_heads: query heads (global).
      n_kv_heads: KV heads (global); :func:`check_heads` must accept them with ``tp``.
      head_dim: per-head width.
      tp: the TP size (ranks on ``comm.axis_name``).
      comm: the :class:`~jax_flashcomm.nn.TPComm` of both projections.
      rope_theta: the RoPE base.
      qkv_bias: biases on the q, k and v projections (Qwen2).
      qk_norm: an RMSNorm over ``head_dim`` on each query and key head before RoPE (Gemma 3),
        with ``norm_eps``.
      query_scale: the score scale (default ``1 / sqrt(head_dim)``).
      dtype: the parameters' dtype.
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, tp: int,
                 comm: TPComm, rope_theta: float = 10000.0, qkv_bias: bool = False,
                 qk_norm: bool = False, norm_eps: float = 1e-6,
                 query_scale: float | None = None, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        self.head_dim, self.rope_theta, self.query_scale = head_dim, rope_theta, query_scale
        self.q_local = n_heads // tp
        self.kv_local = len(kv_heads(n_heads, n_kv_heads, tp)) // tp
        per_rank = (self.q_local + 2 * self.kv_local) * head_dim
        self.qkv = ColumnParallelLinear(d_model, tp * per_rank, tp=tp, comm=comm, dtype=dtype,
                                        use_bias=qkv_bias, rngs=rngs)
        self.o = RowParallelLinear(n_heads * head_dim, d_model, tp=tp, comm=comm, dtype=dtype,
                                   rngs=rngs)
        self.q_norm = (RMSNorm(head_dim, eps=norm_eps, dtype=dtype, rngs=rngs) if qk_norm
                       else None)
        self.k_norm = (RMSNorm(head_dim, eps=norm_eps, dtype=dtype, rngs=rngs) if qk_norm
                       else None)

    def __call__(self, x, start, cache=None, *, decode: bool = False, sp: bool = False,
                 reduce: bool = True, window=None, theta=None):
        qkv = self.qkv(x, sp=sp)
        b, s = qkv.shape[0], qkv.shape[1]
        dh, hq, hkv = self.head_dim, self.q_local, self.kv_local
        q, k, v = jnp.split(qkv, [hq * dh, (hq + hkv) * dh], axis=-1)
        q, k, v = q.reshape(b, s, hq, dh), k.reshape(b, s, hkv, dh), v.reshape(b, s, hkv, dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        positions = start + jnp.arange(s, dtype=jnp.int32)
        theta = self.rope_theta if theta is None else theta
        q, k = rope(q, positions, theta), rope(k, positions, theta)
        if cache is not None:
            ck, cv = cache
            ck = lax.dynamic_update_slice_in_dim(ck, k.astype(ck.dtype), start, axis=1)
            cv = lax.dynamic_update_slice_in_dim(cv, v.astype(cv.dtype), start, axis=1)
            cache = (ck, cv)
            if decode:
                k, v = ck, cv
        elif decode:
            raise ValueError("TPAttention: decode=True needs a cache")
        kpos = jnp.arange(k.shape[1], dtype=jnp.int32) if decode else positions
        out = attend(q, k, v, positions, kpos, scale=self.query_scale, window=window)
        return self.o(out.reshape(b, s, hq * dh), sp=sp, reduce=reduce), cache


class TPMLP(nnx.Module):
    """Gated MLP ``down(act(gate(x)) * up(x))`` (SwiGLU with ``"silu"``, GeGLU with
    ``"gelu_tanh"``), hidden units sharded over ``comm.axis_name``.

    The hidden units are padded to a multiple of ``tp`` with zero units (:func:`padded_ffn`;
    exact, since ``act(0) * 0 = 0``). ``__call__(x, *, sp=False)``: ``x`` in the layout of
    :class:`TPAttention`'s.

    Args:
      d_model: the model width.
      ffn_dim: the hidden width (global, before padding).
      tp: the TP size.
      comm: the :class:`~jax_flashcomm.nn.TPComm` of both projections.
      activation: a key of :data:`ACTIVATIONS`.
      dtype: the parameters' dtype.
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    def __init__(self, d_model: int, ffn_dim: int, *, tp: int, comm: TPComm,
                 activation: str = "silu", dtype=jnp.float32, rngs: nnx.Rngs | None):
        if activation not in ACTIVATIONS:
            raise ValueError(f"TPMLP: activation must be one of {sorted(ACTIVATIONS)}, got "
                             f"{activation!r}")
        self.activation = activation
        self.ffn_local = padded_ffn(ffn_dim, tp) // tp
        self.gate_up = ColumnParallelLinear(d_model, 2 * tp * self.ffn_local, tp=tp, comm=comm,
                                            dtype=dtype, rngs=rngs)
        self.down = RowParallelLinear(tp * self.ffn_local, d_model, tp=tp, comm=comm,
                                      dtype=dtype, rngs=rngs)

    def __call__(self, x, *, sp: bool = False, reduce: bool = True):
        gate, up = jnp.split(self.gate_up(x, sp=sp), 2, axis=-1)
        return self.down(ACTIVATIONS[self.activation](gate) * up, sp=sp, reduce=reduce)
