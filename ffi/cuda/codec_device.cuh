// Device helpers of the codec kernels (ffi/cuda/codec_*.cu): launch constants, memory access
// of 8-element blocks, decoding with spikes, the f32 sums over chunks and the rotation's
// warp-wide Hadamard transform. Only geometry and memory access live here: every arithmetic
// step is a call into flashcomm/codec.h, the functions the CPU kernels run. No XLA headers, so
// the kernel translation units parse only CUDA and codec.h (docs/cuda.md, "Build time").
#ifndef FLASHCOMM_CUDA_CODEC_DEVICE_CUH_
#define FLASHCOMM_CUDA_CODEC_DEVICE_CUH_

#include <cuda_runtime.h>

#include <cstdint>

#include "flashcomm/codec.h"
#include "flashcomm/payload_view.h"

namespace flashcomm {
namespace cuda {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xFFFFFFFFu;
constexpr int kThreads = 256;  // threads per block
constexpr int kWarpsPerBlock = kThreads / kWarp;
constexpr int64_t kMaxGrid = int64_t(1) << 15;  // grid-stride beyond this many blocks
// Resident blocks per SM asked of ptxas (__launch_bounds__), i.e. a register cap of
// 65536 / (256 * k): 64 registers for the elementwise and quantize kernels (half occupancy or
// more), 128 for the fused dequantize-sum-quantize, which needs ~80-100 without spilling.
// Without a minimum ptxas targeted 32 registers for QuantizeKernel<F16> on sm_80 and spilled.
constexpr int kMinBlocks = 4;
constexpr int kMinBlocksFused = 2;

inline int GridFor(int64_t items, int64_t items_per_block) {
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return int(blocks < kMaxGrid ? blocks : kMaxGrid);
}

inline bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// ---- memory access: one block of 8 elements as f32 ----

// `vec`: the buffer is 16-byte aligned, so every block (8 elements of 2 or 4 bytes, at a
// multiple of 8 elements) can be moved with 16-byte vector accesses. Warp-uniform.
template <typename T>
__device__ __forceinline__ void load_block(const typename T::Storage* __restrict__ p, bool vec,
                                           float* v) {
  if constexpr (sizeof(typename T::Storage) == 4) {
    if (vec) {
      const float4 a = reinterpret_cast<const float4*>(p)[0];
      const float4 b = reinterpret_cast<const float4*>(p)[1];
      v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
      v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
      return;
    }
  } else {
    if (vec) {
      const uint4 a = reinterpret_cast<const uint4*>(p)[0];
      const uint32_t w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        v[2 * i] = T::load(uint16_t(w[i] & 0xFFFFu));
        v[2 * i + 1] = T::load(uint16_t(w[i] >> 16));
      }
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = T::load(p[j]);
}

template <typename T>
__device__ __forceinline__ void store_block(const float* v, bool vec,
                                            typename T::Storage* __restrict__ p) {
  if constexpr (sizeof(typename T::Storage) == 4) {
    if (vec) {
      reinterpret_cast<float4*>(p)[0] = make_float4(v[0], v[1], v[2], v[3]);
      reinterpret_cast<float4*>(p)[1] = make_float4(v[4], v[5], v[6], v[7]);
      return;
    }
  } else {
    if (vec) {
      uint32_t w[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        w[i] = uint32_t(T::store(v[2 * i])) | (uint32_t(T::store(v[2 * i + 1])) << 16);
      }
      reinterpret_cast<uint4*>(p)[0] = make_uint4(w[0], w[1], w[2], w[3]);
      return;
    }
  }
#pragma unroll
  for (int j = 0; j < kBlock; ++j) p[j] = T::store(v[j]);
}

// ---- codes: 8 codes of `bits` bits in `bits` bytes, little-endian (codec.h pack_block) ----
// The same bytes as codec.h's pack_block / unpack_block, moved with one access where the block
// is aligned to it (8, 4 and 2 bits: a block is 8, 4 or 2 bytes at a multiple of its size from
// an aligned payload; spike records shift it, hence the check) and shifted in 32-bit words.

__device__ __forceinline__ void store_codes(const uint32_t* q, int bits, uint8_t* out) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(out);
  if (bits == 8 && at % 8 == 0) {
    const uint32_t lo = q[0] | (q[1] << 8) | (q[2] << 16) | (q[3] << 24);
    const uint32_t hi = q[4] | (q[5] << 8) | (q[6] << 16) | (q[7] << 24);
    *reinterpret_cast<uint2*>(out) = make_uint2(lo, hi);
  } else if (bits == 4 && at % 4 == 0) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < kBlock; ++j) w |= q[j] << (4 * j);
    *reinterpret_cast<uint32_t*>(out) = w;
  } else if (bits == 2 && at % 2 == 0) {
    uint32_t w = 0;
#pragma unroll
    for (int j = 0; j < kBlock; ++j) w |= q[j] << (2 * j);
    *reinterpret_cast<uint16_t*>(out) = uint16_t(w);
  } else {
    pack_block(q, bits, out);
  }
}

__device__ __forceinline__ void load_codes(const uint8_t* __restrict__ in, int bits,
                                           uint32_t* q) {
  const uintptr_t at = reinterpret_cast<uintptr_t>(in);
  if (bits == 8 && at % 8 == 0) {
    const uint2 w = *reinterpret_cast<const uint2*>(in);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      q[j] = (w.x >> (8 * j)) & 0xFFu;
      q[j + 4] = (w.y >> (8 * j)) & 0xFFu;
    }
  } else if (bits == 4 && at % 4 == 0) {
    const uint32_t w = *reinterpret_cast<const uint32_t*>(in);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) q[j] = (w >> (4 * j)) & 0xFu;
  } else if (bits == 2 && at % 2 == 0) {
    const uint32_t w = *reinterpret_cast<const uint16_t*>(in);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) q[j] = (w >> (2 * j)) & 0x3u;
  } else {
    unpack_block(in, bits, q);
  }
}

// Decode block `blk` of group `group` of a payload into v.
__device__ __forceinline__ void decode_block(const uint8_t* __restrict__ codes,
                                             const uint16_t* __restrict__ scale,
                                             const uint16_t* __restrict__ zero, int64_t group,
                                             int64_t gbytes, int64_t blk, int bits, float* v) {
  const GroupParams p = stored_params(scale[group], zero[group]);
  uint32_t q[kBlock];
  load_codes(codes + group * gbytes + blk * bits, bits, q);
#pragma unroll
  for (int j = 0; j < kBlock; ++j) v[j] = decode(q[j], p);
}

// ---- spike reserving (codec.h, docs/format.md "Spike reserving") ----

// Put back the spikes of a spike record `spk` (k spikes, group of g values) that fall in block
// `blk` of the decoded values v, in record order (a later duplicate position wins, as in
// codec.h apply_spikes; a position >= g, only in a tampered payload, is outside every block).
// The write index is compared against 0..7 so that v stays in registers.
__device__ __forceinline__ void apply_block_spikes(const uint8_t* __restrict__ spk, int k,
                                                   int64_t g, int64_t blk, float* v) {
  for (int j = 0; j < k; ++j) {
    const int64_t at = spike_position(spk, k, g, j) - blk * kBlock;
    if (at >= 0 && at < kBlock) {
      const float value = spike_value(spk, j);
#pragma unroll
      for (int t = 0; t < kBlock; ++t) v[t] = t == at ? value : v[t];
    }
  }
}

// Decode block `blk` of group `group` of a payload whose records (stride `stride`) carry k
// spikes: the decoded codes, then the group's spikes that fall in this block.
__device__ __forceinline__ void decode_block_spiked(const uint8_t* __restrict__ codes,
                                                    const uint16_t* __restrict__ scale,
                                                    const uint16_t* __restrict__ zero,
                                                    int64_t group, int64_t stride, int64_t blk,
                                                    int bits, int64_t g, int k, float* v) {
  decode_block(codes, scale, zero, group, stride, blk, bits, v);
  apply_block_spikes(codes + group * stride + group_bytes(g, bits), k, g, blk, v);
}

// Block `blk` of chunk group `group` of the payload `in`, decoded (spikes put back if kSpiked).
template <bool kSpiked>
__device__ __forceinline__ void decode_payload_block(const PayloadView& in, int64_t group,
                                                     int64_t blk, float* v) {
  if constexpr (kSpiked) {
    decode_block_spiked(in.codes, in.scale, in.zero, group, in.group_bytes, blk, in.bits,
                        in.group_size, in.spikes, v);
  } else {
    decode_block(in.codes, in.scale, in.zero, group, in.group_bytes, blk, in.bits, v);
  }
}

// f32 sum over the chunk axis, in order 0..N-1, of block `blk` of output group `out_group`
// (= batch * groups_per_chunk + k): acc = chunk 0, then acc = acc + chunk c, like the CPU.
// With kSpiked each chunk's decoded block has its spikes put back before it is added.
template <bool kSpiked>
__device__ __forceinline__ void sum_block(const PayloadView& in, int64_t out_group, int64_t blk,
                                          float* acc) {
  const int64_t b = out_group / in.groups_per_chunk;
  const int64_t k = out_group - b * in.groups_per_chunk;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (b * in.chunks + c) * in.groups_per_chunk + k;
    float d[kBlock];
    decode_payload_block<kSpiked>(in, group, blk, d);
    if (c == 0) {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) acc[j] = d[j];
    } else {
#pragma unroll
      for (int j = 0; j < kBlock; ++j) acc[j] = add_rn(acc[j], d[j]);
    }
  }
  // The overflow fallback of codec.h (sum_shift): only where a plain sum is not finite and every
  // chunk's group is. It scales the same decoded values (spikes included).
  bool overflowed = false;
#pragma unroll
  for (int j = 0; j < kBlock; ++j) overflowed = overflowed || !is_finite(acc[j]);
  if (!overflowed) return;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (b * in.chunks + c) * in.groups_per_chunk + k;
    if (!is_finite(bf16_to_float(in.scale[group]))) return;
  }
  const int s = sum_shift(in.chunks);
  const float down = pow2f(-s), up = pow2f(s);
  float scaled[kBlock] = {};
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (b * in.chunks + c) * in.groups_per_chunk + k;
    float d[kBlock];
    decode_payload_block<kSpiked>(in, group, blk, d);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const float v = mul_rn(d[j], down);
      scaled[j] = c == 0 ? v : add_rn(scaled[j], v);
    }
  }
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    if (!is_finite(acc[j])) acc[j] = mul_rn(scaled[j], up);
  }
}

// ---- rotation (codec.h, docs/format.md "Rotation"): one warp per group, the group in shared
// memory (kWarpsPerBlock * G floats per block, G <= kMaxRotatedGroup). Each butterfly stage
// is split over the lanes; every output is the same single add or subtract as on the CPU.
// With spikes they are selected in the rotated domain (quantize) and put back before the
// inverse transform (dequantize, dequantize_sum). ----

inline size_t RotatedSharedBytes(int64_t group_size) {
  return size_t(kWarpsPerBlock) * size_t(group_size) * sizeof(float);
}

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

// Inverse rotation of the group in s, then store (saturated for dequantize, not for sums).
template <typename T>
__device__ __forceinline__ void unrotate_store(float* s, int group_size, int rotation,
                                               bool saturating, bool vec, int lane,
                                               typename T::Storage* __restrict__ y) {
  __syncwarp();
  warp_hadamard_scaled(s, group_size, lane);
  for (int blk = lane; blk < group_size / kBlock; blk += kWarp) {
    float v[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const int i = blk * kBlock + j;
      v[j] = rotation == kRotationSignedHadamard ? apply_sign(s[i], uint32_t(i)) : s[i];
      if (saturating) v[j] = saturate(v[j], T::kMax);
    }
    store_block<T>(v, vec, y + blk * kBlock);
  }
  __syncwarp();
}

}  // namespace
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_CODEC_DEVICE_CUH_
