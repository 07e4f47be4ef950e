// XLA FFI handlers of the floating-point group formats on CUDA (fp8, mxfp4, nvfp4): the same
// targets, operands, attributes and record layouts as the CPU handlers (ffi/cpu/fp_handlers.cc,
// docs/format.md "Floating-point formats"). They check the operands and call the launchers of
// fp_kernels.cu (launch.h). Plain C++ (host compiler, CUDA runtime API only).
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashcomm/bindings.h"
#include "flashcomm/codec.h"
#include "handlers.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/fp_checks.h"
#include "flashcomm/fp_codec.h"
#include "launch.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

// The group lives in shared memory: G <= kMaxRotatedGroup (1024) on CUDA.
ffi::Error CheckAttrs(const char* op, int32_t format, int64_t group_size, int32_t rotation,
                      int32_t spikes) {
  return CheckFpAttrs(op, format, group_size, rotation, spikes, kMaxRotatedGroup);
}

template <typename Launch>
ffi::Error ByDtype(ffi::DataType dtype, const char* op, Launch launch) {
  switch (dtype) {
    case ffi::F32: return LaunchStatus(op, launch(F32{}));
    case ffi::BF16: return LaunchStatus(op, launch(BF16{}));
    case ffi::F16: return LaunchStatus(op, launch(F16{}));
    default: return FpInvalid(op, "the operand must be f32, bf16 or f16");
  }
}

ffi::Error ViewChunks(const char* op, const U8Buf& records, int32_t format, int64_t group_size,
                      int32_t spikes, FpChunkArgs* in) {
  FpChunkShape shape;
  FLASHCOMM_RETURN_IF_FAILED(ViewFpChunks(op, records, format, group_size, spikes, &shape));
  *in = FpChunkArgs{shape.batch, shape.chunks, shape.groups_per_chunk, group_size, format,
                    spikes};
  return ffi::Error::Success();
}

ffi::Error FpQuantize(cudaStream_t stream, ffi::AnyBuffer x, U8Out records, GroupFormat fmt) {
  const int32_t format = fmt.format, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  const char* op = "flashcomm_fp_quantize";
  FLASHCOMM_RETURN_IF_FAILED(CheckAttrs(op, format, group_size, rotation, spikes));
  const int64_t n = int64_t(x.element_count());
  if (n % group_size != 0) return FpInvalid(op, "x must be whole groups");
  const int64_t n_groups = n / group_size;
  if (int64_t(records->element_count()) !=
      n_groups * fp_record_bytes(format, group_size, spikes)) {
    return FpInvalid(op, "records must hold one record per group");
  }
  return ByDtype(x.element_type(), op, [&](auto t) {
    return LaunchFpQuantize<decltype(t)>(stream, x.untyped_data(), n_groups, group_size, format,
                                         rotation, spikes, records->typed_data());
  });
}

ffi::Error FpDequantize(cudaStream_t stream, U8Buf records, AnyOut y, GroupFormat fmt) {
  const int32_t format = fmt.format, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  const char* op = "flashcomm_fp_dequantize";
  FLASHCOMM_RETURN_IF_FAILED(CheckAttrs(op, format, group_size, rotation, spikes));
  int64_t n_groups = 0;
  FLASHCOMM_RETURN_IF_FAILED(CheckFpDecode(op, records, *y, format, group_size, spikes, &n_groups));
  return ByDtype(y->element_type(), op, [&](auto t) {
    return LaunchFpDequantize<decltype(t)>(stream, records.typed_data(), n_groups, group_size,
                                           format, rotation, spikes, y->untyped_data());
  });
}

ffi::Error FpDequantizeSum(cudaStream_t stream, U8Buf records, AnyOut y, GroupFormat fmt) {
  const int32_t format = fmt.format, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  const char* op = "flashcomm_fp_dequantize_sum";
  FLASHCOMM_RETURN_IF_FAILED(CheckAttrs(op, format, group_size, rotation, spikes));
  FpChunkArgs in;
  FLASHCOMM_RETURN_IF_FAILED(ViewChunks(op, records, format, group_size, spikes, &in));
  if (int64_t(y->element_count()) != in.batch * in.groups_per_chunk * group_size) {
    return FpInvalid(op, "y has the wrong size");
  }
  return ByDtype(y->element_type(), op, [&](auto t) {
    return LaunchFpDequantizeSum<decltype(t)>(stream, records.typed_data(), in, rotation,
                                              y->untyped_data());
  });
}

ffi::Error FpDequantizeSumQuantize(cudaStream_t stream, U8Buf records, U8Out out, GroupFormat fmt,
                                   GroupFormat out_fmt) {
  const int32_t format = fmt.format, out_format = out_fmt.format;
  const int32_t spikes = fmt.spikes, out_spikes = out_fmt.spikes;
  const int64_t group_size = fmt.group_size;
  const char* op = "flashcomm_fp_dequantize_sum_quantize";
  FLASHCOMM_RETURN_IF_FAILED(CheckAttrs(op, format, group_size, 0, spikes));
  FLASHCOMM_RETURN_IF_FAILED(CheckAttrs(op, out_format, group_size, 0, out_spikes));
  FpChunkArgs in;
  FLASHCOMM_RETURN_IF_FAILED(ViewChunks(op, records, format, group_size, spikes, &in));
  if (int64_t(out->element_count()) !=
      in.batch * in.groups_per_chunk * fp_record_bytes(out_format, group_size, out_spikes)) {
    return FpInvalid(op, "the output must hold one record per group");
  }
  return LaunchStatus(op, LaunchFpDequantizeSumQuantize(stream, records.typed_data(), in,
                                                        out_format, out_spikes, out->typed_data()));
}

}  // namespace
}  // namespace cuda
}  // namespace flashcomm

FLASHCOMM_CODEC_FAMILY(FLASHCOMM_CUDA_STREAM_HANDLER, flashcomm::cuda, Fp, );


