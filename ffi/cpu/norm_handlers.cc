// XLA FFI handlers of the fused all-reduce epilogue on CPU (docs/fused_norm.md):
// flashcomm_add_rms_norm (gathered payload + residual -> new residual, RMSNorm(new residual) *
// weight) and flashcomm_add_rms_norm_quantize (the same, the normalised rows quantized instead
// of written). The handler checks shapes (norm_checks.h), then runs the instruction-set build
// chosen at load (cpu_dispatch.h) over rows split across XLA's intra-op pool.
#include <cstdint>

#include "cpu/cpu_dispatch.h"
#include "cpu/handlers.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_parallel.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/norm_checks.h"
#include "flashcomm/bindings.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

ffi::Error Run(const char* op, const NormShape& shape, NormArgs args, int64_t item,
               const Runner& runner) {
  const size_t failed = runner.ForRangesStatus(shape.rows, item, [&](int64_t b, int64_t e) {
    return kernels().add_rms_norm(args, b, e);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(op, failed);
}

NormArgs Args(U8Buf codes, Bf16Buf scale, Bf16Buf zero, ffi::AnyBuffer residual,
              ffi::AnyBuffer weight, ffi::AnyBuffer new_residual, const GroupFormat& fmt,
              float eps, int64_t hidden) {
  NormArgs a{};
  ToDType(residual.element_type(), &a.dtype);
  a.wtype = weight.element_type() == ffi::DataType::BF16 ? DType::kBF16 : DType::kF32;
  SetNormPayload(codes, scale, zero, fmt, &a);
  a.residual = residual.untyped_data();
  a.weight = weight.untyped_data();
  a.hidden = hidden;
  a.eps = eps;
  a.new_residual = new_residual.untyped_data();
  return a;
}

ffi::Error AddRmsNorm(ffi::ThreadPool pool, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                      ffi::AnyBuffer residual, ffi::AnyBuffer weight, AnyOut new_residual,
                      AnyOut out, GroupFormat fmt, float eps) {
  constexpr const char* kOp = "flashcomm_add_rms_norm";
  return Guarded(kOp, [&] {
    NormShape shape;
    ffi::AnyBuffer out_buf = *out;
    if (ffi::Error e = CheckNormArgs(codes, scale, zero, residual, weight, *new_residual,
                                     &out_buf, fmt, eps, kOp,
                                     &shape);
        e.failure()) {
      return e;
    }
    NormArgs a = Args(codes, scale, zero, residual, weight, *new_residual, fmt, eps, shape.hidden);
    a.out = out->untyped_data();
    const int64_t item = shape.rows > 0 ? int64_t(residual.size_bytes()) / shape.rows : 0;
    return Run(kOp, shape, a, item, PoolRunner(pool));
  });
}

ffi::Error AddRmsNormQuantize(ffi::ThreadPool pool, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                              ffi::AnyBuffer residual, ffi::AnyBuffer weight, AnyOut new_residual,
                              U8Out out_codes, Bf16Out out_scale, Bf16Out out_zero, GroupFormat fmt,
                              float eps, GroupFormat out_fmt) {
  constexpr const char* kOp = "flashcomm_add_rms_norm_quantize";
  return Guarded(kOp, [&] {
    NormShape shape;
    if (ffi::Error e = CheckNormArgs(codes, scale, zero, residual, weight, *new_residual,
                                     static_cast<const ffi::AnyBuffer*>(nullptr), fmt, eps,
                                     kOp, &shape);
        e.failure()) {
      return e;
    }
    if (ffi::Error e = CheckNormQuantOut(shape, *out_codes, *out_scale, *out_zero, out_fmt, kOp);
        e.failure()) {
      return e;
    }
    NormArgs a = Args(codes, scale, zero, residual, weight, *new_residual, fmt, eps, shape.hidden);
    a.out_bits = out_fmt.bits;
    a.out_group_size = out_fmt.group_size;
    a.out_codes = out_codes->typed_data();
    a.out_scale = reinterpret_cast<uint16_t*>(out_scale->typed_data());
    a.out_zero = reinterpret_cast<uint16_t*>(out_zero->typed_data());
    const int64_t item = shape.rows > 0 ? int64_t(residual.size_bytes()) / shape.rows : 0;
    return Run(kOp, shape, a, item, PoolRunner(pool));
  });
}

}  // namespace
}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_CPU_POOL_HANDLER(AddRmsNorm, flashcomm::cpu::AddRmsNorm, AddRmsNorm);
FLASHCOMM_CPU_POOL_HANDLER(AddRmsNormQuantize, flashcomm::cpu::AddRmsNormQuantize,
                           AddRmsNormQuantize);

