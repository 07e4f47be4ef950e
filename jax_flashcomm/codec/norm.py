"""The all-reduce's fused epilogue at the codec level: decode + residual add + RMSNorm.

``add_rms_norm(payload, residual, weight)`` takes the all-gather phase's payload (the
all-reduced values of a whole operand, replicated) and, in one pass per row of ``hidden =
weight.shape[-1]`` values (docs/fused_norm.md):

1. ``d`` = the payload decoded as f32 (:func:`jax_flashcomm.codec.dequantize` with
   ``dtype=float32``: rotation and spikes included, saturated to the f32 range);
2. the new residual ``h = T(RN(d + f32(residual)))`` (T the residual's dtype; one rounding:
   the unfused ``dequantize`` then ``+`` rounds twice for bf16);
3. the sum of squares of ``f32(h)``: 16 running sums (value i into sum ``i % 16``, in order,
   ``acc = RN(acc + RN(v * v))``), reduced by the fixed tree of codec.h ``norm_reduce``
   (``s[j] + s[j + 8]``, then ``+4``, ``+2``, ``+1``);
4. ``inv = RN(1 / RN(sqrt(RN(RN(sumsq + RN(eps * hidden)) * RN(1 / hidden)))))`` (codec.h
   ``norm_inverse_rms``; the add before the multiply, so nothing can become an FMA);
5. ``out = T(RN(RN(f32(h) * inv) * f32(weight)))`` (weight f32 or bf16), or, with
   ``out_bits``, ``out`` quantized in groups of ``out_group_size`` (no rotation, no spikes:
   the plain wire format, ``hidden`` a multiple of ``out_group_size``).

The FFI kernels (``flashcomm_add_rms_norm``, ``flashcomm_add_rms_norm_quantize``: C++ per ISA,
CUDA) and the jnp twin below give the same bits; the twin keeps XLA from contracting a
multiply and an add into an FMA with loop boundaries (:func:`add_and_square`), and from
rewriting ``1 / sqrt`` into ``rsqrt`` with an optimization barrier.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import kernels, reference, spec
from jax_flashcomm.codec.payload import Payload
from jax_flashcomm.jax_compat import kernel_platform_name

__all__ = ["add_rms_norm", "NORM_LANES"]

NORM_LANES = 16  # codec.h kNormLanes: running sums of the sum of squares
_NORM_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_WEIGHT_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16))


def inv_hidden(hidden: int) -> np.float32:
    """``RN(1 / hidden)`` as f32 (a true division, as the kernels compute it)."""
    return np.float32(1.0) / np.float32(hidden)


def eps_hidden(eps: float, hidden: int) -> np.float32:
    """``RN(eps * hidden)`` as f32 (codec.h ``norm_inverse_rms``'s ``eps_h``)."""
    return np.float32(eps) * np.float32(hidden)


def _chunks(a: jax.Array) -> jax.Array:
    """``(rows, hidden)`` -> ``(ceil(hidden / 16), rows, 16)``, zero-padded."""
    rows, hidden = a.shape
    a = jnp.pad(a, ((0, 0), (0, -hidden % NORM_LANES)))
    return jnp.moveaxis(a.reshape(rows, -1, NORM_LANES), 1, 0)


def add_and_square(d: jax.Array, residual: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``h = T(d + residual)`` and ``f32(h)**2`` per 16-column chunk, in a loop.

    XLA's CPU backend contracts a multiply feeding an add into an FMA inside one fusion (an
    optimization barrier does not stop it: it is gone before LLVM runs), so the two places
    where that could happen are split by a loop boundary: ``d`` (whose last step may be the
    rotation's multiply) enters the loop as memory, and the squares leave it as memory before
    they are summed (:func:`sum_squares`).

    Args:
      d: ``(rows, hidden)`` f32 decoded values.
      residual: ``(rows, hidden)`` of dtype T.

    Returns:
      ``(h, sq)``: ``h (rows, hidden)`` of T, ``sq (ceil(hidden/16), rows, 16)`` f32 (zero
      in the padding).
    """
    rows, hidden = residual.shape

    def step(_, xs):
        dc, rc = xs
        h = (dc + rc.astype(jnp.float32)).astype(residual.dtype)
        hf = h.astype(jnp.float32)
        return None, (h, hf * hf)

    h, sq = lax.scan(step, None, (_chunks(d), _chunks(residual)))[1]
    h = jnp.moveaxis(h, 0, 1).reshape(rows, -1)[:, :hidden]
    return h, sq


def sum_squares(sq: jax.Array) -> jax.Array:
    """Row sums of squares in the order of codec.h: 16 running sums, then the fixed tree.

    Args:
      sq: ``(chunks, rows, 16)`` f32 squares (:func:`add_and_square`).

    Returns:
      ``(rows,)`` f32.
    """
    acc = lax.scan(lambda a, v: (a + v, None), jnp.zeros(sq.shape[1:], jnp.float32), sq)[0]
    for half in (8, 4, 2, 1):
        acc = acc[:, :half] + acc[:, half:2 * half]
    return acc[:, 0]


def inverse_rms(sumsq: jax.Array, hidden: int, eps: float) -> jax.Array:
    """codec.h ``norm_inverse_rms``: ``1 / sqrt((sumsq + RN(eps*H)) * RN(1/H))``, each step
    rounded (the add before the multiply: nothing to contract)."""
    ms = (sumsq + eps_hidden(eps, hidden)) * inv_hidden(hidden)
    return np.float32(1.0) / lax.optimization_barrier(jnp.sqrt(ms))   # no rsqrt rewrite


def reference_add_rms_norm(codes, scale, zero, residual, weight, *, bits: int, group_size: int,
                           rotation: int, spikes: int, eps: float, out_bits: int | None,
                           out_group_size: int):
    """The jnp twin of the FFI kernels: ``(out or (codes, scale, zero), new_residual)``.

    Args:
      codes, scale, zero: the payload's arrays (``(groups, ...)``).
      residual: ``(..., hidden)`` f32/bf16/f16.
      weight: ``(hidden,)`` f32 or bf16.
      bits, group_size, rotation, spikes: the payload's codec parameters.
      eps: added to the mean square.
      out_bits, out_group_size: quantize the normalised output (None: write it).
    """
    dtype = residual.dtype
    hidden = weight.shape[-1]
    d = reference.dequantize(codes, scale, zero, bits=bits, group_size=group_size,
                             dtype=jnp.float32, rotation=rotation, spikes=spikes)
    d = d.reshape(-1)[:residual.size].reshape(-1, hidden)
    h, sq = add_and_square(d, residual.reshape(-1, hidden))
    hf = h.astype(jnp.float32)
    inv = inverse_rms(sum_squares(sq), hidden, eps)
    out = ((hf * inv[:, None]) * weight.astype(jnp.float32)).astype(dtype)
    new_residual = h.reshape(residual.shape)
    if out_bits is None:
        return out.reshape(residual.shape), new_residual
    groups = out.reshape(-1, out_group_size)
    return reference.quantize(groups, bits=out_bits, group_size=out_group_size), new_residual


def _add_rms_norm_decoded(payload, residual, weight, eps, out_bits, out_group_size, backend):
    """add_rms_norm of a floating-point payload: decoded by the codec, then the twin's add and
    norm (no fused kernel reads these formats yet)."""
    from jax_flashcomm import codec

    hidden = weight.shape[-1]
    d = codec.dequantize(payload, dtype=jnp.float32, backend=backend).reshape(-1, hidden)
    h, sq = add_and_square(d, residual.reshape(-1, hidden))
    inv = inverse_rms(sum_squares(sq), hidden, eps)
    out = ((h.astype(jnp.float32) * inv[:, None]) * weight.astype(jnp.float32))
    out = out.astype(residual.dtype).reshape(residual.shape)
    new_residual = h.reshape(residual.shape)
    if out_bits is None:
        return out, new_residual
    return codec.quantize(out, bits=out_bits, group_size=out_group_size,
                          backend=backend), new_residual


def _check(payload, residual, weight, eps, out_bits, out_group_size):
    if not isinstance(payload, Payload):
        raise TypeError(f"add_rms_norm: payload must be a jax_flashcomm.codec.Payload, got "
                        f"{type(payload)}")
    residual, weight = jnp.asarray(residual), jnp.asarray(weight)
    if np.dtype(residual.dtype) not in _NORM_DTYPES:
        raise TypeError(f"add_rms_norm: residual must be f32, bf16 or f16, got {residual.dtype}")
    if np.dtype(weight.dtype) not in _WEIGHT_DTYPES:
        raise TypeError(f"add_rms_norm: weight must be f32 or bf16, got {weight.dtype}")
    if weight.ndim != 1 or residual.ndim < 1 or residual.shape[-1] != weight.shape[0]:
        raise ValueError(f"add_rms_norm: weight must be (hidden,) with hidden the residual's "
                         f"last axis; got residual {residual.shape}, weight {weight.shape}")
    if residual.size == 0:
        raise ValueError("add_rms_norm: empty residual")
    if tuple(payload.shape) != tuple(residual.shape):
        raise ValueError(f"add_rms_norm: the payload's shape {payload.shape} is not the "
                         f"residual's {residual.shape}")
    if payload.codes.ndim != 2:
        raise ValueError(f"add_rms_norm: the payload must be one operand's groups "
                         f"(scale (groups,)), got scale {payload.scale.shape}")
    if not (math.isfinite(float(eps)) and float(eps) >= 0):
        raise ValueError(f"add_rms_norm: eps must be finite and >= 0, got {eps}")
    if out_bits is not None:
        spec.check_bits(out_bits, "out_bits")
        spec.check_group_size(out_group_size, "out_group_size")
        if weight.shape[0] % out_group_size:
            raise ValueError(f"add_rms_norm: a quantized output needs hidden "
                             f"({weight.shape[0]}) to be a multiple of out_group_size "
                             f"({out_group_size}): each row is whole groups")
    return residual, weight


def add_rms_norm(payload: Payload, residual: jax.Array, weight: jax.Array, *, eps: float,
                 out_bits: int | None = None, out_group_size: int = spec.DEFAULT_GROUP_SIZE,
                 backend: str = "auto"):
    """Decode ``payload``, add ``residual``, RMSNorm with ``weight`` (one kernel).

    Args:
      payload: the all-reduced operand's payload (one operand: ``scale (groups,)``), of shape
        ``residual.shape``.
      residual: ``(..., hidden)``, f32, bf16 or f16.
      weight: ``(hidden,)``, f32 or bf16.
      eps: added to the mean square.
      out_bits: None: return the normalised rows; 2..8: return them quantized (a
        :class:`Payload` of shape ``residual.shape``, no rotation, no spikes).
      out_group_size: the output's group size (divides ``hidden``).
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"`` (the codec's choice, as for dequantize).

    Returns:
      ``(out, new_residual)``: ``out`` of ``residual``'s dtype and shape (or its payload),
      ``new_residual = residual + decoded`` in ``residual``'s dtype.

    Raises:
      TypeError, ValueError: bad dtypes, shapes, ``eps`` or output format.
    """
    residual, weight = _check(payload, residual, weight, eps, out_bits, out_group_size)
    spec.check_backend(backend)
    if payload.format != "int":
        return _add_rms_norm_decoded(payload, residual, weight, float(eps), out_bits,
                                     out_group_size, backend)
    params = dict(bits=payload.bits, group_size=payload.group_size, rotation=payload.rotation,
                  spikes=payload.spikes, eps=float(eps), out_bits=out_bits,
                  out_group_size=out_group_size)
    args = (payload.codes, payload.scale, payload.zero, residual, weight)
    twin = functools.partial(reference_add_rms_norm, **params)
    kernel = functools.partial(kernels.add_rms_norm, **params)
    platform = kernel_platform_name() or jax.default_backend()
    if backend == "jnp":
        out, new_residual = twin(*args)
    elif backend == "ffi":
        kernels.require(platform)
        out, new_residual = lax.platform_dependent(*args, cpu=kernel, cuda=kernel)
    else:
        built = {p: kernel for p in ("cpu", "cuda") if kernels.available(p)}
        out, new_residual = (lax.platform_dependent(*args, default=twin, **built) if built
                             else twin(*args))
    if out_bits is None:
        return out, new_residual
    codes, scale, zero = out
    return Payload(codes, scale, zero, bits=out_bits, group_size=out_group_size,
                   shape=tuple(residual.shape), dtype=np.dtype(residual.dtype)), new_residual
