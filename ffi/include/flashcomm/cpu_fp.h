// The CPU loops of the floating-point group formats (fp_codec.h): fp_codec.h's arithmetic,
// lane-wise in vectors of kLanes f32 (cpu_simd.h), the tails scalar. Compiled once per
// instruction set with the integer codec (ffi/cpu/isa_kernels.cc). Every block (16 or 32
// values) is a whole number of vectors; an fp8 group (G values) may end in a scalar tail.
#ifndef FLASHCOMM_CPU_FP_H_
#define FLASHCOMM_CPU_FP_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"
#include "flashcomm/cpu_codec.h"
#include "flashcomm/cpu_simd.h"
#include "flashcomm/cpu_spikes.h"
#include "flashcomm/fp_codec.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

FC_ALWAYS_INLINE Lanes abs_lanes(Lanes a) { return bits_lanes(lanes_bits(a) & 0x7FFFFFFFu); }

// 0 in even lanes, 4 in odd ones: the nibble of a code in its byte.
constexpr ULanes kNibbleShift = (ULanes)((kLaneIndex & 1) * 4);

// The low byte of every `step`-th lane of v (step 1 or 2), stored as kLanes / step bytes: one
// byte shuffle of the register (a lane-by-lane conversion compiles to scalar extracts).
typedef uint8_t LaneBytes __attribute__((vector_size(4 * kLanes)));
template <int kStep>
FC_ALWAYS_INLINE void store_low_bytes(ULanes v, uint8_t* out) {
  LaneBytes index;
  for (int j = 0; j < 4 * kLanes; ++j) index[j] = uint8_t((4 * kStep * j) & (4 * kLanes - 1));
  const LaneBytes bytes = __builtin_shuffle((LaneBytes)v, index);
  std::memcpy(out, &bytes, kLanes / kStep);
}

// kLanes E2M1 codes (0..15, one per lane) packed into kLanes / 2 bytes, the even lane's code in
// the low nibble.
FC_ALWAYS_INLINE void store_nibbles(ULanes c, uint8_t* out) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  // Each 64-bit lane's high code shifted under its low one, then one vpmovqb.
  const __m512i v = (__m512i)c;
  _mm_storel_epi64(reinterpret_cast<__m128i*>(out),
                   _mm512_cvtepi64_epi8(_mm512_or_si512(v, _mm512_srli_epi64(v, 28))));
#else
  const ULanes shifted = c << kNibbleShift;
  store_low_bytes<2>(shifted | __builtin_shuffle(shifted, (ULanes)(kLaneIndex ^ 1)), out);
#endif
}

// kLanes E2M1 codes from kLanes / 2 bytes, as store_nibbles wrote them.
FC_ALWAYS_INLINE ULanes load_nibbles(const uint8_t* in) {
  const ULanes wide = widen_u8_half(in);
  return (__builtin_shuffle(wide, (ULanes)(kLaneIndex >> 1)) >> kNibbleShift) & 15u;
}

// kLanes bytes as one code per lane.
FC_ALWAYS_INLINE ULanes load_bytes(const uint8_t* in) { return widen_u8(in); }

// min(a, m) for a >= 0 or NaN: a < m ? a : m (x86's minps is exactly that; the vector
// extension's ?: compiles to a compare and a blend).
FC_ALWAYS_INLINE Lanes min_lanes(Lanes a, float m) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  // (the all-lanes mask form: _mm512_min_ps's undefined pass-through operand makes GCC 12 warn
  // wherever the operands are constants)
  return (Lanes)_mm512_maskz_min_ps(__mmask16(0xFFFF), (__m512)a, _mm512_set1_ps(m));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return (Lanes)_mm256_min_ps((__m256)a, _mm256_set1_ps(m));
#else
  return a < m ? a : Lanes{} + m;
#endif
}

// min(|a|, m) (m > 0; a not NaN). AVX-512 DQ: one vrangeps (the smaller magnitude, sign
// cleared) in place of an AND and a minps.
FC_ALWAYS_INLINE Lanes abs_min_lanes(Lanes a, float m) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512DQ__)
  return (Lanes)_mm512_maskz_range_ps(__mmask16(0xFFFF), (__m512)a, _mm512_set1_ps(m), 0x0A);
#else
  return min_lanes(abs_lanes(a), m);
#endif
}

// below < small ? the integer nearest to small_scaled : normal, lane-wise. On x86 the
// conversion instruction rounds in the current mode, as the add of 2^23 does elsewhere (codec.h
// encode; small_scaled < 2^23), and AVX-512 merges it into `normal` under the compare's mask.
FC_ALWAYS_INLINE ULanes round_where_below(Lanes below, float small, Lanes small_scaled,
                                          ULanes normal) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  const __mmask16 k = _mm512_cmp_ps_mask((__m512)below, _mm512_set1_ps(small), _CMP_LT_OQ);
  return (ULanes)_mm512_mask_cvtps_epi32((__m512i)normal, k, (__m512)small_scaled);
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return below < small ? (ULanes)_mm256_cvtps_epi32((__m256)small_scaled) : normal;
#else
  return below < small ? lanes_bits(add_rn(small_scaled, 8388608.0f)) - 0x4B000000u : normal;
#endif
}

// fp_codec.h e4m3_encode, lane-wise. Above 2^-6 the rounded bits' exponent and top three
// mantissa bits, read as one field, are the code plus 120 << 3 (the exponent biases' difference);
// below it the code is 512 a rounded to an integer.
// e4m3_encode_clamped takes a in [0, 448] (abs_min_lanes clamps it); e4m3_encode_lanes any a >= 0.
FC_ALWAYS_INLINE ULanes e4m3_encode_clamped(Lanes a) {
  // (the bias difference subtracted before the shift: one operation fewer; u >= 121 << 23 in
  // the lanes that keep it)
  const ULanes u = lanes_bits(a);
  const ULanes normal = (u + (0x7FFFFu - (960u << 20)) + ((u >> 20) & 1u)) >> 20;
  return round_where_below(a, 0.015625f, mul_rn(a, 512.0f), normal);
}
FC_ALWAYS_INLINE ULanes e4m3_encode_lanes(Lanes a) {
  return e4m3_encode_clamped(min_lanes(a, kE4m3Max));
}

// fp_codec.h e2m1_encode, lane-wise. On AVX-512 a comparison lands in a mask register and costs
// three operations to count, so the codes come from rounding the bits as e4m3_encode_lanes
// does: below 1 the step 1/2 (2a rounded to an integer), above it one mantissa bit under an
// exponent bias of 126, saturated at 6 (the same codes for every a >= 0: tests/codec, the
// ties). Elsewhere the seven comparisons, each -1 where true.
// e2m1_encode_clamped takes a in [0, 6] (the comparisons: any a >= 0); e2m1_magnitude(q) is
// |q| in that range.
FC_ALWAYS_INLINE ULanes e2m1_encode_clamped(Lanes a) {
#if FLASHCOMM_LANES == 16
  const ULanes u = lanes_bits(a);
  const ULanes normal = (u + (0x1FFFFFu - (252u << 22)) + ((u >> 22) & 1u)) >> 22;
  return round_where_below(a, 1.0f, mul_rn(a, 2.0f), normal);
#else
  const ILanes k = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) +
                   (a >= 3.5f) + (a > 5.0f);
  return (ULanes)(-k);
#endif
}
FC_ALWAYS_INLINE ULanes e2m1_encode_lanes(Lanes a) {
#if FLASHCOMM_LANES == 16
  return e2m1_encode_clamped(min_lanes(a, kE2m1Max));
#else
  return e2m1_encode_clamped(a);
#endif
}
FC_ALWAYS_INLINE Lanes e2m1_magnitude(Lanes q) {
#if FLASHCOMM_LANES == 16
  return abs_min_lanes(q, kE2m1Max);
#else
  return abs_lanes(q);
#endif
}

// Lane i: the larger of lanes 2i and 2i + 1 of the concatenation a ++ b.
FC_ALWAYS_INLINE ILanes pair_max(ILanes a, ILanes b) {
  const ILanes even = __builtin_shuffle(a, b, 2 * kLaneIndex);
  const ILanes odd = __builtin_shuffle(a, b, 2 * kLaneIndex + 1);
  return even > odd ? even : odd;
}

// Lane j (j < kCount, a power of two <= kLanes): the largest lane of m[j]. A transposing
// reduction tree: kCount - 1 pair_max for the vectors, then log2(kLanes / kCount) within one.
template <int kCount>
FC_ALWAYS_INLINE ILanes largest_lanes(ILanes* m) {
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  if constexpr (kCount == 8) {
    // AVX2 has no two-register lane permutation: the in-lane unpacks of an 8x8 transpose, then
    // one exchange of the 128-bit halves.
    __m256i t[4], u[2];
    for (int j = 0; j < 4; ++j) {
      const __m256i a = (__m256i)m[2 * j], b = (__m256i)m[2 * j + 1];
      t[j] = _mm256_max_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b));
    }
    for (int j = 0; j < 2; ++j) {
      u[j] = _mm256_max_epi32(_mm256_unpacklo_epi64(t[2 * j], t[2 * j + 1]),
                              _mm256_unpackhi_epi64(t[2 * j], t[2 * j + 1]));
    }
    return (ILanes)_mm256_max_epi32(_mm256_permute2x128_si256(u[0], u[1], 0x20),
                                    _mm256_permute2x128_si256(u[0], u[1], 0x31));
  }
#endif
  for (int n = kCount; n > 1; n /= 2) {
    for (int j = 0; j < n / 2; ++j) m[j] = pair_max(m[2 * j], m[2 * j + 1]);
  }
  for (int n = kCount; n < kLanes; n *= 2) m[0] = pair_max(m[0], m[0]);
  return m[0];
}

// The largest magnitudes (f32 bits) of kCount consecutive blocks of kBlock values (a multiple
// of kLanes): every size known at compile time, so the vectors stay in registers.
template <int kCount, int kBlock>
FC_ALWAYS_INLINE ILanes block_maxima(const float* v) {
  ILanes m[kCount];
  for (int j = 0; j < kCount; ++j) {
    m[j] = (ILanes)(lanes_bits(load_lanes(v + j * kBlock)) & 0x7FFFFFFFu);
    for (int i = kLanes; i < kBlock; i += kLanes) {
      const ILanes a = (ILanes)(lanes_bits(load_lanes(v + j * kBlock + i)) & 0x7FFFFFFFu);
      m[j] = a > m[j] ? a : m[j];
    }
  }
  return largest_lanes<kCount>(m);
}

// The same for nb <= kCount blocks of `block` values (16 or 32), in lanes 0..nb-1.
template <int kCount>
FC_ALWAYS_INLINE ILanes block_maxima(const float* v, int64_t block, int64_t nb) {
  if (nb == kCount && block == 16) return block_maxima<kCount, 16>(v);
  if (nb == kCount && block == 32) return block_maxima<kCount, 32>(v);
  ILanes m[kCount];
  for (int j = 0; j < kCount; ++j) {
    m[j] = ILanes{};
    for (int64_t i = 0; j < nb && i < block; i += kLanes) {
      const ILanes a = (ILanes)(lanes_bits(load_lanes(v + j * block + i)) & 0x7FFFFFFFu);
      m[j] = a > m[j] ? a : m[j];
    }
  }
  return largest_lanes<kCount>(m);
}

// Largest magnitude of n values (n a multiple of kLanes, or any n scalar), as f32 bits order.
FC_ALWAYS_INLINE float max_abs(const float* v, int64_t n) {
  return bits_to_float(uint32_t(max_key_of(v, n)));
}

// E4M3 codes (0..255, one per lane) -> f32, as e4m3_decode: the magnitude's bits placed under
// an f32 exponent bias of 120 (exact for normal codes); a subnormal code m is
// (1 + m/8) 2^-6 - 2^-6 (exact); 0x7F is NaN; then the sign.
FC_ALWAYS_INLINE Lanes e4m3_decode_lanes(ULanes c) {
  const ULanes mag = c & 0x7Fu;
  const ULanes sub = (c & 0x78u) == 0u;
  const Lanes normal = bits_lanes((mag << 20) + (120u << 23));
  const Lanes subn = bits_lanes((mag << 20) + (121u << 23)) - 0.015625f;
  Lanes v = sub ? subn : normal;
  v = mag == 0x7Fu ? bits_lanes(ULanes{} + 0x7FC00000u) : v;
  return bits_lanes(lanes_bits(v) | ((c & 0x80u) << 24));
}

// E2M1 codes (0..15) -> f32, as e2m1_decode: (1 + m/2) 2^(e-1) from the bits under a bias of
// 126, m/2 = (1 + m/2) - 1 for e = 0 (exact), then the sign. On AVX2 and AVX-512 the same
// values as a lookup in one register (vpermps).
FC_ALWAYS_INLINE Lanes e2m1_decode_lanes(ULanes c) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  const __m512 table = _mm512_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f, -0.0f,
                                      -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  return (Lanes)_mm512_permutexvar_ps((__m512i)c, table);
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  const __m256 table = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const Lanes mag = (Lanes)_mm256_permutevar8x32_ps(table, (__m256i)c);
  return bits_lanes(lanes_bits(mag) | ((c & 8u) << 28));
#else
  const ULanes mag = c & 7u;
  const Lanes normal = bits_lanes((mag << 22) + (126u << 23));
  const Lanes subn = bits_lanes((mag << 22) + (127u << 23)) - 1.0f;
  const Lanes v = (mag & 6u) == 0u ? subn : normal;
  return bits_lanes(lanes_bits(v) | ((c & 8u) << 28));
#endif
}

#if FLASHCOMM_LANES == 16 && defined(__AVX512BW__)
typedef __m512i FcVecI;
FC_ALWAYS_INLINE FcVecI fc_packus_epi32(FcVecI a, FcVecI b) { return _mm512_packus_epi32(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packus_epi16(FcVecI a, FcVecI b) { return _mm512_packus_epi16(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packs_epi32(FcVecI a, FcVecI b) { return _mm512_packs_epi32(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packs_epi16(FcVecI a, FcVecI b) { return _mm512_packs_epi16(a, b); }
// a | (b & 0x80 in every byte)
FC_ALWAYS_INLINE FcVecI fc_or_top_bit(FcVecI a, FcVecI b) {
  return _mm512_ternarylogic_epi32(a, b, _mm512_set1_epi8(char(0x80)), 0xF8);
}
// a | (bit 7 of each byte of b, moved to bit 3)
FC_ALWAYS_INLINE FcVecI fc_or_sign_nibble(FcVecI a, FcVecI b) {
  return _mm512_ternarylogic_epi32(a, _mm512_srli_epi16(b, 4), _mm512_set1_epi8(8), 0xF8);
}
// The 4 x 4 pieces of 4 bytes from lane-major to vector-major order (what the packs of four
// vectors leave: 128-bit lane k holds piece k of each vector in turn).
FC_ALWAYS_INLINE FcVecI fc_permute_dwords(FcVecI a) {
  return _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), a);
}
// 64 E2M1 codes (one per byte, in order) to 32 bytes of nibbles, the even code low.
FC_ALWAYS_INLINE void fc_store_nibble_bytes(FcVecI codes, uint8_t* out) {
  // 16-bit words lo | hi << 8 -> lo | hi << 4 (lo < 16), then the words' low bytes
  const __m512i w = _mm512_and_si512(_mm512_or_si512(codes, _mm512_srli_epi16(codes, 4)),
                                     _mm512_set1_epi16(0xFF));
  const __m512i b = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7),
                                             _mm512_packus_epi16(w, w));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm512_castsi512_si256(b));
}
#elif FLASHCOMM_LANES == 8 && defined(__AVX2__)
typedef __m256i FcVecI;
FC_ALWAYS_INLINE FcVecI fc_packus_epi32(FcVecI a, FcVecI b) { return _mm256_packus_epi32(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packus_epi16(FcVecI a, FcVecI b) { return _mm256_packus_epi16(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packs_epi32(FcVecI a, FcVecI b) { return _mm256_packs_epi32(a, b); }
FC_ALWAYS_INLINE FcVecI fc_packs_epi16(FcVecI a, FcVecI b) { return _mm256_packs_epi16(a, b); }
FC_ALWAYS_INLINE FcVecI fc_or_top_bit(FcVecI a, FcVecI b) {
  return _mm256_or_si256(a, _mm256_and_si256(b, _mm256_set1_epi8(char(0x80))));
}
FC_ALWAYS_INLINE FcVecI fc_or_sign_nibble(FcVecI a, FcVecI b) {
  return _mm256_or_si256(a, _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(8)));
}
FC_ALWAYS_INLINE FcVecI fc_permute_dwords(FcVecI a) {
  return _mm256_permutevar8x32_epi32(a, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
}
FC_ALWAYS_INLINE void fc_store_nibble_bytes(FcVecI codes, uint8_t* out) {
  const __m256i w = _mm256_and_si256(_mm256_or_si256(codes, _mm256_srli_epi16(codes, 4)),
                                     _mm256_set1_epi16(0xFF));
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(b));
}
#endif

// Element codes of n values RN(v * inv) (inv, in every lane: fp_inverse of the block scale, or
// mxfp4's exact power of two), E4M3 bytes (fp8) or E2M1 nibbles from element `first` on (n and
// first even).
template <bool kFp8>
FC_ALWAYS_INLINE void encode_run(const float* v, int64_t n, Lanes inv, int64_t first,
                                 uint8_t* codes) {
  int64_t i = 0;
#if (FLASHCOMM_LANES == 8 && defined(__AVX2__)) || (FLASHCOMM_LANES == 16 && defined(__AVX512BW__))
  if constexpr (kFp8) {
    // Four vectors at a time: the magnitudes' codes (<= 0x7E) packed to bytes with unsigned
    // saturation, the values themselves with signed saturation (which keeps each sign, -0.0's
    // too, in the byte's top bit), then one OR of that bit and one permutation of the 32-bit
    // pieces the in-lane packs interleaved: instead of a shift, an OR and a narrowing per vector.
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      FcVecI c[4], q[4];
      for (int j = 0; j < 4; ++j) {
        const Lanes x = mul_rn(load_lanes(v + i + j * kLanes), inv);
        q[j] = (FcVecI)x;
        c[j] = (FcVecI)e4m3_encode_clamped(abs_min_lanes(x, kE4m3Max));
      }
      const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
      const FcVecI sign = fc_packs_epi16(fc_packs_epi32(q[0], q[1]), fc_packs_epi32(q[2], q[3]));
      const FcVecI bytes = fc_permute_dwords(fc_or_top_bit(mag, sign));
      std::memcpy(codes + first + i, &bytes, sizeof(bytes));
    }
  } else {
    // The same for E2M1: the sign's byte bit 7 shifted to bit 3 (a 16-bit shift by 4 moves
    // each byte's bit 7 there), then two codes to a byte.
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      FcVecI c[4], q[4];
      for (int j = 0; j < 4; ++j) {
        const Lanes x = mul_rn(load_lanes(v + i + j * kLanes), inv);
        q[j] = (FcVecI)x;
        c[j] = (FcVecI)e2m1_encode_clamped(e2m1_magnitude(x));
      }
      const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
      const FcVecI sign = fc_packs_epi16(fc_packs_epi32(q[0], q[1]), fc_packs_epi32(q[2], q[3]));
      fc_store_nibble_bytes(fc_permute_dwords(fc_or_sign_nibble(mag, sign)),
                            codes + (first + i) / 2);
    }
  }
#endif
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes x = load_lanes(v + i);
    const Lanes q = mul_rn(x, inv);
    // the sign bit moved to the code's top bit with one shift and one AND
    if constexpr (kFp8) {
      narrow_bytes(
          e4m3_encode_clamped(abs_min_lanes(q, kE4m3Max)) | ((lanes_bits(q) >> 24) & 0x80u),
          codes + first + i);
    } else {
      store_nibbles(e2m1_encode_clamped(e2m1_magnitude(q)) | ((lanes_bits(q) >> 28) & 8u),
                    codes + (first + i) / 2);
    }
  }
  for (; i < n; ++i) {
    const float q = mul_rn(v[i], inv[0]);
    const float a = bits_to_float(float_to_bits(q) & 0x7FFFFFFFu);
    if constexpr (kFp8) {
      codes[first + i] = uint8_t(with_sign(e4m3_encode(a), q, 7));
    } else {
      const uint32_t c = with_sign(e2m1_encode(a), q, 3);
      uint8_t& b = codes[(first + i) / 2];
      b = ((first + i) & 1) ? uint8_t((b & 0x0F) | (c << 4)) : uint8_t(c);
    }
  }
}

// One f32 group v (g values, spikes already zeroed, largest magnitude amax) into its record's
// codes and scales. finite: every value of the group, spikes included, is finite.
inline void fp_encode_group(const float* v, int64_t g, int32_t fmt, float amax, bool finite,
                            uint8_t* rec) {
  const int64_t nc = fp_code_bytes(fmt, g), ns = fp_scale_bytes(fmt, g);
  uint8_t* scales = rec + nc;
  if (!finite) {
    std::memset(rec, 0, size_t(nc + ns));
    if (fmt == kFormatFp8) {
      scales[0] = uint8_t(kBf16NaN & 0xFF);
      scales[1] = uint8_t(kBf16NaN >> 8);
    } else if (fmt == kFormatMxfp4) {
      std::memset(scales, int(kE8m0Nan), size_t(ns));
    } else {
      scales[ns - 1] = uint8_t(kE8m0Nan);
    }
    return;
  }
  if (fmt == kFormatFp8) {
    const uint16_t s = fp8_scale_bits(amax);
    scales[0] = uint8_t(s & 0xFF);
    scales[1] = uint8_t(s >> 8);
    encode_run<true>(v, g, Lanes{} + fp_inverse(bf16_to_float(s)), 0, rec);
    return;
  }
  const int64_t block = fp_block(fmt, g), blocks = g / block;
  const uint32_t gbyte = fmt == kFormatNvfp4 ? nvfp4_group_byte(amax) : 0u;
  if (fmt == kFormatNvfp4) scales[blocks] = uint8_t(gbyte);
  const float gscale = e8m0_value(gbyte), down = e8m0_value(254u - gbyte);
  // kChunk blocks at a time: their largest magnitudes, scale codes, scales and inverses
  // lane-wise (fp_codec.h mxfp4_byte, nvfp4_block_code, fp_block_scale and fp_inverse: the same
  // operations).
  constexpr int kChunk = kLanes < 8 ? kLanes : 8;
  for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
    const int64_t nb = blocks - b0 < kChunk ? blocks - b0 : kChunk;
    const ILanes am = block_maxima<kChunk>(v + b0 * block, block, nb);
    ULanes code;
    Lanes inv;
    bool nonzero[kChunk];
    if (fmt == kFormatMxfp4) {
      const ILanes e = ((am >> 23) & 0xFF) - 2;
      code = (ULanes)(e < kMxByteMin ? kMxByteMin : e > kMxByteMax ? kMxByteMax : e);
      inv = bits_lanes((254u - code) << 23);
      for (int j = 0; j < kChunk; ++j) nonzero[j] = true;
    } else {
      code = e4m3_encode_lanes(mul_rn(mul_rn(bits_lanes((ULanes)am), kInvE2m1Max), down));
      const Lanes sc = mul_rn(e4m3_decode_lanes(code), gscale);
      inv = 1.0f / (sc > 0.0f ? sc : Lanes{} + 1.0f);
      for (int j = 0; j < kChunk; ++j) nonzero[j] = sc[j] > 0.0f;
    }
    uint8_t code_bytes[kLanes];
    narrow_bytes(code, code_bytes);
    std::memcpy(scales + b0, code_bytes, size_t(nb));
    for (int j = 0; j < nb; ++j) {
      const int64_t b = b0 + j;
      if (nonzero[j]) {
        // the two block sizes as constants, so each inlined loop is laid out for its size
        const Lanes inv_b = __builtin_shuffle(inv, ILanes{} + j);
        if (block == 16) {
          encode_run<false>(v + b * block, 16, inv_b, b * block, rec);
        } else {
          encode_run<false>(v + b * block, 32, inv_b, b * block, rec);
        }
      } else {
        std::memset(rec + b * block / 2, 0, size_t(block / 2));
      }
    }
  }
}

// fp8 without spikes, kLanes groups at a time: up to kLanes f32 groups of g values (g a
// multiple of kLanes), one after another in v, into their records. The groups' maxima come from
// one transposing reduction and their scales and inverses lane-wise (fp8_scale_bits and
// fp_inverse's operations, one division for every group), instead of a horizontal reduction and
// a scalar chain per group. The same bytes as fp_quantize_group on each group.
constexpr int64_t kFp8BatchMaxGroup = 512;  // a batch's f32 values stay in L1 / L2
// am: lane j the largest magnitude's bits of group j (block_maxima, or load_group_max's
// vectors through largest_lanes).
inline void fp8_encode_groups(const float* v, int64_t count, int64_t g, ILanes am,
                              uint8_t* records, int64_t stride) {
  const Lanes amax = bits_lanes((ULanes)am);
  Lanes t = mul_rn(amax, kInvE4m3Max);
  t = t > kFp8MinScale ? t : Lanes{} + kFp8MinScale;
  // bf16_round_down / bf16_round_up of t > 0: the truncation, or one ulp more when bits are lost
  const ULanes ut = lanes_bits(t), lo = ut & 0xFFFF0000u;
  const ILanes up = (mul_rn(bits_lanes(lo), kE4m3Max) < amax) & ((ut & 0xFFFFu) != 0u);
  const ULanes s = lo + ((ULanes)up & 0x10000u);
  const Lanes inv = 1.0f / bits_lanes(s);
  for (int64_t j = 0; j < count; ++j) {
    uint8_t* rec = records + j * stride;
    if (uint32_t(am[j]) >= 0x7F800000u) {  // an Inf or a NaN
      fp_encode_group(v + j * g, g, kFormatFp8, bits_to_float(uint32_t(am[j])), false, rec);
      continue;
    }
    rec[g] = uint8_t((s[j] >> 16) & 0xFF);
    rec[g + 1] = uint8_t(s[j] >> 24);
    encode_run<true>(v + j * g, g, __builtin_shuffle(inv, ILanes{} + int32_t(j)), 0, rec);
  }
}

inline void fp8_quantize_groups(const float* v, int64_t count, int64_t g, uint8_t* records,
                                int64_t stride) {
  fp8_encode_groups(v, count, g, block_maxima<kLanes>(v, g, count), records, stride);
}

// load_group (g a multiple of kLanes) that also returns the lane-wise largest magnitude's bits
// of the group: one pass over the values instead of two.
template <typename T>
FC_ALWAYS_INLINE ILanes load_group_max(const typename T::Storage* x, int64_t g, float* v) {
  ILanes m = ILanes{};
  for (int64_t i = 0; i < g; i += kLanes) {
    const Lanes a = load_lanes_t<T>(x + i);
    std::memcpy(v + i, &a, sizeof a);
    const ILanes k = (ILanes)(lanes_bits(a) & 0x7FFFFFFFu);
    m = k > m ? k : m;
  }
  return m;
}

// One f32 group v (overwritten: spikes zeroed) with k spikes into its whole record.
// keys: g int32 of scratch (k > 0).
inline void fp_quantize_group(float* v, int64_t g, int32_t fmt, int k, int32_t* keys,
                              uint8_t* rec) {
  // The largest magnitude's bits are those of an Inf or a NaN exactly when one is there.
  const float amax = max_abs(v, g);
  const bool finite = float_to_bits(amax) < 0x7F800000u;
  if (k == 0) {
    fp_encode_group(v, g, fmt, amax, finite, rec);
    return;
  }
  int32_t pos[kMaxSpikes];
  float kept[kMaxSpikes];
  select_spikes_lanes(v, g, k, keys, pos);
  for (int j = 0; j < k; ++j) {
    kept[j] = v[pos[j]];
    v[pos[j]] = 0.0f;
  }
  fp_encode_group(v, g, fmt, max_abs(v, g), finite, rec);
  uint16_t values[kMaxSpikes];
  for (int j = 0; j < k; ++j) values[j] = spike_bits(kept[j], finite);
  store_spikes(values, pos, k, g, rec + fp_code_bytes(fmt, g) + fp_scale_bytes(fmt, g));
}

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

// A four-bit record (mxfp4 or nvfp4, no spikes) decoded and stored as bf16 or f32 in one pass
// where every block scale s has |s| * 6 within T's finite range (so no value saturates or is
// NaN); false otherwise (y partly written: the caller decodes the group the general way).
template <typename T>
FC_ALWAYS_INLINE bool fp4_decode_store(const uint8_t* rec, int64_t g, int32_t fmt,
                                       typename T::Storage* y) {
  if constexpr (!std::is_same_v<T, BF16> && !std::is_same_v<T, F32>) {
    return false;
  } else {
    const uint8_t* scales = rec + fp_code_bytes(fmt, g);
    const int64_t block = fp_block(fmt, g);
    for (int64_t b = 0; b < g / block; ++b) {
      const float sc = fp_block_scale(fmt, scales, g, b);
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
// pass, without the f32 buffer, where its scale s has 2^-117 <= |s| <= 2^119 (every scale the
// encoder writes): then every value is 0 or normal, finite and within bf16's range, so the
// saturation and the NaN case of store_group change nothing and are left out. False (y partly
// written) for other scales and output types, or where a step holds a NaN code: the caller then
// decodes the group the general way.
template <typename T>
FC_ALWAYS_INLINE bool fp8_decode_store(const uint8_t* rec, int64_t g, typename T::Storage* y) {
  constexpr bool kBf16 = std::is_same_v<T, BF16>;
  if constexpr (!kBf16 && !std::is_same_v<T, F32>) {
    return false;
  } else {
    const float s = bf16_to_float(uint16_t(rec[g] | (rec[g + 1] << 8)));
    const float sa = bits_to_float(float_to_bits(s) & 0x7FFFFFFFu);
    if (!(sa >= 0x1p-117f && sa <= 0x1p119f)) return false;
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

// One record to f32 values (element times its block scale), spikes put back.
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
        store_lanes(d + i, lo);
        if constexpr (kLanes == 8) store_lanes(d + i + 8, hi);
      }
    }
#endif
    for (; i + kLanes <= g; i += kLanes) {
      store_lanes(d + i, mul_rn(e4m3_decode_lanes(load_bytes(rec + i)), s));
    }
    for (; i < g; ++i) d[i] = mul_rn(t.e4m3[rec[i]], s);
  } else {
    // kLanes blocks' scales at a time, lane-wise (fp_block_scale's operations).
    const int64_t block = fp_block(fmt, g), blocks = g / block;
    const float gscale = fmt == kFormatNvfp4 ? e8m0_scale(scales[blocks]) : 0.0f;
    for (int64_t b0 = 0; b0 < blocks; b0 += kLanes) {
      const int64_t nb = blocks - b0 < kLanes ? blocks - b0 : kLanes;
      uint8_t bytes[kLanes] = {};
      std::memcpy(bytes, scales + b0, size_t(nb));
      const ULanes code = load_bytes(bytes);
      const Lanes sc = fmt == kFormatMxfp4
          ? (code == kE8m0Nan ? bits_lanes(ULanes{} + 0x7FC00000u) : bits_lanes(code << 23))
          : mul_rn(e4m3_decode_lanes(code), gscale);
      for (int64_t j = 0; j < nb; ++j) {
        const Lanes s = __builtin_shuffle(sc, ILanes{} + int32_t(j));
        for (int64_t i = (b0 + j) * block; i < (b0 + j + 1) * block; i += kLanes) {
          store_lanes(d + i, mul_rn(e2m1_decode_lanes(load_nibbles(rec + i / 2)), s));
        }
      }
    }
  }
  if (k > 0) apply_spikes(rec + nc + ns, k, g, d);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_H_
