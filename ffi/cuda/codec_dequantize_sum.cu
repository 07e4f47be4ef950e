// Kernels of flashcomm_dequantize_sum and flashcomm_dequantize_sum_quantize on CUDA (handlers:
// codec_handlers.cc): the f32 sum over the chunk axis, in chunk order as on the CPU
// (sum_block, codec_device.cuh). DequantizeSumKernel: one thread per 8-element output block;
// DequantizeSumRotatedKernel: one warp per group, the sums inverse-rotated in shared memory;
// DequantizeSumQuantizeKernel: the sums quantized again by one warp per output group
// (codec_quantize.cuh). Templates on kSpiked (the fused kernel: on input and output spikes).
//
// The fused kernel shares its file with kernels that use dynamic shared memory, as before the
// split: ptxas gives every kernel of such a file the same shared-memory entries (1 KB
// .nv.shared on sm_90), so the fused kernel's cubin is unchanged, not only its SASS.
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_device.cuh"
#include "codec_quantize.cuh"
#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeSumKernel(PayloadView in, int64_t n_out, bool vec,
                        typename T::Storage* __restrict__ y) {
  const int64_t nblocks = in.group_size / kBlock;
  const int64_t total = n_out * nblocks;
  const int64_t stride = int64_t(gridDim.x) * kThreads;
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < total; t += stride) {
    const int64_t g = t / nblocks;
    float acc[kBlock];
    sum_block<kSpiked>(in, g, t - g * nblocks, acc);
    store_block<T>(acc, vec, y + t * kBlock);
  }
}

template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeSumRotatedKernel(PayloadView in, int64_t n_out, int rotation, bool vec,
                               typename T::Storage* __restrict__ y) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  const int group_size = int(in.group_size);
  float* s = smem + (threadIdx.x / kWarp) * group_size;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_out;
       g += warps) {
    for (int blk = lane; blk < group_size / kBlock; blk += kWarp) {
      sum_block<kSpiked>(in, g, blk, s + blk * kBlock);
    }
    unrotate_store<T>(s, group_size, rotation, /*saturating=*/false, vec, lane,
                      y + g * group_size);
  }
}

// Input records carry in.spikes spikes (kSpikedIn: in.spikes > 0), output records out_spikes
// (kSpikedOut: out_spikes > 0): each phase of the all-reduce has its own count.
template <bool kSpikedIn, bool kSpikedOut>
__global__ void __launch_bounds__(kThreads, kMinBlocksFused)
    DequantizeSumQuantizeKernel(PayloadView in, int64_t n_out, int out_bits, int out_spikes,
                                int width, uint8_t* __restrict__ codes,
                                uint16_t* __restrict__ scale, uint16_t* __restrict__ zero) {
  const SumSource<kSpikedIn> source{in};
  if constexpr (kSpikedOut) {
    const int lane = int(threadIdx.x) % kWarp;
    const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
    for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_out;
         g += warps) {
      quantize_group_spiked_warp(source, g, in.group_size / kBlock, out_bits, out_spikes, lane,
                                 codes, scale, zero);
    }
  } else {  // several output groups per warp when they have fewer than 32 blocks
    quantize_groups_subwarp(source, n_out, in.group_size / kBlock, out_bits, width, codes,
                            scale, zero);
  }
}

}  // namespace

template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeSum(cudaStream_t stream, const PayloadView& in, void* y) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  const int64_t total = n_out * (in.group_size / kBlock);
  if (total == 0) return cudaSuccess;
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeSumKernel<T, kSpiked><<<GridFor(total, kThreads), kThreads, 0, stream>>>(
      in, n_out, Aligned16(ys), ys);
  return cudaGetLastError();
}

template <typename T, bool kSpiked>
cudaError_t LaunchDequantizeSumRotated(cudaStream_t stream, const PayloadView& in,
                                       int rotation, void* y) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  if (n_out == 0) return cudaSuccess;
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeSumRotatedKernel<T, kSpiked><<<GridFor(n_out, kWarpsPerBlock), kThreads,
                                           RotatedSharedBytes(in.group_size), stream>>>(
      in, n_out, rotation, Aligned16(ys), ys);
  return cudaGetLastError();
}

template <bool kSpikedIn, bool kSpikedOut>
cudaError_t LaunchDequantizeSumQuantize(cudaStream_t stream, const PayloadView& in,
                                        int64_t n_out, int out_bits, int out_spikes,
                                        uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  if (n_out == 0) return cudaSuccess;
  const int width = kSpikedOut ? kWarp : SubWarpWidth(in.group_size / kBlock);
  DequantizeSumQuantizeKernel<kSpikedIn, kSpikedOut>
      <<<GridFor(n_out, kWarpsPerBlock * (kWarp / width)), kThreads, 0, stream>>>(
          in, n_out, out_bits, out_spikes, width, codes, scale, zero);
  return cudaGetLastError();
}

#define INSTANTIATE(T, S)                                                                      \
  template cudaError_t LaunchDequantizeSum<T, S>(cudaStream_t, const PayloadView&, void*);    \
  template cudaError_t LaunchDequantizeSumRotated<T, S>(cudaStream_t, const PayloadView&, int, \
                                                        void*);
FLASHCOMM_CUDA_INSTANCES(INSTANTIATE)
#undef INSTANTIATE
#define INSTANTIATE_FUSED(I, O)                                                             \
  template cudaError_t LaunchDequantizeSumQuantize<I, O>(cudaStream_t, const PayloadView&,     \
                                                         int64_t, int, int, uint8_t*, uint16_t*, \
                                                         uint16_t*);
INSTANTIATE_FUSED(false, false)
INSTANTIATE_FUSED(false, true)
INSTANTIATE_FUSED(true, false)
INSTANTIATE_FUSED(true, true)
#undef INSTANTIATE_FUSED

}  // namespace cuda
}  // namespace flashcomm
