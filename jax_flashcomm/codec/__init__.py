"""The low-bit codec: per-group asymmetric quantization of activations (docs/format.md).

``quantize`` turns an array into a :class:`Payload` (packed codes plus a bf16 scale and zero
per group), ``dequantize`` turns it back, and the two fused ops used by the two-step
all-reduce decode N received chunks, sum them in f32 and either return the sum or quantize it
again. Each op runs as an XLA FFI kernel where one is built for the platform (CPU always, CUDA
when built) and as the pure-jnp twin (:mod:`jax_flashcomm.codec.reference`) elsewhere, TPU
included. ``backend`` overrides the choice: ``"ffi"`` (the kernels; an error if not built for
the default backend) or ``"jnp"``.
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
from jax_flashcomm.codec.spec import DEFAULT_GROUP_SIZE, wire_bytes_per_element

__all__ = [
    "Payload",
    "quantize",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_quantize",
    "error_bound",
    "wire_bytes_per_element",
    "DEFAULT_GROUP_SIZE",
]

_JAX_TO_FFI_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _dispatch(op: str, *args, backend: str, **params):
    """Run codec op ``op`` with the FFI kernel of the lowering platform, or the jnp twin."""
    backend = spec.check_backend(backend)
    twin = functools.partial(getattr(reference, op), **params)
    if backend == "jnp":
        return twin(*args)
    kernel = functools.partial(getattr(kernels, op), **params)
    if backend == "ffi":
        kernels.require(_JAX_TO_FFI_PLATFORM.get(jax.default_backend(), jax.default_backend()))
        return lax.platform_dependent(*args, cpu=kernel, cuda=kernel)
    built = {p: kernel for p in ("cpu", "cuda") if kernels.available(p)}
    if not built:
        return twin(*args)
    return lax.platform_dependent(*args, default=twin, **built)


def _as_groups(x, group_size: int, num_chunks: int):
    flat = jnp.ravel(x)
    padded = spec.padded_size(flat.size, group_size, num_chunks)
    if padded != flat.size:
        flat = jnp.pad(flat, (0, padded - flat.size))
    return flat.reshape(padded // group_size, group_size)


def quantize(x, *, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE, num_chunks: int = 1,
             backend: str = "auto") -> Payload:
    """Quantize ``x`` (f32, bf16 or f16, any shape) to ``bits`` per value in groups.

    ``x`` is flattened and zero-padded to a multiple of ``num_chunks * group_size`` so the
    groups split evenly into ``num_chunks`` chunks (one per rank in a collective).
    """
    bits = spec.check_bits(bits)
    group_size = spec.check_group_size(group_size)
    x = jnp.asarray(x)
    dtype = spec.check_dtype(x.dtype, "x")
    if x.size == 0:
        raise ValueError("x is empty: there is nothing to quantize")
    if not isinstance(num_chunks, (int, np.integer)) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    groups = _as_groups(x, group_size, int(num_chunks))
    codes, scale, zero = _dispatch("quantize", groups, backend=backend, bits=bits,
                                   group_size=group_size)
    return Payload(codes, scale, zero, bits=bits, group_size=group_size,
                   shape=tuple(x.shape), dtype=dtype)


def _check_payload(payload, name="payload", *, covers_shape: bool = False) -> Payload:
    """A :class:`Payload` whose arrays agree with each other and with its metadata.

    A payload is a pytree, so its arrays can be swapped, sliced or rebuilt independently of its
    static fields; a mismatch would make the kernels reject it at run time and the jnp twin
    broadcast it into a wrong result. ``covers_shape``: its groups (the last group axis) must
    hold at least the ``prod(shape)`` values to rebuild.
    """
    if not isinstance(payload, Payload):
        raise TypeError(f"{name} must be a jax_flashcomm.codec.Payload, got {type(payload)}")
    p = payload
    spec.check_bits(p.bits, f"{name}.bits")
    spec.check_group_size(p.group_size, f"{name}.group_size")
    for field, want in (("codes", np.dtype(jnp.uint8)), ("scale", np.dtype(jnp.bfloat16)),
                        ("zero", np.dtype(jnp.bfloat16))):
        got = getattr(getattr(p, field), "dtype", None)
        if got is None or np.dtype(got) != want:
            raise TypeError(f"{name}.{field} must be a {want} array, got {got}")
    nb = spec.group_bytes(p.group_size, p.bits)
    if p.scale.ndim < 1 or p.zero.shape != p.scale.shape or p.codes.shape != (*p.scale.shape, nb):
        raise ValueError(
            f"{name} arrays do not match: codes {p.codes.shape}, scale {p.scale.shape}, zero "
            f"{p.zero.shape}; want scale == zero == (..., groups) and codes (..., groups, {nb}) "
            f"for bits={p.bits}, group_size={p.group_size}")
    if covers_shape and p.scale.shape[-1] * p.group_size < math.prod(p.shape):
        raise ValueError(
            f"{name} has {p.scale.shape[-1]} groups of {p.group_size} values, fewer than the "
            f"{math.prod(p.shape)} of its shape {p.shape}")
    return payload


def _restore(flat, shape):
    size = math.prod(shape)
    flat = flat.reshape(*flat.shape[:-2], -1)
    return flat[..., :size].reshape(*flat.shape[:-1], *shape)


def dequantize(payload: Payload, *, dtype=None, backend: str = "auto"):
    """Rebuild the operand: ``q * scale + zero`` in f32, cast to ``dtype`` (default: x's)."""
    p = _check_payload(payload, covers_shape=True)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    groups = _dispatch("dequantize", p.codes, p.scale, p.zero, backend=backend, bits=p.bits,
                       group_size=p.group_size, dtype=dtype)
    return _restore(groups, p.shape)


def _check_chunked(p: Payload):
    if p.scale.ndim < 2:
        raise ValueError(
            "payload must have a chunk axis: scale (..., chunks, groups); use "
            "Payload.split_groups(chunks) on a quantized operand")


def dequantize_sum(payload: Payload, *, dtype=None, backend: str = "auto"):
    """Sum the chunks of a chunked payload in f32 (in chunk order): ``(..., groups * G)``."""
    p = _check_payload(payload)
    _check_chunked(p)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    groups = _dispatch("dequantize_sum", p.codes, p.scale, p.zero, backend=backend, bits=p.bits,
                       group_size=p.group_size, dtype=dtype)
    return groups.reshape(*groups.shape[:-2], -1)


def dequantize_sum_quantize(payload: Payload, *, bits: int | None = None,
                            backend: str = "auto") -> Payload:
    """Sum the chunks of a chunked payload in f32 and quantize the sum at ``bits``.

    The result describes a flat operand of ``groups * group_size`` values.
    """
    p = _check_payload(payload)
    _check_chunked(p)
    out_bits = p.bits if bits is None else spec.check_bits(bits)
    codes, scale, zero = _dispatch("dequantize_sum_quantize", p.codes, p.scale, p.zero,
                                   backend=backend, bits=p.bits, out_bits=out_bits,
                                   group_size=p.group_size)
    return Payload(codes, scale, zero, bits=out_bits, group_size=p.group_size,
                   shape=(scale.shape[-1] * p.group_size,), dtype=p.dtype)


def _bf16_bits(a):
    """bf16 array -> its uint16 bit patterns."""
    return lax.bitcast_convert_type(a, jnp.uint16)


def error_bound(payload: Payload, *, dtype=None):
    """Per-element bound on ``|dequantize(quantize(x)) - x|``, from the stored scales.

    ``scale / 2`` (rounding to the nearest code) plus the f32 rounding of encode and decode,
    the flush to zero of f32 values below the smallest normal, and the final rounding to
    ``dtype`` (docs/format.md derives it). NaN marks groups that hold NaN or Inf. Shape: the operand's.
    """
    p = _check_payload(payload, covers_shape=True)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    scale = p.scale.astype(jnp.float32)
    zero = p.zero.astype(jnp.float32)
    levels = float((1 << p.bits) - 1)
    # In quarters: a group's span scale * levels may reach 2 * FLT_MAX (a quarter never
    # overflows, and the terms below are exact multiples of it).
    quarter_span = 0.25 * scale * levels
    quarter_top = jnp.maximum(jnp.abs(0.25 * zero), jnp.abs(0.25 * zero + quarter_span))
    eps32 = float(np.finfo(np.float32).eps)
    # XLA on CPU flushes f32 denormals (FTZ and DAZ): a difference x - zero or a decoded value
    # below the smallest normal becomes 0 (and so does 0.5 * scale when scale is that small
    # here), hence the absolute 3 * FLT_MIN.
    bound = (0.5 * scale + 16 * eps32 * quarter_span + 4 * eps32 * quarter_top
             + 3 * float(spec.FLT_MIN))
    # f32 values below the lowest finite bf16 (-3.38953e38) sit under a group's clamped zero.
    clamped = _bf16_bits(p.zero) == spec.BF16_LOWEST_BITS
    bound = bound + jnp.where(clamped, float(spec.FLT_MAX_MINUS_BF16_LOWEST), 0.0)
    if dtype != np.float32:
        info = jnp.finfo(dtype)
        bound = bound + 2 * float(info.eps) * quarter_top + 0.5 * float(info.smallest_subnormal)
    per_elem = jnp.broadcast_to(bound[..., None], (*bound.shape, p.group_size))
    return _restore(per_elem, p.shape)


