"""The codec ops the collectives call, with FFI result types that work inside ``shard_map``.

``jax_flashcomm.codec.kernels`` builds its ``ffi_call`` result types with
``jax.typeof(x).update(..., sharding=None)``, which JAX 0.10 rejects for a value that varies
over manual mesh axes (``AssertionError: ManualAxisType(varying=...)``): every collective's
operand inside ``shard_map`` is such a value. Until the codec owns a fix, this module calls the
same registered FFI targets with result types that keep the operand's mesh and varying axes
(:func:`_like`), and otherwise defers to :mod:`jax_flashcomm.codec` (the jnp twin, the
validation, the :class:`Payload`). Same targets, same attributes, same bytes.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

from jax_flashcomm import codec
from jax_flashcomm.codec import Payload, kernels, reference, spec

_JAX_TO_FFI_PLATFORM = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def _like(x, shape, dtype):
    """Result type: ``x``'s mesh and varying axes, a new shape and dtype, replicated spec."""
    t = jax.typeof(x)
    return t.update(shape=tuple(shape), dtype=np.dtype(dtype),
                    sharding=NamedSharding(t.sharding.mesh, PartitionSpec()))


def _k_quantize(v, *, bits, group_size):
    lead = v.shape[:-1]
    call = jax.ffi.ffi_call(
        "flashcomm_quantize",
        (_like(v, (*lead, spec.group_bytes(group_size, bits)), jnp.uint8),
         _like(v, lead, jnp.bfloat16), _like(v, lead, jnp.bfloat16)),
        vmap_method="broadcast_all")
    return tuple(call(v, bits=np.int32(bits), group_size=np.int64(group_size)))


def _k_dequantize(codes, scale, zero, *, bits, group_size, dtype):
    call = jax.ffi.ffi_call("flashcomm_dequantize",
                            _like(codes, (*scale.shape, group_size), dtype),
                            vmap_method="broadcast_all")
    return call(codes, scale, zero, bits=np.int32(bits), group_size=np.int64(group_size))


def _k_dequantize_sum(codes, scale, zero, *, bits, group_size, dtype):
    out_shape = (*scale.shape[:-2], scale.shape[-1], group_size)
    call = jax.ffi.ffi_call("flashcomm_dequantize_sum", _like(codes, out_shape, dtype),
                            vmap_method="broadcast_all")
    return call(codes, scale, zero, bits=np.int32(bits), group_size=np.int64(group_size))


def _k_dequantize_sum_quantize(codes, scale, zero, *, bits, out_bits, group_size):
    groups = (*scale.shape[:-2], scale.shape[-1])
    call = jax.ffi.ffi_call(
        "flashcomm_dequantize_sum_quantize",
        (_like(codes, (*groups, spec.group_bytes(group_size, out_bits)), jnp.uint8),
         _like(codes, groups, jnp.bfloat16), _like(codes, groups, jnp.bfloat16)),
        vmap_method="broadcast_all")
    return tuple(call(codes, scale, zero, bits=np.int32(bits), out_bits=np.int32(out_bits),
                      group_size=np.int64(group_size)))


_KERNELS = {"quantize": _k_quantize, "dequantize": _k_dequantize,
            "dequantize_sum": _k_dequantize_sum,
            "dequantize_sum_quantize": _k_dequantize_sum_quantize}


def _dispatch(op, *args, backend, **params):
    backend = spec.check_backend(backend)
    twin = functools.partial(getattr(reference, op), **params)
    if backend == "jnp":
        return twin(*args)
    kernel = functools.partial(_KERNELS[op], **params)
    if backend == "ffi":
        kernels.require(_JAX_TO_FFI_PLATFORM.get(jax.default_backend(), jax.default_backend()))
        return lax.platform_dependent(*args, cpu=kernel, cuda=kernel)
    built = {p: kernel for p in ("cpu", "cuda") if kernels.available(p)}
    if not built:
        return twin(*args)
    return lax.platform_dependent(*args, default=twin, **built)


def _restore(flat, shape):
    size = math.prod(shape)
    flat = flat.reshape(*flat.shape[:-2], -1)
    return flat[..., :size].reshape(*flat.shape[:-1], *shape)


def quantize(x, *, bits, group_size, num_chunks=1, backend="auto") -> Payload:
    """:func:`jax_flashcomm.codec.quantize` (same validation, padding and payload)."""
    bits = spec.check_bits(bits)
    group_size = spec.check_group_size(group_size)
    dtype = spec.check_dtype(x.dtype, "x")
    flat = jnp.ravel(x)
    padded = spec.padded_size(flat.size, group_size, int(num_chunks))
    if padded != flat.size:
        flat = jnp.pad(flat, (0, padded - flat.size))
    groups = flat.reshape(padded // group_size, group_size)
    codes, scale, zero = _dispatch("quantize", groups, backend=backend, bits=bits,
                                   group_size=group_size)
    return Payload(codes, scale, zero, bits=bits, group_size=group_size,
                   shape=tuple(x.shape), dtype=dtype)


def dequantize(p: Payload, *, backend="auto"):
    """:func:`jax_flashcomm.codec.dequantize` to the payload's dtype."""
    groups = _dispatch("dequantize", p.codes, p.scale, p.zero, backend=backend, bits=p.bits,
                       group_size=p.group_size, dtype=p.dtype)
    return _restore(groups, p.shape)


def dequantize_sum(p: Payload, *, backend="auto"):
    """:func:`jax_flashcomm.codec.dequantize_sum`: ``(..., groups * G)`` in the payload dtype."""
    groups = _dispatch("dequantize_sum", p.codes, p.scale, p.zero, backend=backend,
                       bits=p.bits, group_size=p.group_size, dtype=p.dtype)
    return groups.reshape(*groups.shape[:-2], -1)


def dequantize_sum_quantize(p: Payload, *, bits, backend="auto") -> Payload:
    """:func:`jax_flashcomm.codec.dequantize_sum_quantize`."""
    codes, scale, zero = _dispatch("dequantize_sum_quantize", p.codes, p.scale, p.zero,
                                   backend=backend, bits=p.bits, out_bits=bits,
                                   group_size=p.group_size)
    return Payload(codes, scale, zero, bits=bits, group_size=p.group_size,
                   shape=(scale.shape[-1] * p.group_size,), dtype=p.dtype)


error_bound = codec.error_bound
