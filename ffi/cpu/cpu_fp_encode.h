// The floating-point formats' element encoders over runs of values (fp_codec.h's arithmetic,
// from the lane-wise pieces of cpu_fp_lanes.h): E4M3 codes of an fp8 group, E2M1 codes of a
// four-bit group's blocks, and the record of a non-finite group. cpu_fp.h builds the quantize
// loops from them. Compiled once per instruction set (ffi/cpu/isa_kernels.cc).
#ifndef FLASHCOMM_CPU_FP_ENCODE_H_
#define FLASHCOMM_CPU_FP_ENCODE_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_fp_bf16.h"
#include "cpu/cpu_fp_lanes.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// encode_e4m3_run's values from i on (f32), a vector, then one value, at a time.
FC_ALWAYS_INLINE void encode_e4m3_tail(const float* v, int64_t i, int64_t n, Lanes inv,
                                       uint8_t* codes) {
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes q = mul_rn(load_lanes(v + i), inv);
    // the sign bit moved to the code's top bit with one shift and one AND
    narrow_bytes(e4m3_encode_clamped(abs_min_lanes(q, kE4m3Max)) | ((lanes_bits(q) >> 24) & 0x80u),
                 codes + i);
  }
  for (; i < n; ++i) {
    const float q = mul_rn(v[i], inv[0]);
    codes[i] = uint8_t(with_sign(e4m3_encode(bits_to_float(float_to_bits(q) & 0x7FFFFFFFu)), q, 7));
  }
}

// fp8: the E4M3 codes of n values RN(v * inv) (inv, in every lane: fp_inverse of the group
// scale); the four-bit formats' codes are encode_blocks'. In: float, or bf16 bits
// (FLASHCOMM_FP_BF16_DIRECT, n a multiple of 4 * kLanes).
template <typename In>
FC_ALWAYS_INLINE void encode_e4m3_run(const In* v, int64_t n, Lanes inv, uint8_t* codes) {
  int64_t i = 0;
#if (FLASHCOMM_LANES == 8 && defined(__AVX2__)) || (FLASHCOMM_LANES == 16 && defined(__AVX512BW__))
  // Four vectors at a time: the magnitudes' codes (<= 0x7E) packed to bytes with unsigned
  // saturation, the values themselves with signed saturation (which keeps each sign, -0.0's
  // too, in the byte's top bit), then one OR of that bit and one permutation of the 32-bit
  // pieces the in-lane packs interleaved: instead of a shift, an OR and a narrowing per vector.
  for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
    FcVecI c[4], q[4];
    Lanes in[4];
    fc_load_four(v + i, in);
    for (int j = 0; j < 4; ++j) {
      const Lanes x = mul_rn(in[j], inv);
      q[j] = (FcVecI)x;
      c[j] = (FcVecI)e4m3_encode_clamped(abs_min_lanes(x, kE4m3Max));
    }
    const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
    const FcVecI sign = fc_packs_epi16(fc_packs_epi32(q[0], q[1]), fc_packs_epi32(q[2], q[3]));
    const FcVecI bytes = fc_order_four(fc_or_top_bit(mag, sign), v);
    std::memcpy(codes + i, &bytes, sizeof(bytes));
  }
#endif
  if constexpr (std::is_same_v<In, float>) encode_e4m3_tail(v, i, n, inv, codes);
}

// E2M1 codes of n values (n a multiple of kLanes, blocks of kBlock values) from element `first`
// on, block j's values multiplied by lane lane0 + j of inv: a whole group's blocks in one loop,
// so the four-vector packing runs across block boundaries (a 16- or 32-value block is fewer than
// four AVX-512 vectors).
// kUnroll (n a compile-time constant): the loop unrolled, so every block's lane is a constant.
// In: float, or bf16 bits (FLASHCOMM_FP_BF16_DIRECT, n a multiple of 4 * kLanes).
template <int kBlock, bool kUnroll = false, typename In>
FC_ALWAYS_INLINE void encode_blocks(const In* v, int64_t n, Lanes inv, int64_t first,
                                    uint8_t* codes, int32_t lane0 = 0) {
  static_assert(kBlock % kLanes == 0, "a block is a whole number of vectors");
  int64_t i = 0;
#if (FLASHCOMM_LANES == 8 && defined(__AVX2__)) || (FLASHCOMM_LANES == 16 && defined(__AVX512BW__))
  // Four vectors at a time, as encode_e4m3_run: the sign's byte bit 7 shifted to bit 3 (a
  // 16-bit shift by 4 moves each byte's bit 7 there), then two codes to a byte.
  const auto four = [&](int64_t at) __attribute__((always_inline)) {
    Lanes x[4];
    fc_load_four(v + at, x);
    for (int j = 0; j < 4; ++j) {
      x[j] = mul_rn(x[j], __builtin_shuffle(
                              inv, ILanes{} + (lane0 + int32_t((at + j * kLanes) / kBlock))));
    }
    // the signs packed first: fewer vectors live at once (AVX2 has 16 registers)
    const FcVecI sign = fc_packs_epi16(fc_packs_epi32((FcVecI)x[0], (FcVecI)x[1]),
                                       fc_packs_epi32((FcVecI)x[2], (FcVecI)x[3]));
    FcVecI c[4];
    for (int j = 0; j < 4; ++j) c[j] = (FcVecI)e2m1_encode_clamped(e2m1_magnitude(x[j]));
    const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
    fc_store_nibble_bytes(fc_order_four(fc_or_sign_nibble(mag, sign), v),
                          codes + (first + at) / 2);
  };
  if constexpr (kUnroll) {
#pragma GCC unroll 16
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) four(i);
  } else {
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) four(i);
  }
#endif
  if constexpr (std::is_same_v<In, float>) {
    for (; i < n; i += kLanes) {
      const Lanes q = mul_rn(load_lanes(v + i),
                             __builtin_shuffle(inv, ILanes{} + (lane0 + int32_t(i / kBlock))));
      store_nibbles(e2m1_encode_clamped(e2m1_magnitude(q)) | ((lanes_bits(q) >> 28) & 8u),
                    codes + (first + i) / 2);
    }
  }
}

// A record of a group that holds an Inf or a NaN: zero codes, NaN scales.
inline void fp_encode_nonfinite(int64_t g, int32_t fmt, uint8_t* rec) {
  const int64_t nc = fp_code_bytes(fmt, g), ns = fp_scale_bytes(fmt, g);
  uint8_t* scales = rec + nc;
  std::memset(rec, 0, size_t(nc + ns));
  if (fmt == kFormatFp8) {
    scales[0] = uint8_t(kBf16NaN & 0xFF);
    scales[1] = uint8_t(kBf16NaN >> 8);
  } else if (fmt == kFormatMxfp4) {
    std::memset(scales, int(kE8m0Nan), size_t(ns));
  } else {
    scales[ns - 1] = uint8_t(kE8m0Nan);
  }
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_ENCODE_H_
