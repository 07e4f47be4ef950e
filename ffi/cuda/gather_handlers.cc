// XLA FFI handler of flashcomm_dequantize_into on CUDA: decode one payload into a slot of a
// larger output buffer in place (the result is aliased to operand 0), the ring all-gather's
// step. Same target, operands, attributes and results as the CPU handler
// (ffi/cpu/gather_handlers.cc). It checks the operands and calls the launcher of
// gather_kernels.cu (launch.h); plain C++, like codec_handlers.cc.
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
constexpr const char* kOp = "flashcomm_dequantize_into";

ffi::Error DequantizeInto(cudaStream_t stream, ffi::AnyBuffer out_in, U8Buf codes, Bf16Buf scale,
                          Bf16Buf zero, ffi::Buffer<ffi::S32> offset, AnyOut out, GroupFormat fmt,
                          int64_t count) {
  const int32_t bits = fmt.bits, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  if (ffi::Error e = CheckDequantizeIntoArgs(out_in, codes, scale, zero, offset, *out, bits,
                                             group_size, rotation, spikes, count,
                                             kMaxRotatedGroup, " of at most 1024 on CUDA");
      e.failure()) {
    return e;
  }
  const ffi::DataType type = out->element_type();
  const int64_t size = int64_t(out->element_count());
  if (count > size) return InvalidFor(kOp, "the chunk is larger than out");
  if (out->untyped_data() != out_in.untyped_data()) {  // XLA aliases them; be safe if not
    const size_t bytes = size_t(size) * (type == ffi::F32 ? 4 : 2);
    if (cudaMemcpyAsync(out->untyped_data(), out_in.untyped_data(), bytes,
                        cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
      return LaunchStatus(kOp, cudaGetLastError());
    }
  }
  const uint8_t* c = codes.typed_data();
  const uint16_t* s = scale.typed_data();
  const uint16_t* z = zero.typed_data();
  const int32_t* off = offset.typed_data();
  void* y = out->untyped_data();
  cudaError_t err;
  switch (type) {
    case ffi::F32:
      err = LaunchDequantizeInto<F32>(stream, c, s, z, group_size, bits, rotation, spikes, count,
                                      off, size, y);
      break;
    case ffi::BF16:
      err = LaunchDequantizeInto<BF16>(stream, c, s, z, group_size, bits, rotation, spikes, count,
                                       off, size, y);
      break;
    default:
      err = LaunchDequantizeInto<F16>(stream, c, s, z, group_size, bits, rotation, spikes, count,
                                      off, size, y);
  }
  return LaunchStatus(kOp, err);
}

}  // namespace cuda
}  // namespace flashcomm

// Command-buffer compatible (docs/cuda.md, "Command buffers"): a device-to-device copy (only
// when XLA did not alias out to operand 0: a comparison of addresses, which XLA's graph
// traces are keyed by) and one kernel launch on XLA's stream. The offset is read by the
// kernel from device memory, never by the host, so a captured graph stays right for every
// offset.
FLASHCOMM_CUDA_STREAM_HANDLER(DequantizeInto, flashcomm::cuda::DequantizeInto, DequantizeInto);


