// Host loops over one group for the codec (docs/format.md). The arithmetic is codec.h; these
// loops only arrange it in vectors of kLanes f32 lanes (cpu_simd.h): the code width is a
// template parameter (constant shifts), the range pass keeps independent lanes, encode and
// decode are branch-free elementwise loops, and packing works on blocks of 8 codes. This file
// is compiled once per instruction set (ffi/cpu/isa_kernels.cc, kLanes = the ISA's register
// width) and the build is picked at load time (ffi/cpu/dispatch.cc): every operation is a
// correctly rounded IEEE op (no FMA contraction), so every build gives the same bits. The
// rotation's loops are in cpu_rotation.h.
#ifndef FLASHCOMM_CPU_CODEC_H_
#define FLASHCOMM_CPU_CODEC_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashcomm/codec.h"
#include "flashcomm/cpu_simd.h"

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

// bf16_from_float, lane-wise: the bf16 bits in the low half of each lane.
__attribute__((always_inline)) inline ULanes bf16_bits_lanes(Lanes v) {
  const ULanes u = lanes_bits(v);
  const ULanes nan = (u >> 16) | 0x0040u;
  const ULanes rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
}

// One group of T's min, max and finiteness (g a multiple of 8).
template <typename T>
__attribute__((always_inline)) inline void load_range(const typename T::Storage* x, int64_t g,
                                                      float* lo, float* hi, bool* finite) {
  float l = T::load(x[0]), h = l;
  bool ok = true;
  int64_t i = 0;
  if (g >= kLanes) {
    Lanes lo_l = load_lanes_t<T>(x), hi_l = lo_l;
    ILanes bad_l = ILanes{};
    if constexpr (std::is_same_v<T, BF16>) {
      for (; i + 2 * kLanes <= g; i += 2 * kLanes) {
        Lanes a, b;
        load_bf16_pairs(x + i, &a, &b);
        lo_l = a < lo_l ? a : lo_l;
        hi_l = a > hi_l ? a : hi_l;
        lo_l = b < lo_l ? b : lo_l;
        hi_l = b > hi_l ? b : hi_l;
        bad_l |= ((lanes_bits(a) & 0x7F800000u) == 0x7F800000u) |
                 ((lanes_bits(b) & 0x7F800000u) == 0x7F800000u);
      }
    }
    for (; i + kLanes <= g; i += kLanes) {
      const Lanes a = load_lanes_t<T>(x + i);
      lo_l = a < lo_l ? a : lo_l;
      hi_l = a > hi_l ? a : hi_l;
      bad_l |= (lanes_bits(a) & 0x7F800000u) == 0x7F800000u;
    }
    l = reduce_min(lo_l);
    h = reduce_max(hi_l);
    ok = !any_lane(bad_l);
  }
  for (; i < g; ++i) {
    const float a = T::load(x[i]);
    l = a < l ? a : l;
    h = a > h ? a : h;
    ok = ok && is_finite(a);
  }
  // -0.0 and +0.0 compare equal; store +0 so the result does not depend on the order of
  // the reduction.
  *lo = l == 0.0f ? 0.0f : l;
  *hi = h == 0.0f ? 0.0f : h;
  *finite = ok;
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

// codec.h's encode of kLanes values of a group, before the clamp and rounding. kDropPre: the
// group's pre is 1 and the flush mode makes x * 1 the same operand as x
// (unit_multiply_is_identity; encode_group decides), so the multiply is left out: the same
// bits, one op fewer.
template <bool kDropPre = false>
FC_ALWAYS_INLINE Lanes encode_scaled_lanes(Lanes x, const GroupParams& p) {
  if constexpr (kDropPre) return mul_rn(add_rn(x, -p.zero_pre), p.inv_scale);
  return mul_rn(add_rn(mul_rn(x, p.pre), -p.zero_pre), p.inv_scale);
}

// The codes of kLanes values of a group: codec.h's encode, lane-wise (code_lanes).
template <bool kDropPre = false>
FC_ALWAYS_INLINE ULanes encode_code_lanes(Lanes x, const GroupParams& p, float levels) {
  return code_lanes(encode_scaled_lanes<kDropPre>(x, p), levels);
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

// Encode and pack one group of T (read again from x: it is in L1 after the range pass, and
// widening bf16 again is cheaper than storing and reloading f32). kDropPre: encode_scaled_lanes's.
template <typename T, int BITS, bool kDropPre = false>
__attribute__((always_inline)) inline void encode_pack(const typename T::Storage* v, int64_t g,
                                                       const GroupParams& p, uint8_t* codes) {
  const float levels = float(max_code(BITS));
  uint8_t staged[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    uint8_t* out = codes + i0 / kBlock * BITS;
    uint8_t* q = BITS == 8 ? out : staged;  // 8-bit codes are their own packing
    int64_t j = 0;
    if constexpr (std::is_same_v<T, BF16> && kPackPairs<BITS>) {
      // 4 * kLanes values per step: two runs of codes packed together.
      for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
        Lanes e0, o0, e1, o1;
        load_bf16_pairs(v + i0 + j, &e0, &o0);
        load_bf16_pairs(v + i0 + j + 2 * kLanes, &e1, &o1);
        pack_two_runs<BITS>(pack_lanes_input(encode_scaled_lanes<kDropPre>(e0, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(o0, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(e1, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(o1, p), levels),
                            out + j / kBlock * BITS, j + 6 * kLanes <= n);
      }
    }
    if constexpr (std::is_same_v<T, BF16>) {
      for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
        Lanes even, odd;
        load_bf16_pairs(v + i0 + j, &even, &odd);
        const ULanes ce = encode_code_lanes<kDropPre>(even, p, levels);
        const ULanes co = encode_code_lanes<kDropPre>(odd, p, levels);
        if constexpr (kPackPairs<BITS>) {
          pack_pairs<BITS>(ce, co, out + j / kBlock * BITS, j + 2 * kLanes < n);
        } else {
          narrow_byte_pairs(ce | (co << 16), q + j);
        }
      }
    }
    const int64_t packed = kPackPairs<BITS> ? j : 0;  // codes [0, packed) are packed already
    for (; j + kLanes <= n; j += kLanes) {
      narrow_bytes(encode_code_lanes<kDropPre>(load_lanes_t<T>(v + i0 + j), p, levels), q + j);
    }
    for (; j < n; ++j) q[j] = uint8_t(encode(T::load(v[i0 + j]), p, levels));
    if (BITS == 4) {  // the same LSB-first layout, as one vectorizable loop
      for (int64_t k = packed / 2; k < n / 2; ++k) {
        out[k] = uint8_t(q[2 * k] | (q[2 * k + 1] << 4));
      }
    } else if (BITS != 8) {
      int64_t b = packed;
      if (BITS == 6 && kPack6Vector) {
        for (; b + 16 <= n; b += 16) pack6_16(q + b, out + b / kBlock * BITS);
      }
      for (; b < n; b += kBlock) pack_block_t<BITS>(q + b, out + b / kBlock * BITS);
    }
  }
}

// 6-bit codes loaded straight into lanes (AVX2): 16 codes (12 bytes) per step, the bytes
// copied to both halves of a vector, a byte shuffle giving each 32-bit lane the two bytes that
// hold its bits, a per-lane shift and a mask. Integer work only.
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
constexpr bool kLoad6Direct = true;
// The 12 bytes at in, in both 128-bit halves; `over`: 16 bytes may be read.
__attribute__((always_inline)) inline __m256i load12_both(const uint8_t* in, bool over) {
  __m128i r;
  if (over) {
    r = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in));
  } else {
    int32_t tail;
    std::memcpy(&tail, in + 8, 4);
    r = _mm_insert_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(in)), tail, 2);
  }
  return _mm256_broadcastsi128_si256(r);
}
// Codes 8h .. 8h + 7 of the 16 (h = 0, 1) as f32 lanes, in order.
template <int H>
__attribute__((always_inline)) inline Lanes codes6_lanes(__m256i both) {
  // Code j's bits start at bit 6j: bytes 6j / 8 and the next, shifted right by 6j % 8.
  constexpr char o = char(6 * H);
  const __m256i pick = _mm256_setr_epi8(
      o + 0, o + 1, -1, -1, o + 0, o + 1, -1, -1, o + 1, o + 2, -1, -1, o + 2, o + 3, -1, -1,
      o + 3, o + 4, -1, -1, o + 3, o + 4, -1, -1, o + 4, o + 5, -1, -1, o + 5, o + 6, -1, -1);
  const __m256i shift = _mm256_setr_epi32(0, 6, 4, 2, 0, 6, 4, 2);
  const __m256i c = _mm256_and_si256(_mm256_srlv_epi32(_mm256_shuffle_epi8(both, pick), shift),
                                     _mm256_set1_epi32(0x3F));
  return (Lanes)_mm256_cvtepi32_ps(c);
}
// The 16 codes as lanes of pairs: lane i holds code 2i in bits 0..5 and code 2i + 1 in bits
// 6..11 (its 12 bits start at bit 12i).
__attribute__((always_inline)) inline ULanes codes6_pairs(__m256i both) {
  const __m256i pick = _mm256_setr_epi8(0, 1, -1, -1, 1, 2, -1, -1, 3, 4, -1, -1, 4, 5, -1, -1,
                                        6, 7, -1, -1, 7, 8, -1, -1, 9, 10, -1, -1, 10, 11, -1, -1);
  const __m256i shift = _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4);
  return (ULanes)_mm256_srlv_epi32(_mm256_shuffle_epi8(both, pick), shift);
}
#else
constexpr bool kLoad6Direct = false;
#endif

// Unpack n codes (n a multiple of 8) into one byte each.
template <int BITS>
__attribute__((always_inline)) inline void unpack_chunk(const uint8_t* in, int64_t n, uint8_t* q) {
  if (BITS == 8) {
    std::memcpy(q, in, size_t(n));
  } else if (BITS == 4) {  // the same LSB-first layout, as one vectorizable loop
    for (int64_t k = 0; k < n / 2; ++k) {
      q[2 * k] = uint8_t(in[k] & 0x0F);
      q[2 * k + 1] = uint8_t(in[k] >> 4);
    }
  } else {
    int64_t b = 0;
    if (BITS == 6 && kPack6Vector) {
      for (; b + 16 <= n; b += 16) unpack6_16(in + b / kBlock * BITS, q + b);
    }
    for (; b < n; b += kBlock) unpack_block_t<BITS>(in + b / kBlock * BITS, q + b);
  }
}

template <int BITS>
__attribute__((always_inline)) inline void decode_unpacked(const uint8_t* codes, int64_t g, const GroupParams& p,
                            bool accumulate, float* out) {
  uint8_t q[kChunk];
  // q * scale cannot overflow (the usual case): decode is q * scale + zero, the same bits as
  // decode_lanes without its fallback.
  const bool direct = is_finite(mul_rn(float(max_code(BITS)), p.scale));
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
    if (BITS == 6 && direct && n % 16 == 0) {  // decoded straight from the packed codes
      const uint8_t* in = codes + i0 / kBlock * BITS;
      float* o = out + i0;
      for (int64_t j = 0; j < n; j += 16) {
        const __m256i both = load12_both(in + j / kBlock * BITS, j + 16 < n);
        Lanes d0 = add_rn(mul_rn(codes6_lanes<0>(both), p.scale), p.zero);
        Lanes d1 = add_rn(mul_rn(codes6_lanes<1>(both), p.scale), p.zero);
        if (accumulate) {
          d0 = add_rn(load_lanes(o + j), d0);
          d1 = add_rn(load_lanes(o + j + kLanes), d1);
        }
        store_lanes(o + j, d0);
        store_lanes(o + j + kLanes, d1);
      }
      continue;
    }
#endif
    const uint8_t* qs = q;
    if (BITS == 8) {
      qs = codes + i0;  // 8-bit codes need no unpacking
    } else {
      unpack_chunk<BITS>(codes + i0 / kBlock * BITS, n, q);
    }
    float* o = out + i0;
    int64_t j = 0;
    if (direct) {
      for (; j + kLanes <= n; j += kLanes) {
        Lanes d = add_rn(mul_rn(widen_bytes(qs + j), p.scale), p.zero);
        if (accumulate) d = add_rn(load_lanes(o + j), d);
        store_lanes(o + j, d);
      }
    }
    for (; j + kLanes <= n; j += kLanes) {
      Lanes d = decode_lanes(widen_bytes(qs + j), p);
      if (accumulate) d = add_rn(load_lanes(o + j), d);
      store_lanes(o + j, d);
    }
    for (; j < n; ++j) o[j] = accumulate ? add_rn(o[j], decode(qs[j], p)) : decode(qs[j], p);
  }
}

// Encode and pack one group with its parameters (all-zero codes for a non-finite group).
// kDropPre: compile the encode without the multiply by pre too, used where pre is 1 and
// unit_multiply (unit_multiply_is_identity() of the calling thread, read once per call); only
// for the hot paths (bf16 and the fused op's f32 sums at the default group size, 8/6/4 bits),
// each such variant costing compile time.
template <typename T, bool kDropPre = false>
__attribute__((always_inline)) inline void encode_group(const typename T::Storage* x, int64_t g,
                                                        int bits, const GroupParams& p,
                                                        uint8_t* codes,
                                                        bool unit_multiply = false) {
  if (!is_finite(p.scale)) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return;
  }
  if constexpr (kDropPre) {
    if (unit_multiply && p.pre == 1.0f) {
      switch (bits) {
        case 8: return encode_pack<T, 8, true>(x, g, p, codes);
        case 6: return encode_pack<T, 6, true>(x, g, p, codes);
        case 4: return encode_pack<T, 4, true>(x, g, p, codes);
        default: break;
      }
    }
  }
  switch (bits) {
    case 2: return encode_pack<T, 2>(x, g, p, codes);
    case 3: return encode_pack<T, 3>(x, g, p, codes);
    case 4: return encode_pack<T, 4>(x, g, p, codes);
    case 5: return encode_pack<T, 5>(x, g, p, codes);
    case 6: return encode_pack<T, 6>(x, g, p, codes);
    case 7: return encode_pack<T, 7>(x, g, p, codes);
    default: return encode_pack<T, 8>(x, g, p, codes);
  }
}

// Quantize one group; `others_finite` false makes it a non-finite group whatever its values
// (spike reserving: a non-finite spike). Returns whether the group is finite.
template <typename T>
__attribute__((always_inline)) inline bool quantize_one(const typename T::Storage* x, int64_t g,
                                                        int bits, uint8_t* codes,
                                                        uint16_t* scale, uint16_t* zero,
                                                        bool others_finite = true) {
  float lo, hi;
  bool finite;
  load_range<T>(x, g, &lo, &hi, &finite);
  finite = finite && others_finite;
  const GroupParams p = group_params(lo, hi, finite, bits);
  *scale = p.scale_bits;
  *zero = p.zero_bits;
  encode_group<T>(x, g, bits, p, codes);
  return finite;
}

// One group's (g >= kLanes values of T) range as lanes: lo and hi, each lane the min / max of
// the values it met that are not NaN (a lane that met only NaN keeps +inf / -inf), and nan,
// lanes that met a NaN. The group is finite when no lane met a NaN and lo and hi are finite.
template <typename T>
__attribute__((always_inline)) inline void range_lanes(const typename T::Storage* x, int64_t g,
                                                       Lanes* lo, Lanes* hi, ILanes* nan) {
  const float inf = bits_to_float(0x7F800000u);
  Lanes l = Lanes{} + inf, h = Lanes{} - inf;
  ILanes bad = ILanes{};
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BF16>) {
    for (; i + 2 * kLanes <= g; i += 2 * kLanes) {
      Lanes a, b;
      load_bf16_pairs(x + i, &a, &b);
      l = a < l ? a : l;  // minps / maxps: NaN in a keeps l
      h = a > h ? a : h;
      l = b < l ? b : l;
      h = b > h ? b : h;
      bad |= unordered(a, b);
    }
  }
  for (; i < g; i += kLanes) {
    // The last vector may overlap the previous one (g not a multiple of kLanes): min, max and
    // the NaN test do not mind seeing a value twice.
    const Lanes a = load_lanes_t<T>(x + (i + kLanes <= g ? i : g - kLanes));
    l = a < l ? a : l;
    h = a > h ? a : h;
    bad |= unordered(a, a);
  }
  *lo = l;
  *hi = h;
  *nan = bad;
}

// ---- the range of bf16 groups on their bit patterns ----
// A bf16 value's order is its bit pattern's: among values with the sign bit clear, the signed
// 16-bit order; among those with it set, the unsigned order reversed. So three integer
// reductions of the raw 16-bit patterns give a group's min, max and finiteness:
//   smax (signed max): the largest value when one has the sign bit clear (>= 0x7F80: +Inf, NaN);
//   umax (unsigned max): the most negative value when one has the sign bit set (>= 0xFF80:
//     -Inf, NaN);
//   smin (signed min): the smallest value when none has the sign bit set, the largest when all
//     have it.
// One integer min / max per 2 * kLanes values and reduction, against a widening, two float
// min / max per kLanes values and a NaN test in range_lanes. (Not used with 16 lanes: the
// AVX-512 build keeps range_lanes.)
typedef int16_t Words __attribute__((vector_size(4 * kLanes)));
typedef uint16_t UWords __attribute__((vector_size(4 * kLanes)));
template <typename T>
constexpr bool kWordRange = std::is_same_v<T, BF16> && kLanes <= 8;

FC_ALWAYS_INLINE ULanes max_words(ULanes a, ULanes b) {
  return (ULanes)((Words)a > (Words)b ? (Words)a : (Words)b);
}
FC_ALWAYS_INLINE ULanes min_words(ULanes a, ULanes b) {
  return (ULanes)((Words)a < (Words)b ? (Words)a : (Words)b);
}
FC_ALWAYS_INLINE ULanes umax_words(ULanes a, ULanes b) {
  return (ULanes)((UWords)a > (UWords)b ? (UWords)a : (UWords)b);
}

// One bf16 group's (g >= 2 * kLanes values, a multiple of 8) smax, smin and umax, each as a
// vector of 2 * kLanes 16-bit lanes (to be reduced over them).
FC_ALWAYS_INLINE void range_words(const uint16_t* x, int64_t g, ULanes* smax, ULanes* smin,
                                  ULanes* umax) {
  ULanes h;
  std::memcpy(&h, x + g - 2 * kLanes, sizeof h);  // may overlap the others (min / max do not mind)
  ULanes hi = h, lo = h, top = h;
  for (int64_t i = 0; i + 2 * kLanes < g; i += 2 * kLanes) {
    std::memcpy(&h, x + i, sizeof h);
    hi = max_words(hi, h);
    lo = min_words(lo, h);
    top = umax_words(top, h);
  }
  *smax = hi;
  *smin = lo;
  *umax = top;
}

// kLanes groups' lo, hi and non-finite lanes (group_params_lanes's inputs) from their
// range_words reduced to one 16-bit lane each (the low half of each 32-bit lane).
FC_ALWAYS_INLINE void range_from_words(ULanes smax, ULanes smin, ULanes umax, Lanes* lo,
                                       Lanes* hi, ILanes* bad) {
  const ILanes smax_i = ((ILanes)(smax << 16)) >> 16;  // sign-extended
  const ULanes umax_u = umax & 0xFFFFu;
  const ULanes hi_bits = smax_i >= 0 ? smax & 0xFFFFu : smin & 0xFFFFu;
  const ULanes lo_bits = umax_u >= 0x8000u ? umax_u : smin & 0xFFFFu;
  *hi = bits_lanes(hi_bits << 16);
  *lo = bits_lanes(lo_bits << 16);
  *bad = (smax_i >= 0x7F80) | (ILanes)(umax_u >= 0xFF80u);
}

// The ranges of the kLanes groups s0 .. s0 + kLanes - 1 of the m groups (g values each) at x,
// one per lane of lo, hi and bad (group_params_lanes's inputs): each group's range_words or
// range_lanes, reduced to one lane by reduce_lanes (kLanes groups in a few shuffles).
template <typename T>
FC_ALWAYS_INLINE void ranges_lanes(const typename T::Storage* x, int64_t g, int64_t s0,
                                   int64_t m, Lanes* lo, Lanes* hi, ILanes* bad) {
  // Slot s ends in lane kReducedLanes.lane[s]: it takes that group (past the last group, the
  // first one again).
  auto group = [&](int s) {
    return x + (s0 + kReducedLanes.lane[s] < m ? s0 + kReducedLanes.lane[s] : s0) * g;
  };
  if constexpr (kWordRange<T>) {
    if (g >= 2 * kLanes) {
      ULanes smax[kLanes], smin[kLanes], umax[kLanes];
#pragma GCC unroll 16
      for (int s = 0; s < kLanes; ++s) range_words(group(s), g, &smax[s], &smin[s], &umax[s]);
      ULanes a = reduce_lanes(smax, max_words), b = reduce_lanes(smin, min_words),
             c = reduce_lanes(umax, umax_words);
      a = max_words(a, a >> 16);  // the two 16-bit halves of each lane
      b = min_words(b, b >> 16);
      c = umax_words(c, c >> 16);
      return range_from_words(a, b, c, lo, hi, bad);
    }
  }
  Lanes l[kLanes], h[kLanes];
  ILanes nan[kLanes];
#pragma GCC unroll 16
  for (int s = 0; s < kLanes; ++s) range_lanes<T>(group(s), g, &l[s], &h[s], &nan[s]);
  *lo = reduce_lanes(l, [](Lanes a, Lanes b) { return a < b ? a : b; });
  *hi = reduce_lanes(h, [](Lanes a, Lanes b) { return a > b ? a : b; });
  *bad = reduce_lanes(nan, [](ILanes a, ILanes b) { return a | b; });
}

// The parameters of kLanes groups, one per lane (codec.h's group_params, lane-wise: the same
// IEEE operations on each lane).
struct ParamLanes {
  ULanes scale_bits, zero_bits;
  Lanes scale, zero, inv_scale, pre, zero_pre;
};

// lo, hi, nan: per lane, one group's range_lanes reduced over its lanes.
__attribute__((always_inline)) inline void group_params_lanes(Lanes lo, Lanes hi, ILanes nan,
                                                              int bits, ParamLanes* p) {
  const Lanes zeros = Lanes{};
  const ULanes exp_mask = ULanes{} + 0x7F800000u;
  lo = lo == 0.0f ? zeros : lo;  // -0 -> +0 (load_range)
  hi = hi == 0.0f ? zeros : hi;
  const ILanes finite = ~nan & ((lanes_bits(lo) & exp_mask) != exp_mask) &
                        ((lanes_bits(hi) & exp_mask) != exp_mask);
  const float inv_levels = 1.0f / float(max_code(bits));
  // zero: bf16_round_down(lo), clamped to the lowest finite bf16.
  const ULanes u = lanes_bits(lo);
  const ILanes down = ((u & 0x80000000u) != 0) & ((u & 0x0000FFFFu) != 0);
  ULanes zb = ((u & 0xFFFF0000u) + ((ULanes)down & 0x10000u)) >> 16;
  zb = zb == 0xFF80u ? ULanes{} + uint32_t(kBf16Lowest) : zb;
  const Lanes zero = bits_lanes(zb << 16);
  Lanes range = add_rn(hi, -zero);
  range = range > 0.0f ? range : zeros;
  const Lanes direct = mul_rn(range, inv_levels);
  const Lanes halves =
      mul_rn(mul_rn(add_rn(mul_rn(hi, 0.5f), -mul_rn(zero, 0.5f)), inv_levels), 2.0f);
  Lanes scale = select_finite(range, direct, halves);
  scale = (range > 0.0f) & ~(scale >= kFltMin) ? Lanes{} + kFltMin : scale;
  // scale: bf16_round_up.
  const ULanes su = lanes_bits(scale);
  const ILanes up = ((su & 0x80000000u) == 0) & ((su & 0x0000FFFFu) != 0);
  const ULanes sb = ((su & 0xFFFF0000u) + ((ULanes)up & 0x10000u)) >> 16;
  const Lanes sc = bits_lanes(sb << 16);
  // set_inverse.
  const Lanes ones = Lanes{} + 1.0f;
  const Lanes pre = sc >= kHugeScale ? Lanes{} + kTwoPowMinus64 : ones;
  const Lanes zero_pre = mul_rn(zero, pre);
  const Lanes inv = sc > 0.0f ? ones / mul_rn(sc, pre) : zeros;
  // A group holding NaN or Inf: scale NaN, zero 0, all-zero codes.
  p->scale_bits = finite ? sb : ULanes{} + uint32_t(kBf16NaN);
  p->zero_bits = finite ? zb : ULanes{};
  p->scale = finite ? sc : bits_lanes(ULanes{} + (uint32_t(kBf16NaN) << 16));
  p->zero = finite ? zero : zeros;
  p->inv_scale = finite ? inv : zeros;
  p->pre = finite ? pre : ones;
  p->zero_pre = finite ? zero_pre : zeros;
}

// Quantize n_groups groups of g elements of T: codes (g * bits / 8 bytes each), bf16 scale
// and zero. Groups go in batches: the ranges and parameters of a batch first, then its codes.
// The parameters of kLanes groups are computed at once, one group per lane: each group's range
// is reduced to one lane by reduce_lanes (kLanes groups in a few shuffles), and group_params
// runs lane-wise. While a batch is encoded, the next batch's operand and code bytes are
// prefetched, so that its range pass reads from the cache (measured ~1.15x with the operand in
// main memory, no change from L3). G: the group size when known at compile time, else 0.
template <typename T, int64_t G>
FC_ALWAYS_INLINE void quantize_groups_of(const typename T::Storage* x, int64_t n_groups,
                                         int64_t group_size, int bits, uint8_t* codes,
                                         uint16_t* scale, uint16_t* zero) {
  const int64_t g = G != 0 ? G : group_size;
  constexpr int64_t kBatch = kLanes > 16 ? kLanes : 16;  // a multiple of kLanes
  const int64_t nbytes = group_bytes(g, bits);
  if (g < kLanes) {  // G = 8 with 16 lanes: one group at a time
    for (int64_t k = 0; k < n_groups; ++k) {
      quantize_one<T>(x + k * g, g, bits, codes + k * nbytes, scale + k, zero + k);
    }
    return;
  }
  alignas(64) uint16_t sb[kBatch], zb[kBatch];
  alignas(64) float sc[kBatch], ze[kBatch], inv[kBatch], pre[kBatch], zp[kBatch];
  constexpr bool kDropPre = G == kDefaultGroupSize && !std::is_same_v<T, F16>;
  const bool unit_multiply = kDropPre && unit_multiply_is_identity();
  for (int64_t k0 = 0; k0 < n_groups; k0 += kBatch) {
    const int64_t m = n_groups - k0 < kBatch ? n_groups - k0 : kBatch;
    for (int64_t s0 = 0; s0 < m; s0 += kLanes) {
      Lanes l, h;
      ILanes n;
      ranges_lanes<T>(x + k0 * g, g, s0, m, &l, &h, &n);
      ParamLanes p;
      group_params_lanes(l, h, n, bits, &p);
      narrow_halves(p.scale_bits, sb + s0);
      narrow_halves(p.zero_bits, zb + s0);
      store_lanes(sc + s0, p.scale);
      store_lanes(ze + s0, p.zero);
      store_lanes(inv + s0, p.inv_scale);
      store_lanes(pre + s0, p.pre);
      store_lanes(zp + s0, p.zero_pre);
    }
    std::memcpy(scale + k0, sb, size_t(m) * sizeof(uint16_t));
    std::memcpy(zero + k0, zb, size_t(m) * sizeof(uint16_t));
    for (int64_t k = 0; k < m; ++k) {
      const GroupParams p = {sb[k], zb[k], sc[k], ze[k], inv[k], pre[k], zp[k]};
      if (k0 + kBatch + k < n_groups) {
        const char* next = reinterpret_cast<const char*>(x + (k0 + kBatch + k) * g);
        for (int64_t b = 0; b < g * int64_t(sizeof(*x)); b += 64) __builtin_prefetch(next + b);
        uint8_t* out = codes + (k0 + kBatch + k) * nbytes;
        for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(out + b, 1);
      }
      encode_group<T, kDropPre>(x + (k0 + k) * g, g, bits, p, codes + (k0 + k) * nbytes,
                                unit_multiply);
    }
  }
}

template <typename T>
void quantize_groups(const typename T::Storage* x, int64_t n_groups, int64_t g, int bits,
                     uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  if (g == kDefaultGroupSize) {
    return quantize_groups_of<T, kDefaultGroupSize>(x, n_groups, g, bits, codes, scale, zero);
  }
  return quantize_groups_of<T, 0>(x, n_groups, g, bits, codes, scale, zero);
}

// Quantize one group of f32 values: its codes (g * bits / 8 bytes), bf16 scale and zero.
inline void quantize_group(const float* v, int64_t g, int bits, uint8_t* codes,
                                           uint16_t* scale, uint16_t* zero) {
  quantize_one<F32>(v, g, bits, codes, scale, zero);
}

// Decode one group into f32 values; accumulate (out += decoded) when `accumulate`.
__attribute__((always_inline)) inline void decode_one(const uint8_t* codes, uint16_t scale,
                                                      uint16_t zero, int64_t g, int bits,
                                                      bool accumulate, float* out) {
  const GroupParams p = stored_params(scale, zero);
  switch (bits) {
    case 2: return decode_unpacked<2>(codes, g, p, accumulate, out);
    case 3: return decode_unpacked<3>(codes, g, p, accumulate, out);
    case 4: return decode_unpacked<4>(codes, g, p, accumulate, out);
    case 5: return decode_unpacked<5>(codes, g, p, accumulate, out);
    case 6: return decode_unpacked<6>(codes, g, p, accumulate, out);
    case 7: return decode_unpacked<7>(codes, g, p, accumulate, out);
    default: return decode_unpacked<8>(codes, g, p, accumulate, out);
  }
}

inline void decode_group(const uint8_t* codes, uint16_t scale, uint16_t zero,
                                         int64_t g, int bits, bool accumulate, float* out) {
  decode_one(codes, scale, zero, g, bits, accumulate, out);
}

// Store kLanes f32 values as T (T::store's arithmetic, lane-wise where it vectorizes).
template <typename T>
__attribute__((always_inline)) inline void store_lanes_t(Lanes v, typename T::Storage* y) {
  for (int j = 0; j < kLanes; ++j) y[j] = T::store(v[j]);
}
template <>
__attribute__((always_inline)) inline void store_lanes_t<F32>(Lanes v, float* y) {
  std::memcpy(y, &v, sizeof v);
}
template <>
__attribute__((always_inline)) inline void store_lanes_t<BF16>(Lanes v, uint16_t* y) {
  narrow_halves(bf16_bits_lanes(v), y);
}

__attribute__((always_inline)) inline Lanes saturate(Lanes v, float max) {
  const Lanes top = Lanes{} + max;
  const Lanes bottom = Lanes{} - max;
  return v > max ? top : (v < -max ? bottom : v);
}

// Store g f32 values as T; saturated to T's finite range when `saturating`.
template <typename T>
__attribute__((always_inline)) inline void store_values(const float* v, int64_t g,
                                                        bool saturating,
                                                        typename T::Storage* y) {
  int64_t i = 0;
  for (; i + kLanes <= g; i += kLanes) {
    Lanes a = load_lanes(v + i);
    if (saturating) a = saturate(a, T::kMax);
    store_lanes_t<T>(a, y + i);
  }
  for (; i < g; ++i) y[i] = T::store(saturating ? flashcomm::saturate(v[i], T::kMax) : v[i]);
}

// Whether every value of a group decodes to a finite value within [-max, max]: then q * scale
// never overflows (decode_lanes's fallback is not needed) and saturation changes nothing, so
// decoding is q * scale + zero alone, with the same bits. Decoding is monotonic in q (q * scale
// is exact), so the group's values lie between zero (q = 0) and the decode of the top code.
__attribute__((always_inline)) inline bool plain_group(const GroupParams& p, int bits, float max) {
  const float levels = float(max_code(bits));
  const float top = decode(uint32_t(max_code(bits)), p);
  return is_finite(mul_rn(levels, p.scale)) && p.zero >= -max && top <= max;
}

// The bf16 values of the codes qe (even positions) and qo (odd ones) of a plain_group, two to
// a lane (bf16_from_float without its NaN case: the values are finite).
__attribute__((always_inline)) inline ULanes plain_bf16_pairs(Lanes qe, Lanes qo,
                                                              const GroupParams& p) {
  const ULanes e = lanes_bits(add_rn(mul_rn(qe, p.scale), p.zero));
  const ULanes o = lanes_bits(add_rn(mul_rn(qo, p.scale), p.zero));
  const ULanes e_rounded = e + 0x7FFFu + ((e >> 16) & 1u);
  const ULanes o_rounded = o + 0x7FFFu + ((o >> 16) & 1u);
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
  // The high halves of o_rounded above those of e_rounded: one blend for a mask and an or.
  return (ULanes)_mm256_blend_epi16(_mm256_srli_epi32((__m256i)e_rounded, 16),
                                    (__m256i)o_rounded, 0xAA);
#else
  return (e_rounded >> 16) | (o_rounded & 0xFFFF0000u);
#endif
}

// 2 * kLanes bf16 values per step from codes (one byte each), two to a lane; returns how many
// values were written (a multiple of 2 * kLanes, at most n). PLAIN: the group is plain_group,
// so decode is q * scale + zero and the values are finite and in range (no NaN case in the
// rounding, no saturation).
template <bool PLAIN>
__attribute__((always_inline)) inline int64_t decode_bf16_pairs(const uint8_t* qs, int64_t n,
                                                                const GroupParams& p,
                                                                uint16_t* out) {
  int64_t j = 0;
  for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
    const ULanes c = widen_byte_pairs(qs + j);
    const Lanes qe = int_lanes_to_float(c & 0xFFFFu), qo = int_lanes_to_float(c >> 16);
    ULanes pair;
    if constexpr (PLAIN) {
      pair = plain_bf16_pairs(qe, qo, p);
    } else {
      pair = bf16_bits_lanes(saturate(decode_lanes(qe, p), BF16::kMax)) |
             (bf16_bits_lanes(saturate(decode_lanes(qo, p), BF16::kMax)) << 16);
    }
    std::memcpy(out + j, &pair, sizeof pair);
  }
  return j;
}

// Decode groups straight into T, saturated to T's finite range. G: the group size when known
// at compile time (else 0).
template <typename T, int BITS, int64_t G = 0>
__attribute__((always_inline)) inline void dequantize_all(const uint8_t* codes,
                                                          const uint16_t* scale,
                                                          const uint16_t* zero, int64_t n_groups,
                                                          int64_t group_size,
                                                          typename T::Storage* y) {
  const int64_t g = G != 0 ? G : group_size;
  uint8_t q[kChunk];
  for (int64_t k = 0; k < n_groups; ++k) {
    const GroupParams p = stored_params(scale[k], zero[k]);
    const uint8_t* in = codes + k * group_bytes(g, BITS);
    typename T::Storage* out = y + k * g;
    const bool plain = plain_group(p, BITS, T::kMax);
    for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
      const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
      if (std::is_same_v<T, BF16> && BITS == 6 && plain && n % 16 == 0) {  // no unpacking
        const uint8_t* c = in + i0 / kBlock * BITS;
        for (int64_t j = 0; j < n; j += 16) {
          const ULanes w = codes6_pairs(load12_both(c + j / kBlock * BITS, j + 16 < n));
          const ULanes pair = plain_bf16_pairs(int_lanes_to_float(w & 0x3Fu),
                                               int_lanes_to_float((w >> 6) & 0x3Fu), p);
          std::memcpy(out + i0 + j, &pair, sizeof pair);
        }
        continue;
      }
#endif
      const uint8_t* qs = q;
      if (BITS == 8) {
        qs = in + i0;  // 8-bit codes need no unpacking
      } else {
        unpack_chunk<BITS>(in + i0 / kBlock * BITS, n, q);
      }
      int64_t j = 0;
      if constexpr (std::is_same_v<T, BF16>) {  // codes and values two to a lane
        j = plain ? decode_bf16_pairs<true>(qs, n, p, out + i0)
                  : decode_bf16_pairs<false>(qs, n, p, out + i0);
      }
      for (; j + kLanes <= n; j += kLanes) {
        const Lanes d = decode_lanes(widen_bytes(qs + j), p);
        store_lanes_t<T>(saturate(d, T::kMax), out + i0 + j);
      }
      for (; j < n; ++j) out[i0 + j] = T::store(flashcomm::saturate(decode(qs[j], p), T::kMax));
    }
  }
}

// Dequantize n_groups groups into T, saturated to T's finite range (the operand's values came
// from T). buf is scratch of g floats.
template <typename T>
void dequantize_groups(const uint8_t* codes, const uint16_t* scale,
                                       const uint16_t* zero, int64_t n_groups, int64_t g,
                                       int bits, float* buf, typename T::Storage* y) {
  (void)buf;
  if (g == kDefaultGroupSize) {  // the group size known at compile time: loops unrolled
    switch (bits) {
      case 8: return dequantize_all<T, 8, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y);
      case 6: return dequantize_all<T, 6, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y);
      case 4: return dequantize_all<T, 4, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y);
      default: break;
    }
  }
  switch (bits) {
    case 2: return dequantize_all<T, 2>(codes, scale, zero, n_groups, g, y);
    case 3: return dequantize_all<T, 3>(codes, scale, zero, n_groups, g, y);
    case 4: return dequantize_all<T, 4>(codes, scale, zero, n_groups, g, y);
    case 5: return dequantize_all<T, 5>(codes, scale, zero, n_groups, g, y);
    case 6: return dequantize_all<T, 6>(codes, scale, zero, n_groups, g, y);
    case 7: return dequantize_all<T, 7>(codes, scale, zero, n_groups, g, y);
    default: return dequantize_all<T, 8>(codes, scale, zero, n_groups, g, y);
  }
}

// Store g f32 values as T; saturated to T's finite range when `saturating`.
template <typename T>
void store_group(const float* v, int64_t g, bool saturating,
                                 typename T::Storage* y) {
  store_values<T>(v, g, saturating, y);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
