// XLA FFI handler of flashcomm_dequantize_into on CPU: decode one payload (one chunk of a
// gather) straight into a slot of a larger output buffer, in place (the output is aliased to
// operand 0), so a ring all-gather can fill its output one received payload at a time without
// a receive buffer of N payloads or a dynamic-update-slice over the output.
//
// The values written are those of flashcomm_dequantize of the same payload (the same
// per-group functions of cpu_codec.h / cpu_spikes.h, rotation and spikes included), cut to the
// chunk's `count` elements (the payload's zero padding is dropped) and stored at the element
// offset given by a runtime int32 scalar operand. An offset that would put the chunk out of
// bounds is an InvalidArgument error: nothing is written.
#include "cpu/cpu_gather.h"

#include <cstdint>
#include <cstring>
#include <string>

#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/handlers.h"
#include "cpu/cpu_ops.h"
#include "cpu/cpu_parallel.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/bindings.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
constexpr const char* kOp = "flashcomm_dequantize_into";

ffi::Error DequantizeInto(ffi::AnyBuffer out_in, U8Buf codes, Bf16Buf scale, Bf16Buf zero,
                          ffi::Buffer<ffi::S32> offset, AnyOut out, int32_t bits,
                          int64_t group_size, int32_t rotation, int32_t spikes, int64_t count,
                          const Runner& runner) {
  if (ffi::Error e = CheckDequantizeIntoArgs(out_in, codes, scale, zero, offset, *out, bits,
                                             group_size, rotation, spikes, count, 0, "");
      e.failure()) {
    return e;
  }
  const ffi::DataType type = out->element_type();
  const int64_t size = int64_t(out->element_count());
  const int64_t at = int64_t(offset.typed_data()[0]);
  if (at < 0 || count > size || at > size - count) {
    return InvalidFor(kOp, "offset " + std::to_string(at) + " + chunk size " +
                               std::to_string(count) + " is out of bounds for out of " +
                               std::to_string(size) + " elements");
  }
  const size_t item = type == ffi::F32 ? 4 : 2;
  if (out->untyped_data() != out_in.untyped_data()) {  // XLA aliases them; be safe if not
    std::memcpy(out->untyped_data(), out_in.untyped_data(), static_cast<size_t>(size) * item);
  }
  if (count == 0) return ffi::Error::Success();
  DType dtype;
  if (!ToDType(type, &dtype)) return InvalidFor(kOp, "out must be f32, bf16 or f16");
  char* base = static_cast<char*>(out->untyped_data()) + static_cast<size_t>(at) * item;
  // Pieces of whole groups; the last group of the last piece may be cut to `count`.
  const int64_t groups = (count + group_size - 1) / group_size;
  const int64_t record = record_bytes(group_size, bits, spikes);
  const int64_t group_out = group_size * int64_t(item);
  const size_t failed = runner.ForRangesStatus(groups, group_out, [&](int64_t b, int64_t e) {
    const int64_t values = (e * group_size < count ? e * group_size : count) - b * group_size;
    return kernels().dequantize_into(dtype, codes.typed_data() + b * record,
                                     scale.typed_data() + b, zero.typed_data() + b, group_size,
                                     bits, rotation, spikes, values, base + b * group_out);
  });
  return failed == 0 ? ffi::Error::Success() : ScratchError(kOp, failed);
}

namespace {

// The handler proper: the pool XLA gives the call, then the op's own arguments.
ffi::Error DequantizeIntoOnPool(ffi::ThreadPool pool, ffi::AnyBuffer out_in, U8Buf codes,
                                Bf16Buf scale, Bf16Buf zero, ffi::Buffer<ffi::S32> offset,
                                AnyOut out, GroupFormat fmt, int64_t count) {
  return Guarded(kOp, [&] {
    return DequantizeInto(out_in, codes, scale, zero, offset, out, fmt.bits, fmt.group_size,
                          fmt.rotation, fmt.spikes, count, PoolRunner(pool));
  });
}

}  // namespace

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_CPU_POOL_HANDLER(DequantizeInto, flashcomm::cpu::DequantizeIntoOnPool, DequantizeInto);

