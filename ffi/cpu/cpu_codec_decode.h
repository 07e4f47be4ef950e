// The integer codec's decode loops (cpu_codec.h): codes unpacked (6-bit codes straight into
// lanes on AVX2), decoded with codec.h's q * scale + zero lane-wise, accumulated or stored as T
// (saturated to T's finite range where the operand's values came from T). Compiled once per
// instruction set with the rest of cpu_codec.h.

#ifndef FLASHCOMM_CPU_CODEC_DECODE_H_
#define FLASHCOMM_CPU_CODEC_DECODE_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec_lanes.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

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

// Codes i0 .. i0 + n - 1 of a group (i0 and n multiples of 8), one byte each: 8-bit codes are
// read where they are, narrower ones unpacked into q.
template <int BITS>
FC_ALWAYS_INLINE const uint8_t* chunk_codes(const uint8_t* codes, int64_t i0, int64_t n,
                                            uint8_t* q) {
  if (BITS == 8) return codes + i0;
  unpack_chunk<BITS>(codes + i0 / kBlock * BITS, n, q);
  return q;
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
    const uint8_t* qs = chunk_codes<BITS>(codes, i0, n, q);
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
                                                          typename T::Storage* y,
                                                          int64_t stride) {
  const int64_t g = G != 0 ? G : group_size;
  const int64_t step = stride != 0 ? stride : group_bytes(g, BITS);
  uint8_t q[kChunk];
  for (int64_t k = 0; k < n_groups; ++k) {
    const GroupParams p = stored_params(scale[k], zero[k]);
    const uint8_t* in = codes + k * step;
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
      const uint8_t* qs = chunk_codes<BITS>(in, i0, n, q);
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
// from T). buf is scratch of g floats. stride: bytes from one group's codes to the next's (0:
// the codes' own bytes, back to back).
template <typename T>
void dequantize_groups(const uint8_t* codes, const uint16_t* scale,
                                       const uint16_t* zero, int64_t n_groups, int64_t g,
                                       int bits, float* buf, typename T::Storage* y,
                                       int64_t stride = 0) {
  (void)buf;
  if (g == kDefaultGroupSize) {  // the group size known at compile time: loops unrolled
    switch (bits) {
      case 8:
        return dequantize_all<T, 8, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y,
                                                          stride);
      case 6:
        return dequantize_all<T, 6, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y,
                                                          stride);
      case 4:
        return dequantize_all<T, 4, kDefaultGroupSize>(codes, scale, zero, n_groups, g, y,
                                                          stride);
      default: break;
    }
  }
  switch (bits) {
    case 2: return dequantize_all<T, 2>(codes, scale, zero, n_groups, g, y, stride);
    case 3: return dequantize_all<T, 3>(codes, scale, zero, n_groups, g, y, stride);
    case 4: return dequantize_all<T, 4>(codes, scale, zero, n_groups, g, y, stride);
    case 5: return dequantize_all<T, 5>(codes, scale, zero, n_groups, g, y, stride);
    case 6: return dequantize_all<T, 6>(codes, scale, zero, n_groups, g, y, stride);
    case 7: return dequantize_all<T, 7>(codes, scale, zero, n_groups, g, y, stride);
    default: return dequantize_all<T, 8>(codes, scale, zero, n_groups, g, y, stride);
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

#endif  // FLASHCOMM_CPU_CODEC_DECODE_H_
