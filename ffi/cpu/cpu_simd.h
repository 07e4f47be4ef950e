// long file: the lane types and intrinsics of every instruction set, one #if branch each
// The vector layer of the CPU kernels: kLanes f32 lanes (codec.h: 16 on AVX-512, 8 on AVX2, 4
// on SSE2 and NEON) and the few operations on them that GCC's vector extensions do not turn into
// good code on every ISA. Measured with g++ 12: converting 8 or 16 bytes to f32 lanes, and 32-bit
// lanes to bytes, compile to one scalar insert per lane on every x86 ISA, so those use the ISA's
// intrinsics here (selected by the -m flags of the translation unit). Everything is integer
// work or exact conversions: no path can change a bit of the results.
#ifndef FLASHCOMM_CPU_SIMD_H_
#define FLASHCOMM_CPU_SIMD_H_

#include <cstdint>
#include <cstring>
#include <utility>

#include "flashcomm/codec.h"

// FLASHCOMM_NO_INTRINSICS: the portable vector-extension code only (the aarch64 baseline build).
#if !defined(FLASHCOMM_NO_INTRINSICS) && defined(__SSE2__)
#define FC_X86 1
#include <immintrin.h>
#elif !defined(FLASHCOMM_NO_INTRINSICS) && defined(__ARM_NEON)
#define FC_NEON 1
#include <arm_neon.h>
#endif

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

#define FC_ALWAYS_INLINE __attribute__((always_inline)) inline

typedef uint8_t ByteLanes __attribute__((vector_size(kLanes)));
typedef uint16_t HalfLanes __attribute__((vector_size(2 * kLanes)));

// 0, 1, ..., kLanes - 1.
#if FLASHCOMM_LANES == 16
constexpr ILanes kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#elif FLASHCOMM_LANES == 8
constexpr ILanes kLaneIndex = {0, 1, 2, 3, 4, 5, 6, 7};
#else
constexpr ILanes kLaneIndex = {0, 1, 2, 3};
#endif

FC_ALWAYS_INLINE Lanes load_lanes(const float* v) {
  Lanes a;
  std::memcpy(&a, v, sizeof a);
  return a;
}
FC_ALWAYS_INLINE void store_lanes(float* v, Lanes a) { std::memcpy(v, &a, sizeof a); }
FC_ALWAYS_INLINE ILanes load_ilanes(const int32_t* v) {
  ILanes a;
  std::memcpy(&a, v, sizeof a);
  return a;
}

// Lane i takes lane i ^ X (X < kLanes, a power of two): the partner of a butterfly or of a
// halving reduction.
template <int X, typename V>
FC_ALWAYS_INLINE V permute_xor(V v) {
  return __builtin_shuffle(v, kLaneIndex ^ X);
}

// Lane-wise min / max reduced to one value by halving (exact whatever the order: min and max of
// floats are order-independent apart from signed zeros, which the callers canonicalize).
FC_ALWAYS_INLINE float reduce_min(Lanes a) {
  if constexpr (kLanes >= 16) a = permute_xor<8>(a) < a ? permute_xor<8>(a) : a;
  if constexpr (kLanes >= 8) a = permute_xor<4>(a) < a ? permute_xor<4>(a) : a;
  a = permute_xor<2>(a) < a ? permute_xor<2>(a) : a;
  return a[1] < a[0] ? a[1] : a[0];
}
FC_ALWAYS_INLINE float reduce_max(Lanes a) { return -reduce_min(-a); }

// The largest of the int32 lanes.
FC_ALWAYS_INLINE int32_t reduce_imax(ILanes m) {
  if constexpr (kLanes >= 16) m = permute_xor<8>(m) > m ? permute_xor<8>(m) : m;
  if constexpr (kLanes >= 8) m = permute_xor<4>(m) > m ? permute_xor<4>(m) : m;
  m = permute_xor<2>(m) > m ? permute_xor<2>(m) : m;
  return m[1] > m[0] ? m[1] : m[0];
}

// Whether any lane is non-zero: one vptest on AVX2 and AVX-512, else a halving reduction.
FC_ALWAYS_INLINE bool any_lane(ILanes m) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)m, (__m512i)m) != 0;
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return !_mm256_testz_si256((__m256i)m, (__m256i)m);
#else
  if constexpr (kLanes >= 16) m |= permute_xor<8>(m);
  if constexpr (kLanes >= 8) m |= permute_xor<4>(m);
  m |= permute_xor<2>(m);
  return (m[0] | m[1]) != 0;
#endif
}

// Bit i set where lane i is negative (a comparison's -1): one vpmovd2m / vmovmskps on AVX-512 /
// AVX2 (a lane-by-lane read goes through memory).
FC_ALWAYS_INLINE uint32_t lane_bits(ILanes m) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512DQ__)
  return uint32_t(_mm512_movepi32_mask((__m512i)m));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return uint32_t(_mm256_movemask_ps((__m256)m));
#else
  uint32_t bits = 0;
  for (int i = 0; i < kLanes; ++i) bits |= uint32_t(m[i] < 0) << i;
  return bits;
#endif
}

// kLanes bytes as one 32-bit lane each (zero-extended): one vpmovzxbd on AVX2 / AVX-512 (the
// generic conversion compiles to scalar extracts and inserts).
FC_ALWAYS_INLINE ULanes widen_u8(const uint8_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  return (ULanes)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return (ULanes)_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  int32_t word;
  std::memcpy(&word, p, 4);
  const __m128i zero = _mm_setzero_si128();
  return (ULanes)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(word), zero), zero);
#else
  ByteLanes b;
  std::memcpy(&b, p, sizeof b);
  return __builtin_convertvector(b, ULanes);
#endif
}

// kLanes / 2 bytes zero-extended into the low half of the lanes (the others 0), loaded
// straight into a register (a copy through a stack buffer stalls the wide load behind it).
FC_ALWAYS_INLINE ULanes widen_u8_half(const uint8_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  return (ULanes)_mm512_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  int32_t word;
  std::memcpy(&word, p, 4);
  return (ULanes)_mm256_cvtepu8_epi32(_mm_cvtsi32_si128(word));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  uint16_t half;
  std::memcpy(&half, p, 2);
  const __m128i zero = _mm_setzero_si128();
  return (ULanes)_mm_unpacklo_epi16(_mm_unpacklo_epi8(_mm_cvtsi32_si128(half), zero), zero);
#else
  ByteLanes b = {};
  std::memcpy(&b, p, kLanes / 2);
  return __builtin_convertvector(b, ULanes);
#endif
}

// kLanes bytes (codes) as f32 lanes (exact).
FC_ALWAYS_INLINE Lanes widen_bytes(const uint8_t* p) {
#if FLASHCOMM_LANES == 4 && defined(FC_NEON)
  uint32_t word;
  std::memcpy(&word, p, 4);
  const uint16x4_t h = vget_low_u16(vmovl_u8(vcreate_u8(word)));
  return (Lanes)vcvtq_f32_u32(vmovl_u16(h));
#else
  return __builtin_convertvector((ILanes)widen_u8(p), Lanes);
#endif
}

// Store kLanes 32-bit lanes that are all below 256 as kLanes bytes.
FC_ALWAYS_INLINE void narrow_bytes(ULanes u, uint8_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  // (the all-lanes mask form: the plain intrinsic's undefined pass-through operand makes GCC 12
  // warn where it is inlined into some callers)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm512_maskz_cvtepi32_epi8(__mmask16(0xFFFF), (__m512i)u));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  const __m256i v = (__m256i)u;
  const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  const __m128i w = _mm_packs_epi32((__m128i)u, (__m128i)u);
  const int32_t word = _mm_cvtsi128_si32(_mm_packus_epi16(w, w));
  std::memcpy(p, &word, 4);
#elif FLASHCOMM_LANES == 4 && defined(FC_NEON)
  const uint16x4_t h = vmovn_u32((uint32x4_t)u);
  const uint8x8_t b = vmovn_u16(vcombine_u16(h, h));
  const uint32_t word = vget_lane_u32(vreinterpret_u32_u8(b), 0);
  std::memcpy(p, &word, 4);
#else
  const ByteLanes b = __builtin_convertvector(u, ByteLanes);
  std::memcpy(p, &b, sizeof b);
#endif
}

// kLanes 16-bit values, zero-extended to 32-bit lanes.
FC_ALWAYS_INLINE ULanes widen_halves(const uint16_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  return (ULanes)_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return (ULanes)_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  const __m128i h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (ULanes)_mm_unpacklo_epi16(h, _mm_setzero_si128());
#else
  HalfLanes h;
  std::memcpy(&h, p, sizeof h);
  return __builtin_convertvector(h, ULanes);
#endif
}

// Store kLanes 32-bit lanes that are all below 65536 as 16-bit values.
FC_ALWAYS_INLINE void narrow_halves(ULanes u, uint16_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16((__m512i)u));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  const __m256i v = (__m256i)u;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  // No unsigned 32 -> 16 pack before SSE4.1: bias into the signed range and back.
  const __m128i bias = _mm_set1_epi32(0x8000);
  const __m128i w = _mm_packs_epi32(_mm_sub_epi32((__m128i)u, bias), _mm_setzero_si128());
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_add_epi16(w, _mm_set1_epi16(-0x8000)));
#else
  const HalfLanes h = __builtin_convertvector(u, HalfLanes);
  std::memcpy(p, &h, sizeof h);
#endif
}

// 2 * kLanes bytes widened to 16 bits, as kLanes 32-bit lanes: lane i holds byte 2i in its low
// half and byte 2i + 1 in its high half.
FC_ALWAYS_INLINE ULanes widen_byte_pairs(const uint8_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512BW__)
  return (ULanes)_mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  return (ULanes)_mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return (ULanes)_mm_unpacklo_epi8(b, _mm_setzero_si128());
#elif FLASHCOMM_LANES == 4 && defined(FC_NEON)
  return (ULanes)vmovl_u8(vld1_u8(p));
#else
  typedef uint8_t Bytes2 __attribute__((vector_size(2 * kLanes)));
  typedef uint16_t Halves2 __attribute__((vector_size(4 * kLanes)));
  Bytes2 b;
  std::memcpy(&b, p, sizeof b);
  return (ULanes)__builtin_convertvector(b, Halves2);
#endif
}

// Store kLanes 32-bit lanes, each two 16-bit values below 256 (low half first), as 2 * kLanes
// bytes: the inverse of widen_byte_pairs.
FC_ALWAYS_INLINE void narrow_byte_pairs(ULanes u, uint8_t* p) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512BW__)
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi16_epi8((__m512i)u));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  const __m256i v = (__m256i)u;
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi16(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1)));
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16((__m128i)u, (__m128i)u));
#elif FLASHCOMM_LANES == 4 && defined(FC_NEON)
  vst1_u8(p, vmovn_u16((uint16x8_t)u));
#else
  typedef uint8_t Bytes2 __attribute__((vector_size(2 * kLanes)));
  typedef uint16_t Halves2 __attribute__((vector_size(4 * kLanes)));
  const Bytes2 b = __builtin_convertvector((Halves2)u, Bytes2);
  std::memcpy(p, &b, sizeof b);
#endif
}

// narrow_bytes of u then v (2 * kLanes bytes): one pack per vector with SSE2 instead of two.
// (AVX2 packs its codes in cpu_codec.h's pack_two_runs.)
FC_ALWAYS_INLINE void narrow_bytes2(ULanes u, ULanes v, uint8_t* p) {
#if FLASHCOMM_LANES == 4 && defined(FC_X86)
  const __m128i w = _mm_packs_epi32((__m128i)u, (__m128i)v);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
#else
  narrow_bytes(u, p);
  narrow_bytes(v, p + kLanes);
#endif
}

// narrow_byte_pairs of u then v (4 * kLanes bytes).
FC_ALWAYS_INLINE void narrow_byte_pairs2(ULanes u, ULanes v, uint8_t* p) {
#if FLASHCOMM_LANES == 4 && defined(FC_X86)
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packus_epi16((__m128i)u, (__m128i)v));
#else
  narrow_byte_pairs(u, p);
  narrow_byte_pairs(v, p + 2 * kLanes);
#endif
}

// Lanes where a or b is NaN (all ones), else 0.
FC_ALWAYS_INLINE ILanes unordered(Lanes a, Lanes b) {
#if FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  return (ILanes)_mm512_movm_epi32(_mm512_cmp_ps_mask((__m512)a, (__m512)b, _CMP_UNORD_Q));
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX__)
  return (ILanes)_mm256_cmp_ps((__m256)a, (__m256)b, _CMP_UNORD_Q);
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  return (ILanes)_mm_cmpunord_ps((__m128)a, (__m128)b);
#else
  return (a != a) | (b != b);
#endif
}

// The code of a scaled value: v clamped to [0, levels] (NaN to 0; codec.h's clamp_code) and
// rounded to an integer in the current rounding mode, as codec.h's encode does by adding 2^23
// (in [2^23, 2^24) the f32 spacing is 1, so that add rounds v to an integer in the same mode;
// the conversion instruction rounds it the same way). On x86, maxps(v, 0) is exactly
// v > 0 ? v : 0 (its second operand when unordered or both zero) and minps(v, levels) is
// v < levels ? v : levels.
//
// AVX2 clamps from below after rounding, in the integer domain (code_lanes_or_negative): on
// Zen 3 float min / max, add and the conversion issue on the same two pipes (measured), an
// integer max on any of four, and an unsigned pack saturates for free.
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
#define FC_CODES_OR_NEGATIVE 1
// code_lanes, except that lanes whose code is 0 may hold a negative integer. min(levels, v) is
// v where v is NaN (minps returns its second operand when unordered); the conversion gives
// INT_MIN for NaN and for values out of its range (only those below -2^31 remain after the
// min); rounding is monotonic with 0 a fixed point. So max(result, 0) is code_lanes for every v.
FC_ALWAYS_INLINE ILanes code_lanes_or_negative(Lanes v, float levels) {
  return (ILanes)_mm256_cvtps_epi32(_mm256_min_ps(_mm256_set1_ps(levels), (__m256)v));
}
// v rounded to an integer, not clamped: v where |v| < 2^31, INT_MIN for NaN and out of range.
// For v < 2^31, clamping the result to [0, levels] in the integer domain gives code_lanes(v)
// (rounding is monotonic, levels and 0 are fixed points; NaN and v <= -2^31 give INT_MIN -> 0).
// pack_two_runs clamps with an unsigned pack and an unsigned 16-bit min: two integer ops per
// 16 codes in place of a float min per 8, on the pipes the float ops do not need.
FC_ALWAYS_INLINE ILanes rounded_lanes(Lanes v) { return (ILanes)_mm256_cvtps_epi32((__m256)v); }
#endif
FC_ALWAYS_INLINE ULanes code_lanes(Lanes v, float levels) {
#if defined(FC_CODES_OR_NEGATIVE)
  return (ULanes)_mm256_max_epi32((__m256i)code_lanes_or_negative(v, levels),
                                  _mm256_setzero_si256());
#elif FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512F__)
  const __m512 c = _mm512_min_ps(_mm512_max_ps((__m512)v, _mm512_setzero_ps()),
                                 _mm512_set1_ps(levels));
  return (ULanes)_mm512_cvtps_epi32(c);
#elif FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX__)
  const __m256 c = _mm256_min_ps(_mm256_max_ps((__m256)v, _mm256_setzero_ps()),
                                 _mm256_set1_ps(levels));
  return (ULanes)_mm256_cvtps_epi32(c);
#elif FLASHCOMM_LANES == 4 && defined(FC_X86)
  const __m128 c = _mm_min_ps(_mm_max_ps((__m128)v, _mm_setzero_ps()), _mm_set1_ps(levels));
  return (ULanes)_mm_cvtps_epi32(c);
#else
  return lanes_bits(add_rn(clamp_code(v, levels), 8388608.0f)) - kEncodeBias;
#endif
}

// Whether x * 1.0f, as the operand of the next op, is x in the calling thread's flush mode:
// always, except on x86 when results are flushed to zero (FTZ) but denormal operands are not
// (no DAZ): then x * 1 turns a denormal x into 0 where x itself would stay. (NaN: x * 1 only
// quiets it; encode never sees one, a group holding NaN being stored as non-finite.) Elsewhere
// than x86 the answer is no, and encode keeps the multiply.
inline bool unit_multiply_is_identity() {
#if defined(FC_X86)
  const unsigned csr = _mm_getcsr();
  const bool ftz = (csr & 0x8000u) != 0, daz = (csr & 0x0040u) != 0;
  return !ftz || daz;
#else
  return false;
#endif
}

// ---- reductions of kLanes vectors at once (one result lane per vector) ----
// Per chunk of 2B lanes, the first (HI false) or second half of a's chunk, then b's; for
// B = 1, per chunk of 4 lanes: a0 a2 b0 b2 (a1 a3 b1 b3): one shuffle instruction each on x86.
template <int B>
constexpr int half_index(int i, bool hi) {
  if (B == 1) {
    const int chunk = i / 4 * 4, r = i % 4;
    return (r < 2 ? chunk + 2 * r : kLanes + chunk + 2 * (r - 2)) + (hi ? 1 : 0);
  }
  const int chunk = i / (2 * B) * (2 * B), r = i % (2 * B);
  return (r < B ? chunk + r : kLanes + chunk + r - B) + (hi ? B : 0);
}
template <int B, bool HI, int... I>
FC_ALWAYS_INLINE constexpr ILanes half_mask(std::integer_sequence<int, I...>) {
  return ILanes{half_index<B>(I, HI)...};
}

// One stage over v[0..N): N / 2 vectors, each from a pair.
template <int B, int N, typename V, typename Op>
FC_ALWAYS_INLINE void reduce_stage(V* v, Op op) {
  constexpr ILanes lo = half_mask<B, false>(std::make_integer_sequence<int, kLanes>{});
  constexpr ILanes hi = half_mask<B, true>(std::make_integer_sequence<int, kLanes>{});
#pragma GCC unroll 16
  for (int i = 0; i < N / 2; ++i) {
    v[i] = op(__builtin_shuffle(v[2 * i], v[2 * i + 1], lo),
              __builtin_shuffle(v[2 * i], v[2 * i + 1], hi));
  }
}

// Where each input slot of reduce_lanes (below) ends: lane[s] is the lane of the result that
// holds slot s's reduction (found by running reduce_lanes's stages on slot numbers).
struct ReducedLanes {
  int lane[kLanes];
};
constexpr ReducedLanes reduced_lanes() {
  int slot[kLanes][kLanes] = {};  // slot[v][i]: the input slot of lane i of vector v
  for (int v = 0; v < kLanes; ++v) {
    for (int i = 0; i < kLanes; ++i) slot[v][i] = v;
  }
  int n = kLanes;
  for (int b = kLanes / 2; b >= 1; b /= 2, n /= 2) {
    for (int v = 0; v < n / 2; ++v) {
      int next[kLanes] = {};
      for (int i = 0; i < kLanes; ++i) {
        const int at = b == 1 ? half_index<1>(i, false)
                     : b == 2 ? half_index<2>(i, false)
                     : b == 4 ? half_index<4>(i, false) : half_index<8>(i, false);
        next[i] = at < kLanes ? slot[2 * v][at] : slot[2 * v + 1][at - kLanes];
      }
      for (int i = 0; i < kLanes; ++i) slot[v][i] = next[i];
    }
  }
  ReducedLanes r = {};
  for (int i = 0; i < kLanes; ++i) r.lane[slot[0][i]] = i;
  return r;
}
constexpr ReducedLanes kReducedLanes = reduced_lanes();

// kLanes vectors v[s] -> one vector whose lane kReducedLanes.lane[s] is op reduced over v[s]'s lanes
// (op commutative and associative on the values it meets). v is overwritten.
template <typename V, typename Op>
FC_ALWAYS_INLINE V reduce_lanes(V* v, Op op) {
  if constexpr (kLanes >= 16) reduce_stage<8, 16>(v, op);
  if constexpr (kLanes >= 8) reduce_stage<4, 8>(v, op);
  reduce_stage<2, 4>(v, op);
  reduce_stage<1, 2>(v, op);
  return v[0];
}

// 32-bit lanes below 2^24 as f32 lanes (exact).
FC_ALWAYS_INLINE Lanes int_lanes_to_float(ULanes u) {
  return __builtin_convertvector((ILanes)u, Lanes);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_SIMD_H_
