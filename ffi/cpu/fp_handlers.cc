// XLA FFI handlers of the floating-point group formats on CPU (fp8, mxfp4, nvfp4;
// docs/format.md, "Floating-point formats"): fp_quantize, fp_dequantize, fp_dequantize_sum and
// fp_dequantize_sum_quantize. Each checks shapes and attributes, then calls the
// instruction-set build chosen at load (cpu_dispatch.h, ffi/cpu/isa_kernels.cc, cpu_fp.h);
// large calls are split over XLA's intra-op pool. A record holds a whole group: element codes,
// scales, spike record (fp_codec.h).
#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/handlers.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_parallel.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/fp_checks.h"
#include "flashcomm/fp_codec.h"
#include "flashcomm/bindings.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

// Records (..., N, groups, record bytes) as chunks for the sums.
ffi::Error ViewChunks(const char* op, const U8Buf& codes, int32_t format, int64_t group_size,
                      int32_t spikes, FpChunks* in) {
  FpChunkShape shape;
  FLASHCOMM_RETURN_IF_FAILED(ViewFpChunks(op, codes, format, group_size, spikes, &shape));
  *in = FpChunks{codes.typed_data(), shape.batch, shape.chunks, shape.groups_per_chunk,
                 group_size, format, spikes};
  return ffi::Error::Success();
}

// The attributes, then the dtype of operand or result `what`: f32, bf16 or f16.
ffi::Error CheckAttrsAndDType(const char* op, int32_t format, int64_t group_size, int32_t rotation,
                              int32_t spikes, ffi::DataType type, const char* what, DType* dtype) {
  FLASHCOMM_RETURN_IF_FAILED(CheckFpAttrs(op, format, group_size, rotation, spikes));
  if (!ToDType(type, dtype)) return FpInvalid(op, std::string(what) + " must be f32, bf16 or f16");
  return ffi::Error::Success();
}

ffi::Error FpQuantize(ffi::AnyBuffer x, U8Out records, int32_t format, int64_t group_size,
                      int32_t rotation, int32_t spikes, const Runner& runner) {
  const char* op = "flashcomm_fp_quantize";
  DType dtype;
  FLASHCOMM_RETURN_IF_FAILED(
      CheckAttrsAndDType(op, format, group_size, rotation, spikes, x.element_type(), "x", &dtype));
  const int64_t n = int64_t(x.element_count());
  if (n % group_size != 0) return FpInvalid(op, "x must be whole groups");
  const int64_t n_groups = n / group_size, stride = fp_record_bytes(format, group_size, spikes);
  if (int64_t(records->element_count()) != n_groups * stride) {
    return FpInvalid(op, "records must hold " + std::to_string(stride) + " bytes per group");
  }
  const int64_t item = n_groups > 0 ? int64_t(x.size_bytes()) / n_groups : 1;
  const auto* xs = static_cast<const uint8_t*>(x.untyped_data());
  const size_t failed = runner.ForRangesStatus(n_groups, item, [&](int64_t b, int64_t e) {
    return kernels().fp_quantize(dtype, xs + b * item, e - b, group_size, format, rotation,
                                 spikes, records->typed_data() + b * stride);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(op, failed);
}

ffi::Error FpDequantize(U8Buf records, AnyOut y, int32_t format, int64_t group_size,
                        int32_t rotation, int32_t spikes, const Runner& runner) {
  const char* op = "flashcomm_fp_dequantize";
  DType dtype;
  FLASHCOMM_RETURN_IF_FAILED(
      CheckAttrsAndDType(op, format, group_size, rotation, spikes, y->element_type(), "y", &dtype));
  const int64_t stride = fp_record_bytes(format, group_size, spikes);
  int64_t n_groups = 0;
  FLASHCOMM_RETURN_IF_FAILED(CheckFpDecode(op, records, *y, format, group_size, spikes, &n_groups));
  const int64_t esize = y->element_count() > 0 ? int64_t(y->size_bytes() / y->element_count()) : 4;
  const int64_t item = group_size * esize;
  auto* ys = static_cast<uint8_t*>(y->untyped_data());
  const size_t failed = runner.ForRangesStatus(n_groups, item, [&](int64_t b, int64_t e) {
    return kernels().fp_dequantize(dtype, records.typed_data() + b * stride, e - b, group_size,
                                   format, rotation, spikes, ys + b * item);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(op, failed);
}

ffi::Error FpDequantizeSum(U8Buf records, AnyOut y, int32_t format, int64_t group_size,
                           int32_t rotation, int32_t spikes, const Runner& runner) {
  const char* op = "flashcomm_fp_dequantize_sum";
  FLASHCOMM_RETURN_IF_FAILED(CheckFpAttrs(op, format, group_size, rotation, spikes));
  FpChunks in;
  FLASHCOMM_RETURN_IF_FAILED(ViewChunks(op, records, format, group_size, spikes, &in));
  DType dtype;
  if (!ToDType(y->element_type(), &dtype)) return FpInvalid(op, "y must be f32, bf16 or f16");
  const int64_t n_out = in.batch * in.groups_per_chunk;
  if (int64_t(y->element_count()) != n_out * group_size) {
    return FpInvalid(op, "y has the wrong size");
  }
  const size_t failed = runner.ForRangesStatus(n_out, in.chunks * group_size * 4,
                                               [&](int64_t b, int64_t e) {
    return kernels().fp_dequantize_sum(dtype, in, rotation, y->untyped_data(), b, e);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(op, failed);
}

ffi::Error FpDequantizeSumQuantize(U8Buf records, U8Out out, int32_t format, int32_t out_format,
                                   int64_t group_size, int32_t spikes, int32_t out_spikes,
                                   const Runner& runner) {
  const char* op = "flashcomm_fp_dequantize_sum_quantize";
  FLASHCOMM_RETURN_IF_FAILED(CheckFpAttrs(op, format, group_size, 0, spikes));
  FLASHCOMM_RETURN_IF_FAILED(CheckFpAttrs(op, out_format, group_size, 0, out_spikes));
  FpChunks in;
  FLASHCOMM_RETURN_IF_FAILED(ViewChunks(op, records, format, group_size, spikes, &in));
  const int64_t n_out = in.batch * in.groups_per_chunk;
  const int64_t stride = fp_record_bytes(out_format, group_size, out_spikes);
  if (int64_t(out->element_count()) != n_out * stride) {
    return FpInvalid(op, "the output must hold " + std::to_string(stride) + " bytes per group");
  }
  const size_t failed = runner.ForRangesStatus(n_out, in.chunks * group_size * 4,
                                               [&](int64_t b, int64_t e) {
    return kernels().fp_dequantize_sum_quantize(in, out_format, out_spikes,
                                                out->typed_data(), b, e);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(op, failed);
}

ffi::Error FpQuantizeOnPool(ffi::ThreadPool pool, ffi::AnyBuffer x, U8Out records,
                            GroupFormat fmt) {
  return Guarded("flashcomm_fp_quantize", [&] {
    return FpQuantize(x, records, fmt.format, fmt.group_size, fmt.rotation, fmt.spikes,
                      PoolRunner(pool));
  });
}

ffi::Error FpDequantizeOnPool(ffi::ThreadPool pool, U8Buf records, AnyOut y, GroupFormat fmt) {
  return Guarded("flashcomm_fp_dequantize", [&] {
    return FpDequantize(records, y, fmt.format, fmt.group_size, fmt.rotation, fmt.spikes,
                        PoolRunner(pool));
  });
}

ffi::Error FpDequantizeSumOnPool(ffi::ThreadPool pool, U8Buf records, AnyOut y, GroupFormat fmt) {
  return Guarded("flashcomm_fp_dequantize_sum", [&] {
    return FpDequantizeSum(records, y, fmt.format, fmt.group_size, fmt.rotation, fmt.spikes,
                           PoolRunner(pool));
  });
}

ffi::Error FpDequantizeSumQuantizeOnPool(ffi::ThreadPool pool, U8Buf records, U8Out out,
                                         GroupFormat fmt, GroupFormat out_fmt) {
  return Guarded("flashcomm_fp_dequantize_sum_quantize", [&] {
    return FpDequantizeSumQuantize(records, out, fmt.format, out_fmt.format, fmt.group_size,
                                   fmt.spikes, out_fmt.spikes, PoolRunner(pool));
  });
}

}  // namespace
}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_CODEC_FAMILY(FLASHCOMM_CPU_POOL_HANDLER, flashcomm::cpu, Fp, OnPool);

