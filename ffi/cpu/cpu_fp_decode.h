// The floating-point formats' decode (fp_codec.h): one record to f32 values, and the one-pass
// decode-and-store of the plain records (no spikes, scales that keep every value in range) into
// bf16 / f32. Compiled once per instruction set (ffi/cpu/isa_kernels.cc).
#ifndef FLASHCOMM_CPU_FP_DECODE_H_
#define FLASHCOMM_CPU_FP_DECODE_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_fp_bf16.h"
#include "cpu/cpu_fp_lanes.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// Decode tables: E4M3 codes 0..255 and E2M1 codes 0..15 to f32.
struct FpTables {
  FpTables() {
    for (uint32_t c = 0; c < 256; ++c) e4m3[c] = e4m3_decode(c);
    for (uint32_t c = 0; c < 16; ++c) e2m1[c] = e2m1_decode(c);
  }
  float e4m3[256];
  float e2m1[16];
};

// kLanes values that are not NaN and within T's finite range stored as T (bf16 or f32): what
// store_group does with them, its saturation and NaN case left out.
template <typename T>
FC_ALWAYS_INLINE void store_plain(Lanes v, typename T::Storage* y) {
  if constexpr (std::is_same_v<T, BF16>) {  // bf16_bits_lanes of a value that is not NaN
    const ULanes u = lanes_bits(v);
    narrow_halves((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16, y);
  } else {
    store_lanes(y, v);
  }
}

// Block b's scale of a four-bit record (scales: its scale bytes; gscale: nvfp4's group scale,
// e8m0_scale of its byte): fp_block_scale's operations, the E4M3 value from the decode table
// (e4m3: FpTables' e4m3, the scalar e4m3_decode's values) instead of the branching decode.
FC_ALWAYS_INLINE float fp4_block_scale(const uint8_t* scales, int32_t fmt, int64_t b,
                                       float gscale, const float* e4m3) {
  return fmt == kFormatNvfp4 ? mul_rn(e4m3[scales[b]], gscale) : e8m0_scale(scales[b]);
}

// A four-bit record (mxfp4 or nvfp4, no spikes) decoded and stored as bf16 or f32 in one pass
// where every block scale s has |s| * 6 within T's finite range (so no value saturates or is
// NaN); false otherwise (y partly written: the caller decodes the group the general way).
// e4m3: FpTables' E4M3 table (fp4_block_scale).
template <typename T>
FC_ALWAYS_INLINE bool fp4_decode_store(const uint8_t* rec, int64_t g, int32_t fmt,
                                       const float* e4m3, typename T::Storage* y) {
  if constexpr (!std::is_same_v<T, BF16> && !std::is_same_v<T, F32>) {
    return false;
  } else {
    const uint8_t* scales = rec + fp_code_bytes(fmt, g);
    const int64_t block = fp_block(fmt, g), blocks = g / block;
    const float gscale = fmt == kFormatNvfp4 ? e8m0_scale(scales[blocks]) : 0.0f;
#ifdef FLASHCOMM_E2M1_BF16_TABLES
    if constexpr (std::is_same_v<T, BF16>) {  // 32 values at a time through byte tables
      if (g % 32 == 0) {
        for (int64_t i = 0; i < g; i += 32) {
          const float s0 = fp4_block_scale(scales, fmt, i / block, gscale, e4m3);
          const float s1 = fp4_block_scale(scales, fmt, (i + 16) / block, gscale, e4m3);
          if (!e2m1_bf16_exact(s0) || !e2m1_bf16_exact(s1)) return false;
          e2m1_bf16_decode32(rec + i / 2, s0, s1, y + i);
        }
        return true;
      }
    }
#endif
    for (int64_t b = 0; b < blocks; ++b) {
      const float sc = fp4_block_scale(scales, fmt, b, gscale, e4m3);
      if (!(mul_rn(bits_to_float(float_to_bits(sc) & 0x7FFFFFFFu), 6.0f) <= T::kMax)) {
        return false;
      }
      for (int64_t i = b * block; i < (b + 1) * block; i += kLanes) {
        store_plain<T>(mul_rn(e2m1_decode_lanes(load_nibbles(rec + i / 2)), sc), y + i);
      }
    }
    return true;
  }
}

#if defined(FC_X86) && defined(__F16C__) && (FLASHCOMM_LANES == 8 || FLASHCOMM_LANES == 16)
// E4M3 bits are those of an IEEE half 2^-8 times the value, subnormals included: 16 codes at a
// time placed in half-precision words and widened by the conversion instruction, the 2^8 folded
// into the scale (v * s: one rounding either way). Only where s * 2^8 is finite (every scale
// the encoder writes; NaN passes) and the 16 codes hold no NaN (0x7F, 0xFF: the lane decode
// takes those).
FC_ALWAYS_INLINE bool fp8_half_decodable(float s) {
  return !(bits_to_float(float_to_bits(s) & 0x7FFFFFFFu) > 0x1p119f);
}
// The 16 values of codes c times s256 / 2^8 in lo (and hi: the second 8 with 8 lanes); false,
// and nothing computed, when a code is a NaN.
FC_ALWAYS_INLINE bool fp8_half_decode16(const uint8_t* c, float s256, Lanes* lo, Lanes* hi) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c));
  if (_mm_movemask_epi8(_mm_cmpeq_epi8(_mm_and_si128(b, _mm_set1_epi8(0x7F)),
                                       _mm_set1_epi8(0x7F))) != 0) {
    return false;
  }
  __m256i h = _mm256_slli_epi16(_mm256_cvtepu8_epi16(b), 7);                   // sign at bit 14
  h = _mm256_add_epi16(h, _mm256_and_si256(h, _mm256_set1_epi16(0x4000)));  // moved to bit 15
#if FLASHCOMM_LANES == 16
  *lo = mul_rn((Lanes)_mm512_cvtph_ps(h), s256);
  *hi = *lo;
#else
  *lo = mul_rn((Lanes)_mm256_cvtph_ps(_mm256_castsi256_si128(h)), s256);
  *hi = mul_rn((Lanes)_mm256_cvtph_ps(_mm256_extracti128_si256(h, 1)), s256);
#endif
  return true;
}

// An fp8 record without spikes (g a multiple of 16) decoded and stored as bf16 or f32 in one
// pass, without the f32 buffer, where its scale s is not NaN and passes fp8_half_decodable
// (|s| <= 2^119: every scale the encoder writes): then |value| <= 448 * 2^119 < bf16's largest
// finite, so the saturation and the NaN case of store_group change nothing and are left out.
// False (y partly written) for other scales and output types, or where a step holds a NaN
// code: the caller then decodes the group the general way.
template <typename T>
FC_ALWAYS_INLINE bool fp8_decode_store(const uint8_t* rec, int64_t g, typename T::Storage* y) {
  constexpr bool kBf16 = std::is_same_v<T, BF16>;
  if constexpr (!kBf16 && !std::is_same_v<T, F32>) {
    return false;
  } else {
    const float s = bf16_to_float(uint16_t(rec[g] | (rec[g + 1] << 8)));
    if (s != s || !fp8_half_decodable(s)) return false;
    const float s256 = mul_rn(s, 256.0f);
    Lanes v[2];
    for (int64_t i = 0; i < g; i += 16) {
      if (!fp8_half_decode16(rec + i, s256, &v[0], &v[1])) return false;
      for (int j = 0; j < 16 / kLanes; ++j) store_plain<T>(v[j], y + i + j * kLanes);
    }
    return true;
  }
}
#define FC_FP8_DECODE_STORE 1
#endif

// v stored at d, or added to what d holds (kAdd).
template <bool kAdd>
FC_ALWAYS_INLINE void put_lanes(float* d, Lanes v) {
  store_lanes(d, kAdd ? add_rn(load_lanes(d), v) : v);
}

// One record to f32 values (element times its block scale), spikes put back. kAdd (no spikes,
// k == 0): the values added to d's, in one pass (the chunk sums' accumulation).
template <bool kAdd = false>
inline void fp_decode_group(const uint8_t* rec, int64_t g, int32_t fmt, int k,
                            const FpTables& t, float* d) {
  const int64_t nc = fp_code_bytes(fmt, g), ns = fp_scale_bytes(fmt, g);
  const uint8_t* scales = rec + nc;
  if (fmt == kFormatFp8) {
    const float s = fp_block_scale(fmt, scales, g, 0);
    int64_t i = 0;
#if defined(FC_X86) && defined(__F16C__) && (FLASHCOMM_LANES == 8 || FLASHCOMM_LANES == 16)
    if (fp8_half_decodable(s)) {
      const float s256 = mul_rn(s, 256.0f);
      Lanes lo, hi;
      for (; i + 16 <= g && fp8_half_decode16(rec + i, s256, &lo, &hi); i += 16) {
        put_lanes<kAdd>(d + i, lo);
        if constexpr (kLanes == 8) put_lanes<kAdd>(d + i + 8, hi);
      }
    }
#endif
    for (; i + kLanes <= g; i += kLanes) {
      put_lanes<kAdd>(d + i, mul_rn(e4m3_decode_lanes(load_bytes(rec + i)), s));
    }
    for (; i < g; ++i) {
      const float v = mul_rn(t.e4m3[rec[i]], s);
      d[i] = kAdd ? add_rn(d[i], v) : v;
    }
  } else {
    const int64_t block = fp_block(fmt, g), blocks = g / block;
    const float gscale = fmt == kFormatNvfp4 ? e8m0_scale(scales[blocks]) : 0.0f;
    for (int64_t b = 0; b < blocks; ++b) {
      const float s = fp4_block_scale(scales, fmt, b, gscale, t.e4m3);
      for (int64_t i = b * block; i < (b + 1) * block; i += kLanes) {
        put_lanes<kAdd>(d + i, mul_rn(e2m1_decode_lanes(load_nibbles(rec + i / 2)), s));
      }
    }
  }
  if (!kAdd && k > 0) apply_spikes(rec + nc + ns, k, g, d);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_DECODE_H_
