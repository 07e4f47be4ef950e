// XLA FFI handlers of the codec on CUDA: quantize, dequantize, dequantize_sum and
// dequantize_sum_quantize, with the same targets, operands, attributes and layouts as the CPU
// handlers (ffi/cpu/codec_handlers.cc, docs/format.md). They check the operands, pick the
// kernel instance on the host (dtype, rotation, spikes > 0) and call its launcher (launch.h).
// The kernels live in codec_quantize.cu, codec_dequantize.cu and codec_dequantize_sum.cu;
// every codec operation there is a call into flashcomm/codec.h, so results are bit-identical
// to the CPU ones (docs/cuda.md).
//
// Plain C++ (host compiler, CUDA runtime API only): XLA's ffi.h is parsed once here instead of
// once per GPU architecture in every kernel file (docs/cuda.md, "Build time").
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashcomm/bindings.h"
#include "flashcomm/codec.h"
#include "handlers.h"
#include "flashcomm/ffi_checks.h"
#include "launch.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

// The CUDA kernels' limit on rotated groups, as the messages say it.
constexpr const char* kRotatedGroupNote = " of at most 1024 on CUDA";

// The rotation attribute with that limit.
ffi::Error CheckRotation(int32_t rotation, int64_t group_size, const char* op) {
  return flashcomm::CheckRotation(rotation, group_size, op, kMaxRotatedGroup, kRotatedGroupNote);
}

// The launcher of one (rotated?, spiked?) path for a runtime element type: calls
// launch(Tag<T>{}) with T = F32, BF16 or F16 and turns its cudaError_t into op's status.
template <typename T>
struct Tag {
  using type = T;
};

template <typename Launch>
ffi::Error ForDtype(ffi::DataType dtype, const char* op, const char* what, Launch launch) {
  switch (dtype) {
    case ffi::F32:
      return LaunchStatus(op, launch(Tag<F32>{}));
    case ffi::BF16:
      return LaunchStatus(op, launch(Tag<BF16>{}));
    case ffi::F16:
      return LaunchStatus(op, launch(Tag<F16>{}));
    default:
      return ffi::Error::InvalidArgument(what);
  }
}

}  // namespace

ffi::Error Quantize(cudaStream_t stream, ffi::AnyBuffer x, U8Out codes, Bf16Out scale, Bf16Out zero,
                    GroupFormat fmt) {
  const int32_t bits = fmt.bits, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  int64_t n_groups = 0;
  if (ffi::Error e = CheckCodecOperands("flashcomm_quantize", x, *codes, *scale, *zero, bits,
                                        group_size, rotation, spikes, kMaxRotatedGroup,
                                        kRotatedGroupNote, &n_groups);
      e.failure()) {
    return e;
  }
  uint8_t* c = codes->typed_data();
  uint16_t* s = scale->typed_data();
  uint16_t* z = zero->typed_data();
  const void* xd = x.untyped_data();
  return ForDtype(x.element_type(), "flashcomm_quantize",
                  "flashcomm_quantize: x must be f32, bf16 or f16", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchQuantizeRotated<T, true>(stream, xd, n_groups, group_size, bits,
                                                         rotation, spikes, c, s, z)
                        : LaunchQuantizeRotated<T, false>(stream, xd, n_groups, group_size,
                                                          bits, rotation, 0, c, s, z);
    }
    return spikes > 0 ? LaunchQuantize<T, true>(stream, xd, n_groups, group_size, bits, spikes,
                                                c, s, z)
                      : LaunchQuantize<T, false>(stream, xd, n_groups, group_size, bits, 0, c,
                                                 s, z);
  });
}

ffi::Error Dequantize(cudaStream_t stream, U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y,
                      GroupFormat fmt) {
  const int32_t bits = fmt.bits, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  int64_t n_groups = 0;
  if (ffi::Error e = CheckCodecOperands("flashcomm_dequantize", *y, codes, scale, zero, bits,
                                        group_size, rotation, spikes, kMaxRotatedGroup,
                                        kRotatedGroupNote, &n_groups);
      e.failure()) {
    return e;
  }
  const uint8_t* c = codes.typed_data();
  const uint16_t* s = scale.typed_data();
  const uint16_t* z = zero.typed_data();
  void* yd = y->untyped_data();
  return ForDtype(y->element_type(), "flashcomm_dequantize",
                  "flashcomm_dequantize: y must be f32, bf16 or f16", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchDequantizeRotated<T, true>(stream, c, s, z, n_groups,
                                                           group_size, bits, rotation, spikes,
                                                           yd)
                        : LaunchDequantizeRotated<T, false>(stream, c, s, z, n_groups,
                                                            group_size, bits, rotation, 0, yd);
    }
    return spikes > 0 ? LaunchDequantize<T, true>(stream, c, s, z, n_groups, group_size, bits,
                                                  spikes, yd)
                      : LaunchDequantize<T, false>(stream, c, s, z, n_groups, group_size, bits,
                                                   0, yd);
  });
}

ffi::Error DequantizeSum(cudaStream_t stream, U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y,
                         GroupFormat fmt) {
  const int32_t bits = fmt.bits, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  PayloadView in;
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, &in);
      e.failure()) {
    return e;
  }
  if (y->element_count() != size_t(in.batch * in.groups_per_chunk * group_size)) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize_sum: y has the wrong size");
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize_sum");
      e.failure()) {
    return e;
  }
  void* yd = y->untyped_data();
  return ForDtype(y->element_type(), "flashcomm_dequantize_sum",
                  "flashcomm_dequantize_sum: y must be f32, bf16 or f16", [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchDequantizeSumRotated<T, true>(stream, in, rotation, yd)
                        : LaunchDequantizeSumRotated<T, false>(stream, in, rotation, yd);
    }
    return spikes > 0 ? LaunchDequantizeSum<T, true>(stream, in, yd)
                      : LaunchDequantizeSum<T, false>(stream, in, yd);
  });
}

ffi::Error DequantizeSumQuantize(cudaStream_t stream, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                                 U8Out out_codes, Bf16Out out_scale, Bf16Out out_zero,
                                 GroupFormat fmt, GroupFormat out_fmt) {
  PayloadView in;
  int64_t n_out = 0;
  if (ffi::Error e = CheckSumQuantizeOperands(codes, scale, zero, *out_codes, *out_scale,
                                              *out_zero, fmt.bits, out_fmt.bits, fmt.group_size,
                                              fmt.spikes, out_fmt.spikes, &in, &n_out);
      e.failure()) {
    return e;
  }
  const int32_t spikes = fmt.spikes, out_bits = out_fmt.bits, out_spikes = out_fmt.spikes;
  uint8_t* c = out_codes->typed_data();
  uint16_t* s = out_scale->typed_data();
  uint16_t* z = out_zero->typed_data();
  const auto launch = spikes > 0 ? (out_spikes > 0 ? LaunchDequantizeSumQuantize<true, true>
                                                   : LaunchDequantizeSumQuantize<true, false>)
                                 : (out_spikes > 0 ? LaunchDequantizeSumQuantize<false, true>
                                                   : LaunchDequantizeSumQuantize<false, false>);
  return LaunchStatus("flashcomm_dequantize_sum_quantize",
                      launch(stream, in, n_out, out_bits, out_spikes, c, s, z));
}

}  // namespace cuda
}  // namespace flashcomm

// Command buffers (CUDA graphs): each handler declares kCmdBufferCompatible, so XLA may capture
// it into a graph. What a call enqueues depends only on what XLA fixes for the executable or
// keys its captured graphs by: the attributes and shapes (compile time) and the buffers'
// device addresses (the 16-byte alignment test picks a kernel's vector path; XLA traces a
// custom call again when an address changes). No handler reads device memory or host state
// at run time, allocates, synchronizes or queries the stream: one kernel launch (or none, for
// an empty operand) per call, on XLA's stream. docs/cuda.md, "Command buffers".
FLASHCOMM_CODEC_FAMILY(FLASHCOMM_CUDA_STREAM_HANDLER, flashcomm::cuda, , );


