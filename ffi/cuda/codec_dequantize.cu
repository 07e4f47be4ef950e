// Kernels of flashcomm_dequantize on CUDA (handler: codec_handlers.cc): DequantizeKernel, one
// thread per 8-element block, and DequantizeRotatedKernel, one warp per group with the group
// in shared memory (docs/cuda.md). Templates on kSpiked like every codec kernel.
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_device.cuh"
#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

// With kSpiked, each thread puts back the spikes of its group that fall in its block.
template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeKernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scale,
                     const uint16_t* __restrict__ zero, int64_t n_groups, int64_t group_size,
                     int bits, int spikes, bool vec, typename T::Storage* __restrict__ y) {
  const int64_t nblocks = group_size / kBlock;
  const int64_t gbytes = kSpiked ? record_bytes(group_size, bits, spikes)
                                 : group_bytes(group_size, bits);
  const int64_t total = n_groups * nblocks;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < total; t += stride) {
    const int64_t g = t / nblocks;
    float v[kBlock];
    if constexpr (kSpiked) {
      decode_block_spiked(codes, scale, zero, g, gbytes, t - g * nblocks, bits, group_size,
                          spikes, v);
    } else {
      decode_block(codes, scale, zero, g, gbytes, t - g * nblocks, bits, v);
    }
    // A dequantized operand is saturated to its dtype's finite range, as on the CPU (the sums
    // of dequantize_sum are not).
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = saturate(v[j], T::kMax);
    store_block<T>(v, vec, y + t * kBlock);
  }
}

template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeRotatedKernel(const uint8_t* __restrict__ codes,
                            const uint16_t* __restrict__ scale,
                            const uint16_t* __restrict__ zero, int64_t n_groups, int group_size,
                            int bits, int rotation, int spikes, bool vec,
                            typename T::Storage* __restrict__ y) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  float* s = smem + (threadIdx.x / kWarp) * group_size;
  const int64_t gbytes = kSpiked ? record_bytes(group_size, bits, spikes)
                                 : group_bytes(group_size, bits);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_groups;
       g += warps) {
    for (int blk = lane; blk < group_size / kBlock; blk += kWarp) {
      if constexpr (kSpiked) {
        decode_block_spiked(codes, scale, zero, g, gbytes, blk, bits, group_size, spikes,
                            s + blk * kBlock);
      } else {
        decode_block(codes, scale, zero, g, gbytes, blk, bits, s + blk * kBlock);
      }
    }
    unrotate_store<T>(s, group_size, rotation, /*saturating=*/true, vec, lane,
                      y + g * group_size);
  }
}

}  // namespace

template <typename T, bool kSpiked>
cudaError_t LaunchDequantize(cudaStream_t stream, const uint8_t* codes, const uint16_t* scale,
                             const uint16_t* zero, int64_t n_groups, int64_t group_size,
                             int bits, int spikes, void* y) {
  const int64_t total = n_groups * (group_size / kBlock);
  if (total == 0) return cudaSuccess;
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeKernel<T, kSpiked><<<GridFor(total, kThreads), kThreads, 0, stream>>>(
      codes, scale, zero, n_groups, group_size, bits, spikes, Aligned16(ys), ys);
  return cudaGetLastError();
}

template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeRotated(cudaStream_t stream, const uint8_t* codes,
                                    const uint16_t* scale, const uint16_t* zero,
                                    int64_t n_groups, int64_t group_size, int bits,
                                    int rotation, int spikes, void* y) {
  if (n_groups == 0) return cudaSuccess;
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeRotatedKernel<T, kSpiked><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                                        RotatedSharedBytes(group_size), stream>>>(
      codes, scale, zero, n_groups, int(group_size), bits, rotation, spikes, Aligned16(ys), ys);
  return cudaGetLastError();
}

#define INSTANTIATE(T, S)                                                                    \
  template cudaError_t LaunchDequantize<T, S>(cudaStream_t, const uint8_t*, const uint16_t*, \
                                              const uint16_t*, int64_t, int64_t, int, int,   \
                                              void*);                                        \
  template cudaError_t LaunchDequantizeRotated<T, S>(cudaStream_t, const uint8_t*,           \
                                                     const uint16_t*, const uint16_t*,       \
                                                     int64_t, int64_t, int, int, int, void*);
FLASHCOMM_CUDA_INSTANCES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cuda
}  // namespace flashcomm
