// The kernel launchers of the CUDA module: the boundary between the kernel translation units
// (ffi/cuda/*.cu, compiled by nvcc without the XLA headers) and the FFI handlers
// (ffi/cuda/*_handlers.cc, plain C++ compiled by the host compiler). Keeping the two apart
// saves parsing XLA's ffi.h once per GPU architecture (docs/cuda.md, "Build time").
//
// Each launcher enqueues one kernel on `stream` and returns cudaGetLastError(), or cudaSuccess
// without launching when there is no work. T is F32, BF16 or F16 (flashcomm/codec.h) and
// kSpiked picks the spikes > 0 instance; every (T, kSpiked) is explicitly instantiated in the
// .cu file named for each launcher.
#ifndef FLASHCOMM_CUDA_LAUNCH_H_
#define FLASHCOMM_CUDA_LAUNCH_H_

#include <cuda_runtime_api.h>

#include <cstdint>

#include "flashcomm/payload_view.h"

// Calls X(T, kSpiked) for the six launcher instances: (f32, bf16, f16) x (spikes = 0, > 0).
#define FLASHCOMM_CUDA_INSTANCES(X) \
  X(F32, false) X(F32, true) X(BF16, false) X(BF16, true) X(F16, false) X(F16, true)

namespace flashcomm {
namespace cuda {

// Rotated kernels hold the group in shared memory: 8 warps * 1024 * 4 B = 32 KB per block.
constexpr int64_t kMaxRotatedGroup = 1024;

// norm_kernels.cu: the fused residual add + RMSNorm (docs/fused_norm.md). The payload of the
// gathered all-reduce (group_size, bits, rotation, spikes) covers rows * hidden values; `out`
// null: the normalised rows are quantized to out_bits in groups of out_group_size (a divisor of
// hidden) into out_codes / out_scale / out_zero. inv_h = RN(1 / hidden), eps_h = RN(eps * hidden).
struct NormLaunch {
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t group_size;
  int bits, rotation, spikes;
  int64_t rows, hidden;
  float inv_h, eps_h;
  int out_bits;
  int64_t out_group_size;
  uint8_t* out_codes;
  uint16_t* out_scale;
  uint16_t* out_zero;
};
// Shared memory of one block: the row's groups as f32 (at most hidden / G + 2 of them).
size_t NormSharedBytes(int64_t hidden, int64_t group_size);
template <typename T, typename W, bool kSpiked>
cudaError_t LaunchAddRmsNorm(cudaStream_t stream, const NormLaunch& args, const void* residual,
                             const void* weight, void* new_residual, void* out);

// codec_quantize.cu
template <typename T, bool kSpiked>
cudaError_t LaunchQuantize(cudaStream_t stream, const void* x, int64_t n_groups,
                           int64_t group_size, int bits, int spikes, uint8_t* codes,
                           uint16_t* scale, uint16_t* zero);
template <typename T, bool kSpiked>
cudaError_t LaunchQuantizeRotated(cudaStream_t stream, const void* x, int64_t n_groups,
                                  int64_t group_size, int bits, int rotation, int spikes,
                                  uint8_t* codes, uint16_t* scale, uint16_t* zero);

// codec_dequantize.cu
template <typename T, bool kSpiked>
cudaError_t LaunchDequantize(cudaStream_t stream, const uint8_t* codes, const uint16_t* scale,
                             const uint16_t* zero, int64_t n_groups, int64_t group_size,
                             int bits, int spikes, void* y);
template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeRotated(cudaStream_t stream, const uint8_t* codes,
                                    const uint16_t* scale, const uint16_t* zero,
                                    int64_t n_groups, int64_t group_size, int bits,
                                    int rotation, int spikes, void* y);

// codec_dequantize_sum.cu
template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeSum(cudaStream_t stream, const PayloadView& in, void* y);
template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeSumRotated(cudaStream_t stream, const PayloadView& in,
                                       int rotation, void* y);
// Input records carry in.spikes spikes (kSpikedIn = in.spikes > 0), output records
// out_spikes (kSpikedOut = out_spikes > 0).
template <bool kSpikedIn, bool kSpikedOut>
cudaError_t LaunchDequantizeSumQuantize(cudaStream_t stream, const PayloadView& in,
                                        int64_t n_out, int out_bits, int out_spikes,
                                        uint8_t* codes, uint16_t* scale, uint16_t* zero);

// sum_kernels.cu: y[i] = the f32 sum over j < ranks of in[j * stride + i] in rank order, rounded
// once to T (T = F32, BF16, F16), for i < count.
template <typename T>
cudaError_t LaunchSumRanks(cudaStream_t stream, const void* in, int64_t stride, int ranks,
                           int64_t count, void* y);
// gather_kernels.cu: one payload decoded into out[*offset, *offset + count) (T = F32, BF16,
// F16); `offset` is in device memory, `size` is out's element count.
template <typename T>
cudaError_t LaunchDequantizeInto(cudaStream_t stream, const uint8_t* codes,
                                 const uint16_t* scale, const uint16_t* zero,
                                 int64_t group_size, int bits, int rotation, int spikes,
                                 int64_t count, const int32_t* offset, int64_t size, void* out);

// fp_kernels.cu: the floating-point group formats (flashcomm/fp_codec.h; docs/format.md,
// "Floating-point formats"), one warp per group in shared memory (RotatedSharedBytes, G <=
// kMaxRotatedGroup). Records hold whole groups; chunked records are (batch, chunks,
// groups_per_chunk, fp_record_bytes(format, group_size, spikes)).
struct FpChunkArgs {
  int64_t batch, chunks, groups_per_chunk, group_size;
  int32_t format;
  int spikes;
};
template <typename T>
cudaError_t LaunchFpQuantize(cudaStream_t stream, const void* x, int64_t n_groups,
                             int64_t group_size, int32_t format, int rotation, int spikes,
                             uint8_t* records);
template <typename T>
cudaError_t LaunchFpDequantize(cudaStream_t stream, const uint8_t* records, int64_t n_groups,
                               int64_t group_size, int32_t format, int rotation, int spikes,
                               void* y);
template <typename T>
cudaError_t LaunchFpDequantizeSum(cudaStream_t stream, const uint8_t* records,
                                  const FpChunkArgs& in, int rotation, void* y);
cudaError_t LaunchFpDequantizeSumQuantize(cudaStream_t stream, const uint8_t* records,
                                          const FpChunkArgs& in, int32_t out_format,
                                          int out_spikes, uint8_t* out);

}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_LAUNCH_H_
