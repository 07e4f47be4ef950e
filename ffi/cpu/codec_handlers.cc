// XLA FFI handlers of the codec on CPU: quantize, dequantize, dequantize_sum and
// dequantize_sum_quantize (docs/format.md). One handler per op: it checks shapes and
// attributes, then calls the instruction-set build chosen at load (cpu_dispatch.h,
// ffi/cpu/isa_kernels.cc). The arithmetic is in ffi/include/flashcomm/codec.h, shared with the
// CUDA kernels. Large calls are split over XLA's intra-op thread pool (cpu_parallel.h).
#include "cpu/handlers.h"

#include <cstdint>
#include <string>

#include "flashcomm/bindings.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_parallel.h"
#include "flashcomm/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {

ffi::Error Quantize(ffi::AnyBuffer x, U8Out codes, Bf16Out scale, Bf16Out zero, int32_t bits,
                    int64_t group_size, int32_t rotation, int32_t spikes, const Runner& runner) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckCodecOperands("flashcomm_quantize", x, *codes, *scale, *zero, bits,
                                        group_size, rotation, spikes, 0, "",
                                        &n_groups);
      e.failure()) {
    return e;
  }
  DType dtype;
  if (!ToDType(x.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument("flashcomm_quantize: x must be f32, bf16 or f16");
  }
  const int64_t item = int64_t(x.size_bytes()) / (n_groups > 0 ? n_groups : 1);
  const int64_t record = record_bytes(group_size, bits, spikes);
  const auto* xs = static_cast<const uint8_t*>(x.untyped_data());
  const size_t failed = runner.ForRangesStatus(n_groups, item, [&](int64_t b, int64_t e) {
    return kernels().quantize(dtype, xs + b * item, e - b, group_size, bits, rotation, spikes,
                              codes->typed_data() + b * record, scale->typed_data() + b,
                              zero->typed_data() + b);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError("flashcomm_quantize", failed);
}

ffi::Error Dequantize(U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y, int32_t bits,
                      int64_t group_size, int32_t rotation, int32_t spikes, const Runner& runner) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckCodecOperands("flashcomm_dequantize", *y, codes, scale, zero, bits,
                                        group_size, rotation, spikes, 0, "",
                                        &n_groups);
      e.failure()) {
    return e;
  }
  DType dtype;
  if (!ToDType(y->element_type(), &dtype)) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize: y must be f32, bf16 or f16");
  }
  const int64_t item = int64_t(y->size_bytes()) / (n_groups > 0 ? n_groups : 1);
  const int64_t record = record_bytes(group_size, bits, spikes);
  auto* ys = static_cast<uint8_t*>(y->untyped_data());
  const size_t failed = runner.ForRangesStatus(n_groups, item, [&](int64_t b, int64_t e) {
    return kernels().dequantize(dtype, codes.typed_data() + b * record, scale.typed_data() + b,
                                zero.typed_data() + b, e - b, group_size, bits, rotation,
                                spikes, ys + b * item);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError("flashcomm_dequantize", failed);
}

ffi::Error DequantizeSum(U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y, int32_t bits,
                         int64_t group_size, int32_t rotation, int32_t spikes,
                         const Runner& runner) {
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
  DType dtype;
  if (!ToDType(y->element_type(), &dtype)) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize_sum: y must be f32, bf16 or f16");
  }
  // An output group reads `chunks` input groups: its operand bytes, for the piece size.
  const int64_t item = in.chunks * in.group_size * 4;
  const size_t failed =
      runner.ForRangesStatus(in.batch * in.groups_per_chunk, item, [&](int64_t b, int64_t e) {
        return kernels().dequantize_sum(dtype, in, rotation, y->untyped_data(), b, e);
      });
  return failed == 0 ? ffi::Error::Success() : ScratchError("flashcomm_dequantize_sum", failed);
}

ffi::Error DequantizeSumQuantize(U8Buf codes, Bf16Buf scale, Bf16Buf zero, U8Out out_codes,
                                 Bf16Out out_scale, Bf16Out out_zero, int32_t bits,
                                 int32_t out_bits, int64_t group_size, int32_t spikes,
                                 int32_t out_spikes, const Runner& runner) {
  PayloadView in;
  int64_t n_out = 0;
  if (ffi::Error e = CheckSumQuantizeOperands(codes, scale, zero, *out_codes, *out_scale,
                                              *out_zero, bits, out_bits, group_size, spikes,
                                              out_spikes, &in, &n_out);
      e.failure()) {
    return e;
  }
  const int64_t item = in.chunks * in.group_size * 4;
  const size_t failed =
      runner.ForRangesStatus(in.batch * in.groups_per_chunk, item, [&](int64_t b, int64_t e) {
        return kernels().dequantize_sum_quantize(in, out_bits, out_spikes,
                                                 out_codes->typed_data(),
                                                 out_scale->typed_data(),
                                                 out_zero->typed_data(), b, e);
      });
  return failed == 0 ? ffi::Error::Success()
                     : ScratchError("flashcomm_dequantize_sum_quantize", failed);
}

namespace {

// The handlers proper: the pool XLA gives the call, then the op's own arguments (bindings.h).

ffi::Error QuantizeOnPool(ffi::ThreadPool pool, ffi::AnyBuffer x, U8Out codes, Bf16Out scale,
                          Bf16Out zero, GroupFormat fmt) {
  return Guarded("flashcomm_quantize", [&] {
    return Quantize(x, codes, scale, zero, fmt.bits, fmt.group_size, fmt.rotation, fmt.spikes,
                    PoolRunner(pool));
  });
}

constexpr char kDequantizeOp[] = "flashcomm_dequantize";
constexpr char kDequantizeSumOp[] = "flashcomm_dequantize_sum";

// dequantize and dequantize_sum: `F` on the pool, its errors named as op `kOp`'s.
template <decltype(&Dequantize) F, const char* kOp>
ffi::Error DecodeOnPool(ffi::ThreadPool pool, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                        AnyOut y, GroupFormat fmt) {
  return Guarded(kOp, [&] {
    return F(codes, scale, zero, y, fmt.bits, fmt.group_size, fmt.rotation, fmt.spikes,
             PoolRunner(pool));
  });
}

constexpr auto DequantizeOnPool = &DecodeOnPool<&Dequantize, kDequantizeOp>;
constexpr auto DequantizeSumOnPool = &DecodeOnPool<&DequantizeSum, kDequantizeSumOp>;

ffi::Error DequantizeSumQuantizeOnPool(ffi::ThreadPool pool, U8Buf codes, Bf16Buf scale,
                                       Bf16Buf zero, U8Out out_codes, Bf16Out out_scale,
                                       Bf16Out out_zero, GroupFormat fmt, GroupFormat out_fmt) {
  return Guarded("flashcomm_dequantize_sum_quantize", [&] {
    return DequantizeSumQuantize(codes, scale, zero, out_codes, out_scale, out_zero, fmt.bits,
                                 out_fmt.bits, fmt.group_size, fmt.spikes, out_fmt.spikes,
                                 PoolRunner(pool));
  });
}

}  // namespace
}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_CODEC_FAMILY(FLASHCOMM_CPU_POOL_HANDLER, flashcomm::cpu, , OnPool);

