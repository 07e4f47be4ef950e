"""The ``ffi_call``\\ s of the floating-point group formats' kernels (ffi/cpu/fp_handlers.cc).

Each phase's format travels as one :class:`~jax_flashcomm.codec.group_format.GroupFormat`
attribute. The arguments are validated by :mod:`jax_flashcomm.codec.fp`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flashcomm.codec import spec
from jax_flashcomm.codec.group_format import GroupFormat
from jax_flashcomm.codec.kernels import result_like

TARGETS = (
    "flashcomm_fp_quantize",
    "flashcomm_fp_dequantize",
    "flashcomm_fp_dequantize_sum",
    "flashcomm_fp_dequantize_sum_quantize",
)



def _format(fmt: str, group_size: int, rotation: int, spikes: int) -> dict:
    """The FFI attribute of a floating-point group format (its bits are the format's)."""
    return GroupFormat(fmt, spec.FP_BITS[fmt], group_size, rotation, spikes).ffi_attribute()


def quantize(v, *, fmt: str, group_size: int, rotation: int = 0, spikes: int = 0):
    """Groups ``(..., group_size)`` of f32/bf16/f16 -> records uint8 ``(..., record bytes)``."""
    lead = v.shape[:-1]
    call = jax.ffi.ffi_call(
        "flashcomm_fp_quantize",
        result_like(v, (*lead, spec.fp_record_bytes(fmt, group_size, spikes)), jnp.uint8),
        vmap_method="broadcast_all")
    return call(v,
                fmt=_format(fmt, group_size, rotation, spikes))


def dequantize(codes, *, fmt: str, group_size: int, dtype, rotation: int = 0, spikes: int = 0):
    """Records ``(..., groups, record)`` -> decoded groups ``(..., groups, group_size)``."""
    call = jax.ffi.ffi_call(
        "flashcomm_fp_dequantize", result_like(codes, (*codes.shape[:-1], group_size), dtype),
        vmap_method="broadcast_all")
    return call(codes,
                fmt=_format(fmt, group_size, rotation, spikes))


def dequantize_sum(codes, *, fmt: str, group_size: int, dtype, rotation: int = 0,
                   spikes: int = 0):
    """Chunked records ``(..., N, groups, record)`` -> the f32 sum over N as ``dtype``,
    ``(..., groups, group_size)``."""
    shape = (*codes.shape[:-3], codes.shape[-2], group_size)
    call = jax.ffi.ffi_call("flashcomm_fp_dequantize_sum", result_like(codes, shape, dtype),
                            vmap_method="broadcast_all")
    return call(codes,
                fmt=_format(fmt, group_size, rotation, spikes))


def dequantize_sum_quantize(codes, *, fmt: str, out_fmt: str, group_size: int, spikes: int = 0,
                            out_spikes: int = 0):
    """Chunked records -> the f32 sum over N re-quantized: records ``(..., groups, record')``."""
    shape = (*codes.shape[:-3], codes.shape[-2],
             spec.fp_record_bytes(out_fmt, group_size, out_spikes))
    call = jax.ffi.ffi_call("flashcomm_fp_dequantize_sum_quantize",
                            result_like(codes, shape, jnp.uint8), vmap_method="broadcast_all")
    return call(codes,
                fmt=GroupFormat(fmt, spec.FP_BITS[fmt], group_size, 0, spikes).ffi_attribute(),
                out_fmt=GroupFormat(out_fmt, spec.FP_BITS[out_fmt], group_size, 0,
                                    out_spikes).ffi_attribute())
