// Kernels of flashcomm_dequantize_into on CUDA (handler: gather_handlers.cc): decode one
// payload into a slot of a larger output buffer in place, the ring all-gather's step. The
// values are those of flashcomm_dequantize (codec.h's decode, the spikes put back in record
// order, the inverse rotation as in codec_dequantize.cu, saturated to the dtype), cut to the
// chunk's `count` values.
//
// The element offset is an int32 scalar in device memory: the kernels read it, and an offset
// that would put the chunk out of bounds makes them write nothing (the handler cannot see the
// value without synchronizing the stream; the CPU handler returns InvalidArgument instead).
//
// Geometry: without rotation one thread per 8-value block of the chunk, grid-stride (16-byte
// stores where the destination is aligned, which depends on the runtime offset); with
// rotation one warp per group, the group in shared memory (as codec_dequantize.cu).
#include <cuda_runtime.h>

#include <cstdint>

#include "flashcomm/codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxGrid = int64_t(1) << 15;
constexpr int kMinBlocks = 4;

int GridFor(int64_t items, int64_t items_per_block) {
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return int(blocks < kMaxGrid ? blocks : kMaxGrid);
}

// The destination of the chunk, or nullptr when offset + count is out of bounds.
template <typename S>
__device__ __forceinline__ S* chunk_at(S* out, const int32_t* offset, int64_t size,
                                       int64_t count) {
  const int64_t at = int64_t(*offset);
  if (at < 0 || at > size - count) return nullptr;
  return out + at;
}

// Store values [i0, i0 + 8) of the chunk (those below count): a 16-byte store when the block
// is whole and its destination aligned.
template <typename T>
__device__ __forceinline__ void store_block(const float* v, int64_t i0, int64_t count,
                                            typename T::Storage* __restrict__ y) {
  typename T::Storage* p = y + i0;
  if (i0 + kBlock <= count && reinterpret_cast<uintptr_t>(p) % 16 == 0) {
    if constexpr (sizeof(typename T::Storage) == 4) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = uint32_t(T::store(v[2 * i])) | (uint32_t(T::store(v[2 * i + 1])) << 16);
      }
      reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    if (i0 + j < count) p[j] = T::store(v[j]);
  }
}

// Block `blk` of group `group`, decoded; spikes put back in record order (as apply_spikes).
// The spike's slot is chosen by comparison, so v stays in registers.
__device__ __forceinline__ void decode_block(const uint8_t* __restrict__ codes,
                                             const uint16_t* __restrict__ scale,
                                             const uint16_t* __restrict__ zero, int64_t group,
                                             int64_t stride, int64_t g, int64_t blk, int bits,
                                             int spikes, float* v) {
  const GroupParams p = stored_params(scale[group], zero[group]);
  const uint8_t* rec = codes + group * stride;
  uint32_t q[kBlock];
  unpack_block(rec + blk * bits, bits, q);
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = decode(q[j], p);
  const uint8_t* sp = rec + group_bytes(g, bits);
  for (int s = 0; s < spikes; ++s) {
    const int64_t at = spike_position(sp, spikes, g, s) - blk * kBlock;
    if (at < 0 || at >= kBlock) continue;
    const float value = spike_value(sp, s);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = at == j ? value : v[j];
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeIntoKernel(const uint8_t* __restrict__ codes, const uint16_t* __restrict__ scale,
                         const uint16_t* __restrict__ zero, int64_t group_size, int bits,
                         int spikes, int64_t count, const int32_t* __restrict__ offset,
                         int64_t size, typename T::Storage* __restrict__ out) {
  typename T::Storage* y = chunk_at(out, offset, size, count);
  if (y == nullptr) return;
  const int64_t nblocks = group_size / kBlock;
  const int64_t stride = record_bytes(group_size, bits, spikes);
  const int64_t total = (count + kBlock - 1) / kBlock;
  const int64_t step = int64_t(gridDim.x) * kThreads;
  for (int64_t t = int64_t(blockIdx.x) * kThreads + threadIdx.x; t < total; t += step) {
    const int64_t g = t / nblocks;
    float v[kBlock];
    decode_block(codes, scale, zero, g, stride, group_size, t - g * nblocks, bits, spikes, v);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = saturate(v[j], T::kMax);
    store_block<T>(v, t * kBlock, count, y);
  }
}

// The inverse of the rotation's orthonormal Hadamard transform on the group in s, split over
// the lanes: each output is the same single add or subtract as codec_device.cuh and the CPU.
__device__ __forceinline__ void warp_hadamard_scaled(float* s, int g, int lane) {
  for (int h = 1, log_h = 0; h < g; h *= 2, ++log_h) {
    for (int p = lane; p < g / 2; p += kWarp) {
      const int j = ((p >> log_h) << (log_h + 1)) + (p & (h - 1));
      const float a = s[j], b = s[j + h];
      s[j] = add_rn(a, b);
      s[j + h] = add_rn(a, -b);
    }
    __syncwarp();
  }
  const float c = rotation_scale(g);
  for (int i = lane; i < g; i += kWarp) s[i] = mul_rn(s[i], c);
  __syncwarp();
}

template <typename T>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    DequantizeIntoRotatedKernel(const uint8_t* __restrict__ codes,
                                const uint16_t* __restrict__ scale,
                                const uint16_t* __restrict__ zero, int group_size, int bits,
                                int rotation, int spikes, int64_t count,
                                const int32_t* __restrict__ offset, int64_t size,
                                typename T::Storage* __restrict__ out) {
  extern __shared__ float smem[];
  typename T::Storage* y = chunk_at(out, offset, size, count);
  if (y == nullptr) return;
  const int lane = int(threadIdx.x) % kWarp;
  float* s = smem + (threadIdx.x / kWarp) * group_size;
  const int64_t stride = record_bytes(group_size, bits, spikes);
  const int64_t n_groups = (count + group_size - 1) / group_size;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_groups;
       g += warps) {
    for (int blk = lane; blk < group_size / kBlock; blk += kWarp) {
      decode_block(codes, scale, zero, g, stride, group_size, blk, bits, spikes,
                   s + blk * kBlock);
    }
    __syncwarp();
    warp_hadamard_scaled(s, group_size, lane);
    for (int blk = lane; blk < group_size / kBlock; blk += kWarp) {
      float v[kBlock];
#pragma unroll
      for (int j = 0; j < kBlock; ++j) {
        const int i = blk * kBlock + j;
        v[j] = rotation == kRotationSignedHadamard ? apply_sign(s[i], uint32_t(i)) : s[i];
        v[j] = saturate(v[j], T::kMax);
      }
      store_block<T>(v, g * group_size + blk * kBlock, count, y);
    }
    __syncwarp();  // the next group overwrites s
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchDequantizeInto(cudaStream_t stream, const uint8_t* codes,
                                 const uint16_t* scale, const uint16_t* zero,
                                 int64_t group_size, int bits, int rotation, int spikes,
                                 int64_t count, const int32_t* offset, int64_t size, void* out) {
  if (count == 0) return cudaSuccess;
  auto* ys = static_cast<typename T::Storage*>(out);
  if (rotation != kRotationNone) {
    const int64_t n_groups = (count + group_size - 1) / group_size;
    const size_t shared = size_t(kWarpsPerBlock) * size_t(group_size) * sizeof(float);
    DequantizeIntoRotatedKernel<T><<<GridFor(n_groups, kWarpsPerBlock), kThreads, shared,
                                     stream>>>(codes, scale, zero, int(group_size), bits,
                                               rotation, spikes, count, offset, size, ys);
  } else {
    const int64_t total = (count + kBlock - 1) / kBlock;
    DequantizeIntoKernel<T><<<GridFor(total, kThreads), kThreads, 0, stream>>>(
        codes, scale, zero, group_size, bits, spikes, count, offset, size, ys);
  }
  return cudaGetLastError();
}

#define INSTANTIATE(T)                                                                       \
  template cudaError_t LaunchDequantizeInto<T>(cudaStream_t, const uint8_t*, const uint16_t*, \
                                               const uint16_t*, int64_t, int, int, int,       \
                                               int64_t, const int32_t*, int64_t, void*);
INSTANTIATE(F32)
INSTANTIATE(BF16)
INSTANTIATE(F16)
#undef INSTANTIATE

}  // namespace cuda
}  // namespace flashcomm
