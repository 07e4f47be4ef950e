// Host loops over one group for the codec (docs/format.md). The arithmetic is codec.h; these
// loops only arrange it so the compiler vectorizes it: the code width is a template parameter
// (constant shifts), the range pass keeps 8 independent lanes, encode and decode are
// branch-free elementwise loops, and packing works on blocks of 8 codes. The entry points are
// compiled for AVX-512, AVX2 and baseline x86-64 and picked at load time (target_clones):
// every operation is a correctly rounded IEEE op (no FMA contraction), so all three give the
// same bits.
#ifndef FLASHCOMM_CPU_CODEC_H_
#define FLASHCOMM_CPU_CODEC_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashcomm/codec.h"

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(FLASHCOMM_NO_MULTIVERSION)
#define FC_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FC_MULTIVERSION
#endif

namespace flashcomm {
namespace cpu {

constexpr int64_t kChunk = 256;  // codes staged per pass (group sizes may be larger)

typedef uint8_t ByteLanes __attribute__((vector_size(kLanes)));

__attribute__((always_inline)) inline Lanes load_lanes(const float* v) {
  Lanes a;
  std::memcpy(&a, v, sizeof a);
  return a;
}

typedef uint16_t HalfLanes __attribute__((vector_size(2 * kLanes)));

// kLanes elements of T as f32 lanes.
template <typename T>
__attribute__((always_inline)) inline Lanes load_lanes_t(const typename T::Storage* x) {
  Lanes a;
  for (int j = 0; j < kLanes; ++j) a[j] = T::load(x[j]);
  return a;
}
template <>
__attribute__((always_inline)) inline Lanes load_lanes_t<F32>(const float* x) {
  return load_lanes(x);
}
template <>
__attribute__((always_inline)) inline Lanes load_lanes_t<BF16>(const uint16_t* x) {
  HalfLanes h;
  std::memcpy(&h, x, sizeof h);
  const ULanes u = __builtin_convertvector(h, ULanes) << 16;
  return bits_lanes(u);
}

// Lane-wise min/max reduced to one value by halving (exact whatever the order: min and max of
// floats are order-independent apart from signed zeros, which the caller canonicalizes).
__attribute__((always_inline)) inline float reduce_min(Lanes a) {
  a = __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7) < a
          ? __builtin_shufflevector(a, a, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7)
          : a;
  a = __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11) < a
          ? __builtin_shufflevector(a, a, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11)
          : a;
  a = __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13) < a
          ? __builtin_shufflevector(a, a, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13)
          : a;
  return a[1] < a[0] ? a[1] : a[0];
}
__attribute__((always_inline)) inline float reduce_max(Lanes a) {
  return -reduce_min(-a);
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
    for (; i + kLanes <= g; i += kLanes) {
      const Lanes a = load_lanes_t<T>(x + i);
      lo_l = a < lo_l ? a : lo_l;
      hi_l = a > hi_l ? a : hi_l;
      bad_l |= (lanes_bits(a) & 0x7F800000u) == 0x7F800000u;
    }
    l = reduce_min(lo_l);
    h = reduce_max(hi_l);
    const ILanes folded = bad_l | __builtin_shufflevector(bad_l, bad_l, 8, 9, 10, 11, 12, 13, 14,
                                                         15, 0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < kLanes / 2; ++j) ok = ok && folded[j] == 0;
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

// Pack 8 codes of BITS bits (one byte each) LSB-first into BITS bytes.
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
    for (; j + kLanes <= n; j += kLanes) {
      const Lanes biased = encode_biased(load_lanes_t<T>(v + i0 + j), p, levels);
      const ULanes code = lanes_bits(biased) - kEncodeBias;
      const ByteLanes bytes = __builtin_convertvector(code, ByteLanes);
      std::memcpy(q + j, &bytes, kLanes);
    }
    for (; j < n; ++j) q[j] = uint8_t(encode(T::load(v[i0 + j]), p, levels));
    if (BITS == 4) {  // the same LSB-first layout, as one vectorizable loop
      for (int64_t k = 0; k < n / 2; ++k) out[k] = uint8_t(q[2 * k] | (q[2 * k + 1] << 4));
    } else if (BITS != 8) {
      for (int64_t b = 0; b < n; b += kBlock) pack_block_t<BITS>(q + b, out + b / kBlock * BITS);
    }
  }
}

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
    for (int64_t b = 0; b < n; b += kBlock) unpack_block_t<BITS>(in + b / kBlock * BITS, q + b);
  }
}

template <int BITS>
__attribute__((always_inline)) inline void decode_unpacked(const uint8_t* codes, int64_t g, const GroupParams& p,
                            bool accumulate, float* out) {
  uint8_t q[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    unpack_chunk<BITS>(codes + i0 / kBlock * BITS, n, q);
    float* o = out + i0;
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      ByteLanes bytes;
      std::memcpy(&bytes, q + j, kLanes);
      Lanes d = decode_lanes(__builtin_convertvector(bytes, Lanes), p);
      if (accumulate) d = add_rn(load_lanes(o + j), d);
      std::memcpy(o + j, &d, sizeof d);
    }
    for (; j < n; ++j) o[j] = accumulate ? add_rn(o[j], decode(q[j], p)) : decode(q[j], p);
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
  if (!finite) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return false;
  }
  switch (bits) {
    case 2: encode_pack<T, 2>(x, g, p, codes); break;
    case 3: encode_pack<T, 3>(x, g, p, codes); break;
    case 4: encode_pack<T, 4>(x, g, p, codes); break;
    case 5: encode_pack<T, 5>(x, g, p, codes); break;
    case 6: encode_pack<T, 6>(x, g, p, codes); break;
    case 7: encode_pack<T, 7>(x, g, p, codes); break;
    default: encode_pack<T, 8>(x, g, p, codes); break;
  }
  return true;
}

// Quantize n_groups groups of g elements of T: codes (g * bits / 8 bytes each), bf16 scale
// and zero.
template <typename T>
FC_MULTIVERSION void quantize_groups(const typename T::Storage* x, int64_t n_groups, int64_t g,
                                     int bits, uint8_t* codes, uint16_t* scale,
                                     uint16_t* zero) {
  const int64_t nbytes = group_bytes(g, bits);
  for (int64_t k = 0; k < n_groups; ++k) {
    quantize_one<T>(x + k * g, g, bits, codes + k * nbytes, scale + k, zero + k);
  }
}

// Quantize one group of f32 values: its codes (g * bits / 8 bytes), bf16 scale and zero.
FC_MULTIVERSION inline void quantize_group(const float* v, int64_t g, int bits, uint8_t* codes,
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

FC_MULTIVERSION inline void decode_group(const uint8_t* codes, uint16_t scale, uint16_t zero,
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
  const ULanes u = lanes_bits(v);  // bf16_from_float, lane-wise
  const ULanes nan = (u >> 16) | 0x0040u;
  const ULanes rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  const ULanes r = (u & 0x7FFFFFFFu) > 0x7F800000u ? nan : rounded;
  const HalfLanes h = __builtin_convertvector(r, HalfLanes);
  std::memcpy(y, &h, sizeof h);
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
    for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
      const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
      const uint8_t* qs = q;
      if (BITS == 8) {
        qs = in + i0;  // 8-bit codes need no unpacking
      } else {
        unpack_chunk<BITS>(in + i0 / kBlock * BITS, n, q);
      }
      int64_t j = 0;
      for (; j + kLanes <= n; j += kLanes) {
        ByteLanes bytes;
        std::memcpy(&bytes, qs + j, kLanes);
        const Lanes d = decode_lanes(__builtin_convertvector(bytes, Lanes), p);
        store_lanes_t<T>(saturate(d, T::kMax), out + i0 + j);
      }
      for (; j < n; ++j) out[i0 + j] = T::store(flashcomm::saturate(decode(qs[j], p), T::kMax));
    }
  }
}

// Dequantize n_groups groups into T, saturated to T's finite range (the operand's values came
// from T). buf is scratch of g floats.
template <typename T>
FC_MULTIVERSION void dequantize_groups(const uint8_t* codes, const uint16_t* scale,
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
FC_MULTIVERSION void store_group(const float* v, int64_t g, bool saturating,
                                 typename T::Storage* y) {
  store_values<T>(v, g, saturating, y);
}

// ---- rotation (codec.h, docs/format.md "Rotation") ----

// Sign masks of rotation 2 for positions 0..g-1: 0x80000000 where the sign is -1, else 0.
inline void rotation_sign_masks(int64_t g, uint32_t* masks) {
  for (int64_t i = 0; i < g; ++i) masks[i] = rotation_sign_bit(uint32_t(i)) << 31;
}

// One butterfly stage of distance H < kLanes inside each vector of 16 values: lanes with bit H
// clear get a + b, the others a - b (a = the lane with bit H clear, b = its partner), the same
// operands and operations as hadamard_butterflies.
template <int H>
__attribute__((always_inline)) inline Lanes butterfly_in_lanes(Lanes v) {
  Lanes p;
  if (H == 1) p = __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  if (H == 2) p = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  if (H == 4) p = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  if (H == 8) p = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  const ILanes lane = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  return (lane & H) == 0 ? v + p : p - v;
}

__attribute__((always_inline)) inline Lanes xor_masks(Lanes a, const uint32_t* masks) {
  ULanes m;
  std::memcpy(&m, masks, sizeof m);
  return bits_lanes(lanes_bits(a) ^ m);
}

// The last operations of a rotation on 16 values: * c, then (inverse) the signs in post.
__attribute__((always_inline)) inline Lanes finish_lanes(Lanes a, float c,
                                                         const uint32_t* post) {
  a = a * c;
  return post != nullptr ? xor_masks(a, post) : a;
}

// Forward or inverse rotation of one group of g values of T (g a power of two >= kLanes) into
// the f32 buffer v: signs `pre` (forward rotation 2), the butterflies of codec.h's
// hadamard_butterflies, * c, signs `post` (inverse rotation 2); null masks are skipped. Every
// value goes through the same IEEE operations in the same order as the scalar reference; the
// passes are only fused: stages 1, 2, 4, 8 run inside each vector of 16 as it is loaded, and
// the scaling (and signs) ride on the last stage.
template <typename T>
__attribute__((always_inline)) inline void rotate_group(const typename T::Storage* x, int64_t g,
                                                        float c, const uint32_t* pre,
                                                        const uint32_t* post, float* v) {
  for (int64_t j = 0; j < g; j += kLanes) {
    Lanes a = load_lanes_t<T>(x + j);
    if (pre != nullptr) a = xor_masks(a, pre + j);
    a = butterfly_in_lanes<1>(a);
    a = butterfly_in_lanes<2>(a);
    a = butterfly_in_lanes<4>(a);
    a = butterfly_in_lanes<8>(a);
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

// Scalar path for groups smaller than one vector (g = 8).
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

// Quantize n_groups rotated groups of T: each group is rotated into buf (g floats; signed when
// masks is non-null: rotation 2), then quantized as f32.
template <typename T>
FC_MULTIVERSION void quantize_groups_rotated(const typename T::Storage* x, int64_t n_groups,
                                             int64_t g, int bits, const uint32_t* masks,
                                             float* buf, uint8_t* codes, uint16_t* scale,
                                             uint16_t* zero) {
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

// The inverse rotation of one decoded f32 group in place: butterflies, * c, then the signs.
FC_MULTIVERSION inline void unrotate_group(float* v, int64_t g, const uint32_t* masks) {
  if (g >= kLanes) {
    rotate_group<F32>(v, g, rotation_scale(g), nullptr, masks, v);
  } else {
    rotate_small(v, g, rotation_scale(g), nullptr, masks);
  }
}

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
