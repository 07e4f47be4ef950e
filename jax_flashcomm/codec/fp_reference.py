"""The pure-jnp twin of the floating-point group formats (fp8, mxfp4, nvfp4).

It mirrors ffi/include/flashcomm/fp_codec.h operation for operation, so its codes are
bit-identical to the CPU kernels' (tests/codec/test_fp_formats.py holds them to it). A
floating-point payload keeps a whole group in its codes array: element codes, the scales, then
the spike record (docs/format.md, "Floating-point formats").
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import spec
from jax_flashcomm.codec.reference import (
    _bits_f32, _f32_bits, _le_bytes, bf16_bits_to_f32, bf16_round_down, bf16_round_up,
    from_le_bytes, is_position, pack, restore_spikes, rotate, saturate, select_spikes,
    spike_value_bits, take_last, unpack, unrotate)

_U32 = jnp.uint32
E4M3_MAX = np.float32(448.0)
E2M1_MAX = np.float32(6.0)
#: RN(1/448) and RN(1/6): a division by a constant is this multiplication everywhere (XLA
#: rewrites such a division so; docs/format.md).
INV_E4M3_MAX = np.float32(1) / E4M3_MAX
INV_E2M1_MAX = np.float32(1) / E2M1_MAX
#: fp8's smallest group scale: every decoded value stays a normal f32 (XLA on CPU flushes
#: subnormals), 2^-117 * 2^-9 = 2^-126.
FP8_MIN_SCALE = np.float32(2.0**-117)
#: E8M0 bytes the encoders write: an MXFP4 block scale 2^(byte - 127) with byte in 2..252, an
#: NVFP4 group scale with byte in 12..253 (decoded values stay normal f32s, and the inverse
#: 2^(127 - byte) is a normal f32).
MX_BYTE_RANGE = (2, 252)
NV_BYTE_RANGE = (12, 253)
#: An E8M0 byte of 0xFF is NaN: the group held a NaN or an Inf.
E8M0_NAN = 0xFF


def e4m3_table() -> np.ndarray:
    """The f32 value of each E4M3 (fn) code 0..255; 0x7F and 0xFF are NaN."""
    c = np.arange(256)
    e, m = (c >> 3) & 15, c & 7
    mag = np.where(e == 0, m * 2.0**-9, (1 + m / 8) * 2.0 ** (e - 7))
    mag = np.where((c & 0x7F) == 0x7F, np.nan, mag)
    return np.where(c & 0x80, -mag, mag).astype(np.float32)


def e2m1_table() -> np.ndarray:
    """The f32 value of each E2M1 code 0..15."""
    mag = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)
    return np.concatenate([mag, -mag]).astype(np.float32)


def e4m3_decode(c):
    """E4M3 (fn) codes ``c`` (uint32 0..255) -> their f32 values, built from the bits (equal
    to :func:`e4m3_table` at every code; arithmetic, not a table lookup, so that it runs where
    gathers do not, as in a Mosaic kernel).

    Args:
      c: the codes.
    """
    c = c.astype(_U32)
    e, m = (c >> 3) & _U32(15), c & _U32(7)
    sub = m.astype(jnp.float32) * np.float32(2.0**-9)
    mag = jnp.where(e == 0, sub, _bits_f32(((e + _U32(120)) << 23) | (m << 20)))
    mag = jnp.where((c & _U32(0x7F)) == _U32(0x7F), np.float32(np.nan), mag)
    return _bits_f32(_f32_bits(mag) | ((c & _U32(0x80)) << 24))


def e2m1_decode(c):
    """E2M1 codes ``c`` (uint32 0..15) -> their f32 values, built from the bits (equal to
    :func:`e2m1_table` at every code).

    Args:
      c: the codes.
    """
    c = c.astype(_U32)
    e, m = (c >> 1) & _U32(3), c & _U32(1)
    sub = m.astype(jnp.float32) * np.float32(0.5)
    mag = jnp.where(e == 0, sub, _bits_f32(((e + _U32(126)) << 23) | (m << 22)))
    return _bits_f32(_f32_bits(mag) | ((c & _U32(8)) << 28))


def e4m3_encode(a):
    """Magnitudes ``a`` (f32 >= 0, finite) -> E4M3 codes (uint32 0..0x7E): round to nearest
    even, saturated at 448 (fp_codec.h e4m3_encode).

    Args:
      a: f32 magnitudes.
    """
    a = jnp.minimum(a, E4M3_MAX)
    sub = lax.round(a * np.float32(512), lax.RoundingMethod.TO_NEAREST_EVEN).astype(_U32)
    u = _f32_bits(a)
    u = u + _U32(0x7FFFF) + ((u >> 20) & _U32(1))
    normal = (((u >> 23) - _U32(120)) << 3) | ((u >> 20) & _U32(7))
    return jnp.where(a < np.float32(2.0**-6), sub, normal)


def e2m1_encode(a):
    """Magnitudes ``a`` (f32 >= 0) -> E2M1 codes (uint32 0..7): round to nearest even on
    {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturated at 6 (fp_codec.h e2m1_encode).

    Args:
      a: f32 magnitudes.
    """
    k = jnp.zeros(a.shape, _U32)
    for t in (0.25, 1.25, 2.5, 5.0):  # ties stay on the even code below
        k = k + (a > np.float32(t)).astype(_U32)
    for t in (0.75, 1.75, 3.5):       # ties go up to the even code
        k = k + (a >= np.float32(t)).astype(_U32)
    return k


def _signed(code, q, magnitude_bits: int):
    """``code`` with the sign bit of the f32 quotient ``q`` above its magnitude bits."""
    return code | ((_f32_bits(q) >> 31) << magnitude_bits)


def _exponent_field(a):
    """The biased exponent field (0..255) of f32 ``a``, uint32."""
    return (_f32_bits(a) >> 23) & _U32(0xFF)


def _clamp(u, lo: int, hi: int):
    return jnp.clip(u.astype(jnp.int32), lo, hi).astype(_U32)


def _pow2(byte):
    """2^(byte - 127) as f32 for an E8M0 byte in 1..254."""
    return _bits_f32(byte << 23)


def inverse(s):
    """RN(1 / s) per block (fp_codec.h fp_inverse): one IEEE division per scale, so that XLA
    cannot turn it into anything else; elements are encoded from ``RN(x * inverse)``."""
    return np.float32(1) / s


def _blocks(v, block: int):
    return v.reshape(*v.shape[:-1], v.shape[-1] // block, block)


def encode_groups(v, fmt: str, finite):
    """f32 groups ``(..., G)`` (no spikes) -> (element codes uint32 ``(..., G)``, scale bytes
    uint8 ``(..., scale bytes)``), per ``fmt`` (fp_codec.h fp_encode_group).

    Args:
      v: f32 groups.
      fmt: "fp8", "mxfp4" or "nvfp4".
      finite: per group, whether every value of the original group is finite.
    """
    g = v.shape[-1]
    fin = finite[..., None]
    if fmt == "fp8":
        amax = jnp.max(jnp.abs(v), axis=-1)
        t = jnp.maximum(amax * INV_E4M3_MAX, FP8_MIN_SCALE)
        lo = bf16_round_down(t)
        s_bits = jnp.where(bf16_bits_to_f32(lo) * E4M3_MAX >= amax, lo, bf16_round_up(t))
        q = v * inverse(bf16_bits_to_f32(s_bits))[..., None]
        codes = _signed(e4m3_encode(jnp.abs(q)), q, 7)
        s_bits = jnp.where(finite, s_bits, _U32(spec.BF16_NAN_BITS))
        return jnp.where(fin, codes, _U32(0)), _le_bytes(s_bits[..., None], 2)
    block = spec.FP_BLOCK[fmt]
    vb = _blocks(v, block)                                   # (..., G/B, B)
    amax = jnp.max(jnp.abs(vb), axis=-1)                     # (..., G/B)
    if fmt == "mxfp4":
        byte = _clamp(_exponent_field(amax).astype(jnp.int32) - 2, *MX_BYTE_RANGE)
        q = vb * _pow2(_U32(254) - byte)[..., None]
        codes = _signed(e2m1_encode(jnp.abs(q)), q, 3).reshape(v.shape)
        byte = jnp.where(fin, byte, _U32(E8M0_NAN))
        return jnp.where(fin, codes, _U32(0)), byte.astype(jnp.uint8)
    gamax = jnp.max(amax, axis=-1)                           # nvfp4
    gbyte = _clamp(_exponent_field(gamax).astype(jnp.int32) - 10, *NV_BYTE_RANGE)
    r = (amax * INV_E2M1_MAX) * _pow2(_U32(254) - gbyte)[..., None]
    sb = e4m3_encode(r)                                      # (..., G/B)
    sval = e4m3_decode(sb) * _pow2(gbyte)[..., None]
    safe = jnp.where(sval > 0, sval, np.float32(1))
    q = vb * inverse(safe)[..., None]
    codes = jnp.where((sval > 0)[..., None], _signed(e2m1_encode(jnp.abs(q)), q, 3), _U32(0))
    codes = jnp.where(fin, codes.reshape(v.shape), _U32(0))
    sb = jnp.where(fin, sb, _U32(0))
    gbyte = jnp.where(finite, gbyte, _U32(E8M0_NAN))
    del g
    return codes, jnp.concatenate([sb, gbyte[..., None]], axis=-1).astype(jnp.uint8)


def block_scales(scale_bytes, fmt: str, group_size: int):
    """Per block of a group, its f32 scale (NaN in a non-finite group), ``(..., G/B)``
    (fp8: ``(..., 1)``).

    Args:
      scale_bytes: uint8 ``(..., scale bytes)`` of the record.
      fmt, group_size: the codec parameters.
    """
    if fmt == "fp8":
        return bf16_bits_to_f32(from_le_bytes(scale_bytes, 2))
    b = scale_bytes.astype(_U32)
    if fmt == "mxfp4":
        return jnp.where(b == E8M0_NAN, np.float32(np.nan), _pow2(b))
    nb = group_size // spec.FP_BLOCK["nvfp4"]
    gbyte = b[..., nb:nb + 1]
    g = jnp.where(gbyte == E8M0_NAN, np.float32(np.nan), _pow2(gbyte))
    return e4m3_decode(b[..., :nb]) * g


def decode_groups(codes, fmt: str, group_size: int, spikes: int = 0):
    """A floating-point payload's codes ``(..., groups, record)`` -> f32 ``(..., groups, G)``:
    element value times its block's scale, then the spikes over their positions.

    Args:
      codes: the records.
      fmt, group_size, spikes: the codec parameters.
    """
    nc = spec.fp_code_bytes(fmt, group_size)
    ns = spec.fp_scale_bytes(fmt, group_size)
    scales = block_scales(codes[..., nc:nc + ns], fmt, group_size)
    if fmt == "fp8":
        elems = e4m3_decode(codes[..., :nc])
        d = elems * scales
    else:
        elems = e2m1_decode(unpack(codes[..., :nc], 4, group_size))
        block = spec.FP_BLOCK[fmt]
        d = (_blocks(elems, block) * scales[..., None]).reshape(elems.shape)
    return restore_spikes(d, codes[..., nc + ns:], group_size, spikes)


def quantize_groups(v, fmt: str, spikes: int = 0):
    """f32 groups ``(..., G)`` -> the records, uint8 ``(..., fp_record_bytes)``.

    With ``spikes``, each group's k largest magnitudes (:func:`select_spikes`) travel in bf16
    and are encoded as 0 among the elements.

    Args:
      v: the groups (cast to f32).
      fmt: "fp8", "mxfp4" or "nvfp4".
      spikes: values per group kept in bf16.
    """
    v = v.astype(jnp.float32)
    finite = jnp.all(jnp.isfinite(v), axis=-1)
    record = []
    if spikes:
        pos = select_spikes(v, spikes)
        iota = lax.broadcasted_iota(jnp.int32, v.shape, v.ndim - 1)
        is_spike = is_position(iota, pos)
        kept = take_last(v, pos)
        v = jnp.where(is_spike, np.float32(0), v)
        record = [_le_bytes(spike_value_bits(kept, finite), 2),
                  _le_bytes(pos.astype(_U32), spec.position_bytes(v.shape[-1]))]
    codes, scale_bytes = encode_groups(v, fmt, finite)
    packed = codes.astype(jnp.uint8) if fmt == "fp8" else pack(codes, 4)
    return jnp.concatenate([packed, scale_bytes, *record], axis=-1)


def sum_chunks(codes, fmt: str, group_size: int, spikes: int = 0):
    """Decode chunked records ``(..., N, groups, record)`` and sum over N in f32, in order."""
    decoded = decode_groups(codes, fmt, group_size, spikes)
    acc = decoded[..., 0, :, :]
    for i in range(1, decoded.shape[-3]):
        acc = acc + decoded[..., i, :, :]
    return acc


def quantize(v, *, fmt: str, group_size: int, rotation: int = 0, spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.fp_quantize`: the records.

    Args:
      v: groups ``(..., group_size)`` of f32/bf16/f16.
      fmt, group_size, rotation, spikes: the codec parameters.
    """
    del group_size
    v = v.astype(jnp.float32)
    if rotation:
        v = rotate(v, rotation)
    return quantize_groups(v, fmt, spikes)


def dequantize(codes, *, fmt: str, group_size: int, dtype, rotation: int = 0, spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.fp_dequantize`: groups of ``dtype``."""
    v = decode_groups(codes, fmt, group_size, spikes)
    if rotation:
        v = unrotate(v, rotation)
    return saturate(v, dtype).astype(dtype)


def dequantize_sum(codes, *, fmt: str, group_size: int, dtype, rotation: int = 0,
                   spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.fp_dequantize_sum`."""
    v = sum_chunks(codes, fmt, group_size, spikes)
    if rotation:
        v = unrotate(v, rotation)
    return saturate(v, dtype).astype(dtype)


def dequantize_sum_quantize(codes, *, fmt: str, out_fmt: str, group_size: int, spikes: int = 0,
                            out_spikes: int = 0):
    """The twin of :func:`jax_flashcomm.codec.kernels.fp_dequantize_sum_quantize`: the f32 sum
    of the chunks re-quantized in ``out_fmt`` (rotated payloads stay rotated)."""
    return quantize_groups(sum_chunks(codes, fmt, group_size, spikes), out_fmt, out_spikes)
