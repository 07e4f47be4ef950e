// The CPU codec's work, compiled once per instruction set: the build system compiles this file
// with FLASHCOMM_ISA (isa_<name>: the namespace of every symbol here and in the codec headers),
// FLASHCOMM_LANES (16 / 8 / 4 f32 lanes) and the ISA's -m flags; the
// result is one CodecKernels table per ISA (cpu_dispatch.h). The handlers check shapes and
// attributes first (codec_kernels.cc, gather_kernels.cc), so sizes here are valid.
//
// Nothing here may instantiate a template or inline function outside FLASHCOMM_ISA's
// namespace (no std containers): the linker keeps one copy of such a function for the whole
// library, and an AVX-512 copy called from the baseline build would not run on other CPUs.
// Scratch memory comes from malloc.
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "flashcomm/codec.h"
#include "flashcomm/cpu_codec.h"
#include "flashcomm/cpu_dispatch.h"
#include "flashcomm/cpu_rotation.h"
#include "flashcomm/cpu_spikes.h"

#if !defined(FLASHCOMM_ISA) || !defined(FLASHCOMM_LANES)
#error "compile with -DFLASHCOMM_ISA=isa_<name> -DFLASHCOMM_LANES=<16, 8 or 4>"
#endif
#define FC_STRINGIFY(x) #x
#define FC_STRING(x) FC_STRINGIFY(x)

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {
namespace {

// Scratch of n values of T (malloc, freed on scope exit; null when n is 0).
template <typename T>
struct Scratch {
  explicit Scratch(int64_t n) : data(static_cast<T*>(n > 0 ? std::malloc(size_t(n) * sizeof(T)) : nullptr)) {}
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  T* data;
};

// Sign masks of rotation 2 (rotation_sign_masks), or null for rotation 0 and 1.
struct SignMasks {
  SignMasks(int rotation, int64_t g) : masks(rotation == kRotationSignedHadamard ? g : 0) {
    if (masks.data != nullptr) rotation_sign_masks(g, masks.data);
  }
  const uint32_t* get() const { return masks.data; }
  Scratch<uint32_t> masks;
};

template <typename T>
void QuantizeAs(const void* x, int64_t n_groups, int64_t g, int bits, int rotation, int spikes,
                uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  if (spikes == 0 && rotation == kRotationNone) {
    return quantize_groups<T>(xs, n_groups, g, bits, codes, scale, zero);
  }
  const SignMasks masks(rotation, g);
  Scratch<float> buf(g);
  if (spikes == 0) {
    return quantize_groups_rotated<T>(xs, n_groups, g, bits, masks.get(), buf.data, codes, scale,
                                      zero);
  }
  // Spikes (any rotation): each group is widened (and rotated) into buf, then
  // quantize_spiked_group writes its record.
  Scratch<int32_t> keys(g);
  const int64_t stride = record_bytes(g, bits, spikes);
  const float c = rotation_scale(g);
  for (int64_t k = 0; k < n_groups; ++k) {
    const typename T::Storage* group = xs + k * g;
    if (rotation != kRotationNone && g >= kLanes) {
      rotate_group<T>(group, g, c, masks.get(), nullptr, buf.data);
    } else {
      load_group<T>(group, g, buf.data);
      if (rotation != kRotationNone) rotate_small(buf.data, g, c, masks.get(), nullptr);
    }
    quantize_spiked_group(buf.data, g, bits, spikes, codes + k * stride, scale + k, zero + k,
                          keys.data);
  }
}

// Dequantize: plain groups straight into T; rotated groups fused per group; with spikes:
// decode, put the spikes back, rotate back, saturate, store.
template <typename T>
void DequantizeAs(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                  int64_t n_groups, int64_t g, int bits, int rotation, int spikes, void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  const SignMasks masks(rotation, g);
  if (spikes == 0 && rotation == kRotationNone) {
    return dequantize_groups<T>(codes, scale, zero, n_groups, g, bits, nullptr, ys);
  }
  Scratch<float> buf(g);
  if (spikes == 0) {
    return dequantize_groups_rotated<T>(codes, scale, zero, n_groups, g, bits, masks.get(),
                                        buf.data, ys);
  }
  const int64_t stride = record_bytes(g, bits, spikes);
  for (int64_t k = 0; k < n_groups; ++k) {
    decode_spiked_group(codes + k * stride, scale[k], zero[k], g, bits, spikes, false, nullptr,
                        buf.data);
    if (rotation != kRotationNone) unrotate_group(buf.data, g, masks.get());
    store_group<T>(buf.data, g, /*saturating=*/true, ys + k * g);
  }
}

// Sum over the chunk axis in order 0..n-1, in f32, of chunk c's group k, into buf.
// With spikes, each chunk's decoded group (spikes put back) is added through tmp.
void SumGroup(const PayloadView& in, int64_t batch, int64_t k, float* tmp, float* buf) {
  bool chunks_finite = true;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
    if (in.spikes > 0) {
      decode_spiked_group(in.codes + group * in.group_bytes, in.scale[group], in.zero[group],
                          in.group_size, in.bits, in.spikes, c > 0, tmp, buf);
    } else {
      decode_group(in.codes + group * in.group_bytes, in.scale[group], in.zero[group],
                   in.group_size, in.bits, c > 0, buf);
    }
    chunks_finite = chunks_finite && is_finite(bf16_to_float(in.scale[group]));
  }
  if (!chunks_finite) return;
  // The overflow fallback of codec.h (sum_shift): rare, so scalar, and skipped when no partial
  // sum can overflow: the chunks' decoded values are within [zero, top] of their group
  // (decoding is monotonic), and the magnitudes' sum, rounded up, stays below FLT_MAX.
  double bound = 0.0;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
    const GroupParams p = stored_params(in.scale[group], in.zero[group]);
    const double top = double(p.zero) + double(max_code(in.bits)) * double(p.scale);
    const double zero_mag = p.zero < 0.0f ? -double(p.zero) : double(p.zero);
    double mag = top > zero_mag ? top : zero_mag;
    const uint8_t* spikes = in.codes + group * in.group_bytes + group_bytes(in.group_size, in.bits);
    for (int j = 0; j < in.spikes; ++j) {  // spikes replace values: any finite bf16
      const double v = double(spike_value(spikes, j));
      mag = (v < 0.0 ? -v : v) > mag ? (v < 0.0 ? -v : v) : mag;
    }
    bound += mag;
  }
  if (bound * (1.0 + 1e-6) < double(kFltMax) / 2.0) return;
  const int s = sum_shift(in.chunks);
  const float down = pow2f(-s), up = pow2f(s);
  for (int64_t i = 0; i < in.group_size; i += kBlock) {
    bool overflowed = false;
    for (int j = 0; j < kBlock; ++j) overflowed = overflowed || !is_finite(buf[i + j]);
    if (!overflowed) continue;
    float scaled[kBlock] = {};
    for (int64_t c = 0; c < in.chunks; ++c) {
      const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
      const GroupParams p = stored_params(in.scale[group], in.zero[group]);
      float decoded[kBlock];
      decode_spiked_block(in.codes + group * in.group_bytes, p, in.group_size, in.bits,
                          in.spikes, i / kBlock, decoded);
      for (int j = 0; j < kBlock; ++j) {
        const float d = mul_rn(decoded[j], down);
        scaled[j] = c == 0 ? d : add_rn(scaled[j], d);
      }
    }
    for (int j = 0; j < kBlock; ++j) {
      if (!is_finite(buf[i + j])) buf[i + j] = mul_rn(scaled[j], up);
    }
  }
}

// Sums in the rotated domain; with rotation, the inverse rotation runs once on the sum.
template <typename T>
void DequantizeSumAs(const PayloadView& in, int rotation, void* y, int64_t begin, int64_t end) {
  auto* ys = static_cast<typename T::Storage*>(y);
  Scratch<float> buf(in.group_size), tmp(in.group_size);
  const SignMasks masks(rotation, in.group_size);
  for (int64_t o = begin; o < end; ++o) {  // o = b * groups_per_chunk + k
    SumGroup(in, o / in.groups_per_chunk, o % in.groups_per_chunk, tmp.data, buf.data);
    typename T::Storage* out = ys + o * in.group_size;
    if (rotation != kRotationNone) {
      unrotate_store_group<T>(buf.data, in.group_size, masks.get(), out);  // the store fused in
    } else {
      store_group<T>(buf.data, in.group_size, /*saturating=*/false, out);
    }
  }
}

void DequantizeSumQuantize(const PayloadView& in, int out_bits, int out_spikes, uint8_t* codes,
                           uint16_t* scale, uint16_t* zero, int64_t begin, int64_t end) {
  const int64_t out_nbytes = record_bytes(in.group_size, out_bits, out_spikes);
  const int64_t gpc = in.groups_per_chunk;
  if (out_spikes == 0) {
    constexpr int64_t kSumBatch = 16;
    Scratch<float> sums(kSumBatch * in.group_size), tmp(in.group_size);
    for (int64_t o0 = begin; o0 < end; o0 += kSumBatch) {  // o = b * groups_per_chunk + k
      const int64_t m = end - o0 < kSumBatch ? end - o0 : kSumBatch;
      for (int64_t i = 0; i < m; ++i) {
        SumGroup(in, (o0 + i) / gpc, (o0 + i) % gpc, tmp.data, sums.data + i * in.group_size);
      }
      quantize_groups<F32>(sums.data, m, in.group_size, out_bits, codes + o0 * out_nbytes,
                           scale + o0, zero + o0);
    }
    return;
  }
  Scratch<float> buf(in.group_size), tmp(in.group_size);
  Scratch<int32_t> keys(in.group_size);
  for (int64_t o = begin; o < end; ++o) {
    SumGroup(in, o / gpc, o % gpc, tmp.data, buf.data);
    quantize_spiked_group(buf.data, in.group_size, out_bits, out_spikes, codes + o * out_nbytes,
                          scale + o, zero + o, keys.data);
  }
}

template <typename T>
void DequantizeIntoAs(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                      int64_t g, int bits, int rotation, int spikes, int64_t count, void* out) {
  using S = typename T::Storage;
  S* y = static_cast<S*>(out);
  const int64_t full = count / g;
  const int64_t tail = count - full * g;
  const int64_t stride = record_bytes(g, bits, spikes);
  Scratch<S> last(tail > 0 ? g : 0);
  if (full > 0) DequantizeAs<T>(codes, scale, zero, full, g, bits, rotation, spikes, y);
  if (tail > 0) {
    DequantizeAs<T>(codes + full * stride, scale + full, zero + full, 1, g, bits, rotation,
                    spikes, last.data);
    std::memcpy(y + full * g, last.data, size_t(tail) * sizeof(S));
  }
}

// dtype dispatch of the templates above.
template <template <typename> class Op, typename... Args>
void ByDType(DType dtype, Args... args) {
  switch (dtype) {
    case DType::kF32: return Op<F32>::run(args...);
    case DType::kBF16: return Op<BF16>::run(args...);
    default: return Op<F16>::run(args...);
  }
}
template <typename T> struct QuantizeOp { template <typename... A> static void run(A... a) { QuantizeAs<T>(a...); } };
template <typename T> struct DequantizeOp { template <typename... A> static void run(A... a) { DequantizeAs<T>(a...); } };
template <typename T> struct DequantizeSumOp { template <typename... A> static void run(A... a) { DequantizeSumAs<T>(a...); } };
template <typename T> struct DequantizeIntoOp { template <typename... A> static void run(A... a) { DequantizeIntoAs<T>(a...); } };

void Quantize(DType dtype, const void* x, int64_t n_groups, int64_t g, int bits, int rotation,
              int spikes, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  ByDType<QuantizeOp>(dtype, x, n_groups, g, bits, rotation, spikes, codes, scale, zero);
}
void Dequantize(DType dtype, const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                int64_t n_groups, int64_t g, int bits, int rotation, int spikes, void* y) {
  ByDType<DequantizeOp>(dtype, codes, scale, zero, n_groups, g, bits, rotation, spikes, y);
}
void DequantizeSum(DType dtype, const PayloadView& in, int rotation, void* y, int64_t begin,
                   int64_t end) {
  ByDType<DequantizeSumOp>(dtype, in, rotation, y, begin, end);
}
void DequantizeInto(DType dtype, const uint8_t* codes, const uint16_t* scale,
                    const uint16_t* zero, int64_t g, int bits, int rotation, int spikes,
                    int64_t count, void* y) {
  ByDType<DequantizeIntoOp>(dtype, codes, scale, zero, g, bits, rotation, spikes, count, y);
}

}  // namespace

// This build's table (declared per ISA in ffi/cpu/dispatch.cc).
const CodecKernels& isa_kernels() {
  // The build's name: FLASHCOMM_ISA without its "isa_" prefix.
  static const CodecKernels table = {FC_STRING(FLASHCOMM_ISA) + 4, Quantize, Dequantize, DequantizeSum,
                                     DequantizeSumQuantize, DequantizeInto};
  return table;
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm
