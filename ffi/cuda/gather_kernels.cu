// XLA FFI handler of flashcomm_dequantize_into on CUDA: decode one payload into a slot of a
// larger output buffer in place (the result is aliased to operand 0), the ring all-gather's
// step. Same target, operands, attributes and results as the CPU handler
// (ffi/cpu/gather_kernels.cc); the values are those of flashcomm_dequantize (codec.h's decode,
// the spikes put back in record order, the inverse rotation as in codec_kernels.cu, saturated
// to the dtype), cut to the chunk's `count` values.
//
// The element offset is an int32 scalar in device memory: the kernels read it, and an offset
// that would put the chunk out of bounds makes them write nothing (the handler cannot see the
// value without synchronizing the stream; the CPU handler returns InvalidArgument instead).
//
// Geometry: without rotation one thread per 8-value block of the chunk, grid-stride (16-byte
// stores where the destination is aligned, which depends on the runtime offset); with
// rotation one warp per group, the group in shared memory (as codec_kernels.cu).
#include "flashcomm/cuda_kernels.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "flashcomm/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxGrid = int64_t(1) << 15;
constexpr int kMinBlocks = 4;
constexpr int64_t kMaxRotatedGroup = 1024;  // 8 warps * 1024 * 4 B = 32 KB of shared memory
constexpr const char* kOp = "flashcomm_dequantize_into";

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
// the lanes: each output is the same single add or subtract as codec_kernels.cu and the CPU.
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

ffi::Error LaunchStatus() {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(kOp) + ": CUDA kernel launch failed: " +
                                cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

template <typename T>
ffi::Error Launch(cudaStream_t stream, const uint8_t* codes, const uint16_t* scale,
                  const uint16_t* zero, int64_t group_size, int bits, int rotation, int spikes,
                  int64_t count, const int32_t* offset, int64_t size, void* out) {
  if (count == 0) return ffi::Error::Success();
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
  return LaunchStatus();
}

ffi::Error Invalid(const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(kOp) + ": " + what);
}

}  // namespace

ffi::Error DequantizeInto(cudaStream_t stream, ffi::AnyBuffer out_in,
                          ffi::Buffer<ffi::U8> codes, ffi::Buffer<ffi::BF16> scale,
                          ffi::Buffer<ffi::BF16> zero, ffi::Buffer<ffi::S32> offset,
                          ffi::Result<ffi::AnyBuffer> out, int32_t bits, int64_t group_size,
                          int32_t rotation, int32_t spikes, int64_t count) {
  if (ffi::Error e = CheckCodecAttrs(bits, group_size, spikes); e.failure()) return e;
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard) {
    return Invalid("rotation must be 0, 1 or 2");
  }
  if (rotation != kRotationNone &&
      ((group_size & (group_size - 1)) != 0 || group_size > kMaxRotatedGroup)) {
    return Invalid("rotation needs a power-of-two group_size of at most 1024 on CUDA");
  }
  const int64_t n_groups = int64_t(scale.element_count());
  if (int64_t(zero.element_count()) != n_groups ||
      int64_t(codes.element_count()) != n_groups * record_bytes(group_size, bits, spikes)) {
    return Invalid("payload codes/scale/zero do not match");
  }
  if (count < 0 || count > n_groups * group_size) {
    return Invalid("count is negative or more than the payload's groups hold");
  }
  const ffi::DataType type = out->element_type();
  if (type != ffi::F32 && type != ffi::BF16 && type != ffi::F16) {
    return Invalid("out must be f32, bf16 or f16");
  }
  const int64_t size = int64_t(out->element_count());
  if (out_in.element_type() != type || int64_t(out_in.element_count()) != size) {
    return Invalid("the result does not match operand 0 (out)");
  }
  if (count > size) return Invalid("the chunk is larger than out");
  if (offset.element_count() != 1) return Invalid("offset must be an int32 scalar");
  if (out->untyped_data() != out_in.untyped_data()) {  // XLA aliases them; be safe if not
    const size_t bytes = size_t(size) * (type == ffi::F32 ? 4 : 2);
    if (cudaMemcpyAsync(out->untyped_data(), out_in.untyped_data(), bytes,
                        cudaMemcpyDeviceToDevice, stream) != cudaSuccess) {
      return LaunchStatus();
    }
  }
  const uint8_t* c = codes.typed_data();
  const uint16_t* s = scale.typed_data();
  const uint16_t* z = zero.typed_data();
  const int32_t* off = offset.typed_data();
  void* y = out->untyped_data();
  switch (type) {
    case ffi::F32:
      return Launch<F32>(stream, c, s, z, group_size, bits, rotation, spikes, count, off, size,
                         y);
    case ffi::BF16:
      return Launch<BF16>(stream, c, s, z, group_size, bits, rotation, spikes, count, off, size,
                          y);
    default:
      return Launch<F16>(stream, c, s, z, group_size, bits, rotation, spikes, count, off, size,
                         y);
  }
}

}  // namespace cuda
}  // namespace flashcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeIntoCuda, flashcomm::cuda::DequantizeInto,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()          // out: f32/bf16/f16, any shape
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes: (groups, record bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // scale: (groups,)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // zero: (groups,)
                                  .Arg<ffi::Buffer<ffi::S32>>()   // offset: () in device memory
                                  .Ret<ffi::AnyBuffer>()          // out, aliased to operand 0
                                  .Attr<int32_t>("bits")          // code width, 2..8
                                  .Attr<int64_t>("group_size")    // multiple of 8
                                  .Attr<int32_t>("rotation")      // 0, 1 or 2
                                  .Attr<int32_t>("spikes")        // kept per group, 0..16
                                  .Attr<int64_t>("count"));       // the chunk's elements
