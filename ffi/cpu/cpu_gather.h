// Plain C++ entry point of the CPU flashcomm_dequantize_into handler (ffi/cpu/gather_handlers.cc),
// declared for the C++ tests (ffi/tests/gather_cpu_test.cc), as cpu_ops.h does for the codec.
#ifndef FLASHCOMM_CPU_GATHER_H_
#define FLASHCOMM_CPU_GATHER_H_

#include <cstdint>

#include "cpu/cpu_parallel.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// Decode one payload (codes (groups, record bytes), scale and zero (groups,)) as
// flashcomm_dequantize would, keep its first `count` values and store them, cast to out's
// dtype (f32/bf16/f16) and saturated to its finite range, at out's flat elements
// [offset, offset + count). `out` is the result, aliased to operand `out_in` (XLA passes the
// same buffer; if not, out_in is copied first). offset < 0 or offset + count > out's size is
// InvalidArgument and nothing is written. `runner` splits the groups over threads (cpu_ops.h).
xla::ffi::Error DequantizeInto(xla::ffi::AnyBuffer out_in, xla::ffi::Buffer<xla::ffi::U8> codes,
                               xla::ffi::Buffer<xla::ffi::BF16> scale,
                               xla::ffi::Buffer<xla::ffi::BF16> zero,
                               xla::ffi::Buffer<xla::ffi::S32> offset,
                               xla::ffi::Result<xla::ffi::AnyBuffer> out, int32_t bits,
                               int64_t group_size, int32_t rotation, int32_t spikes,
                               int64_t count, const Runner& runner = Runner::Inline());

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_GATHER_H_
