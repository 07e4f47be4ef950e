// The floating-point group formats of the codec (docs/format.md, "Floating-point formats"):
// the normative arithmetic, shared by every implementation (the jnp twin,
// jax_flashcomm/codec/fp_reference.py, copies it operation by operation).
//
//   fp8    E4M3 values, a bf16 scale per group:            record = G codes, 2 scale bytes
//   mxfp4  E2M1 values, an E8M0 scale per 32 (OCP MX):     record = G/2, G/32
//   nvfp4  E2M1 values, an E4M3 scale per 16, under an     record = G/2, G/16, 1
//          E8M0 scale per group (NVFP4's per-tensor f32 scale, per group: groups stay
//          independent, so a NaN poisons only its own)
//
// followed by the spike record of codec.h when spikes > 0. E2M1 codes pack two per byte, the
// first in the low nibble (the 4-bit packing of codec.h).
#ifndef FLASHCOMM_FP_CODEC_H_
#define FLASHCOMM_FP_CODEC_H_

#include <cstdint>

#include "flashcomm/codec.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {

// Format ids: the index in jax_flashcomm.codec.spec.FORMATS (0 is the integer format).
enum FpFormat : int32_t { kFormatInt = 0, kFormatFp8 = 1, kFormatMxfp4 = 2, kFormatNvfp4 = 3 };

constexpr float kE4m3Max = 448.0f;
constexpr float kE2m1Max = 6.0f;
// RN(1/448) and RN(1/6): a division by a constant is this multiplication in every
// implementation (XLA rewrites the division so; docs/format.md, "Why range * RN(1/L)").
constexpr float kInvE4m3Max = 1.0f / 448.0f;
constexpr float kInvE2m1Max = 1.0f / 6.0f;
constexpr float kFp8MinScale = 0x1p-117f;  // 2^-117: decoded values stay normal
constexpr uint32_t kE8m0Nan = 0xFF;
constexpr int32_t kMxByteMin = 2, kMxByteMax = 252;     // an MXFP4 block scale 2^(byte - 127)
constexpr int32_t kNvByteMin = 12, kNvByteMax = 253;    // an NVFP4 group scale 2^(byte - 127)

FC_HD int64_t fp_block(int32_t fmt, int64_t g) {
  return fmt == kFormatMxfp4 ? 32 : fmt == kFormatNvfp4 ? 16 : g;
}
FC_HD int64_t fp_code_bytes(int32_t fmt, int64_t g) { return fmt == kFormatFp8 ? g : g / 2; }
FC_HD int64_t fp_scale_bytes(int32_t fmt, int64_t g) {
  return fmt == kFormatFp8 ? 2 : fmt == kFormatMxfp4 ? g / 32 : g / 16 + 1;
}
FC_HD int64_t fp_record_bytes(int32_t fmt, int64_t g, int spikes) {
  return fp_code_bytes(fmt, g) + fp_scale_bytes(fmt, g) + spikes * (2 + position_bytes(g));
}

// 2^(byte - 127) for an E8M0 byte in 1..254 (a normal f32).
FC_HD float e8m0_value(uint32_t byte) { return bits_to_float(byte << 23); }

// The encoders' inverse of a block scale s > 0: RN(1 / s), one IEEE division per block; an
// element is encoded from RN(x * inverse).
FC_HD float fp_inverse(float s) { return 1.0f / s; }

// An E8M0 byte's scale, NaN for 0xFF.
FC_HD float e8m0_scale(uint32_t byte) {
  return byte == kE8m0Nan ? bits_to_float(0x7FC00000u) : e8m0_value(byte);
}

FC_HD int32_t clamp_i32(int32_t v, int32_t lo, int32_t hi) { return v < lo ? lo : v > hi ? hi : v; }

// The f32 exponent field of a (0..255).
FC_HD int32_t exponent_field(float a) { return int32_t((float_to_bits(a) >> 23) & 0xFFu); }

// |a| (f32, finite) -> E4M3 magnitude code 0..0x7E: round to nearest even, saturated at 448.
// Below 2^-6 the subnormal step 2^-9: a * 512 rounded to an integer (adding 2^23 rounds it).
FC_HD uint32_t e4m3_encode(float a) {
  a = a < kE4m3Max ? a : kE4m3Max;
  if (a < 0.015625f) {
    return float_to_bits(add_rn(mul_rn(a, 512.0f), 8388608.0f)) - 0x4B000000u;
  }
  uint32_t u = float_to_bits(a);
  u = u + 0x7FFFFu + ((u >> 20) & 1u);
  return (((u >> 23) - 120u) << 3) | ((u >> 20) & 7u);
}

// E4M3 code (0..255) -> f32: 0x7F and 0xFF are NaN.
FC_HD float e4m3_decode(uint32_t c) {
  const uint32_t e = (c >> 3) & 15u, m = c & 7u;
  float mag;
  if ((c & 0x7Fu) == 0x7Fu) {
    mag = bits_to_float(0x7FC00000u);
  } else if (e == 0) {
    mag = float(m) * 0.001953125f;  // m * 2^-9, exact
  } else {
    mag = bits_to_float(((e + 120u) << 23) | (m << 20));
  }
  return (c & 0x80u) ? -mag : mag;
}

// |a| -> E2M1 magnitude code 0..7 on {0, .5, 1, 1.5, 2, 3, 4, 6}: nearest, ties to the even
// code, saturated at 6.
FC_HD uint32_t e2m1_encode(float a) {
  return uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) +
         uint32_t(a >= 1.75f) + uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.0f);
}

// E2M1 code (0..15) -> f32: (1 + m/2) 2^(e-1) from the bits placed under an f32 exponent bias
// of 126; for e = 0, m/2 = (1 + m/2) - 1 (exact).
FC_HD float e2m1_decode(uint32_t c) {
  const uint32_t mag = c & 7u;
  const float v = (mag & 6u) != 0u ? bits_to_float((mag << 22) + (126u << 23))
                                   : add_rn(bits_to_float((mag << 22) + (127u << 23)), -1.0f);
  return (c & 8u) ? -v : v;
}

// A code with the sign bit of the quotient q above `magnitude_bits`.
FC_HD uint32_t with_sign(uint32_t code, float q, int magnitude_bits) {
  return code | ((float_to_bits(q) >> 31) << magnitude_bits);
}

// fp8: the stored bf16 scale of a group of largest magnitude amax: the bf16 below
// t = RN(amax * RN(1/448)) when it still maps amax within 448 (RN(s * 448) >= amax: t is often
// a hair above a bf16 that is exactly amax / 448), else the bf16 above t.
FC_HD uint16_t fp8_scale_bits(float amax) {
  float t = mul_rn(amax, kInvE4m3Max);
  t = t > kFp8MinScale ? t : kFp8MinScale;
  const uint16_t lo = bf16_round_down(t);
  return mul_rn(bf16_to_float(lo), kE4m3Max) >= amax ? lo : bf16_round_up(t);
}

// mxfp4: a block's E8M0 byte from its largest magnitude (OCP MX: 2^(floor(log2 amax) - 2)).
FC_HD uint32_t mxfp4_byte(float amax) {
  return uint32_t(clamp_i32(exponent_field(amax) - 2, kMxByteMin, kMxByteMax));
}

// nvfp4: the group's E8M0 byte from its largest magnitude (every block scale then fits E4M3:
// amax / 6 / 2^(e - 10) < 2^11 / 6 < 448), and a block's E4M3 scale code.
FC_HD uint32_t nvfp4_group_byte(float gamax) {
  return uint32_t(clamp_i32(exponent_field(gamax) - 10, kNvByteMin, kNvByteMax));
}
FC_HD uint32_t nvfp4_block_code(float amax, uint32_t gbyte) {
  return e4m3_encode(mul_rn(mul_rn(amax, kInvE2m1Max), e8m0_value(254u - gbyte)));
}

// The f32 scale of block b of a record's scale bytes (NaN in a non-finite group).
FC_HD float fp_block_scale(int32_t fmt, const uint8_t* scales, int64_t g, int64_t b) {
  if (fmt == kFormatFp8) return bf16_to_float(uint16_t(scales[0] | (scales[1] << 8)));
  if (fmt == kFormatMxfp4) return e8m0_scale(scales[b]);
  return mul_rn(e4m3_decode(scales[b]), e8m0_scale(scales[g / 16]));
}

// Element i of a record's codes (without its block scale).
FC_HD float fp_element(int32_t fmt, const uint8_t* codes, int64_t i) {
  if (fmt == kFormatFp8) return e4m3_decode(codes[i]);
  return e2m1_decode((codes[i / 2] >> (4 * (i & 1))) & 15u);
}

}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_FP_CODEC_H_
