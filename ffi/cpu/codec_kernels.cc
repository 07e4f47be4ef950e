// XLA FFI handlers of the codec on CPU: quantize, dequantize, dequantize_sum and
// dequantize_sum_quantize (docs/format.md). One handler per op; the arithmetic is in
// ffi/include/flashcomm/codec.h, shared with the CUDA kernels.
#include "flashcomm/cpu_kernels.h"

#include <cstdint>
#include <string>
#include <vector>

#include "flashcomm/cpu_codec.h"
#include "flashcomm/cpu_ops.h"
#include "flashcomm/cpu_spikes.h"
#include "flashcomm/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

template <typename T>
void QuantizeAll(const void* x, int64_t n_groups, int64_t g, int bits, uint8_t* codes,
                 uint16_t* scale, uint16_t* zero) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  quantize_groups<T>(xs, n_groups, g, bits, codes, scale, zero);
}

// Rotation attribute: 0 (none), 1 (Hadamard) or 2 (signed Hadamard); G a power of two.
ffi::Error CheckRotation(int32_t rotation, int64_t group_size, const char* op) {
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rotation must be 0, 1 or 2");
  }
  if (rotation != kRotationNone && (group_size & (group_size - 1)) != 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": rotation needs a power-of-two group_size");
  }
  return ffi::Error::Success();
}

// Sign masks of rotation 2 (empty otherwise).
std::vector<uint32_t> SignMasks(int32_t rotation, int64_t g) {
  std::vector<uint32_t> masks;
  if (rotation == kRotationSignedHadamard) {
    masks.resize(static_cast<size_t>(g));
    rotation_sign_masks(g, masks.data());
  }
  return masks;
}

template <typename T>
void QuantizeAllRotated(const void* x, int64_t n_groups, int64_t g, int bits, int32_t rotation,
                        uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  const std::vector<uint32_t> masks = SignMasks(rotation, g);
  std::vector<float> buf(static_cast<size_t>(g));
  quantize_groups_rotated<T>(xs, n_groups, g, bits, masks.empty() ? nullptr : masks.data(),
                             buf.data(), codes, scale, zero);
}

// Dequantize rotated groups: decode, inverse rotation, saturate and store, fused per group
// (cpu_codec.h dequantize_groups_rotated).
template <typename T>
void DequantizeAllRotated(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                          int64_t n_groups, int64_t g, int bits, int32_t rotation, void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  const std::vector<uint32_t> masks = SignMasks(rotation, g);
  const uint32_t* m = masks.empty() ? nullptr : masks.data();
  std::vector<float> buf(static_cast<size_t>(g));
  dequantize_groups_rotated<T>(codes, scale, zero, n_groups, g, bits, m, buf.data(), ys);
}

template <typename T>
void DequantizeAll(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                   int64_t n_groups, int64_t g, int bits, void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  std::vector<float> buf(static_cast<size_t>(g));
  dequantize_groups<T>(codes, scale, zero, n_groups, g, bits, buf.data(), ys);
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
  // The overflow fallback of codec.h (sum_shift): rare, so scalar.
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
void DequantizeSumAll(const PayloadView& in, int32_t rotation, void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  std::vector<float> buf(static_cast<size_t>(in.group_size)), tmp(buf.size());
  const std::vector<uint32_t> masks = SignMasks(rotation, in.group_size);
  const uint32_t* m = masks.empty() ? nullptr : masks.data();
  for (int64_t b = 0; b < in.batch; ++b) {
    for (int64_t k = 0; k < in.groups_per_chunk; ++k) {
      SumGroup(in, b, k, tmp.data(), buf.data());
      typename T::Storage* out = ys + (b * in.groups_per_chunk + k) * in.group_size;
      if (rotation != kRotationNone) {
        unrotate_store_group<T>(buf.data(), in.group_size, m, out);  // the store fused in
      } else {
        store_group<T>(buf.data(), in.group_size, /*saturating=*/false, out);
      }
    }
  }
}


// Quantize with k spikes per group (any rotation): each group is widened (and rotated) into
// buf, then quantize_spiked_group writes its record.
template <typename T>
void QuantizeAllSpiked(const void* x, int64_t n_groups, int64_t g, int bits, int32_t rotation,
                       int spikes, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  const std::vector<uint32_t> masks = SignMasks(rotation, g);
  const uint32_t* m = masks.empty() ? nullptr : masks.data();
  std::vector<float> buf(static_cast<size_t>(g));
  const int64_t stride = record_bytes(g, bits, spikes);
  const float c = rotation_scale(g);
  for (int64_t k = 0; k < n_groups; ++k) {
    const typename T::Storage* group = xs + k * g;
    if (rotation != kRotationNone && g >= kLanes) {
      rotate_group<T>(group, g, c, m, nullptr, buf.data());
    } else {
      load_group<T>(group, g, buf.data());
      if (rotation != kRotationNone) rotate_small(buf.data(), g, c, m, nullptr);
    }
    quantize_spiked_group(buf.data(), g, bits, spikes, codes + k * stride, scale + k, zero + k);
  }
}

// Dequantize with k spikes per group: decode, put the spikes back, rotate back, saturate, store.
template <typename T>
void DequantizeAllSpiked(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                         int64_t n_groups, int64_t g, int bits, int32_t rotation, int spikes,
                         void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  const std::vector<uint32_t> masks = SignMasks(rotation, g);
  const uint32_t* m = masks.empty() ? nullptr : masks.data();
  std::vector<float> buf(static_cast<size_t>(g));
  const int64_t stride = record_bytes(g, bits, spikes);
  for (int64_t k = 0; k < n_groups; ++k) {
    decode_spiked_group(codes + k * stride, scale[k], zero[k], g, bits, spikes, false, nullptr,
                        buf.data());
    if (rotation != kRotationNone) unrotate_group(buf.data(), g, m);
    store_group<T>(buf.data(), g, /*saturating=*/true, ys + k * g);
  }
}

}  // namespace

ffi::Error Quantize(ffi::AnyBuffer x, ffi::Result<ffi::Buffer<ffi::U8>> codes,
                    ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                    ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                    int64_t group_size, int32_t rotation, int32_t spikes) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, *codes, *scale, *zero, bits, group_size, spikes,
                                         &n_groups);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_quantize"); e.failure()) {
    return e;
  }
  uint8_t* c = codes->typed_data();
  uint16_t* s = scale->typed_data();
  uint16_t* z = zero->typed_data();
  if (spikes > 0) {
    const void* xs = x.untyped_data();
    switch (x.element_type()) {
      case ffi::F32:
        QuantizeAllSpiked<F32>(xs, n_groups, group_size, bits, rotation, spikes, c, s, z);
        return ffi::Error::Success();
      case ffi::BF16:
        QuantizeAllSpiked<BF16>(xs, n_groups, group_size, bits, rotation, spikes, c, s, z);
        return ffi::Error::Success();
      case ffi::F16:
        QuantizeAllSpiked<F16>(xs, n_groups, group_size, bits, rotation, spikes, c, s, z);
        return ffi::Error::Success();
      default:
        return ffi::Error::InvalidArgument("flashcomm_quantize: x must be f32, bf16 or f16");
    }
  }
  if (rotation != kRotationNone) {
    switch (x.element_type()) {
      case ffi::F32:
        QuantizeAllRotated<F32>(x.untyped_data(), n_groups, group_size, bits, rotation, c, s, z);
        return ffi::Error::Success();
      case ffi::BF16:
        QuantizeAllRotated<BF16>(x.untyped_data(), n_groups, group_size, bits, rotation, c, s,
                                 z);
        return ffi::Error::Success();
      case ffi::F16:
        QuantizeAllRotated<F16>(x.untyped_data(), n_groups, group_size, bits, rotation, c, s, z);
        return ffi::Error::Success();
      default:
        return ffi::Error::InvalidArgument("flashcomm_quantize: x must be f32, bf16 or f16");
    }
  }
  switch (x.element_type()) {
    case ffi::F32:
      QuantizeAll<F32>(x.untyped_data(), n_groups, group_size, bits, c, s, z);
      return ffi::Error::Success();
    case ffi::BF16:
      QuantizeAll<BF16>(x.untyped_data(), n_groups, group_size, bits, c, s, z);
      return ffi::Error::Success();
    case ffi::F16:
      QuantizeAll<F16>(x.untyped_data(), n_groups, group_size, bits, c, s, z);
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("flashcomm_quantize: x must be f32, bf16 or f16");
  }
}

ffi::Error Dequantize(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::BF16> scale,
                      ffi::Buffer<ffi::BF16> zero, ffi::Result<ffi::AnyBuffer> y, int32_t bits,
                      int64_t group_size, int32_t rotation, int32_t spikes) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckDequantizeShapes(codes, scale, zero, *y, bits, group_size, spikes,
                                           &n_groups);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize"); e.failure()) {
    return e;
  }
  const uint8_t* c = codes.typed_data();
  const uint16_t* s = scale.typed_data();
  const uint16_t* z = zero.typed_data();
  if (spikes > 0) {
    void* out = y->untyped_data();
    switch (y->element_type()) {
      case ffi::F32:
        DequantizeAllSpiked<F32>(c, s, z, n_groups, group_size, bits, rotation, spikes, out);
        return ffi::Error::Success();
      case ffi::BF16:
        DequantizeAllSpiked<BF16>(c, s, z, n_groups, group_size, bits, rotation, spikes, out);
        return ffi::Error::Success();
      case ffi::F16:
        DequantizeAllSpiked<F16>(c, s, z, n_groups, group_size, bits, rotation, spikes, out);
        return ffi::Error::Success();
      default:
        return ffi::Error::InvalidArgument("flashcomm_dequantize: y must be f32, bf16 or f16");
    }
  }
  if (rotation != kRotationNone) {
    void* out = y->untyped_data();
    switch (y->element_type()) {
      case ffi::F32:
        DequantizeAllRotated<F32>(c, s, z, n_groups, group_size, bits, rotation, out);
        return ffi::Error::Success();
      case ffi::BF16:
        DequantizeAllRotated<BF16>(c, s, z, n_groups, group_size, bits, rotation, out);
        return ffi::Error::Success();
      case ffi::F16:
        DequantizeAllRotated<F16>(c, s, z, n_groups, group_size, bits, rotation, out);
        return ffi::Error::Success();
      default:
        return ffi::Error::InvalidArgument("flashcomm_dequantize: y must be f32, bf16 or f16");
    }
  }
  switch (y->element_type()) {
    case ffi::F32:
      DequantizeAll<F32>(c, s, z, n_groups, group_size, bits, y->untyped_data());
      return ffi::Error::Success();
    case ffi::BF16:
      DequantizeAll<BF16>(c, s, z, n_groups, group_size, bits, y->untyped_data());
      return ffi::Error::Success();
    case ffi::F16:
      DequantizeAll<F16>(c, s, z, n_groups, group_size, bits, y->untyped_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("flashcomm_dequantize: y must be f32, bf16 or f16");
  }
}

ffi::Error DequantizeSum(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::BF16> scale,
                         ffi::Buffer<ffi::BF16> zero, ffi::Result<ffi::AnyBuffer> y,
                         int32_t bits, int64_t group_size, int32_t rotation, int32_t spikes) {
  PayloadView in;
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, &in);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize_sum");
      e.failure()) {
    return e;
  }
  if (y->element_count() != size_t(in.batch * in.groups_per_chunk * group_size)) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize_sum: y has the wrong size");
  }
  switch (y->element_type()) {
    case ffi::F32:
      DequantizeSumAll<F32>(in, rotation, y->untyped_data());
      return ffi::Error::Success();
    case ffi::BF16:
      DequantizeSumAll<BF16>(in, rotation, y->untyped_data());
      return ffi::Error::Success();
    case ffi::F16:
      DequantizeSumAll<F16>(in, rotation, y->untyped_data());
      return ffi::Error::Success();
    default:
      return ffi::Error::InvalidArgument("flashcomm_dequantize_sum: y must be f32, bf16 or f16");
  }
}

ffi::Error DequantizeSumQuantize(ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::BF16> scale,
                                 ffi::Buffer<ffi::BF16> zero,
                                 ffi::Result<ffi::Buffer<ffi::U8>> out_codes,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> out_scale,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> out_zero, int32_t bits,
                                 int32_t out_bits, int64_t group_size, int32_t spikes) {
  PayloadView in;
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, &in);
      e.failure()) {
    return e;
  }
  int64_t n_out = 0;
  if (ffi::Error e = CheckSumQuantizeOutputs(in, *out_codes, *out_scale, *out_zero, out_bits,
                                             &n_out);
      e.failure()) {
    return e;
  }
  const int64_t out_nbytes = record_bytes(group_size, out_bits, spikes);
  std::vector<float> buf(static_cast<size_t>(group_size)), tmp(buf.size());
  for (int64_t b = 0; b < in.batch; ++b) {
    for (int64_t k = 0; k < in.groups_per_chunk; ++k) {
      SumGroup(in, b, k, tmp.data(), buf.data());
      const int64_t o = b * in.groups_per_chunk + k;
      uint8_t* rec = out_codes->typed_data() + o * out_nbytes;
      uint16_t* s = out_scale->typed_data() + o;
      uint16_t* z = out_zero->typed_data() + o;
      if (spikes > 0) {
        quantize_spiked_group(buf.data(), group_size, out_bits, spikes, rec, s, z);
      } else {
        quantize_group(buf.data(), group_size, out_bits, rec, s, z);
      }
    }
  }
  return ffi::Error::Success();
}

}  // namespace cpu
}  // namespace flashcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommQuantizeCpu, flashcomm::cpu::Quantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()              // x: (..., group_size)
                                  .Ret<ffi::Buffer<ffi::U8>>()        // codes: (..., group bytes)
                                  .Ret<ffi::Buffer<ffi::BF16>>()      // scale: (...)
                                  .Ret<ffi::Buffer<ffi::BF16>>()      // zero: (...)
                                  .Attr<int32_t>("bits")              // code width, 2..8
                                  .Attr<int64_t>("group_size")        // multiple of 8
                                  .Attr<int32_t>("rotation")          // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));          // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeCpu, flashcomm::cpu::Dequantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()        // codes: (..., group bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()      // scale: (...)
                                  .Arg<ffi::Buffer<ffi::BF16>>()      // zero: (...)
                                  .Ret<ffi::AnyBuffer>()              // y: (..., group_size)
                                  .Attr<int32_t>("bits")              // code width, 2..8
                                  .Attr<int64_t>("group_size")        // multiple of 8
                                  .Attr<int32_t>("rotation")          // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));          // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeSumCpu, flashcomm::cpu::DequantizeSum,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes: (..., N, G/chunk, bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // scale: (..., N, G/chunk)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // zero: (..., N, G/chunk)
                                  .Ret<ffi::AnyBuffer>()          // y: (..., G/chunk * group_size)
                                  .Attr<int32_t>("bits")          // code width of the input
                                  .Attr<int64_t>("group_size")    // multiple of 8
                                  .Attr<int32_t>("rotation")      // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));      // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeSumQuantizeCpu,
                              flashcomm::cpu::DequantizeSumQuantize,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes: (..., N, G/chunk, bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // scale: (..., N, G/chunk)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // zero: (..., N, G/chunk)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // codes: (..., G/chunk, bytes')
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // scale: (..., G/chunk)
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // zero: (..., G/chunk)
                                  .Attr<int32_t>("bits")          // code width of the input
                                  .Attr<int32_t>("out_bits")      // code width of the output
                                  .Attr<int64_t>("group_size")    // multiple of 8
                                  .Attr<int32_t>("spikes"));      // in and out, 0..16
