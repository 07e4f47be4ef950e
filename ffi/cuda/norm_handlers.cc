// XLA FFI handlers of the fused all-reduce epilogue on CUDA (docs/fused_norm.md):
// flashcomm_add_rms_norm and flashcomm_add_rms_norm_quantize, with the operands, attributes and
// checks of the CPU handlers (ffi/cpu/norm_handlers.cc, flashcomm/norm_checks.h). They pick the
// kernel instance (dtype, weight dtype, spikes > 0) and call its launcher (launch.h); the kernel
// is in norm_kernels.cu. Plain C++: XLA's ffi.h is parsed by the host compiler only.
#include <cuda_runtime_api.h>

#include <cstdint>
#include <string>

#include "flashcomm/bindings.h"
#include "flashcomm/codec.h"
#include "handlers.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/norm_checks.h"
#include "launch.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

// Shared memory of a block is at most 227 KB (sm_90; 163 KB on sm_80): the row's groups.
constexpr size_t kMaxNormShared = 160 * 1024;

template <typename T, typename W>
cudaError_t LaunchFor(cudaStream_t stream, const NormLaunch& a, const void* res, const void* w,
                      void* new_res, void* out) {
  return a.spikes > 0 ? LaunchAddRmsNorm<T, W, true>(stream, a, res, w, new_res, out)
                      : LaunchAddRmsNorm<T, W, false>(stream, a, res, w, new_res, out);
}

template <typename T>
cudaError_t LaunchW(cudaStream_t stream, ffi::DataType wtype, const NormLaunch& a,
                    const void* res, const void* w, void* new_res, void* out) {
  return wtype == ffi::BF16 ? LaunchFor<T, BF16>(stream, a, res, w, new_res, out)
                            : LaunchFor<T, F32>(stream, a, res, w, new_res, out);
}

ffi::Error Launch(const char* op, cudaStream_t stream, const NormLaunch& a, ffi::AnyBuffer residual,
                  ffi::AnyBuffer weight, void* new_res, void* out) {
  if (a.rotation != kRotationNone && a.group_size > kMaxRotatedGroup) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": rotation needs group_size <= 1024 on CUDA");
  }
  if (NormSharedBytes(a.hidden, a.group_size) > kMaxNormShared) {
    return ffi::Error::InvalidArgument(std::string(op) + ": a row of " +
                                       std::to_string(a.hidden) +
                                       " values is too long for one block's shared memory");
  }
  const void* res = residual.untyped_data();
  const void* w = weight.untyped_data();
  const ffi::DataType wt = weight.element_type();
  cudaError_t err;
  switch (residual.element_type()) {
    case ffi::F32: err = LaunchW<F32>(stream, wt, a, res, w, new_res, out); break;
    case ffi::BF16: err = LaunchW<BF16>(stream, wt, a, res, w, new_res, out); break;
    default: err = LaunchW<F16>(stream, wt, a, res, w, new_res, out); break;
  }
  return LaunchStatus(op, err);
}

NormLaunch Args(U8Buf codes, Bf16Buf scale, Bf16Buf zero, const NormShape& shape,
                GroupFormat fmt, float eps) {
  NormLaunch a{};
  SetNormPayload(codes, scale, zero, fmt, &a);
  a.rows = shape.rows;
  a.hidden = shape.hidden;
  a.inv_h = 1.0f / float(shape.hidden);
  a.eps_h = mul_rn(eps, float(shape.hidden));
  return a;
}

}  // namespace

ffi::Error AddRmsNorm(cudaStream_t stream, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                      ffi::AnyBuffer residual, ffi::AnyBuffer weight, AnyOut new_residual,
                      AnyOut out, GroupFormat fmt, float eps) {
  constexpr const char* kOp = "flashcomm_add_rms_norm";
  NormShape shape;
  ffi::AnyBuffer out_buf = *out;
  if (ffi::Error e = CheckNormArgs(codes, scale, zero, residual, weight, *new_residual, &out_buf,
                                   fmt, eps, kOp, &shape);
      e.failure()) {
    return e;
  }
  const NormLaunch a = Args(codes, scale, zero, shape, fmt, eps);
  return Launch(kOp, stream, a, residual, weight, new_residual->untyped_data(),
                out->untyped_data());
}

ffi::Error AddRmsNormQuantize(cudaStream_t stream, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                              ffi::AnyBuffer residual, ffi::AnyBuffer weight, AnyOut new_residual,
                              U8Out out_codes, Bf16Out out_scale, Bf16Out out_zero, GroupFormat fmt,
                              float eps, GroupFormat out_fmt) {
  constexpr const char* kOp = "flashcomm_add_rms_norm_quantize";
  NormShape shape;
  if (ffi::Error e = CheckNormArgs(codes, scale, zero, residual, weight, *new_residual,
                                   static_cast<const ffi::AnyBuffer*>(nullptr), fmt, eps, kOp,
                                   &shape);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckNormQuantOut(shape, *out_codes, *out_scale, *out_zero, out_fmt, kOp);
      e.failure()) {
    return e;
  }
  NormLaunch a = Args(codes, scale, zero, shape, fmt, eps);
  a.out_bits = out_fmt.bits;
  a.out_group_size = out_fmt.group_size;
  a.out_codes = out_codes->typed_data();
  a.out_scale = reinterpret_cast<uint16_t*>(out_scale->typed_data());
  a.out_zero = reinterpret_cast<uint16_t*>(out_zero->typed_data());
  return Launch(kOp, stream, a, residual, weight, new_residual->untyped_data(), nullptr);
}

}  // namespace cuda
}  // namespace flashcomm

// One kernel launch per call on XLA's stream, nothing read from device memory on the host: a
// command buffer may capture it (as the codec handlers, codec_handlers.cc).
FLASHCOMM_CUDA_STREAM_HANDLER(AddRmsNorm, flashcomm::cuda::AddRmsNorm, AddRmsNorm);
FLASHCOMM_CUDA_STREAM_HANDLER(AddRmsNormQuantize, flashcomm::cuda::AddRmsNormQuantize,
                              AddRmsNormQuantize);


