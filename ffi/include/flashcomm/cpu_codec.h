// Host loops over one group for the codec (docs/format.md). The arithmetic is codec.h; these
// loops only arrange it in vectors of kLanes f32 lanes (cpu_simd.h): the code width is a
// template parameter (constant shifts), the range pass keeps independent lanes, encode and
// decode are branch-free elementwise loops, and packing works on blocks of 8 codes. This file
// is compiled once per instruction set (ffi/cpu/isa_kernels.cc, kLanes = the ISA's register
// width) and the build is picked at load time (ffi/cpu/dispatch.cc): every operation is a
// correctly rounded IEEE op (no FMA contraction), so every build gives the same bits.
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

// Unpack BITS bytes into 8 codes of BITS bits.
template <int BITS>
__attribute__((always_inline)) inline void unpack_block_t(const uint8_t* in, uint8_t* q) {
  if (BITS == 8) {
    std::memcpy(q, in, kBlock);
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

// The codes of kLanes values of a group: codec.h's encode, lane-wise (code_lanes).
__attribute__((always_inline)) inline ULanes encode_code_lanes(Lanes x, const GroupParams& p,
                                                               float levels) {
  return code_lanes(mul_rn(add_rn(mul_rn(x, p.pre), -p.zero_pre), p.inv_scale), levels);
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

// Encode and pack one group of T (read again from x: it is in L1 after the range pass, and
// widening bf16 again is cheaper than storing and reloading f32).
template <typename T, int BITS>
__attribute__((always_inline)) inline void encode_pack(const typename T::Storage* v, int64_t g,
                                                       const GroupParams& p, uint8_t* codes) {
  const float levels = float(max_code(BITS));
  uint8_t staged[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    uint8_t* out = codes + i0 / kBlock * BITS;
    uint8_t* q = BITS == 8 ? out : staged;  // 8-bit codes are their own packing
    int64_t j = 0;
    if constexpr (std::is_same_v<T, BF16>) {
      for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
        Lanes even, odd;
        load_bf16_pairs(v + i0 + j, &even, &odd);
        const ULanes ce = encode_code_lanes(even, p, levels);
        const ULanes co = encode_code_lanes(odd, p, levels);
        if constexpr (kPackPairs<BITS>) {
          pack_pairs<BITS>(ce, co, out + j / kBlock * BITS, j + 2 * kLanes < n);
        } else {
          narrow_byte_pairs(ce | (co << 16), q + j);
        }
      }
    }
    const int64_t packed = kPackPairs<BITS> ? j : 0;  // codes [0, packed) are packed already
    for (; j + kLanes <= n; j += kLanes) {
      narrow_bytes(encode_code_lanes(load_lanes_t<T>(v + i0 + j), p, levels), q + j);
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
template <typename T>
__attribute__((always_inline)) inline void encode_group(const typename T::Storage* x, int64_t g,
                                                        int bits, const GroupParams& p,
                                                        uint8_t* codes) {
  if (!is_finite(p.scale)) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return;
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
// runs lane-wise.
template <typename T>
void quantize_groups(const typename T::Storage* x, int64_t n_groups, int64_t g,
                                     int bits, uint8_t* codes, uint16_t* scale,
                                     uint16_t* zero) {
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
  for (int64_t k0 = 0; k0 < n_groups; k0 += kBatch) {
    const int64_t m = n_groups - k0 < kBatch ? n_groups - k0 : kBatch;
    for (int64_t s0 = 0; s0 < m; s0 += kLanes) {
      Lanes lo[kLanes], hi[kLanes];
      ILanes nan[kLanes];
#pragma GCC unroll 16
      for (int s = 0; s < kLanes; ++s) {
        // Slot s ends in lane kReducedLanes.lane[s]: it takes that group (past the last
        // group, the first one again).
        const int64_t k = s0 + kReducedLanes.lane[s] < m ? s0 + kReducedLanes.lane[s] : s0;
        range_lanes<T>(x + (k0 + k) * g, g, &lo[s], &hi[s], &nan[s]);
      }
      const Lanes l = reduce_lanes(lo, [](Lanes a, Lanes b) { return a < b ? a : b; });
      const Lanes h = reduce_lanes(hi, [](Lanes a, Lanes b) { return a > b ? a : b; });
      const ILanes n = reduce_lanes(nan, [](ILanes a, ILanes b) { return a | b; });
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
      encode_group<T>(x + (k0 + k) * g, g, bits, p, codes + (k0 + k) * nbytes);
    }
  }
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
  return ((e + 0x7FFFu + ((e >> 16) & 1u)) >> 16) |
         ((o + 0x7FFFu + ((o >> 16) & 1u)) & 0xFFFF0000u);
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

// Decode groups straight into T, saturated to T's finite range.
template <typename T, int BITS>
__attribute__((always_inline)) inline void dequantize_all(const uint8_t* codes,
                                                          const uint16_t* scale,
                                                          const uint16_t* zero, int64_t n_groups,
                                                          int64_t g, typename T::Storage* y) {
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

// ---- rotation (codec.h, docs/format.md "Rotation") ----

// Sign masks of rotation 2 for positions 0..g-1: 0x80000000 where the sign is -1, else 0.
inline void rotation_sign_masks(int64_t g, uint32_t* masks) {
  for (int64_t i = 0; i < g; ++i) masks[i] = rotation_sign_bit(uint32_t(i)) << 31;
}

// One butterfly stage of distance H < kLanes inside each vector of kLanes values: lanes with
// bit H clear get a + b, the others a - b (a = the lane with bit H clear, b = its partner), the
// same operands and operations as hadamard_butterflies.
template <int H>
__attribute__((always_inline)) inline Lanes butterfly_in_lanes(Lanes v) {
  const Lanes p = permute_xor<H>(v);
  return (kLaneIndex & H) == 0 ? v + p : p - v;
}

// Every stage of distance 1, 2, ..., kLanes / 2 (the stages inside one vector), in order.
__attribute__((always_inline)) inline Lanes butterflies_in_lanes(Lanes v) {
  v = butterfly_in_lanes<1>(v);
  v = butterfly_in_lanes<2>(v);
  if constexpr (kLanes >= 8) v = butterfly_in_lanes<4>(v);
  if constexpr (kLanes >= 16) v = butterfly_in_lanes<8>(v);
  return v;
}

__attribute__((always_inline)) inline Lanes xor_masks(Lanes a, const uint32_t* masks) {
  ULanes m;
  std::memcpy(&m, masks, sizeof m);
  return bits_lanes(lanes_bits(a) ^ m);
}

// The last operations of a rotation on kLanes values: * c, then (inverse) the signs in post.
__attribute__((always_inline)) inline Lanes finish_lanes(Lanes a, float c,
                                                         const uint32_t* post) {
  a = a * c;
  return post != nullptr ? xor_masks(a, post) : a;
}

// Forward or inverse rotation of one group of g values of T (g a power of two >= kLanes) into
// the f32 buffer v: signs `pre` (forward rotation 2), the butterflies of codec.h's
// hadamard_butterflies, * c, signs `post` (inverse rotation 2); null masks are skipped. Every
// value goes through the same IEEE operations in the same order as the scalar reference; the
// passes are only fused: stages 1 .. kLanes / 2 run inside each vector as it is loaded, and
// the scaling (and signs) ride on the last stage.
template <typename T>
__attribute__((always_inline)) inline void rotate_group(const typename T::Storage* x, int64_t g,
                                                        float c, const uint32_t* pre,
                                                        const uint32_t* post, float* v) {
  for (int64_t j = 0; j < g; j += kLanes) {
    Lanes a = load_lanes_t<T>(x + j);
    if (pre != nullptr) a = xor_masks(a, pre + j);
    a = butterflies_in_lanes(a);
    if (g == kLanes) a = finish_lanes(a, c, post);
    std::memcpy(v + j, &a, sizeof a);
  }
  for (int64_t h = kLanes; h < g; h *= 2) {
    const bool last = 2 * h == g;
    for (int64_t j0 = 0; j0 < g; j0 += 2 * h) {
      for (int64_t j = j0; j < j0 + h; j += kLanes) {
        const Lanes a = load_lanes(v + j), b = load_lanes(v + j + h);
        Lanes sum = a + b, diff = a - b;
        if (last) {
          sum = finish_lanes(sum, c, post == nullptr ? nullptr : post + j);
          diff = finish_lanes(diff, c, post == nullptr ? nullptr : post + j + h);
        }
        std::memcpy(v + j, &sum, sizeof sum);
        std::memcpy(v + j + h, &diff, sizeof diff);
      }
    }
  }
}

// Scalar path for groups smaller than one vector (g = 8 with 16 lanes).
__attribute__((always_inline)) inline void rotate_small(float* v, int64_t g, float c,
                                                        const uint32_t* pre,
                                                        const uint32_t* post) {
  if (pre != nullptr) {
    for (int64_t i = 0; i < g; ++i) v[i] = bits_to_float(float_to_bits(v[i]) ^ pre[i]);
  }
  hadamard_butterflies(v, g);
  for (int64_t i = 0; i < g; ++i) v[i] = v[i] * c;
  if (post != nullptr) {
    for (int64_t i = 0; i < g; ++i) v[i] = bits_to_float(float_to_bits(v[i]) ^ post[i]);
  }
}

// The inverse rotation of one decoded f32 group in place: butterflies, * c, then the signs.
inline void unrotate_group(float* v, int64_t g, const uint32_t* masks) {
  if (g >= kLanes) {
    rotate_group<F32>(v, g, rotation_scale(g), nullptr, masks, v);
  } else {
    rotate_small(v, g, rotation_scale(g), nullptr, masks);
  }
}

// ---- register-blocked rotation ----
// The kernels below run the same butterflies (same operands, same IEEE ops, same stage order
// per value) as rotate_group, arranged so that each value goes through memory as few times as
// possible: a block of NV vectors (kLanes * NV values, NV <= 8) runs every stage that stays
// inside it (h = 1 .. kLanes * NV / 2) in registers as it is loaded or decoded; the stages across blocks run
// over the f32 buffer up to three at a time (radix 8: the vectors j, j + h, ..., j + 7h); and
// the last stage is fused with the scaling, the signs, the saturation and the store of the
// output. A block may run its stages before another block has run earlier ones: the stages of
// one block only read the block's own values, so every value still sees the stages in order.

// The stages that cross vectors inside an array of NV vectors: vector distance HV, 2 HV, ...,
// NV / 2 (value distance kLanes * HV ... when the vectors are consecutive; h * HV when they are
// h apart).
template <int NV, int HV = 1>
__attribute__((always_inline)) inline void cross_stages(Lanes* v) {
  if constexpr (HV < NV) {
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      if ((i & HV) != 0) continue;
      const Lanes a = v[i], b = v[i + HV];
      v[i] = a + b;
      v[i + HV] = a - b;
    }
    cross_stages<NV, 2 * HV>(v);
  }
}

// Stages h = 1, 2, ..., kLanes * NV / 2 of NV consecutive vectors held in registers.
template <int NV>
__attribute__((always_inline)) inline void butterflies_block(Lanes* v) {
#pragma GCC unroll 8
  for (int i = 0; i < NV; ++i) v[i] = butterflies_in_lanes(v[i]);
  cross_stages<NV>(v);
}

// The end of a rotation for kLanes values: * c, the signs in post (null: none), saturation to T's
// finite range when SATURATE, and the store as T.
template <typename T, bool SATURATE>
__attribute__((always_inline)) inline void finish_store(Lanes a, float c, const uint32_t* post,
                                                        typename T::Storage* y) {
  a = finish_lanes(a, c, post);
  if (SATURATE) a = saturate(a, T::kMax);
  store_lanes_t<T>(a, y);
}

__attribute__((always_inline)) inline const uint32_t* masks_at(const uint32_t* m, int64_t i) {
  return m == nullptr ? nullptr : m + i;
}

// Stages h, 2h, ..., h * R / 2 over the f32 group v (g values): the vectors j + t * h, t < R,
// for every j. LAST: these are the group's last stages, fused with finish_store into y (y may
// be v itself: each position is read before it is written).
template <typename T, bool SATURATE, int R, bool LAST>
__attribute__((always_inline)) inline void tail_pass(float* v, int64_t g, int64_t h, float c,
                                                     const uint32_t* post,
                                                     typename T::Storage* y) {
  for (int64_t j0 = 0; j0 < g; j0 += R * h) {
    for (int64_t j = j0; j < j0 + h; j += kLanes) {
      Lanes a[R];
#pragma GCC unroll 8
      for (int t = 0; t < R; ++t) a[t] = load_lanes(v + j + t * h);
      cross_stages<R>(a);
#pragma GCC unroll 8
      for (int t = 0; t < R; ++t) {
        if (LAST) {
          finish_store<T, SATURATE>(a[t], c, masks_at(post, j + t * h), y + j + t * h);
        } else {
          std::memcpy(v + j + t * h, &a[t], sizeof a[t]);
        }
      }
    }
  }
}

// Stages h0, 2 * h0, ..., g / 2 (h0 a multiple of kLanes, h0 < g) over the f32 group v, the
// last pass fused with finish_store into y.
template <typename T, bool SATURATE>
__attribute__((always_inline)) inline void butterflies_tail_store(float* v, int64_t g, int64_t h0,
                                                                  float c, const uint32_t* post,
                                                                  typename T::Storage* y) {
  int64_t h = h0;
  for (; g / h > 8; h *= 8) tail_pass<T, SATURATE, 8, false>(v, g, h, c, post, y);
  switch (g / h) {
    case 2: return tail_pass<T, SATURATE, 2, true>(v, g, h, c, post, y);
    case 4: return tail_pass<T, SATURATE, 4, true>(v, g, h, c, post, y);
    default: return tail_pass<T, SATURATE, 8, true>(v, g, h, c, post, y);
  }
}

#if FLASHCOMM_LANES == 16
// The 16 codes of BITS bits (BITS in 2..8) packed LSB-first at in (2 * BITS bytes), as f32
// lanes: code j is bits [j * BITS, (j + 1) * BITS) of the little-endian bytes, i.e. the 16-bit
// pair at byte j * BITS / 8 shifted right by j * BITS % 8 (a code never spans more than two
// bytes). Exactly 2 * BITS bytes are read.
template <int BITS>
__attribute__((always_inline)) inline Lanes load_codes16(const uint8_t* in) {
  if constexpr (BITS == 8) {
    ByteLanes bytes;
    std::memcpy(&bytes, in, kLanes);
    return __builtin_convertvector(bytes, Lanes);
  } else {
#define FC_O(j) ((j) * BITS / 8)
#define FC_S(j) ((j) * BITS % 8)
    ByteLanes raw = ByteLanes{};
    std::memcpy(&raw, in, 2 * BITS);
    const ByteLanes lo = __builtin_shufflevector(
        raw, raw, FC_O(0), FC_O(1), FC_O(2), FC_O(3), FC_O(4), FC_O(5), FC_O(6), FC_O(7),
        FC_O(8), FC_O(9), FC_O(10), FC_O(11), FC_O(12), FC_O(13), FC_O(14), FC_O(15));
    ULanes u = __builtin_convertvector(lo, ULanes);
    if constexpr (8 % BITS != 0) {  // codes may straddle a byte boundary
      const ByteLanes hi = __builtin_shufflevector(
          raw, raw, FC_O(0) + 1, FC_O(1) + 1, FC_O(2) + 1, FC_O(3) + 1, FC_O(4) + 1,
          FC_O(5) + 1, FC_O(6) + 1, FC_O(7) + 1, FC_O(8) + 1, FC_O(9) + 1, FC_O(10) + 1,
          FC_O(11) + 1, FC_O(12) + 1, FC_O(13) + 1, FC_O(14) + 1, FC_O(15) + 1);
      u |= __builtin_convertvector(hi, ULanes) << 8;
    }
    const ULanes shift = {FC_S(0), FC_S(1), FC_S(2),  FC_S(3),  FC_S(4),  FC_S(5),
                          FC_S(6), FC_S(7), FC_S(8),  FC_S(9),  FC_S(10), FC_S(11),
                          FC_S(12), FC_S(13), FC_S(14), FC_S(15)};
#undef FC_O
#undef FC_S
    const ULanes code = (u >> shift) & uint32_t((1u << BITS) - 1);
    return __builtin_convertvector((ILanes)code, Lanes);  // exact: codes < 256
  }
}

typedef uint64_t U64x8 __attribute__((vector_size(64)));
typedef uint32_t U32x8 __attribute__((vector_size(32)));

// load_codes16 another way (any BITS in 2..7; used at 6 bits, where it measured ~15% faster
// than the byte shuffles and the byte buffer): each block of 8 codes is one little-endian
// 64-bit word of BITS bytes, broadcast and shifted right by 0, BITS, ..., 7 BITS per lane.
template <int BITS>
__attribute__((always_inline)) inline Lanes load_codes16_wide(const uint8_t* in) {
  uint64_t w0 = 0, w1 = 0;
  std::memcpy(&w0, in, BITS);
  std::memcpy(&w1, in + BITS, BITS);
  const U64x8 shift = {0, BITS, 2 * BITS, 3 * BITS, 4 * BITS, 5 * BITS, 6 * BITS, 7 * BITS};
  const U64x8 mask = U64x8{} + uint64_t((1u << BITS) - 1);
  const U32x8 c0 = __builtin_convertvector(((U64x8{} + w0) >> shift) & mask, U32x8);
  const U32x8 c1 = __builtin_convertvector(((U64x8{} + w1) >> shift) & mask, U32x8);
  const ULanes code = __builtin_shufflevector(c0, c1, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
                                              13, 14, 15);
  return __builtin_convertvector((ILanes)code, Lanes);  // exact: codes < 256
}
#endif  // FLASHCOMM_LANES == 16

// Unpack n codes of `bits` bits (n a multiple of 8) into one byte each.
__attribute__((always_inline)) inline void unpack_codes(const uint8_t* in, int64_t n, int bits,
                                                        uint8_t* q) {
  switch (bits) {
    case 2: return unpack_chunk<2>(in, n, q);
    case 3: return unpack_chunk<3>(in, n, q);
    case 4: return unpack_chunk<4>(in, n, q);
    case 5: return unpack_chunk<5>(in, n, q);
    case 6: return unpack_chunk<6>(in, n, q);
    case 7: return unpack_chunk<7>(in, n, q);
    default: return unpack_chunk<8>(in, n, q);
  }
}

// Rotated dequantize of n_groups groups of g = kLanes * NV * m values (m >= 1; m > 1 only with
// NV = 8): per block of kLanes * NV values, decode and the in-block stages in registers; then
// the stages across blocks; the last stage with * c, the signs (post, or null), saturation and
// the store as T. The codes are BITS wide (8, 6 and 4 with 16 lanes: loaded straight into
// lanes), or with BITS = 0 `bits` wide (unpacked through a byte buffer).
// buf is scratch of g floats (unused when g = kLanes * NV).
template <typename T, int NV, int BITS>
__attribute__((always_inline)) inline void dequantize_rotated_all(
    const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int64_t n_groups,
    int64_t g, int bits, const uint32_t* post, float* buf, typename T::Storage* y) {
  constexpr int64_t kBlockValues = kLanes * NV;
  const float c = rotation_scale(g);
  const int64_t nbytes = group_bytes(g, bits);
  uint8_t q[kBlockValues];
  for (int64_t k = 0; k < n_groups; ++k) {
    const GroupParams p = stored_params(scale[k], zero[k]);
    const uint8_t* in = codes + k * nbytes;
    typename T::Storage* out = y + k * g;
    for (int64_t b0 = 0; b0 < g; b0 += kBlockValues) {
      if (BITS == 0) unpack_codes(in + b0 / kBlock * bits, kBlockValues, bits, q);
      Lanes v[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        Lanes codes_f;
        if constexpr (BITS == 0) {
          codes_f = widen_bytes(q + kLanes * i);
        } else {
#if FLASHCOMM_LANES == 16
          const uint8_t* at = in + (b0 + kLanes * i) / kBlock * BITS;
          if constexpr (BITS == 6) {
            codes_f = load_codes16_wide<BITS>(at);
          } else {
            codes_f = load_codes16<BITS>(at);
          }
#endif
        }
        v[i] = decode_lanes(codes_f, p);
      }
      butterflies_block<NV>(v);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        if (g == kBlockValues) {
          finish_store<T, true>(v[i], c, masks_at(post, kLanes * i), out + kLanes * i);
        } else {
          std::memcpy(buf + b0 + kLanes * i, &v[i], sizeof v[i]);
        }
      }
    }
    if (g > kBlockValues) butterflies_tail_store<T, true>(buf, g, kBlockValues, c, post, out);
  }
}

template <typename T, int NV>
__attribute__((always_inline)) inline void dequantize_rotated_bits(
    const uint8_t* codes, const uint16_t* scale, const uint16_t* zero, int64_t n_groups,
    int64_t g, int bits, const uint32_t* post, float* buf, typename T::Storage* y) {
  if constexpr (kLanes != 16) {  // the direct code loads are written for 16 lanes
    return dequantize_rotated_all<T, NV, 0>(codes, scale, zero, n_groups, g, bits, post, buf, y);
  } else {
    switch (bits) {
      case 8: return dequantize_rotated_all<T, NV, 8>(codes, scale, zero, n_groups, g, 8, post, buf, y);
      case 6: return dequantize_rotated_all<T, NV, 6>(codes, scale, zero, n_groups, g, 6, post, buf, y);
      case 4: return dequantize_rotated_all<T, NV, 4>(codes, scale, zero, n_groups, g, 4, post, buf, y);
      default:
        return dequantize_rotated_all<T, NV, 0>(codes, scale, zero, n_groups, g, bits, post, buf, y);
    }
  }
}

// Dequantize n_groups rotated groups into T, saturated to T's finite range: decode, inverse
// rotation (masks: rotation 2's signs, or null for rotation 1), store. buf is scratch of g
// floats.
template <typename T>
void dequantize_groups_rotated(const uint8_t* codes, const uint16_t* scale,
                                               const uint16_t* zero, int64_t n_groups, int64_t g,
                                               int bits, const uint32_t* masks, float* buf,
                                               typename T::Storage* y) {
  if constexpr (kLanes > kBlock) {  // a group smaller than a vector (G = 8): scalar
    if (g < kLanes) {
      const int64_t nbytes = group_bytes(g, bits);
      const float c = rotation_scale(g);
      for (int64_t k = 0; k < n_groups; ++k) {
        decode_one(codes + k * nbytes, scale[k], zero[k], g, bits, false, buf);
        rotate_small(buf, g, c, nullptr, masks);
        store_values<T>(buf, g, /*saturating=*/true, y + k * g);
      }
      return;
    }
  }
  if constexpr (kLanes >= kBlock) {  // blocks of whole 8-code packing blocks only
    if (g == kLanes) {
      return dequantize_rotated_bits<T, 1>(codes, scale, zero, n_groups, g, bits, masks, buf, y);
    }
  }
  if (g == 2 * kLanes) {
    return dequantize_rotated_bits<T, 2>(codes, scale, zero, n_groups, g, bits, masks, buf, y);
  }
  if (g == 4 * kLanes) {
    return dequantize_rotated_bits<T, 4>(codes, scale, zero, n_groups, g, bits, masks, buf, y);
  }
  return dequantize_rotated_bits<T, 8>(codes, scale, zero, n_groups, g, bits, masks, buf, y);
}

// The inverse rotation of one f32 group v (g >= kLanes) with the store fused into its last
// stage: y = T(unrotated v), not saturated. v is overwritten.
template <int NV, typename T>
__attribute__((always_inline)) inline void unrotate_store_blocks(float* v, int64_t g, float c,
                                                                 const uint32_t* post,
                                                                 typename T::Storage* y) {
  constexpr int64_t kBlockValues = kLanes * NV;
  for (int64_t b0 = 0; b0 < g; b0 += kBlockValues) {
    Lanes a[NV];
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) a[i] = load_lanes(v + b0 + kLanes * i);
    butterflies_block<NV>(a);
#pragma GCC unroll 8
    for (int i = 0; i < NV; ++i) {
      if (g == kBlockValues) {
        finish_store<T, false>(a[i], c, masks_at(post, kLanes * i), y + kLanes * i);
      } else {
        std::memcpy(v + b0 + kLanes * i, &a[i], sizeof a[i]);
      }
    }
  }
  if (g > kBlockValues) butterflies_tail_store<T, false>(v, g, kBlockValues, c, post, y);
}

// The inverse rotation of one f32 group (the fused sum), stored as T without saturation: the
// butterflies, * c, the signs (masks, or null), the store. v is overwritten.
template <typename T>
void unrotate_store_group(float* v, int64_t g, const uint32_t* masks,
                                          typename T::Storage* y) {
  const float c = rotation_scale(g);
  if (g < kLanes) {
    rotate_small(v, g, c, nullptr, masks);
    return store_values<T>(v, g, /*saturating=*/false, y);
  }
  if (g == kLanes) return unrotate_store_blocks<1, T>(v, g, c, masks, y);
  if (g == 2 * kLanes) return unrotate_store_blocks<2, T>(v, g, c, masks, y);
  if (g == 4 * kLanes) return unrotate_store_blocks<4, T>(v, g, c, masks, y);
  return unrotate_store_blocks<8, T>(v, g, c, masks, y);
}

// Forward rotation of n_groups groups of T into buf, block by block (signs pre, or null), then
// quantized as f32.
template <typename T, int NV>
__attribute__((always_inline)) inline void quantize_rotated_all(
    const typename T::Storage* x, int64_t n_groups, int64_t g, int bits, const uint32_t* pre,
    float* buf, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  constexpr int64_t kBlockValues = kLanes * NV;
  const int64_t nbytes = group_bytes(g, bits);
  const float c = rotation_scale(g);
  for (int64_t k = 0; k < n_groups; ++k) {
    const typename T::Storage* xs = x + k * g;
    for (int64_t b0 = 0; b0 < g; b0 += kBlockValues) {
      Lanes a[NV];
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        a[i] = load_lanes_t<T>(xs + b0 + kLanes * i);
        if (pre != nullptr) a[i] = xor_masks(a[i], pre + b0 + kLanes * i);
      }
      butterflies_block<NV>(a);
#pragma GCC unroll 8
      for (int i = 0; i < NV; ++i) {
        if (g == kBlockValues) a[i] = a[i] * c;
        std::memcpy(buf + b0 + kLanes * i, &a[i], sizeof a[i]);
      }
    }
    if (g > kBlockValues) butterflies_tail_store<F32, false>(buf, g, kBlockValues, c, nullptr, buf);
    quantize_one<F32>(buf, g, bits, codes + k * nbytes, scale + k, zero + k);
  }
}

// Quantize n_groups rotated groups of T: each group is rotated into buf (g floats; signed when
// masks is non-null: rotation 2), then quantized as f32.
template <typename T>
void quantize_groups_rotated(const typename T::Storage* x, int64_t n_groups,
                                             int64_t g, int bits, const uint32_t* masks,
                                             float* buf, uint8_t* codes, uint16_t* scale,
                                             uint16_t* zero) {
  if (g >= 8 * kLanes) {
    return quantize_rotated_all<T, 8>(x, n_groups, g, bits, masks, buf, codes, scale, zero);
  }
  // Smaller groups: rotate_group (measured faster here than the register blocks), or scalar.
  const int64_t nbytes = group_bytes(g, bits);
  const float c = rotation_scale(g);
  for (int64_t k = 0; k < n_groups; ++k) {
    const typename T::Storage* xs = x + k * g;
    if (g >= kLanes) {
      rotate_group<T>(xs, g, c, masks, nullptr, buf);
    } else {
      for (int64_t i = 0; i < g; ++i) buf[i] = T::load(xs[i]);
      rotate_small(buf, g, c, masks, nullptr);
    }
    quantize_one<F32>(buf, g, bits, codes + k * nbytes, scale + k, zero + k);
  }
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
