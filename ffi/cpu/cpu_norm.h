// Host loops of the fused epilogue (residual add + RMSNorm, docs/fused_norm.md) over rows whose
// all-reduced values are already decoded to f32. Compiled once per instruction set with the
// codec (ffi/cpu/isa_kernels.cc): the loops run in vectors of kLanes f32 lanes, while the sum
// of squares keeps codec.h's kNormLanes (16) running sums whatever kLanes is (16 / kLanes
// vectors), so every build gives the same bits. No FMA contraction (-ffp-contract=off).
#ifndef FLASHCOMM_CPU_NORM_H_
#define FLASHCOMM_CPU_NORM_H_

#include <cstdint>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

static_assert(kNormLanes % kLanes == 0, "the norm's running sums fill whole vectors");

// f32(T(v)) lane-wise: the value the stored T holds, without reading the store back (bf16: the
// rounded bits widened; f32: v itself; f16: through a small buffer).
template <typename T>
FC_ALWAYS_INLINE Lanes round_lanes_t(Lanes v) {
  typename T::Storage tmp[kLanes];
  store_lanes_t<T>(v, tmp);
  return load_lanes_t<T>(tmp);
}
template <>
FC_ALWAYS_INLINE Lanes round_lanes_t<F32>(Lanes v) {
  return v;
}
template <>
FC_ALWAYS_INLINE Lanes round_lanes_t<BF16>(Lanes v) {
  return bits_lanes(bf16_bits_lanes(v) << 16);
}

// One row of H values: d (the decoded all-reduce, f32) plus the residual r gives the new
// residual h = T(d + r), written to h_out; d is overwritten by f32(h). Returns 1 / rms(h)
// (codec.h norm_inverse_rms of the 16 running sums).
template <typename T>
FC_ALWAYS_INLINE float add_residual_row(float* d, const typename T::Storage* r, int64_t h_len,
                                        float inv_h, float eps_h, typename T::Storage* h_out) {
  constexpr int kVecs = kNormLanes / kLanes;
  Lanes acc[kVecs];
  for (int v = 0; v < kVecs; ++v) acc[v] = Lanes{} + 0.0f;
  int64_t i = 0;
  for (; i + kNormLanes <= h_len; i += kNormLanes) {
    for (int v = 0; v < kVecs; ++v) {
      const int64_t at = i + v * kLanes;
      const Lanes s = add_rn(load_lanes(d + at), load_lanes_t<T>(r + at));
      store_lanes_t<T>(s, h_out + at);
      const Lanes hv = round_lanes_t<T>(s);  // f32(T(s)): the stored residual
      store_lanes(d + at, hv);
      acc[v] = add_rn(acc[v], mul_rn(hv, hv));
    }
  }
  float sums[kNormLanes];
  for (int v = 0; v < kVecs; ++v) {
    for (int j = 0; j < kLanes; ++j) sums[v * kLanes + j] = acc[v][j];
  }
  for (; i < h_len; ++i) {  // the tail: value i still goes to running sum i % 16
    const typename T::Storage hs = T::store(add_rn(d[i], T::load(r[i])));
    h_out[i] = hs;
    d[i] = T::load(hs);
    sums[i % kNormLanes] = add_rn(sums[i % kNormLanes], mul_rn(d[i], d[i]));
  }
  return norm_inverse_rms(norm_reduce(sums), inv_h, eps_h);
}

// out[i] = T(RN(RN(h[i] * inv_rms) * w[i])) for one row (h as f32, w of W: F32 or BF16).
template <typename T, typename W>
FC_ALWAYS_INLINE void scale_row(const float* h, float inv_rms, const typename W::Storage* w,
                                int64_t h_len, typename T::Storage* out) {
  int64_t i = 0;
  for (; i + kLanes <= h_len; i += kLanes) {
    const Lanes y = mul_rn(mul_rn(load_lanes(h + i), inv_rms), load_lanes_t<W>(w + i));
    store_lanes_t<T>(y, out + i);
  }
  for (; i < h_len; ++i) out[i] = T::store(mul_rn(mul_rn(h[i], inv_rms), W::load(w[i])));
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_NORM_H_
