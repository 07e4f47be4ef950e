"""Tensor-parallel transformer blocks (Flax NNX): RMSNorm, RoPE, GQA attention with a KV cache,
SwiGLU MLP. ``__call__`` runs on local shards inside ``jax.shard_map``; parameters are at global
shape with ``out_sharding`` metadata (see :mod:`jax_flashcomm.nn.linear`).

Head layout over ``tp`` ranks (vLLM's): each rank owns ``n_heads / tp`` query heads. When
``tp <= n_kv_heads`` it owns ``n_kv_heads / tp`` KV heads; when ``tp > n_kv_heads`` every rank
holds one KV head, replicated ``tp / n_kv_heads`` times over consecutive ranks (:func:`kv_heads`).
The q, k and v projections are one column-parallel matmul whose columns are, per rank, that
rank's q, k and v heads (one ring in the sequence-parallel layout); gate and up of the MLP likewise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_flashcomm.fused_norm import rms_norm
from jax_flashcomm.nn.attention import attend
from jax_flashcomm.nn.comm import TPComm
from jax_flashcomm.nn.linear import ColumnParallelLinear, RowParallelLinear, init_param

__all__ = ["RMSNorm", "TPAttention", "TPMLP", "kv_heads", "check_heads", "padded_ffn", "rope"]


def check_heads(n_heads: int, n_kv_heads: int, tp: int) -> None:
    """Raise a clear ValueError unless ``tp`` ranks can split these heads.

    Args:
      n_heads: query heads.
      n_kv_heads: KV heads (divides ``n_heads``).
      tp: the TP size: it must divide ``n_heads`` and divide or be a multiple of ``n_kv_heads``.

    Raises:
      ValueError: the heads do not split over ``tp`` ranks (the message lists the sizes that
        do).
    """
    if not isinstance(tp, int) or tp < 1:
        raise ValueError(f"the TP size must be a positive int, got {tp!r}")
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    sizes = [d for d in range(1, n_heads + 1) if n_heads % d == 0
             and (n_kv_heads % d == 0 or d % n_kv_heads == 0)]
    if tp not in sizes:
        raise ValueError(f"TP size {tp} does not divide the {n_heads} query heads "
                         f"({n_kv_heads} KV heads): use one of {sizes}")


def kv_heads(n_kv_heads: int, tp: int) -> list[int]:
    """For each KV slot (``tp * local`` of them, rank-major), the checkpoint KV head it holds.

    Args:
      n_kv_heads: the checkpoint's KV heads.
      tp: the TP size (valid for these heads: :func:`check_heads`).

    Returns:
      ``range(n_kv_heads)`` when ``tp <= n_kv_heads``, else ``tp`` head indices (each head
      replicated over ``tp / n_kv_heads`` consecutive ranks).
    """
    if tp <= n_kv_heads:
        return list(range(n_kv_heads))
    return [r // (tp // n_kv_heads) for r in range(tp)]


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

    ``__call__(x, start, cache=None, *, decode=False, sp=False)`` on local shards: ``x`` is
    ``(B, S, D)`` replicated (or with ``sp=True`` this rank's ``(B, S / N, D)``), ``start`` the
    position of its first token. ``cache`` is ``(k, v)``, each ``(B, T, kv_local, dh)``: prefill
    (``decode=False``) attends over its own keys and writes them at ``[start, start + S)``;
    ``decode=True`` writes then attends over the cache up to each query's position. Returns
    ``(y, cache)`` with ``y`` of ``x``'s layout (the all-reduced or reduce-scattered output).

    Args:
      d_model: the model width.
      n_heads: query heads (global).
      n_kv_heads: KV heads (global); :func:`check_heads` must accept them with ``tp``.
      head_dim: per-head width.
      tp: the TP size (ranks on ``comm.axis_name``).
      comm: the :class:`~jax_flashcomm.nn.TPComm` of both projections.
      rope_theta: the RoPE base.
      dtype: the parameters' dtype.
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int, head_dim: int, *, tp: int,
                 comm: TPComm, rope_theta: float = 10000.0, dtype=jnp.float32,
                 rngs: nnx.Rngs | None):
        check_heads(n_heads, n_kv_heads, tp)
        self.head_dim, self.rope_theta = head_dim, rope_theta
        self.q_local = n_heads // tp
        self.kv_local = len(kv_heads(n_kv_heads, tp)) // tp
        per_rank = (self.q_local + 2 * self.kv_local) * head_dim
        self.qkv = ColumnParallelLinear(d_model, tp * per_rank, tp=tp, comm=comm, dtype=dtype,
                                        rngs=rngs)
        self.o = RowParallelLinear(n_heads * head_dim, d_model, tp=tp, comm=comm, dtype=dtype,
                                   rngs=rngs)

    def __call__(self, x, start, cache=None, *, decode: bool = False, sp: bool = False,
                 reduce: bool = True):
        qkv = self.qkv(x, sp=sp)
        b, s = qkv.shape[0], qkv.shape[1]
        dh, hq, hkv = self.head_dim, self.q_local, self.kv_local
        q, k, v = jnp.split(qkv, [hq * dh, (hq + hkv) * dh], axis=-1)
        q, k, v = q.reshape(b, s, hq, dh), k.reshape(b, s, hkv, dh), v.reshape(b, s, hkv, dh)
        positions = start + jnp.arange(s, dtype=jnp.int32)
        q, k = rope(q, positions, self.rope_theta), rope(k, positions, self.rope_theta)
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
        out = attend(q, k, v, positions, kpos)
        return self.o(out.reshape(b, s, hq * dh), sp=sp, reduce=reduce), cache


class TPMLP(nnx.Module):
    """SwiGLU MLP ``down(silu(gate(x)) * up(x))``, hidden units sharded over ``comm.axis_name``.

    The hidden units are padded to a multiple of ``tp`` with zero units (:func:`padded_ffn`).
    ``__call__(x, *, sp=False)``: ``x`` in the layout of :class:`TPAttention`'s.

    Args:
      d_model: the model width.
      ffn_dim: the hidden width (global, before padding).
      tp: the TP size.
      comm: the :class:`~jax_flashcomm.nn.TPComm` of both projections.
      dtype: the parameters' dtype.
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    def __init__(self, d_model: int, ffn_dim: int, *, tp: int, comm: TPComm,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.ffn_local = padded_ffn(ffn_dim, tp) // tp
        self.gate_up = ColumnParallelLinear(d_model, 2 * tp * self.ffn_local, tp=tp, comm=comm,
                                            dtype=dtype, rngs=rngs)
        self.down = RowParallelLinear(tp * self.ffn_local, d_model, tp=tp, comm=comm,
                                      dtype=dtype, rngs=rngs)

    def __call__(self, x, *, sp: bool = False, reduce: bool = True):
        gate, up = jnp.split(self.gate_up(x, sp=sp), 2, axis=-1)
        return self.down(jax.nn.silu(gate) * up, sp=sp, reduce=reduce)
