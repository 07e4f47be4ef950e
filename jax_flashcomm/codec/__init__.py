# long file: the codec's public ops, each checking its arguments at trace time before it dispatches
"""The low-bit codec: per-group asymmetric quantization of activations (docs/format.md).

``quantize`` turns an array into a :class:`Payload` (packed codes plus a bf16 scale and zero
per group), ``dequantize`` turns it back, and the two fused ops used by the two-step
all-reduce decode N received chunks, sum them in f32 and either return the sum or quantize it
again; ``dequantize_into`` decodes one payload into a slot of a larger buffer in place (the
ring all-gather's step). Each op runs as an XLA FFI kernel where one is built for the
platform (CPU always, CUDA when built) and as the pure-jnp twin
(:mod:`jax_flashcomm.codec.reference`) elsewhere, TPU included. ``backend`` overrides the
choice: ``"ffi"`` (the kernels; an error if not built for the default backend) or ``"jnp"``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import bounds, fp, kernels, reference, spec
from jax_flashcomm.codec.bounds import (  # public; the first two also for tests
    rotated_domain_bound, rotation_bound, spike_bound)
from jax_flashcomm.codec.payload import Payload
from jax_flashcomm.codec.group_format import GroupFormat
from jax_flashcomm.codec.spec import DEFAULT_GROUP_SIZE, wire_bytes_per_element

__all__ = [
    "Payload",
    "quantize",
    "dequantize",
    "dequantize_sum",
    "dequantize_sum_quantize",
    "dequantize_into",
    "add_rms_norm",
    "error_bound",
    "spike_bound",
    "wire_bytes_per_element",
    "GroupFormat",
    "rotation_bound",
    "rotated_domain_bound",
    "DEFAULT_GROUP_SIZE",
    "cpu_isa",
    "cpu_isas",
    "use_cpu_isa",
    "cpu_threads",
    "use_cpu_threads",
]

from jax_flashcomm.codec.norm import add_rms_norm  # noqa: E402
from jax_flashcomm.codec.kernels import (  # noqa: E402
    cpu_isa, cpu_isas, cpu_threads, use_cpu_isa, use_cpu_threads)
from jax_flashcomm.jax_compat import kernel_platform_name  # noqa: E402


def _dispatch(op: str, *args, backend: str, **params):
    """Run codec op ``op`` with the FFI kernel of the lowering platform, or the jnp twin."""
    backend = spec.check_backend(backend)
    twin = functools.partial(getattr(reference, op), **params)
    if backend == "jnp":
        return twin(*args)
    kernel = functools.partial(getattr(kernels, op), **params)
    if backend == "ffi":
        kernels.require(kernel_platform_name() or jax.default_backend())
        return lax.platform_dependent(*args, cpu=kernel, cuda=kernel)
    built = {p: kernel for p in ("cpu", "cuda") if kernels.available(p)}
    if not built:
        return twin(*args)
    return lax.platform_dependent(*args, default=twin, **built)


def as_groups(x: jax.Array, group_size: int, num_chunks: int) -> jax.Array:
    """``x`` flattened, zero-padded and viewed as groups: the layout the codec ops take.

    Args:
      x: an array of any shape.
      group_size: values per group.
      num_chunks: the size is padded to a multiple of ``num_chunks * group_size``.

    Returns:
      ``(groups, group_size)`` of ``x``'s dtype (at least one group per chunk).
    """
    flat = jnp.ravel(x)
    padded = spec.padded_size(flat.size, group_size, num_chunks)
    if padded != flat.size:
        flat = jnp.pad(flat, (0, padded - flat.size))
    return flat.reshape(padded // group_size, group_size)


def quantize(x: jax.Array, *, bits: int = 8, group_size: int = DEFAULT_GROUP_SIZE,
             num_chunks: int = 1, backend: str = "auto", rotation: int | str | None = 0,
             spikes: int = 0, format: str = "int") -> Payload:
    """Quantize ``x`` (f32, bf16 or f16, any shape) to ``bits`` per value in groups.

    ``x`` is flattened and zero-padded to a multiple of ``num_chunks * group_size`` so the
    groups split evenly into ``num_chunks`` chunks (one per rank in a collective).
    ``rotation`` (0/"none", 1/"hadamard", 2/"signed_hadamard"; needs a power-of-two
    ``group_size``) quantizes each group's orthonormal Walsh-Hadamard transform instead of the
    group (docs/format.md, "Rotation"); decoding applies the inverse. ``spikes`` (0..16, below
    ``group_size``) keeps each group's k largest-magnitude values in bf16 beside the codes
    (docs/format.md, "Spike reserving"), after the rotation if there is one. ``format``
    "fp8", "mxfp4" or "nvfp4" quantizes to floating-point groups instead of integer ones
    (docs/format.md, "Floating-point formats"; ``bits`` is then ignored).

    Args:
      x: the operand: f32, bf16 or f16, any shape, not empty.
      bits: bits per code, 2..8.
      group_size: values per group (a positive multiple of 8; a power of two to rotate).
      num_chunks: the groups split evenly into this many chunks (a positive int).
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"`` (module docstring).
      rotation: 0 / ``"none"``, 1 / ``"hadamard"`` or 2 / ``"signed_hadamard"``.
      spikes: values per group kept in bf16 (0..16, below ``group_size``).
      format: "int" (the default), "fp8", "mxfp4" or "nvfp4".

    Returns:
      A :class:`Payload`: codes ``(groups, record bytes)``, scale and zero ``(groups,)`` (None
      in a floating-point format);
      ``shape`` and ``dtype`` are ``x``'s.

    Raises:
      TypeError: a non-float ``x`` or an option of the wrong type.
      ValueError: an empty ``x`` or an option out of range.
    """
    group_size = spec.check_group_size(group_size)
    fmt = spec.check_format(format, group_size)
    bits = spec.FP_BITS[fmt] if fmt != "int" else spec.check_bits(bits)
    rotation = spec.check_rotation(rotation, group_size)
    spikes = spec.check_spikes(spikes, group_size)
    x = jnp.asarray(x)
    dtype = spec.check_dtype(x.dtype, "x")
    if x.size == 0:
        raise ValueError("x is empty: there is nothing to quantize")
    if not isinstance(num_chunks, (int, np.integer)) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    groups = as_groups(x, group_size, int(num_chunks))
    if fmt != "int":
        codes = fp.quantize(groups, fmt=fmt, group_size=group_size, rotation=rotation,
                            spikes=spikes, backend=backend)
        return Payload(codes, None, None, bits=bits, group_size=group_size,
                       shape=tuple(x.shape), dtype=dtype, rotation=rotation, spikes=spikes,
                       format=fmt)
    codes, scale, zero = _dispatch("quantize", groups, backend=backend, bits=bits,
                                   group_size=group_size, rotation=rotation, spikes=spikes)
    return Payload(codes, scale, zero, bits=bits, group_size=group_size,
                   shape=tuple(x.shape), dtype=dtype, rotation=rotation, spikes=spikes)


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
    spec.check_rotation(p.rotation, p.group_size, f"{name}.rotation")
    spec.check_spikes(p.spikes, p.group_size, f"{name}.spikes")
    if p.format != "int":
        fp.check(p, name)
        if covers_shape and p.num_groups * p.group_size < math.prod(p.shape):
            raise ValueError(
                f"{name} has {p.num_groups} groups of {p.group_size} values, fewer than the "
                f"{math.prod(p.shape)} of its shape {p.shape}")
        return payload
    for field, want in (("codes", np.dtype(jnp.uint8)), ("scale", np.dtype(jnp.bfloat16)),
                        ("zero", np.dtype(jnp.bfloat16))):
        got = getattr(getattr(p, field), "dtype", None)
        if got is None or np.dtype(got) != want:
            raise TypeError(f"{name}.{field} must be a {want} array, got {got}")
    nb = spec.record_bytes(p.group_size, p.bits, p.spikes)
    if p.scale.ndim < 1 or p.zero.shape != p.scale.shape or p.codes.shape != (*p.scale.shape, nb):
        raise ValueError(
            f"{name} arrays do not match: codes {p.codes.shape}, scale {p.scale.shape}, zero "
            f"{p.zero.shape}; want scale == zero == (..., groups) and codes (..., groups, {nb}) "
            f"for bits={p.bits}, group_size={p.group_size}, spikes={p.spikes}")
    if covers_shape and p.scale.shape[-1] * p.group_size < math.prod(p.shape):
        raise ValueError(
            f"{name} has {p.scale.shape[-1]} groups of {p.group_size} values, fewer than the "
            f"{math.prod(p.shape)} of its shape {p.shape}")
    return payload


def restore_shape(flat: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Inverse of :func:`as_groups`: decoded groups back to the operand's shape.

    Args:
      flat: ``(..., groups, group_size)`` decoded values.
      shape: the operand's shape; the padding after ``prod(shape)`` values is dropped.

    Returns:
      ``(..., *shape)``: the leading axes of ``flat`` are kept.
    """
    size = math.prod(shape)
    flat = flat.reshape(*flat.shape[:-2], -1)
    return flat[..., :size].reshape(*flat.shape[:-1], *shape)


def dequantize(payload: Payload, *, dtype=None, backend: str = "auto") -> jax.Array:
    """Rebuild the operand: ``q * scale + zero`` in f32, cast to ``dtype`` (default: x's).

    Args:
      payload: a :class:`Payload` from :func:`quantize` (leading chunk/batch axes allowed).
      dtype: f32, bf16 or f16; None: the payload's ``dtype``.
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"``.

    Returns:
      ``(..., *payload.shape)`` of ``dtype``: the payload's leading axes, then the operand's.

    Raises:
      TypeError, ValueError: a payload whose arrays disagree with its metadata.
    """
    p = _check_payload(payload, covers_shape=True)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    if p.format != "int":
        return restore_shape(fp.dequantize(p, dtype, backend), p.shape)
    groups = _dispatch("dequantize", p.codes, p.scale, p.zero, backend=backend, bits=p.bits,
                       group_size=p.group_size, dtype=dtype, rotation=p.rotation,
                       spikes=p.spikes)
    return restore_shape(groups, p.shape)


def _static_offset(offset):
    """``offset`` as a Python int when it is known at trace time, else None (a tracer)."""
    if isinstance(offset, (bool, np.bool_)):
        raise TypeError(f"offset must be an integer, got {offset!r}")
    if isinstance(offset, (int, np.integer)):
        return int(offset)
    if isinstance(offset, jax.core.Tracer):
        return None
    arr = np.asarray(offset)
    if arr.ndim != 0 or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"offset must be an integer scalar, got {arr.dtype}{list(arr.shape)}")
    return int(arr)


def dequantize_into(out: jax.Array, payload: Payload, offset, *,
                    backend: str = "auto") -> jax.Array:
    """``out`` with the decoded ``payload`` written at flat element ``offset``.

    ``payload`` is one operand's payload (``scale`` of shape ``(groups,)``; its ``shape``
    gives the ``count = prod(shape)`` values written, the padding is dropped). ``out`` is an
    f32/bf16/f16 array of any shape, addressed as its flat row-major view: elements
    ``[offset, offset + count)`` get exactly the values ``dequantize(payload, dtype=out.dtype)``
    has, and every other element keeps its value. ``offset`` is an int or an int32 scalar
    array (it may be traced, e.g. a loop index). The FFI kernel updates ``out``'s buffer in
    place (the result aliases operand 0), so inside a loop XLA writes each chunk without a
    pass over ``out``. A static out-of-range ``offset`` (or ``count > out.size``) is rejected
    here; a traced one is an error of the CPU kernel at run time (the CUDA kernel then writes
    nothing; the jnp twin clamps it, like ``lax.dynamic_update_slice``).

    Args:
      out: the buffer, f32/bf16/f16, any shape, at most ``2^31 - 1`` elements.
      payload: one operand's payload (``scale`` of shape ``(groups,)``).
      offset: the first flat element written: an int or an int32 scalar array.
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"``.

    Returns:
      An array of ``out``'s shape and dtype.

    Raises:
      ValueError: a chunked payload, ``count > out.size`` or a static ``offset`` out of range.
      TypeError: a non-array ``out`` or a non-integer ``offset``.
    """
    p = _check_payload(payload)
    if p.codes.ndim != 2:
        raise ValueError(f"payload must be one operand's payload, scale (groups,); got scale "
                         f"{p.scale.shape} (use one chunk of a chunked payload)")
    _check_payload(p, covers_shape=True)
    if not hasattr(out, "dtype") or not hasattr(out, "shape"):
        raise TypeError(f"out must be an array, got {type(out)}")
    spec.check_dtype(out.dtype, "out")
    size, count = math.prod(out.shape), math.prod(p.shape)
    if size > np.iinfo(np.int32).max:
        raise ValueError(f"out has {size} elements; an int32 offset addresses at most 2^31 - 1")
    if count > size:
        raise ValueError(f"payload has {count} values, more than out's {size}")
    static = _static_offset(offset)
    if static is not None:
        if not 0 <= static <= size - count:
            raise ValueError(f"offset {static} + {count} values is out of bounds for out of "
                             f"{size} elements")
        offset = np.int32(static)
    else:
        if jnp.ndim(offset) != 0 or not jnp.issubdtype(offset.dtype, jnp.integer):
            raise TypeError(f"offset must be an integer scalar, got {jax.typeof(offset)}")
        offset = offset.astype(jnp.int32)
    if p.format != "int":  # no in-place kernel: decode, then update the slice
        v = dequantize(p, dtype=out.dtype, backend=backend).reshape(-1)
        flat = lax.dynamic_update_slice(out.reshape(-1), v, (offset,))
        return flat.reshape(out.shape)
    return _dispatch("dequantize_into", out, p.codes, p.scale, p.zero, offset, backend=backend,
                     bits=p.bits, group_size=p.group_size, count=count, rotation=p.rotation,
                     spikes=p.spikes)


def _check_chunked(p: Payload):
    if p.codes.ndim < 3:
        raise ValueError(
            "payload must have a chunk axis: scale (..., chunks, groups); use "
            "Payload.split_groups(chunks) on a quantized operand")


def dequantize_sum(payload: Payload, *, dtype=None, backend: str = "auto") -> jax.Array:
    """Sum the chunks of a chunked payload in f32 (in chunk order): ``(..., groups * G)``.

    A rotated payload is summed in the rotated domain and rotated back once.

    Args:
      payload: a chunked payload: scale ``(..., chunks, groups)``
        (:meth:`Payload.split_groups`).
      dtype: the result's dtype (f32, bf16 or f16); None: the payload's ``dtype``.
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"``.

    Returns:
      ``(..., groups * group_size)`` of ``dtype``: the flat sum, padding included.

    Raises:
      ValueError: a payload without a chunk axis.
    """
    p = _check_payload(payload)
    _check_chunked(p)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    if p.format != "int":
        groups = fp.dequantize_sum(p, dtype, backend)
        return groups.reshape(*groups.shape[:-2], -1)
    groups = _dispatch("dequantize_sum", p.codes, p.scale, p.zero, backend=backend, bits=p.bits,
                       group_size=p.group_size, dtype=dtype, rotation=p.rotation,
                       spikes=p.spikes)
    return groups.reshape(*groups.shape[:-2], -1)


def dequantize_sum_quantize(payload: Payload, *, bits: int | None = None,
                            spikes: int | None = None, backend: str = "auto",
                            format: str | None = None) -> Payload:
    """Sum the chunks of a chunked payload in f32 and quantize the sum.

    The result describes a flat operand of ``groups * group_size`` values. A rotated payload
    stays rotated: the sum is formed and re-quantized in the rotated domain (the transform is
    linear), and the result carries the same ``rotation``.

    Args:
      payload: a chunked payload: scale ``(..., chunks, groups)``.
      bits: the sum's bits per code (2..8); None: the payload's own.
      spikes: the sum's spikes per group; None: the payload's own.
      backend: ``"auto"``, ``"ffi"`` or ``"jnp"``.
      format: the sum's format; None: the payload's own. Between "int" and a floating-point
        format the sum is decoded and quantized in two ops.

    Returns:
      A :class:`Payload` with scale ``(..., groups)`` and ``shape`` ``(groups * group_size,)``.

    Raises:
      ValueError: a payload without a chunk axis.
    """
    p = _check_payload(payload)
    _check_chunked(p)
    out_fmt = p.format if format is None else spec.check_format(format, p.group_size)
    out_spikes = p.spikes if spikes is None else spec.check_spikes(spikes, p.group_size)
    if out_fmt != "int" or p.format != "int":
        return _sum_quantize_formats(p, out_fmt, bits, out_spikes, backend)
    out_bits = p.bits if bits is None else spec.check_bits(bits)
    codes, scale, zero = _dispatch("dequantize_sum_quantize", p.codes, p.scale, p.zero,
                                   backend=backend, bits=p.bits, out_bits=out_bits,
                                   group_size=p.group_size, spikes=p.spikes,
                                   out_spikes=out_spikes)
    return Payload(codes, scale, zero, bits=out_bits, group_size=p.group_size,
                   shape=(scale.shape[-1] * p.group_size,), dtype=p.dtype, rotation=p.rotation,
                   spikes=out_spikes)


def _sum_quantize_formats(p: Payload, out_fmt: str, bits, out_spikes: int,
                          backend: str) -> Payload:
    """dequantize_sum_quantize where either side is a floating-point format."""
    shape = (p.num_groups * p.group_size,)
    if p.format != "int" and out_fmt != "int":
        codes = fp.dequantize_sum_quantize(p, out_fmt, out_spikes, backend)
        return Payload(codes, None, None, bits=spec.FP_BITS[out_fmt], group_size=p.group_size,
                       shape=shape, dtype=p.dtype, rotation=p.rotation, spikes=out_spikes,
                       format=out_fmt)
    # Mixed: the f32 sum in the rotated domain, then the other format's quantize.
    plain = dataclasses.replace(p, rotation=0)
    total = dequantize_sum(plain, dtype=jnp.float32, backend=backend)
    lead = total.shape[:-1]
    if out_fmt == "int":
        out_bits = p.bits if bits is None else spec.check_bits(bits)
        if p.format != "int" and bits is None:
            raise ValueError("dequantize_sum_quantize from a floating-point format to 'int' "
                             "needs bits")
        codes, scale, zero = _dispatch("quantize", total.reshape(*lead, -1, p.group_size),
                                       backend=backend, bits=out_bits, group_size=p.group_size,
                                       rotation=0, spikes=out_spikes)
        return Payload(codes, scale, zero, bits=out_bits, group_size=p.group_size, shape=shape,
                       dtype=p.dtype, rotation=p.rotation, spikes=out_spikes)
    codes = fp.quantize(total.reshape(*lead, -1, p.group_size), fmt=out_fmt,
                        group_size=p.group_size, rotation=0, spikes=out_spikes, backend=backend)
    return Payload(codes, None, None, bits=spec.FP_BITS[out_fmt], group_size=p.group_size,
                   shape=shape, dtype=p.dtype, rotation=p.rotation, spikes=out_spikes,
                   format=out_fmt)


def error_bound(payload: Payload, *, dtype=None) -> jax.Array:
    """Per-element bound on ``|dequantize(quantize(x)) - x|``, from the stored scales.

    ``scale / 2`` (rounding to the nearest code) plus the f32 rounding of encode and decode,
    the flush to zero of f32 values below the smallest normal, and the final rounding to
    ``dtype`` (docs/format.md derives it; the terms are in :mod:`jax_flashcomm.codec.bounds`).
    NaN marks groups that hold NaN or Inf.

    Args:
      payload: a payload from :func:`quantize` (leading axes allowed).
      dtype: the dtype the operand is decoded to; None: the payload's ``dtype``.

    Returns:
      f32 of the operand's shape (``(..., *payload.shape)``).
    """
    p = _check_payload(payload, covers_shape=True)
    dtype = spec.check_dtype(p.dtype if dtype is None else dtype, "dtype")
    return restore_shape(bounds.element_bound(p, dtype), p.shape)
