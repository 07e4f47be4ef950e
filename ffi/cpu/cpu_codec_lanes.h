// The integer codec's lanes and bytes (cpu_codec.h's loops): a group's values loaded as f32
// lanes (bf16 two to a lane), and codes packed LSB-first into BITS bytes per 8 codes
// (docs/format.md), per block, 16 at a time for 6 bits, or straight from lanes. Compiled once per
// instruction set with the rest of cpu_codec.h (kLanes = the register width).

#ifndef FLASHCOMM_CPU_CODEC_LANES_H_
#define FLASHCOMM_CPU_CODEC_LANES_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashcomm/codec.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

constexpr int64_t kChunk = 256;  // codes staged per pass (group sizes may be larger)
// The default group size (jax_flashcomm.codec): the plain quantize and dequantize loops are
// also compiled for it with the size known, so that they unroll (~1.2x at 8, 6 and 4 bits).
constexpr int64_t kDefaultGroupSize = 128;

// kLanes elements of T as f32 lanes.
template <typename T>
__attribute__((always_inline)) inline Lanes load_lanes_t(const typename T::Storage* x) {
  Lanes a = {};
  for (int j = 0; j < kLanes; ++j) a[j] = T::load(x[j]);
  return a;
}
template <>
__attribute__((always_inline)) inline Lanes load_lanes_t<F32>(const float* x) {
  return load_lanes(x);
}
template <>
__attribute__((always_inline)) inline Lanes load_lanes_t<BF16>(const uint16_t* x) {
  return bits_lanes(widen_halves(x) << 16);
}

// bf16 values two to a 32-bit lane, as two f32 vectors: the even-indexed values (the low
// halves) and the odd-indexed ones (exact; 2 * kLanes values per call). The bf16 loops work on
// these pairs: no widening shuffle on the way in, no narrowing one on the way out.
__attribute__((always_inline)) inline void load_bf16_pairs(const uint16_t* x, Lanes* even,
                                                           Lanes* odd) {
  ULanes u;
  std::memcpy(&u, x, sizeof u);
  *even = bits_lanes(u << 16);
  *odd = bits_lanes(u & 0xFFFF0000u);
}

// The same for 2 * kLanes f32 values (two loads, one even / odd permutation each), and either
// by the operand's type (BF16 or F32).
__attribute__((always_inline)) inline void load_f32_pairs(const float* x, Lanes* even,
                                                          Lanes* odd) {
  const Lanes a = load_lanes(x), b = load_lanes(x + kLanes);
  *even = __builtin_shuffle(a, b, 2 * kLaneIndex);
  *odd = __builtin_shuffle(a, b, 2 * kLaneIndex + 1);
}
template <typename T>
__attribute__((always_inline)) inline void load_pairs(const typename T::Storage* x, Lanes* even,
                                                      Lanes* odd) {
  if constexpr (std::is_same_v<T, F32>) {
    load_f32_pairs(x, even, odd);
  } else {
    load_bf16_pairs(x, even, odd);
  }
}

// bf16_from_float, lane-wise: the bf16 bits in the low half of each lane.
__attribute__((always_inline)) inline ULanes bf16_bits_lanes(Lanes v) {
  const ULanes u = lanes_bits(v);
  const ULanes nan = (u >> 16) | 0x0040u;
  const ULanes rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

// Pack 8 codes of BITS bits (one byte each) LSB-first into BITS bytes. (GCC 12 cannot see that
// encode_pack wrote every staged code it packs here: a false -Wmaybe-uninitialized.)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
template <int BITS>
__attribute__((always_inline)) inline void pack_block_t(const uint8_t* q, uint8_t* out) {
  if (BITS == 8) {
    std::memcpy(out, q, kBlock);
    return;
  }
  uint64_t acc = 0;
  for (int j = 0; j < kBlock; ++j) acc |= uint64_t(q[j]) << (j * BITS);
  for (int k = 0; k < BITS; ++k) out[k] = uint8_t(acc >> (8 * k));
}
#pragma GCC diagnostic pop

// Unpack BITS bytes into 8 codes of BITS bits. 6 bits: the 48 bits are spread in one 64-bit
// word, halving the fields three times (24-bit halves into 32-bit lanes, 12 into 16, 6 into 8:
// the LSB-first layout puts code j in byte j), one store.
template <int BITS>
__attribute__((always_inline)) inline void unpack_block_t(const uint8_t* in, uint8_t* q) {
  if (BITS == 8) {
    std::memcpy(q, in, kBlock);
    return;
  }
  if constexpr (BITS == 6) {
    uint32_t lo;
    uint16_t hi;
    std::memcpy(&lo, in, 4);
    std::memcpy(&hi, in + 4, 2);
    uint64_t w = uint64_t(lo) | (uint64_t(hi) << 32);  // little-endian: code j at bit 6j
    w = (w & 0xFFFFFFull) | ((w & 0xFFFFFF000000ull) << 8);
    w = (w & 0x00000FFF00000FFFull) | ((w & 0x00FFF00000FFF000ull) << 4);
    w = (w & 0x003F003F003F003Full) | ((w & 0x0FC00FC00FC00FC0ull) << 2);
    std::memcpy(q, &w, 8);
    return;
  }
  uint64_t acc = 0;
  for (int k = 0; k < BITS; ++k) acc |= uint64_t(in[k]) << (8 * k);
  constexpr uint64_t mask = (uint64_t(1) << BITS) - 1;
  for (int j = 0; j < kBlock; ++j) q[j] = uint8_t((acc >> (j * BITS)) & mask);
}

// 6-bit packing, 16 codes at a time (the LSB-first layout of pack_block_t<6>): in each 32-bit
// word of 4 codes (one byte each) the codes are shifted together into its low 24 bits, and a
// byte shuffle keeps 3 bytes of each word. Integer work only; measured ~1.5x the per-block
// path with a byte shuffle instruction (SSSE3, NEON), slower without one (the SSE2 baseline).
#if defined(FC_X86) && defined(__SSSE3__) || defined(FC_NEON)
constexpr bool kPack6Vector = true;
#else
constexpr bool kPack6Vector = false;
#endif
typedef uint8_t Bytes16 __attribute__((vector_size(16)));
typedef uint32_t Words4 __attribute__((vector_size(16)));

__attribute__((always_inline)) inline void pack6_16(const uint8_t* q, uint8_t* out) {
  Words4 w;
  std::memcpy(&w, q, 16);
  w = (w & 0x3Fu) | ((w >> 2) & 0xFC0u) | ((w >> 4) & 0x3F000u) | ((w >> 6) & 0xFC0000u);
  const Bytes16 keep = {0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, 0, 0, 0, 0};
  const Bytes16 packed = __builtin_shuffle((Bytes16)w, keep);
  std::memcpy(out, &packed, 12);
}

// The inverse: 12 bytes -> 16 codes of 6 bits, one byte each. (The 12 bytes go into the
// vector as an 8- and a 4-byte integer: through memory they cost a store-forwarding stall.)
__attribute__((always_inline)) inline void unpack6_16(const uint8_t* in, uint8_t* q) {
  typedef uint64_t Longs2 __attribute__((vector_size(16)));
  uint64_t head;
  uint32_t tail;
  std::memcpy(&head, in, 8);
  std::memcpy(&tail, in + 8, 4);
  const Longs2 longs = {head, tail};
  const Bytes16 raw = (Bytes16)longs;
  const Bytes16 spread = {0, 1, 2, 15, 3, 4, 5, 15, 6, 7, 8, 15, 9, 10, 11, 15};
  const Words4 w = (Words4)__builtin_shuffle(raw, spread);  // byte 15 is 0
  const Words4 codes =
      (w & 0x3Fu) | ((w << 2) & 0x3F00u) | ((w << 4) & 0x3F0000u) | ((w << 6) & 0x3F000000u);
  std::memcpy(q, &codes, 16);
}

// What pack_two_runs takes for encode's scaled values v: rounded only on AVX2 (it clamps after
// its pack), code_lanes elsewhere.
FC_ALWAYS_INLINE ILanes pack_lanes_input(Lanes v, float levels) {
#if defined(FC_CODES_OR_NEGATIVE)
  (void)levels;
  return rounded_lanes(v);
#else
  return (ILanes)code_lanes(v, levels);
#endif
}

// Whether pack_pairs<BITS> packs straight from lanes (else the codes are staged as bytes and
// packed per block).
template <int BITS>
constexpr bool kPackPairs =
    BITS == 8 || BITS == 4 || (BITS == 6 && kLanes <= 8);

// Pack 2 * kLanes codes given as the even-indexed ones (ce) and the odd-indexed ones (co), one
// per 32-bit lane, LSB-first (the layout of pack_block_t) into 2 * kLanes * BITS / 8 bytes.
// `more`: more codes follow at out + 2 * kLanes * BITS / 8 (the bytes past the packed ones may
// be written; the next call overwrites them).
template <int BITS>
__attribute__((always_inline)) inline void pack_pairs(ULanes ce, ULanes co, uint8_t* out,
                                                      bool more) {
  (void)more;
  if constexpr (BITS == 8) {
    narrow_byte_pairs(ce | (co << 16), out);
  } else if constexpr (BITS == 4) {
    narrow_bytes(ce | (co << 4), out);
  } else {
    static_assert(BITS == 6, "pack_pairs: 8, 6 or 4 bits");
    // 12 bits per 32-bit lane (codes 2i, 2i + 1), then 24 per 64-bit lane (codes 4i .. 4i + 3).
    typedef uint64_t Longs __attribute__((vector_size(4 * kLanes)));
    Longs w = (Longs)(ce | (co << 6));
    w = w | (w >> 20);  // bits 24.. hold leftovers: only the low 3 bytes of each lane are kept
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
    // The low 3 bytes of each 64-bit lane, gathered into 12 bytes.
    const __m256i keep = _mm256_setr_epi8(0, 1, 2, 8, 9, 10, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          -1, -1, -1, -1, -1, -1, -1, 0, 1, 2, 8, 9, 10, -1, -1,
                                          -1, -1);
    const __m256i b = _mm256_shuffle_epi8((__m256i)w, keep);
    const __m128i r = _mm_or_si128(_mm256_castsi256_si128(b), _mm256_extracti128_si256(b, 1));
    if (more) {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), r);
    } else {
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out), r);  // 8 + 4 bytes (no round trip
      const int32_t tail = _mm_extract_epi32(r, 2);           // through the stack)
      std::memcpy(out + 8, &tail, 4);
    }
#else
    for (int i = 0; i < kLanes / 2; i += 2) {  // 8 codes in 6 bytes
      const uint64_t block = (w[i] & 0xFFFFFFu) | ((w[i + 1] & 0xFFFFFFu) << 24);
      std::memcpy(out + 3 * i, &block, 6);
    }
#endif
  }
}

// Pack 4 * kLanes codes of two runs of 2 * kLanes values (the even- and odd-indexed values of
// run 0, e0 and o0, then of run 1), LSB-first, into 4 * kLanes * BITS / 8 bytes. The inputs are
// encode's scaled values after pack_lanes_input: rounded only, on AVX2 (clamped here), or
// code_lanes. `more`: at least 2 * kLanes more codes follow, so the bytes past the packed ones
// may be written (up to kLanes of them; the next call overwrites them).
//
// Why the AVX2 clamp after rounding is exact, i.e. why encode's v = ((x * pre) - zero * pre) *
// inv_scale stays below 2^31: in a finite group lo <= x <= hi, zero <= lo and scale >=
// (hi - zero) / levels up to f32 rounding (or inv_scale = 0: v = +-0), with scale >= 2^-126
// (scale * pre >= 2^56 for huge groups); each op is correctly rounded, and flushing a denormal
// operand or result moves x * pre - zero * pre by less than 3 * 2^-126. So v < levels * (1 +
// 2^-20) + 3. A non-finite group has inv_scale = 0: v is +-0 or NaN.
template <int BITS>
FC_ALWAYS_INLINE void pack_two_runs(ILanes e0, ILanes o0, ILanes e1, ILanes o1, uint8_t* out,
                                    bool more) {
#if defined(FC_CODES_OR_NEGATIVE)
  // 16-bit lanes, code pairs: per 128-bit half, 4 pairs of run 0 then 4 of run 1 (the unsigned
  // packs saturate negative codes, NaN's and those below -2^31 to 0); pair i holds codes 2i and
  // 2i + 1 in bits 0.. and BITS..
  const __m256i levels = _mm256_set1_epi16(int16_t(max_code(BITS)));
  const __m256i even = _mm256_min_epu16(_mm256_packus_epi32((__m256i)e0, (__m256i)e1), levels);
  const __m256i odd = _mm256_min_epu16(_mm256_packus_epi32((__m256i)o0, (__m256i)o1), levels);
  const __m256i pairs = _mm256_or_si256(even, _mm256_slli_epi16(odd, BITS));
  if constexpr (BITS == 8) {  // 64-bit blocks: pairs 0-3, 8-11, 4-7, 12-15
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), _mm256_permute4x64_epi64(pairs, 0xD8));
  } else if constexpr (BITS == 4) {  // 32-bit blocks of bytes: pairs 0-3, 8-11, x, x, 4-7, 12-15
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(pairs, pairs),
                                                      _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(bytes));
  } else {
    static_assert(BITS == 6, "pack_two_runs: 8, 6 or 4 bits");
    // Pairs in order, then joined two by two (a multiply-add, exact: 24 bits per 32-bit lane);
    // the low 3 bytes of each lane: 12 bytes per half, then the halves joined.
    const __m256i quads = _mm256_madd_epi16(_mm256_permute4x64_epi64(pairs, 0xD8),
                                            _mm256_set1_epi32(1 + (4096 << 16)));
    const __m256i keep = _mm256_setr_epi8(0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1,
                                          0, 1, 2, 4, 5, 6, 8, 9, 10, 12, 13, 14, -1, -1, -1, -1);
    const __m256i packed = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(quads, keep),
                                                       _mm256_setr_epi32(0, 1, 2, 4, 5, 6, 7, 7));
    if (more) {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), packed);
    } else {
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
      _mm_storel_epi64(reinterpret_cast<__m128i*>(out + 16), _mm256_extracti128_si256(packed, 1));
    }
  }
#else
  // pack_lanes_input is code_lanes here: the codes are in [0, 2^BITS).
  const ULanes ce0 = (ULanes)e0, co0 = (ULanes)o0, ce1 = (ULanes)e1, co1 = (ULanes)o1;
  if constexpr (BITS == 8) {
    narrow_byte_pairs2(ce0 | (co0 << 16), ce1 | (co1 << 16), out);
  } else if constexpr (BITS == 4) {
    narrow_bytes2(ce0 | (co0 << 4), ce1 | (co1 << 4), out);
  } else {
    pack_pairs<BITS>(ce0, co0, out, true);
    pack_pairs<BITS>(ce1, co1, out + 2 * kLanes * BITS / 8, more);
  }
#endif
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_LANES_H_
