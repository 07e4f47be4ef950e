// long file: the Hadamard rotations of every group size, forward and register-blocked inverse, one
// unit per instruction-set build
// Host loops of the rotation (codec.h, docs/format.md "Rotation"): the Walsh-Hadamard
// butterflies of codec.h's hadamard_butterflies arranged in vectors of kLanes f32 lanes, fused
// with the decode and store of cpu_codec.h's loops. Split from cpu_codec.h (same conventions:
// compiled once per instruction set, every operation the scalar definition's IEEE operation).
#ifndef FLASHCOMM_CPU_ROTATION_H_
#define FLASHCOMM_CPU_ROTATION_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

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

#endif  // FLASHCOMM_CPU_ROTATION_H_
