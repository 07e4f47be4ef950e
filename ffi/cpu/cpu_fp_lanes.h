// The floating-point formats' lane-wise pieces (fp_codec.h's element arithmetic in vectors of
// kLanes f32, cpu_simd.h): E4M3 / E2M1 encode and decode, the group and block maxima, and the
// byte and nibble packing of AVX2 and AVX-512. cpu_fp.h and cpu_fp_decode.h build the group
// loops from them. Compiled once per instruction set (ffi/cpu/isa_kernels.cc).
#ifndef FLASHCOMM_CPU_FP_LANES_H_
#define FLASHCOMM_CPU_FP_LANES_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec.h"
#include "cpu/cpu_simd.h"
#include "cpu/cpu_spikes.h"
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

// The code of a >= 0 (finite, at most the format's largest value) in a float format of kMant
// mantissa bits whose smallest normal binade is 2^kMinExp, rounded to nearest, ties to even:
// fp_codec.h e4m3_encode (kMant 3, kMinExp -6) and e2m1_encode (1, 0), lane-wise. One add does
// the rounding: c = 2^(e + 23 - kMant), e the binade of a (at least kMinExp), has an ulp of
// 2^(e - kMant), the format's step in that binade (its subnormal step below 2^kMinExp), so the
// bits of RN(c + a) exceed c's by m = a / step rounded; the code is then m plus the binade's
// first code, read from c's exponent: (e - kMinExp) << kMant. Eight operations, no compare.
template <int kMant, int kMinExp>
FC_ALWAYS_INLINE ULanes fp_round_code(Lanes a) {
  constexpr uint32_t kMinBinade = uint32_t(127 + kMinExp) << 23;
  constexpr uint32_t kShift = 23 - kMant;
  ULanes d = lanes_bits(a) & 0x7F800000u;
  d = d > kMinBinade ? d : ULanes{} + kMinBinade;
  const ULanes c = d + (kShift << 23);
  const ULanes s = lanes_bits(add_rn(bits_lanes(c), a));
  // c >> kShift is (e + 127 + kShift) << kMant
  return s - c + (c >> kShift) - (uint32_t(127 + kShift + kMinExp) << kMant);
}

// fp_codec.h e4m3_encode, lane-wise: e4m3_encode_clamped takes a in [0, 448]
// (abs_min_lanes clamps it), e4m3_encode_lanes any a >= 0.
FC_ALWAYS_INLINE ULanes e4m3_encode_clamped(Lanes a) { return fp_round_code<3, -6>(a); }
FC_ALWAYS_INLINE ULanes e4m3_encode_lanes(Lanes a) {
  return e4m3_encode_clamped(min_lanes(a, kE4m3Max));
}

// fp_codec.h e2m1_encode, lane-wise, of a in [0, 6]; e2m1_magnitude(q) is |q| in that range.
// (On AVX2 the quantize took 0.87-0.89x the time with fp_round_code than with a rounding of
// the bits and a compare: benchmarks/native/fp_ab.sh, Intel Xeon.)
FC_ALWAYS_INLINE ULanes e2m1_encode_clamped(Lanes a) { return fp_round_code<1, 0>(a); }
FC_ALWAYS_INLINE Lanes e2m1_magnitude(Lanes q) { return abs_min_lanes(q, kE2m1Max); }

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

// The same for nb <= kCount blocks of `block` values, in lanes 0..nb-1 (the lanes from nb on
// hold 0 or copies of the first nb). Blocks of 16 or 32 values, nb a power of two: the
// compile-time loops above (a runtime count keeps the vectors in memory).
template <int kCount>
FC_ALWAYS_INLINE ILanes block_maxima(const float* v, int64_t block, int64_t nb) {
  if (nb == kCount && block == 16) return block_maxima<kCount, 16>(v);
  if (nb == kCount && block == 32) return block_maxima<kCount, 32>(v);
  if constexpr (kCount > 1) {
    if (nb == kCount / 2 && (block == 16 || block == 32)) {
      return block_maxima<kCount / 2>(v, block, nb);
    }
  }
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
  // 16-bit words lo | hi << 8 -> lo + 16 hi (one multiply-add of the byte pairs), then the
  // words' low bytes
  const __m512i w = _mm512_maddubs_epi16(codes, _mm512_set1_epi16(0x1001));
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
  const __m256i w = _mm256_maddubs_epi16(codes, _mm256_set1_epi16(0x1001));
  const __m256i b = _mm256_permute4x64_epi64(_mm256_packus_epi16(w, w), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(b));
}
#endif

#if (FLASHCOMM_LANES == 8 && defined(__AVX2__)) || (FLASHCOMM_LANES == 16 && defined(__AVX512BW__))
// The four-vector packing's inputs (4 * kLanes f32 from v, in order) and the permutation that
// orders its packed bytes, for values of type In (cpu_fp_bf16.h: bf16 read where it lies, and
// AVX2's own order for it).
FC_ALWAYS_INLINE void fc_load_four(const float* v, Lanes* x) {
  for (int j = 0; j < 4; ++j) x[j] = load_lanes(v + j * kLanes);
}
template <typename In>
FC_ALWAYS_INLINE FcVecI fc_order_four(FcVecI packed, const In*) {
  return fc_permute_dwords(packed);
}
#endif

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_LANES_H_
