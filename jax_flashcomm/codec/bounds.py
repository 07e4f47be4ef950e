"""The codec's error bounds from the stored scales (docs/format.md derives each term):
:func:`jax_flashcomm.codec.error_bound` checks its payload and returns :func:`element_bound`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import fp, reference, spec
from jax_flashcomm.codec.payload import Payload


def _bf16_bits(a):
    """bf16 array -> its uint16 bit patterns."""
    return lax.bitcast_convert_type(a, jnp.uint16)


def element_bound(p: Payload, dtype) -> jax.Array:
    """Per-element bound on ``|dequantize(p) - x|`` of a checked payload, ``(..., groups, G)``
    (``error_bound`` restores the operand's shape).

    Args:
      p: a payload whose fields passed ``error_bound``'s checks.
      dtype: the dtype the operand is decoded to.

    Returns:
      f32 ``(..., groups, G)``; NaN in groups that hold NaN or Inf.
    """
    if p.format != "int":
        return _fp_bound(p, dtype)
    if p.rotation:
        rot_bound, top = rotated_domain_bound(p)
        bound = rotation_bound(rot_bound, top, p.group_size, dtype)
        return jnp.broadcast_to(bound[..., None], (*bound.shape, p.group_size))
    bound, _ = group_bound(p, dtype)
    per_elem = jnp.broadcast_to(bound[..., None], (*bound.shape, p.group_size))
    if p.spikes:
        values, positions = _spikes(p)
        iota = lax.broadcasted_iota(jnp.uint32, per_elem.shape, per_elem.ndim - 1)
        spike_b = spike_bound(values, dtype)
        for j in range(p.spikes):
            per_elem = jnp.where(iota == positions[..., j:j + 1], spike_b[..., j:j + 1], per_elem)
    return per_elem


def _fp_bound(p: Payload, dtype) -> jax.Array:
    """error_bound of a floating-point payload, ``(..., groups, G)``: the element bound
    (:func:`fp.element_bound`) plus the f32 rounding of the quotient and of a flushed subnormal,
    through the inverse rotation (:func:`rotation_bound`), then the cast to ``dtype``."""
    elem = fp.element_bound(p)
    top = fp.group_top(p)
    eps32 = float(np.finfo(np.float32).eps)
    elem = elem + 2 * eps32 * top[..., None] + 2 * float(spec.FLT_MIN)
    if p.rotation:
        bound = rotation_bound(jnp.max(elem, axis=-1), top, p.group_size, dtype)
        return jnp.broadcast_to(bound[..., None], (*bound.shape, p.group_size))
    if np.dtype(dtype) != np.float32:
        info = jnp.finfo(dtype)
        # eps * top + eps * elem, not eps * (top + elem): near the dtype's maximum the sum
        # overflows f32 while every term is finite
        elem = (elem + float(info.eps) * top[..., None] + float(info.eps) * elem
                + 0.5 * float(info.smallest_subnormal))
    return elem


def _spikes(p: Payload):
    """A spiked payload's spike values (f32) and positions (uint32), ``(..., groups, k)``."""
    nb = spec.group_bytes(p.group_size, p.bits)
    values = reference.bf16_bits_to_f32(
        reference.from_le_bytes(p.codes[..., nb:nb + 2 * p.spikes], 2))
    positions = reference.from_le_bytes(p.codes[..., nb + 2 * p.spikes:],
                                         spec.position_bytes(p.group_size))
    return values, positions


def spike_bound(values: jax.Array, dtype) -> jax.Array:
    """Bound on ``|x - s|`` of a spike stored as ``s`` (f32).

    The terms: bf16 round-to-nearest (``2^-8 |s|``), subnormals stored as zero (below
    ``FLT_MIN``), the saturation of values above the largest bf16, and the cast to ``dtype``
    (docs/format.md, "Spike reserving").

    Args:
      values: the stored spike values, f32, any shape.
      dtype: the dtype the operand is decoded to.

    Returns:
      f32 of ``values``' shape.
    """
    mag = jnp.abs(values)
    bound = mag * np.float32(2.0**-8) + 2 * float(spec.FLT_MIN)
    saturated = mag == np.float32(3.3895313892515355e38)
    bound = bound + jnp.where(saturated, float(spec.FLT_MAX_MINUS_BF16_LOWEST), 0.0)
    dtype = np.dtype(dtype)
    if dtype != np.float32:
        info = jnp.finfo(dtype)
        bound = bound + float(info.eps) * mag + 0.5 * float(info.smallest_subnormal)
    return bound


def rotated_domain_bound(p: Payload) -> tuple[jax.Array, jax.Array]:
    """Per group of a payload's f32 (rotated-domain) values: the error bound and ``top``.

    Spikes included.

    Args:
      p: a (rotated) payload.

    Returns:
      ``(bound, top)``, f32 ``(..., groups)``: the elementwise error bound and a bound on
      every decoded value's magnitude.
    """
    bound, top = group_bound(p, np.dtype(np.float32))
    if p.spikes:
        values, _ = _spikes(p)
        bound = jnp.maximum(bound, jnp.max(spike_bound(values, np.float32), axis=-1))
        top = jnp.maximum(top, jnp.max(jnp.abs(values), axis=-1))
    return bound, top


def group_bound(p: Payload, dtype):
    """Per group of an integer payload: the elementwise bound of the codes' domain, and
    ``top = max(|zero|, |zero + scale * L|)``, which bounds every decoded value."""
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
    return bound, 4 * quarter_top


def rotation_bound(rot_bound: jax.Array, top: jax.Array, group_size: int,
                   dtype) -> jax.Array:
    """Elementwise bound in the operand's domain from a rotated-domain one (per group).

    ``rot_bound`` bounds every element's error in the rotated domain (f32 values), ``top`` every
    rotated value's magnitude (both ``(..., groups)``). The inverse rotation is orthonormal, so a
    group's error has 2-norm at most ``sqrt(G) * rot_bound``, and so has every element. Added:
    the f32 rounding of the forward and inverse transforms (``log2 G`` butterfly stages and one
    scaling, each at most ``u`` relative in 2-norm, on groups of 2-norm at most
    ``sqrt(G) * (top + rot_bound)``), their flush to zero, and the final cast to ``dtype``
    (docs/format.md, "Rotation").

    Args:
      rot_bound: f32 ``(..., groups)``, from :func:`rotated_domain_bound`.
      top: f32 ``(..., groups)``, from :func:`rotated_domain_bound`.
      group_size: G, a power of two.
      dtype: the dtype the operand is decoded to.

    Returns:
      f32 ``(..., groups)``: every element's bound in the operand's domain.
    """
    g = int(group_size)
    k = g.bit_length() - 1
    sq = float(np.sqrt(g))
    eps32 = float(np.finfo(np.float32).eps)
    norm = sq * (top + rot_bound)
    bound = (sq * rot_bound * (1 + 4 * eps32) + 2 * (k + 2) * eps32 * norm
             + 2 * (k + 4) * sq * float(spec.FLT_MIN))
    dtype = np.dtype(dtype)
    if dtype != np.float32:
        info = jnp.finfo(dtype)
        bound = bound + float(info.eps) * norm + 0.5 * float(info.smallest_subnormal)
    return bound


