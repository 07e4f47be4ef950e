// Kernels of flashcomm_quantize on CUDA (handler: codec_handlers.cc): QuantizeKernel and
// QuantizeRotatedKernel, one warp per group (codec_quantize.cuh, docs/cuda.md). Every kernel
// is a template on kSpiked (spikes > 0, decided per launch on the host), so the spikes = 0
// instances are the kernels without spike reserving, unchanged.
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_device.cuh"
#include "codec_quantize.cuh"
#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

// Without spikes a group of fewer than 32 blocks takes SubWarpWidth lanes (`width`), so a warp
// quantizes several groups at once; with spikes one warp takes each group.
template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    QuantizeKernel(const typename T::Storage* __restrict__ x, int64_t n_groups,
                   int64_t group_size, int bits, int spikes, int width, bool vec,
                   uint8_t* __restrict__ codes, uint16_t* __restrict__ scale,
                   uint16_t* __restrict__ zero) {
  const LoadSource<T> source{x, group_size, vec};
  if constexpr (kSpiked) {
    const int lane = int(threadIdx.x) % kWarp;
    const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
    for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_groups;
         g += warps) {
      quantize_group_spiked_warp(source, g, group_size / kBlock, bits, spikes, lane, codes,
                                 scale, zero);
    }
  } else {
    quantize_groups_subwarp(source, n_groups, group_size / kBlock, bits, width, codes, scale,
                            zero);
  }
}

// Rotation: the group is loaded, sign-flipped (rotation 2) and transformed in shared memory,
// then quantized from there.
template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    QuantizeRotatedKernel(const typename T::Storage* __restrict__ x, int64_t n_groups,
                          int group_size, int bits, int rotation, int spikes, bool vec,
                          uint8_t* __restrict__ codes, uint16_t* __restrict__ scale,
                          uint16_t* __restrict__ zero) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  float* s = smem + (threadIdx.x / kWarp) * group_size;
  const int nblocks = group_size / kBlock;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const SharedSource source{s};
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_groups;
       g += warps) {
    for (int blk = lane; blk < nblocks; blk += kWarp) {
      float v[kBlock];
      load_block<T>(x + g * group_size + blk * kBlock, vec, v);
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const int i = blk * kBlock + j;
        s[i] = rotation == kRotationSignedHadamard ? apply_sign(v[j], uint32_t(i)) : v[j];
      }
    }
    __syncwarp();
    warp_hadamard_scaled(s, group_size, lane);
    if constexpr (kSpiked) {
      quantize_group_spiked_warp(source, g, nblocks, bits, spikes, lane, codes, scale, zero);
    } else {
      quantize_group_warp(source, g, nblocks, bits, lane, codes, scale, zero);
    }
    __syncwarp();  // the next group overwrites s
  }
}

}  // namespace

template <typename T, bool kSpiked>
cudaError_t LaunchQuantize(cudaStream_t stream, const void* x, int64_t n_groups,
                           int64_t group_size, int bits, int spikes, uint8_t* codes,
                           uint16_t* scale, uint16_t* zero) {
  if (n_groups == 0) return cudaSuccess;
  const auto* xs = static_cast<const typename T::Storage*>(x);
  const int width = kSpiked ? kWarp : SubWarpWidth(group_size / kBlock);
  QuantizeKernel<T, kSpiked>
      <<<GridFor(n_groups, kWarpsPerBlock * (kWarp / width)), kThreads, 0, stream>>>(
          xs, n_groups, group_size, bits, spikes, width, Aligned16(xs), codes, scale, zero);
  return cudaGetLastError();
}

template <typename T, bool kSpiked>
cudaError_t LaunchQuantizeRotated(cudaStream_t stream, const void* x, int64_t n_groups,
                                  int64_t group_size, int bits, int rotation, int spikes,
                                  uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  if (n_groups == 0) return cudaSuccess;
  const auto* xs = static_cast<const typename T::Storage*>(x);
  QuantizeRotatedKernel<T, kSpiked><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                                      RotatedSharedBytes(group_size), stream>>>(
      xs, n_groups, int(group_size), bits, rotation, spikes, Aligned16(xs), codes, scale, zero);
  return cudaGetLastError();
}

#define INSTANTIATE(T, S)                                                                      \
  template cudaError_t LaunchQuantize<T, S>(cudaStream_t, const void*, int64_t, int64_t, int, \
                                            int, uint8_t*, uint16_t*, uint16_t*);             \
  template cudaError_t LaunchQuantizeRotated<T, S>(cudaStream_t, const void*, int64_t,        \
                                                   int64_t, int, int, int, uint8_t*,          \
                                                   uint16_t*, uint16_t*);
FLASHCOMM_CUDA_INSTANCES(INSTANTIATE)
#undef INSTANTIATE

}  // namespace cuda
}  // namespace flashcomm
