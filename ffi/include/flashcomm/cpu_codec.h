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

// Lane-wise min/max reduced to one value (exact whatever the order: min and max of floats
// are order-independent apart from signed zeros, which the caller canonicalizes).
__attribute__((always_inline)) inline float reduce_min(Lanes a) {
  float r = a[0];
  for (int j = 1; j < kLanes; ++j) r = a[j] < r ? a[j] : r;
  return r;
}
__attribute__((always_inline)) inline float reduce_max(Lanes a) {
  float r = a[0];
  for (int j = 1; j < kLanes; ++j) r = a[j] > r ? a[j] : r;
  return r;
}

// One group of T's min, max and finiteness (g a multiple of 8); with STORE, also the group as
// f32 in buf.
template <typename T, bool STORE>
__attribute__((always_inline)) inline void load_range(const typename T::Storage* x, int64_t g,
                                                      float* buf, float* lo, float* hi,
                                                      bool* finite) {
  float l = T::load(x[0]), h = l;
  bool ok = true;
  int64_t i = 0;
  if (g >= kLanes) {
    Lanes lo_l = load_lanes_t<T>(x), hi_l = lo_l;
    ILanes bad_l = ILanes{};
    for (; i + kLanes <= g; i += kLanes) {
      const Lanes a = load_lanes_t<T>(x + i);
      if (STORE) std::memcpy(buf + i, &a, sizeof a);
      lo_l = a < lo_l ? a : lo_l;
      hi_l = a > hi_l ? a : hi_l;
      bad_l |= (lanes_bits(a) & 0x7F800000u) == 0x7F800000u;
    }
    l = reduce_min(lo_l);
    h = reduce_max(hi_l);
    for (int j = 0; j < kLanes; ++j) ok = ok && bad_l[j] == 0;
  }
  for (; i < g; ++i) {
    const float a = T::load(x[i]);
    if (STORE) buf[i] = a;
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

template <int BITS>
__attribute__((always_inline)) inline void encode_pack(const float* v, int64_t g, const GroupParams& p, uint8_t* codes) {
  const float levels = float(max_code(BITS));
  uint8_t staged[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    uint8_t* out = codes + i0 / kBlock * BITS;
    uint8_t* q = BITS == 8 ? out : staged;  // 8-bit codes are their own packing
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      const Lanes biased = encode_biased(load_lanes(v + i0 + j), p, levels);
      const ULanes code = lanes_bits(biased) - kEncodeBias;
      const ByteLanes bytes = __builtin_convertvector(code, ByteLanes);
      std::memcpy(q + j, &bytes, kLanes);
    }
    for (; j < n; ++j) q[j] = uint8_t(encode(v[i0 + j], p, levels));
    if (BITS == 4) {  // the same LSB-first layout, as one vectorizable loop
      for (int64_t k = 0; k < n / 2; ++k) out[k] = uint8_t(q[2 * k] | (q[2 * k + 1] << 4));
    } else if (BITS != 8) {
      for (int64_t b = 0; b < n; b += kBlock) pack_block_t<BITS>(q + b, out + b / kBlock * BITS);
    }
  }
}

template <int BITS>
__attribute__((always_inline)) inline void decode_unpacked(const uint8_t* codes, int64_t g, const GroupParams& p,
                            bool accumulate, float* out) {
  uint8_t q[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    for (int64_t b = 0; b < n; b += kBlock) unpack_block_t<BITS>(codes + (i0 + b) / kBlock * BITS, q + b);
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

template <typename T>
__attribute__((always_inline)) inline void quantize_one(const typename T::Storage* x, int64_t g,
                                                        int bits, float* buf, uint8_t* codes,
                                                        uint16_t* scale, uint16_t* zero) {
  // f32 input is encoded in place; other dtypes are widened into buf on the range pass.
  constexpr bool kWiden = !std::is_same<T, F32>::value;
  float lo, hi;
  bool finite;
  load_range<T, kWiden>(x, g, buf, &lo, &hi, &finite);
  const float* v = kWiden ? buf : reinterpret_cast<const float*>(x);
  const GroupParams p = group_params(lo, hi, finite, bits);
  *scale = p.scale_bits;
  *zero = p.zero_bits;
  if (!finite) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return;
  }
  switch (bits) {
    case 2: return encode_pack<2>(v, g, p, codes);
    case 3: return encode_pack<3>(v, g, p, codes);
    case 4: return encode_pack<4>(v, g, p, codes);
    case 5: return encode_pack<5>(v, g, p, codes);
    case 6: return encode_pack<6>(v, g, p, codes);
    case 7: return encode_pack<7>(v, g, p, codes);
    default: return encode_pack<8>(v, g, p, codes);
  }
}

// Quantize n_groups groups of g elements of T: codes (g * bits / 8 bytes each), bf16 scale
// and zero. buf is scratch of g floats.
template <typename T>
FC_MULTIVERSION void quantize_groups(const typename T::Storage* x, int64_t n_groups, int64_t g,
                                     int bits, float* buf, uint8_t* codes, uint16_t* scale,
                                     uint16_t* zero) {
  const int64_t nbytes = group_bytes(g, bits);
  for (int64_t k = 0; k < n_groups; ++k) {
    quantize_one<T>(x + k * g, g, bits, buf, codes + k * nbytes, scale + k, zero + k);
  }
}

// Quantize one group of f32 values: its codes (g * bits / 8 bytes), bf16 scale and zero.
FC_MULTIVERSION inline void quantize_group(const float* v, int64_t g, int bits, uint8_t* codes,
                                           uint16_t* scale, uint16_t* zero) {
  quantize_one<F32>(v, g, bits, nullptr, codes, scale, zero);
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

// Dequantize n_groups groups into T, saturated to T's finite range (the operand's values came
// from T). buf is scratch of g floats.
template <typename T>
FC_MULTIVERSION void dequantize_groups(const uint8_t* codes, const uint16_t* scale,
                                       const uint16_t* zero, int64_t n_groups, int64_t g,
                                       int bits, float* buf, typename T::Storage* y) {
  const int64_t nbytes = group_bytes(g, bits);
  for (int64_t k = 0; k < n_groups; ++k) {
    decode_one(codes + k * nbytes, scale[k], zero[k], g, bits, false, buf);
    store_values<T>(buf, g, /*saturating=*/true, y + k * g);
  }
}

// Store g f32 values as T; saturated to T's finite range when `saturating`.
template <typename T>
FC_MULTIVERSION void store_group(const float* v, int64_t g, bool saturating,
                                 typename T::Storage* y) {
  store_values<T>(v, g, saturating, y);
}

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
