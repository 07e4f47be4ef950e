# long file: the jnp twin of every kernel in one file, read side by side with
# ffi/include/flashcomm/codec.h
"""The pure-jnp twin of the codec kernels: runs on any backend (CPU, GPU, TPU).

It mirrors ffi/include/flashcomm/codec.h operation for operation, so its codes are
bit-identical to the FFI kernels' (tests/codec/test_codec_parity.py holds them to it). All functions
work on grouped arrays: values ``(..., group_size)`` and payload arrays ``(..., groups, bytes)``.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import spec

_U32 = jnp.uint32


def _f32_bits(x):
    return lax.bitcast_convert_type(x.astype(jnp.float32), _U32)


def _bits_f32(u):
    return lax.bitcast_convert_type(u.astype(_U32), jnp.float32)


def bf16_bits_to_f32(bits16):
    """bf16 bit patterns (uint16/uint32) to f32, exactly.

    Args:
      bits16: the bit patterns, any shape.
    """
    return _bits_f32(bits16.astype(_U32) << 16)


def bf16_to_bits(a):
    """bf16 array -> its uint16 bit patterns.

    Args:
      a: a bf16 array.
    """
    return lax.bitcast_convert_type(a, jnp.uint16)


def bits_to_bf16(bits16):
    """uint16/uint32 bit patterns -> bf16.

    Args:
      bits16: the bit patterns (the low 16 bits are kept).
    """
    return lax.bitcast_convert_type(bits16.astype(jnp.uint16), jnp.bfloat16)


def _bf16_round_away(x, sign: int):
    """f32 -> bf16 bits (uint32), truncated, then bumped one bf16 step away from zero where
    the sign bit is ``sign`` and bits were dropped."""
    u = _f32_bits(x)
    truncated = u & _U32(0xFFFF0000)
    bump = ((u >> 31) == sign) & ((u & _U32(0xFFFF)) != 0)
    return jnp.where(bump, truncated + _U32(0x10000), truncated) >> 16


def bf16_round_down(x):
    """f32 -> bf16 bits (uint32) rounded toward -inf.

    Args:
      x: f32 values.
    """
    return _bf16_round_away(x, 1)


def bf16_round_up(x):
    """f32 -> bf16 bits (uint32) rounded toward +inf.

    Args:
      x: f32 values.
    """
    return _bf16_round_away(x, 0)


def group_params(v, bits: int, finite=None):
    """Per group of ``v``: stored (scale_bits, zero_bits), and zero, pre, inv_scale, finite.

    Args:
      v: f32 groups ``(..., G)``.
      bits: bits per code.
      finite: per group, overrides whether the group counts as finite (spike reserving).
    """
    inv_levels = np.float32(1) / np.float32((1 << bits) - 1)
    lo = jnp.min(v, axis=-1)
    hi = jnp.max(v, axis=-1)
    if finite is None:
        finite = jnp.all(jnp.isfinite(v), axis=-1)
    lo = jnp.where(lo == 0, jnp.float32(0), lo)  # canonical +0 (see codec.h)
    hi = jnp.where(hi == 0, jnp.float32(0), hi)
    zero_bits = bf16_round_down(lo)
    zero_bits = jnp.where(zero_bits == spec.BF16_NEG_INF_BITS, _U32(spec.BF16_LOWEST_BITS),
                          zero_bits)
    zero = bf16_bits_to_f32(zero_bits)
    rng = hi - zero
    rng = jnp.where(rng > 0, rng, jnp.float32(0))  # groups below the lowest bf16 (see codec.h)
    halves = (hi * np.float32(0.5) - zero * np.float32(0.5)) * inv_levels * np.float32(2)
    scale = jnp.where(jnp.isfinite(rng), rng * inv_levels, halves)
    scale = jnp.where((rng > 0) & ~(scale >= spec.FLT_MIN), spec.FLT_MIN, scale)
    scale_bits = bf16_round_up(scale)
    scale = bf16_bits_to_f32(scale_bits)
    pre, inv_scale = inverse(scale)
    scale_bits = jnp.where(finite, scale_bits, _U32(spec.BF16_NAN_BITS))
    zero_bits = jnp.where(finite, zero_bits, _U32(0))
    zero = jnp.where(finite, zero, jnp.float32(0))
    inv_scale = jnp.where(finite, inv_scale, jnp.float32(0))
    pre = jnp.where(finite, pre, jnp.float32(1))
    return scale_bits, zero_bits, zero, pre, inv_scale, finite


def inverse(scale):
    """(pre, inv_scale): 1/scale, scaled by 2^64 where it would be denormal (see codec.h).

    Args:
      scale: f32 scales, per group.
    """
    pre = jnp.where(scale >= np.float32(2.0**120), np.float32(2.0**-64), np.float32(1))
    safe = jnp.where(scale > 0, scale * pre, np.float32(1))
    return pre, jnp.where(scale > 0, np.float32(1) / safe, np.float32(0))


def encode(v, zero, pre, inv_scale, finite, bits: int):
    """Codes ``clamp(round_half_even((v * pre - zero * pre) * inv_scale), 0, 2^bits - 1)``.

    Args:
      v: f32 groups ``(..., G)``.
      zero, pre, inv_scale, finite: per group, from :func:`group_params`.
      bits: bits per code.

    Returns:
      uint32 codes ``(..., G)`` (0 in non-finite groups).
    """
    levels = jnp.float32((1 << bits) - 1)
    t = (v * pre[..., None] - (zero * pre)[..., None]) * inv_scale[..., None]
    t = jnp.where(t > 0, t, jnp.float32(0))
    t = jnp.where(t < levels, t, levels)
    q = lax.round(t, lax.RoundingMethod.TO_NEAREST_EVEN).astype(_U32)
    return jnp.where(finite[..., None], q, _U32(0))


def pack(q, bits: int):
    """uint32 codes ``(..., G)`` -> uint8 ``(..., G * bits / 8)``, LSB-first per block of 8.

    Args:
      q: the codes.
      bits: bits per code.
    """
    if bits == 8:
        return q.astype(jnp.uint8)
    lead, g = q.shape[:-1], q.shape[-1]
    blocks = q.reshape(*lead, g // spec.BLOCK, spec.BLOCK, 1)
    bitplanes = (blocks >> jnp.arange(bits, dtype=_U32)) & _U32(1)  # (..., G/8, 8, bits)
    bytes_bits = bitplanes.reshape(*lead, g // spec.BLOCK, bits, 8)
    packed = jnp.sum(bytes_bits << jnp.arange(8, dtype=_U32), axis=-1)
    return packed.reshape(*lead, g * bits // 8).astype(jnp.uint8)


def unpack(codes, bits: int, group_size: int):
    """uint8 ``(..., G * bits / 8)`` -> uint32 codes ``(..., G)``.

    Args:
      codes: the packed codes (no spike record).
      bits, group_size: the codec parameters.
    """
    if bits == 8:
        return codes.astype(_U32)
    lead = codes.shape[:-1]
    byts = codes.astype(_U32).reshape(*lead, group_size // spec.BLOCK, bits, 1)
    bitplanes = (byts >> jnp.arange(8, dtype=_U32)) & _U32(1)  # (..., G/8, bits, 8)
    per_value = bitplanes.reshape(*lead, group_size // spec.BLOCK, spec.BLOCK, bits)
    q = jnp.sum(per_value << jnp.arange(bits, dtype=_U32), axis=-1)
    return q.reshape(*lead, group_size)


# ---- spike reserving (codec.h select_spikes ..., docs/format.md "Spike reserving") ----

def select_spikes(v, spikes: int):
    """Positions ``(..., k)`` int32 of the k largest ``|v|`` per group.

    Key: the magnitude's bits; in descending order, ties to the lowest position: k rounds of
    first-argmax.

    Args:
      v: f32 groups ``(..., G)``.
      spikes: k.
    """
    keys = (_f32_bits(v) & _U32(0x7FFFFFFF)).astype(jnp.int32)
    iota = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
    positions = []
    for _ in range(spikes):
        top = jnp.max(keys, axis=-1, keepdims=True)
        p = first_index(keys == top)
        positions.append(p)
        keys = jnp.where(iota == p[..., None], jnp.int32(-1), keys)
    return jnp.stack(positions, axis=-1)


def first_index(mask):
    """Per row of ``mask`` ``(..., G)``, the first position holding True (0 where none does:
    ``jnp.argmax``'s answer), int32 ``(...)``; integer min and max reductions only, so it runs
    where an argmax of integers does not (a Mosaic kernel)."""
    g = mask.shape[-1]
    iota = lax.broadcasted_iota(jnp.int32, mask.shape, mask.ndim - 1)
    first = jnp.min(jnp.where(mask, iota, jnp.int32(g)), axis=-1)
    return jnp.where(first == g, jnp.int32(0), first)


def take_last(v, pos):
    """``jnp.take_along_axis(v, pos, axis=-1)`` for f32 ``v`` ``(..., G)`` and int32 positions
    ``(..., k)`` in range: each value's bits picked by an integer sum of one nonzero term
    (exact, signed zeros and NaN payloads included), so it runs where a gather does not."""
    bits = lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    iota = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
    picked = [jnp.sum(jnp.where(iota == pos[..., j:j + 1], bits, jnp.int32(0)), axis=-1)
              for j in range(pos.shape[-1])]
    return lax.bitcast_convert_type(jnp.stack(picked, axis=-1), jnp.float32)


def is_position(iota, pos):
    """Per value, whether its position is one of ``pos`` ``(..., k)``."""
    hit = iota == pos[..., 0:1]
    for j in range(1, pos.shape[-1]):
        hit = hit | (iota == pos[..., j:j + 1])
    return hit


def spike_value_bits(v, finite):
    """bf16 bits (uint32) of the spikes.

    Round to nearest even, saturated to the finite bf16 range, subnormals as signed zeros;
    NaN (0x7FC0) in non-finite groups.

    Args:
      v: f32 spike values ``(..., k)``.
      finite: per group, whether it is finite.
    """
    u = _f32_bits(v)
    rounded = (u + _U32(0x7FFF) + ((u >> 16) & _U32(1))) >> 16
    h = jnp.where((u & _U32(0x7FFFFFFF)) > _U32(0x7F800000), (u >> 16) | _U32(0x40), rounded)
    h = jnp.where((h & _U32(0x7FFF)) == _U32(0x7F80), (h & _U32(0x8000)) | _U32(0x7F7F), h)
    h = jnp.where((h & _U32(0x7F80)) == 0, h & _U32(0x8000), h)  # subnormal: a signed zero
    return jnp.where(finite[..., None], h, _U32(spec.BF16_NAN_BITS))


def _le_bytes(x, nbytes: int):
    """uint32 ``(..., k)`` -> uint8 ``(..., k * nbytes)``, each little-endian."""
    parts = [(x >> (8 * i)) & _U32(0xFF) for i in range(nbytes)]
    return jnp.stack(parts, axis=-1).reshape(*x.shape[:-1], -1).astype(jnp.uint8)


def from_le_bytes(b, nbytes: int):
    """uint8 ``(..., k * nbytes)`` -> uint32 ``(..., k)``, each little-endian.

    Args:
      b: the bytes.
      nbytes: bytes per value (1..4).
    """
    b = b.astype(_U32).reshape(*b.shape[:-1], -1, nbytes)
    return sum(b[..., i] << (8 * i) for i in range(nbytes))


def quantize_groups(v, bits: int, spikes: int = 0):
    """f32 groups ``(..., G)`` -> (codes uint8, scale bf16, zero bf16).

    With ``spikes`` the codes array holds each group's spike record after its codes.

    Args:
      v: the groups (cast to f32).
      bits: bits per code.
      spikes: values per group kept in bf16.
    """
    v = v.astype(jnp.float32)
    if not spikes:
        scale_bits, zero_bits, zero, pre, inv_scale, finite = group_params(v, bits)
        q = encode(v, zero, pre, inv_scale, finite, bits)
        return pack(q, bits), bits_to_bf16(scale_bits), bits_to_bf16(zero_bits)
    g = v.shape[-1]
    pos = select_spikes(v, spikes)
    iota = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
    is_spike = is_position(iota, pos)
    stand_in = take_last(v, first_index(~is_spike)[..., None])
    kept = take_last(v, pos)
    finite = jnp.all(jnp.isfinite(v), axis=-1)
    v = jnp.where(is_spike, stand_in, v)
    scale_bits, zero_bits, zero, pre, inv_scale, finite = group_params(v, bits, finite)
    q = encode(v, zero, pre, inv_scale, finite, bits)
    record = [pack(q, bits), _le_bytes(spike_value_bits(kept, finite), 2),
              _le_bytes(pos.astype(_U32), spec.position_bytes(g))]
    return jnp.concatenate(record, axis=-1), bits_to_bf16(scale_bits), bits_to_bf16(zero_bits)


def decode_groups(codes, scale, zero, bits: int, group_size: int, spikes: int = 0):
    """(codes, scale, zero) -> f32 groups ``(..., G)``.

    ``fma(q, scale, zero)`` (see codec.h), then the spikes written over their positions, in
    record order.

    Args:
      codes, scale, zero: the payload's arrays.
      bits, group_size, spikes: the codec parameters.
    """
    nb = spec.group_bytes(group_size, bits)
    q = unpack(codes[..., :nb], bits, group_size).astype(jnp.float32)
    scale = scale.astype(jnp.float32)[..., None]
    zero = zero.astype(jnp.float32)[..., None]
    prod = q * scale
    half = np.float32(0.5)
    from_halves = (q * (scale * half) + zero * half) * np.float32(2)
    d = jnp.where(jnp.isfinite(prod), prod + zero, from_halves)
    return restore_spikes(d, codes[..., nb:], group_size, spikes)


def restore_spikes(d, record, group_size: int, spikes: int):
    """``d`` (decoded groups ``(..., G)``) with each group's spikes put back from its spike
    ``record`` (``spikes`` bf16 values, then their positions)."""
    if not spikes:
        return d
    values = bf16_bits_to_f32(from_le_bytes(record[..., :2 * spikes], 2))
    pos = from_le_bytes(record[..., 2 * spikes:], spec.position_bytes(group_size))
    iota = lax.broadcasted_iota(_U32, d.shape, d.ndim - 1)
    for j in range(spikes):
        d = jnp.where(iota == pos[..., j:j + 1], values[..., j:j + 1], d)
    return d


def sum_chunks(codes, scale, zero, bits: int, group_size: int, spikes: int = 0):
    """Decode chunked payload arrays ``(..., N, groups, bytes)`` and sum over N in f32, in order.

    Args:
      codes, scale, zero: the chunked payload's arrays.
      bits, group_size, spikes: the codec parameters.

    Returns:
      f32 ``(..., groups, G)``.
    """
    decoded = decode_groups(codes, scale, zero, bits, group_size, spikes)  # (..., N, groups, G)
    n = decoded.shape[-3]
    acc = decoded[..., 0, :, :]
    for i in range(1, n):
        acc = acc + decoded[..., i, :, :]
    # The overflow fallback (codec.h sum_shift): where a plain sum is not finite and every
    # chunk's group is, sum the values scaled by 2^-s and scale back by 2^s.
    shift = 1
    while (1 << shift) < n:
        shift += 1
    down, up = np.float32(2.0**-shift), np.float32(2.0**shift)
    # The barrier keeps XLA from factoring (a*c + b*c) * (1/c) back into the plain sum.
    terms = lax.optimization_barrier(decoded * down)
    scaled = terms[..., 0, :, :]
    for i in range(1, n):
        scaled = scaled + terms[..., i, :, :]
    chunks_finite = jnp.all(jnp.isfinite(scale.astype(jnp.float32)), axis=-2)[..., None]
    return jnp.where(jnp.isfinite(acc) | ~chunks_finite, acc, scaled * up)



def rotation_scale(group_size: int) -> np.float32:
    """RN(1/sqrt(G)) as an f32 (codec.h rotation_scale).

    Args:
      group_size: G.
    """
    return np.float32(1.0 / np.sqrt(np.float64(group_size)))


def rotation_sign_bits(group_size: int) -> np.ndarray:
    """codec.h rotation_sign_bit(i) << 31 for i in 0..G-1 (uint32; 0x80000000 means -1).

    Args:
      group_size: G.
    """
    i = np.arange(group_size, dtype=np.uint64)
    m = np.uint64(0xFFFFFFFF)
    h = (i * np.uint64(0x9E3779B1)) & m
    h ^= h >> np.uint64(15)
    h = (h * np.uint64(0x85EBCA77)) & m
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & m
    h ^= h >> np.uint64(16)
    return ((h >> np.uint64(31)) << np.uint64(31)).astype(np.uint32)


def apply_signs(v):
    """Flip the sign bit where rotation 2's sign is -1 (exact).

    Args:
      v: f32 groups ``(..., G)``.
    """
    signs = jnp.asarray(rotation_sign_bits(v.shape[-1]))
    return lax.bitcast_convert_type(_f32_bits(v) ^ signs, jnp.float32)


def hadamard_scaled(v):
    """Unnormalized Walsh-Hadamard butterflies over the last axis, then RN(1/sqrt(G)).

    Stages h = 1, 2, ..., G/2 (codec.h hadamard_butterflies), then one multiply.

    Args:
      v: f32 groups ``(..., G)``, G a power of two.
    """
    lead, g = v.shape[:-1], v.shape[-1]
    h = 1
    while h < g:
        w = v.reshape(*lead, g // (2 * h), 2, h)
        a, b = w[..., 0, :], w[..., 1, :]
        v = jnp.stack([a + b, a - b], axis=-2).reshape(*lead, g)
        h *= 2
    # The barrier keeps XLA from reassociating this inexact multiply with a consumer's
    # (the encoder's ``* pre``), after which LLVM contracts the product into the encoder's
    # subtraction: one rounding where codec.h has two (a code of 1 in ~50000 differed).
    return lax.optimization_barrier(v * rotation_scale(g))


def rotate(v, rotation: int):
    """Forward rotation of f32 groups ``(..., G)``: ``H (D v) / sqrt(G)``.

    Args:
      v: f32 groups.
      rotation: 1 (Hadamard) or 2 (signed Hadamard).
    """
    if rotation == 2:
        v = apply_signs(v)
    return hadamard_scaled(v)


def unrotate(v, rotation: int):
    """Inverse rotation: ``D (H v) / sqrt(G)``.

    Args:
      v: f32 groups ``(..., G)``.
      rotation: 1 (Hadamard) or 2 (signed Hadamard).
    """
    v = hadamard_scaled(v)
    return apply_signs(v) if rotation == 2 else v


def quantize(v, *, bits: int, group_size: int, rotation: int = 0, spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.quantize`: (codes, scale, zero).

    Args:
      v: groups ``(..., group_size)`` of f32/bf16/f16.
      bits, group_size, rotation, spikes: the codec parameters.
    """
    del group_size
    if rotation:
        return quantize_groups(rotate(v.astype(jnp.float32), rotation), bits, spikes)
    return quantize_groups(v, bits, spikes)


def saturate(v, dtype):
    """Clamp to the finite range of ``dtype``; NaN passes through (see codec.h).

    Args:
      v: f32 values.
      dtype: the target dtype.
    """
    top = np.float32(jnp.finfo(dtype).max)
    return jnp.where(v > top, top, jnp.where(v < -top, -top, v))


def dequantize(codes, scale, zero, *, bits: int, group_size: int, dtype, rotation: int = 0,
               spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.dequantize`: groups of ``dtype``.

    Args:
      codes, scale, zero: the payload's arrays.
      bits, group_size, dtype, rotation, spikes: the codec parameters.
    """
    v = decode_groups(codes, scale, zero, bits, group_size, spikes)
    if rotation:
        v = unrotate(v, rotation)
    return saturate(v, dtype).astype(dtype)


def dequantize_sum(codes, scale, zero, *, bits: int, group_size: int, dtype, rotation: int = 0,
                   spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.dequantize_sum`.

    Args:
      codes, scale, zero: the chunked payload's arrays.
      bits, group_size, dtype, rotation, spikes: the codec parameters (``dtype``: the sum's).
    """
    v = sum_chunks(codes, scale, zero, bits, group_size, spikes)
    if rotation:
        v = unrotate(v, rotation)
    return v.astype(dtype)


def dequantize_sum_quantize(codes, scale, zero, *, bits: int, out_bits: int, group_size: int,
                            spikes: int = 0, out_spikes: int | None = None):
    """The twin of :func:`jax_flashcomm.codec.kernels.dequantize_sum_quantize`.

    Args:
      codes, scale, zero: the chunked payload's arrays.
      bits, group_size, spikes: the input's codec parameters.
      out_bits, out_spikes: the sum's (``out_spikes`` None: ``spikes``).
    """
    out_spikes = spikes if out_spikes is None else out_spikes
    return quantize_groups(sum_chunks(codes, scale, zero, bits, group_size, spikes), out_bits,
                           out_spikes)




def dequantize_into(out, codes, scale, zero, offset, *, bits: int, group_size: int, count: int,
                    rotation: int = 0, spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.dequantize_into` (same arguments):
    ``out`` (flat row-major view) with elements ``[offset, offset + count)`` replaced by the
    first ``count`` decoded values of one payload. An out-of-range traced offset is clamped,
    as ``dynamic_update_slice`` does; the wrapper rejects static ones."""
    v = dequantize(codes, scale, zero, bits=bits, group_size=group_size, dtype=out.dtype,
                   rotation=rotation, spikes=spikes)
    flat = lax.dynamic_update_slice(out.reshape(-1), v.reshape(-1)[:count], (offset,))
    return flat.reshape(out.shape)
