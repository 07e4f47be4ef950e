// Kernel of flashcomm_add_rms_norm(_quantize) on CUDA (handler: norm_handlers.cc): the
// all-reduce's fused epilogue (docs/fused_norm.md). One block of kThreads per row (grid-stride
// over rows): the row's groups are decoded into shared memory (decode_block, the spikes put
// back, the inverse rotation one warp per group as in DequantizeRotatedKernel), then the
// residual add (new residual written), the 16 running sums of squares (thread j < 16 sums
// values j, j + 16, ... in order: codec.h's order), the inverse rms (thread 0, codec.h
// norm_inverse_rms), and the scaling by the weight: written, or quantized one warp per output
// group (quantize_group_warp). Every arithmetic step is a codec.h call, as on the CPU.
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_device.cuh"
#include "codec_quantize.cuh"
#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

template <typename T, typename W, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    AddRmsNormKernel(NormLaunch a, const typename T::Storage* __restrict__ residual,
                     const typename W::Storage* __restrict__ weight,
                     typename T::Storage* __restrict__ new_residual,
                     typename T::Storage* __restrict__ out) {
  extern __shared__ float smem[];
  __shared__ float sums[kNormLanes];
  __shared__ float inv_rms;
  const int tid = int(threadIdx.x), lane = tid % kWarp, warp = tid / kWarp;
  const int64_t g = a.group_size, h = a.hidden, per_group = g / kBlock;
  const int64_t gbytes = kSpiked ? record_bytes(g, a.bits, a.spikes) : group_bytes(g, a.bits);
  for (int64_t row = blockIdx.x; row < a.rows; row += gridDim.x) {
    const int64_t first = row * h / g, last = ((row + 1) * h + g - 1) / g;
    for (int64_t b = tid; b < (last - first) * per_group; b += kThreads) {
      const int64_t group = first + b / per_group;
      if constexpr (kSpiked) {
        decode_block_spiked(a.codes, a.scale, a.zero, group, gbytes, b % per_group, a.bits, g,
                            a.spikes, smem + b * kBlock);
      } else {
        decode_block(a.codes, a.scale, a.zero, group, gbytes, b % per_group, a.bits,
                     smem + b * kBlock);
      }
    }
    __syncthreads();
    if (a.rotation != kRotationNone) {
      for (int64_t k = warp; k < last - first; k += kWarpsPerBlock) {
        float* s = smem + k * g;
        warp_hadamard_scaled(s, int(g), lane);
        if (a.rotation == kRotationSignedHadamard) {
          for (int i = lane; i < int(g); i += kWarp) s[i] = apply_sign(s[i], uint32_t(i));
        }
      }
      __syncthreads();
    }
    float* d = smem + (row * h - first * g);
    for (int64_t i = tid; i < h; i += kThreads) {
      // the payload decoded as f32 (saturated, as dequantize does), plus the residual
      const typename T::Storage hs =
          T::store(add_rn(saturate(d[i], kFltMax), T::load(residual[row * h + i])));
      new_residual[row * h + i] = hs;
      d[i] = T::load(hs);
    }
    __syncthreads();
    if (tid < kNormLanes) {
      float acc = 0.0f;
      for (int64_t i = tid; i < h; i += kNormLanes) acc = add_rn(acc, mul_rn(d[i], d[i]));
      sums[tid] = acc;
    }
    __syncthreads();
    if (tid == 0) inv_rms = norm_inverse_rms(norm_reduce(sums), a.inv_h, a.eps_h);
    __syncthreads();
    const float inv = inv_rms;
    for (int64_t i = tid; i < h; i += kThreads) {
      const float y = mul_rn(mul_rn(d[i], inv), W::load(weight[i]));
      if (out != nullptr) {
        out[row * h + i] = T::store(y);
      } else {
        d[i] = T::load(T::store(y));  // quantize reads the output as T, widened
      }
    }
    if (out == nullptr) {
      __syncthreads();
      const int64_t og = a.out_group_size, per_row = h / og;
      for (int64_t k = warp; k < per_row; k += kWarpsPerBlock) {
        const float* src = d + k * og;
        auto source = [src](int64_t, int64_t blk, float* v) {
#pragma unroll
          for (int j = 0; j < kBlock; ++j) v[j] = src[blk * kBlock + j];
        };
        quantize_group_warp(source, row * per_row + k, og / kBlock, a.out_bits, lane,
                            a.out_codes, a.out_scale, a.out_zero);
      }
    }
    __syncthreads();
  }
}

}  // namespace

size_t NormSharedBytes(int64_t hidden, int64_t group_size) {
  return size_t(hidden / group_size + 2) * size_t(group_size) * sizeof(float);
}

template <typename T, typename W, bool kSpiked>
cudaError_t LaunchAddRmsNorm(cudaStream_t stream, const NormLaunch& a, const void* residual,
                             const void* weight, void* new_residual, void* out) {
  if (a.rows == 0) return cudaSuccess;
  const size_t shared = NormSharedBytes(a.hidden, a.group_size);
  auto kernel = AddRmsNormKernel<T, W, kSpiked>;
  if (shared > 48 * 1024) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             int(shared));
        e != cudaSuccess) {
      return e;
    }
  }
  const int grid = int(a.rows < kMaxGrid ? a.rows : kMaxGrid);
  kernel<<<grid, kThreads, shared, stream>>>(
      a, static_cast<const typename T::Storage*>(residual),
      static_cast<const typename W::Storage*>(weight),
      static_cast<typename T::Storage*>(new_residual), static_cast<typename T::Storage*>(out));
  return cudaGetLastError();
}

#define INSTANTIATE_W(T, S, W)                                                               \
  template cudaError_t LaunchAddRmsNorm<T, W, S>(cudaStream_t, const NormLaunch&, const void*, \
                                                 const void*, void*, void*);
#define INSTANTIATE(T, S) INSTANTIATE_W(T, S, F32) INSTANTIATE_W(T, S, BF16)
FLASHCOMM_CUDA_INSTANCES(INSTANTIATE)
#undef INSTANTIATE
#undef INSTANTIATE_W

}  // namespace cuda
}  // namespace flashcomm
