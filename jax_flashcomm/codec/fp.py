"""The floating-point group formats behind the codec's public ops (docs/format.md,
"Floating-point formats"): fp8 (E4M3 values, a bf16 scale per group), mxfp4 (E2M1 values, an
E8M0 scale per 32) and nvfp4 (E2M1 values, an E4M3 scale per 16 under an E8M0 scale per group).

:mod:`jax_flashcomm.codec` calls these for a payload whose ``format`` is not "int". Each op
runs the FFI kernel where it is registered (CPU: ffi/cpu/fp_handlers.cc; CUDA:
ffi/cuda/fp_kernels.cu, compiled and lowered, not yet run on a GPU) and the jnp twin
(:mod:`jax_flashcomm.codec.fp_reference`) elsewhere.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import fp_kernels, fp_reference, kernels, spec
from jax_flashcomm.codec.payload import Payload
from jax_flashcomm.jax_compat import kernel_platform_name

#: Per element, the largest rounding error in units of the element's block scale: half the
#: widest gap of the element grid (E4M3: 32 between 416 and 448; E2M1: 2 between 4 and 6),
#: and for mxfp4 the saturation of values in [6, 8) scales (docs/format.md).
ELEMENT_ERROR = {"fp8": 16.0, "mxfp4": 2.0, "nvfp4": 1.0}


def dispatch(op: str, *args, backend: str, **params):
    """Run floating-point op ``op`` with the FFI kernel of the lowering platform (CPU, or CUDA
    where built), or the jnp twin elsewhere."""
    backend = spec.check_backend(backend)
    twin = functools.partial(getattr(fp_reference, op), **params)
    if backend == "jnp":
        return twin(*args)
    kernel = functools.partial(getattr(fp_kernels, op), **params)
    built = {p: kernel for p in ("cpu", "cuda")
             if "flashcomm_fp_quantize" in kernels.registered(p)}
    if backend == "ffi":
        platform = kernel_platform_name() or jax.default_backend()
        if platform not in built:
            raise RuntimeError(
                f"backend='ffi': no floating-point format kernels are registered for "
                f"{jax.default_backend()!r} (built: {sorted(built) or 'none'}). Use "
                f"backend='jnp' or 'auto' (the jnp twin elsewhere)")
        return lax.platform_dependent(*args, cpu=kernel, cuda=kernel)
    if not built:
        return twin(*args)
    return lax.platform_dependent(*args, default=twin, **built)


def check(p: Payload, name: str) -> None:
    """A floating-point payload's codes record matches its metadata; scale and zero are None."""
    spec.check_format(p.format, p.group_size, f"{name}.format")
    if p.scale is not None or p.zero is not None:
        raise ValueError(f"{name} is a {p.format} payload: its scale and zero must be None "
                         f"(the codes record holds the scales)")
    if p.bits != spec.FP_BITS[p.format]:
        raise ValueError(f"{name}.bits must be {spec.FP_BITS[p.format]} for format "
                         f"{p.format!r}, got {p.bits}")
    got = getattr(p.codes, "dtype", None)
    if got is None or np.dtype(got) != np.dtype(jnp.uint8):
        raise TypeError(f"{name}.codes must be a uint8 array, got {got}")
    nb = spec.fp_record_bytes(p.format, p.group_size, p.spikes)
    if p.codes.ndim < 2 or p.codes.shape[-1] != nb:
        raise ValueError(f"{name}.codes must be (..., groups, {nb}) for format={p.format!r}, "
                         f"group_size={p.group_size}, spikes={p.spikes}; got {p.codes.shape}")


def quantize(groups, *, fmt: str, group_size: int, rotation: int, spikes: int,
             backend: str):
    """Records of ``groups`` ``(groups, G)`` in ``fmt``."""
    return dispatch("quantize", groups, backend=backend, fmt=fmt, group_size=group_size,
                    rotation=rotation, spikes=spikes)


def dequantize(p: Payload, dtype, backend: str):
    """Decoded groups ``(..., groups, G)`` of ``dtype``."""
    return dispatch("dequantize", p.codes, backend=backend, fmt=p.format,
                    group_size=p.group_size, dtype=dtype, rotation=p.rotation, spikes=p.spikes)


def dequantize_sum(p: Payload, dtype, backend: str):
    """The f32 sum over a chunked payload's chunk axis, ``(..., groups, G)`` of ``dtype``."""
    return dispatch("dequantize_sum", p.codes, backend=backend, fmt=p.format,
                    group_size=p.group_size, dtype=dtype, rotation=p.rotation, spikes=p.spikes)


def dequantize_sum_quantize(p: Payload, out_fmt: str, out_spikes: int, backend: str):
    """Records ``(..., groups, record)`` of the chunks' f32 sum in ``out_fmt``."""
    return dispatch("dequantize_sum_quantize", p.codes, backend=backend, fmt=p.format,
                    out_fmt=out_fmt, group_size=p.group_size, spikes=p.spikes,
                    out_spikes=out_spikes)


def element_bound(p: Payload) -> jax.Array:
    """Per element of the groups ``(..., groups, G)``, the bound on its error in the codes'
    domain: ``ELEMENT_ERROR * block scale`` (nvfp4 blocks whose E4M3 scale is 0: the largest
    magnitude that rounds to it, ``6 * 2^-10`` group scales), and at spike positions the bf16
    rounding of the spike (``2^-8 |s|``). NaN in a group that held a NaN or an Inf."""
    g, fmt = p.group_size, p.format
    nc, ns = spec.fp_code_bytes(fmt, g), spec.fp_scale_bytes(fmt, g)
    scales = fp_reference.block_scales(p.codes[..., nc:nc + ns], fmt, g)
    per_block = np.float32(ELEMENT_ERROR[fmt]) * scales
    if fmt == "nvfp4":
        gbyte = p.codes[..., nc + ns - 1:nc + ns].astype(jnp.uint32)
        gscale = jnp.where(gbyte == fp_reference.E8M0_NAN, np.float32(np.nan),
                           fp_reference._pow2(gbyte))
        per_block = jnp.maximum(per_block, np.float32(6 * 2.0**-10) * gscale)
    block = g if fmt == "fp8" else spec.FP_BLOCK[fmt]
    bound = jnp.repeat(per_block, block, axis=-1)
    if p.spikes:
        base = nc + ns
        values = fp_reference.bf16_bits_to_f32(
            fp_reference.from_le_bytes(p.codes[..., base:base + 2 * p.spikes], 2))
        pos = fp_reference.from_le_bytes(p.codes[..., base + 2 * p.spikes:],
                                         spec.position_bytes(g))
        iota = lax.broadcasted_iota(jnp.uint32, bound.shape, bound.ndim - 1)
        spike_b = jnp.abs(values) * np.float32(2.0**-8)
        for j in range(p.spikes):
            bound = jnp.where(iota == pos[..., j:j + 1], spike_b[..., j:j + 1], bound)
    return bound


def group_top(p: Payload) -> jax.Array:
    """Per group ``(..., groups)``, a bound on every decoded value's magnitude (for the
    rotation's bound): the largest element times its block scale, or the largest spike."""
    d = fp_reference.decode_groups(p.codes, p.format, p.group_size, p.spikes)
    return jnp.max(jnp.abs(d), axis=-1)
