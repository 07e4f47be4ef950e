// Host loops over groups for the codec (docs/format.md). Written so that the compiler
// vectorizes the per-group passes (8 independent lanes, no cross-iteration dependence);
// all arithmetic is the shared codec.h.
#ifndef FLASHCOMM_CPU_CODEC_H_
#define FLASHCOMM_CPU_CODEC_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"

namespace flashcomm {
namespace cpu {

// min, max and finiteness of one group of f32 values (g a multiple of 8).
inline void group_range(const float* v, int64_t g, float* lo, float* hi, bool* finite) {
  float lo8[kBlock], hi8[kBlock];
  int ok8[kBlock];
  for (int j = 0; j < kBlock; ++j) {
    lo8[j] = v[j];
    hi8[j] = v[j];
    ok8[j] = 1;
  }
  for (int64_t i = 0; i < g; i += kBlock) {
    for (int j = 0; j < kBlock; ++j) {
      const float a = v[i + j];
      lo8[j] = a < lo8[j] ? a : lo8[j];
      hi8[j] = a > hi8[j] ? a : hi8[j];
      ok8[j] &= (a == a) & (a - a == 0.0f);  // false for NaN and +-Inf
    }
  }
  float l = lo8[0], h = hi8[0];
  int ok = ok8[0];
  for (int j = 1; j < kBlock; ++j) {
    l = lo8[j] < l ? lo8[j] : l;
    h = hi8[j] > h ? hi8[j] : h;
    ok &= ok8[j];
  }
  // -0.0 and +0.0 compare equal; store +0 so the result does not depend on the order of
  // the reduction.
  *lo = l == 0.0f ? 0.0f : l;
  *hi = h == 0.0f ? 0.0f : h;
  *finite = ok != 0;
}

// Quantize one group of f32 values: its codes (g * bits / 8 bytes), bf16 scale and zero.
inline void quantize_group(const float* v, int64_t g, int bits, uint8_t* codes, uint16_t* scale,
                           uint16_t* zero) {
  float lo, hi;
  bool finite;
  group_range(v, g, &lo, &hi, &finite);
  const GroupParams p = group_params(lo, hi, finite, bits);
  *scale = p.scale_bits;
  *zero = p.zero_bits;
  if (!finite) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return;
  }
  const float levels = float(max_code(bits));
  for (int64_t i = 0; i < g; i += kBlock) {
    uint32_t q[kBlock];
    for (int j = 0; j < kBlock; ++j) q[j] = encode(v[i + j], p, levels);
    pack_block(q, bits, codes + (i / kBlock) * bits);
  }
}

// Decode one group into f32 values; accumulate (out += decoded) when `accumulate`.
inline void decode_group(const uint8_t* codes, uint16_t scale, uint16_t zero, int64_t g,
                         int bits, bool accumulate, float* out) {
  const GroupParams p = stored_params(scale, zero);
  for (int64_t i = 0; i < g; i += kBlock) {
    uint32_t q[kBlock];
    unpack_block(codes + (i / kBlock) * bits, bits, q);
    for (int j = 0; j < kBlock; ++j) {
      const float d = decode(q[j], p);
      out[i + j] = accumulate ? add_rn(out[i + j], d) : d;
    }
  }
}

// Load g elements of type T as f32.
template <typename T>
inline void load_group(const typename T::Storage* x, int64_t g, float* out) {
  for (int64_t i = 0; i < g; ++i) out[i] = T::load(x[i]);
}

// Store g f32 values as T; saturated to T's finite range when `saturating`.
template <typename T>
inline void store_group(const float* v, int64_t g, bool saturating, typename T::Storage* y) {
  if (saturating) {
    for (int64_t i = 0; i < g; ++i) y[i] = T::store(saturate(v[i], T::kMax));
  } else {
    for (int64_t i = 0; i < g; ++i) y[i] = T::store(v[i]);
  }
}

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
