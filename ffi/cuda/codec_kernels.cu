// XLA FFI handlers of the codec on CUDA: quantize, dequantize, dequantize_sum and
// dequantize_sum_quantize, with the same targets, operands, attributes and layouts as the CPU
// handlers (ffi/cpu/codec_kernels.cc, docs/format.md). This file holds only launch geometry,
// memory access and warp reductions; every codec operation is a call into
// ffi/include/flashcomm/codec.h, the arithmetic the CPU kernels run, so results are
// bit-identical to the CPU ones (built with --fmad=false; codec.h uses __fmul_rn/__fadd_rn).
//
// Geometry (docs/cuda.md):
// - quantize and dequantize_sum_quantize: one warp per group, kWarpsPerBlock warps per block,
//   grid-stride over groups. Lane l handles the group's 8-element blocks l, l + 32, ...; the
//   warp reduces min / max (__shfl_xor_sync) and finiteness (__all_sync); every lane derives
//   the group's parameters with flashcomm::group_params; lane 0 stores scale and zero; each
//   lane encodes and packs its blocks. A lane keeps its first block in registers between the
//   range pass and the encode pass (groups of up to 256 values are read once); further blocks
//   are read (or, for the fused op, decoded and summed) again in the encode pass.
// - dequantize and dequantize_sum: one thread per 8-element block, grid-stride. The fused sum
//   decodes chunks 0..N-1 in order and accumulates in f32 exactly like the CPU kernel.
// - rotation: one warp per group with the group in shared memory (see below).
// - spike reserving (spikes = k > 0): the same geometry, in separate template instances
//   (kSpiked), so the spikes = 0 kernels are unchanged. Quantizing warps select the k spikes in
//   k warp-wide rounds (quantize_group_spiked_warp); decoding threads put back the spikes that
//   fall in their 8-element block (apply_block_spikes).
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

int GridFor(int64_t items, int64_t items_per_block) {
  const int64_t blocks = (items + items_per_block - 1) / items_per_block;
  return int(blocks < kMaxGrid ? blocks : kMaxGrid);
}

bool Aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

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

// Decode block `blk` of group `group` of a payload into v.
__device__ __forceinline__ void decode_block(const uint8_t* __restrict__ codes,
                                             const uint16_t* __restrict__ scale,
                                             const uint16_t* __restrict__ zero, int64_t group,
                                             int64_t gbytes, int64_t blk, int bits, float* v) {
  const GroupParams p = stored_params(scale[group], zero[group]);
  uint32_t q[kBlock];
  unpack_block(codes + group * gbytes + blk * bits, bits, q);
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

// ---- warp-per-group quantization ----

// Running min / max / finiteness over one block, with the CPU's comparisons.
__device__ __forceinline__ void block_range(const float* v, float& lo, float& hi, bool& finite) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    lo = v[j] < lo ? v[j] : lo;
    hi = v[j] > hi ? v[j] : hi;
    finite = finite && is_finite(v[j]);
  }
}

// Warp-wide min / max / all-finite. Lanes without blocks hold (+inf, -inf, true). Every lane
// gets the same result: for finite groups min and max do not depend on the reduction order
// except for the sign of zero, which is canonicalized to +0 as in cpu::load_range; for
// non-finite groups lo and hi are not used.
__device__ __forceinline__ void warp_range(float& lo, float& hi, bool& finite) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const float l = __shfl_xor_sync(kFullMask, lo, offset);
    const float h = __shfl_xor_sync(kFullMask, hi, offset);
    lo = l < lo ? l : lo;
    hi = h > hi ? h : hi;
  }
  finite = __all_sync(kFullMask, finite) != 0;
  lo = lo == 0.0f ? 0.0f : lo;
  hi = hi == 0.0f ? 0.0f : hi;
}

__device__ __forceinline__ void encode_block(const float* v, const GroupParams& p, bool finite,
                                             float levels, int bits, uint8_t* __restrict__ out) {
  uint32_t q[kBlock];
#pragma unroll
  for (int j = 0; j < kBlock; ++j) q[j] = finite ? encode(v[j], p, levels) : 0u;
  pack_block(q, bits, out);
}

// Quantize group `group` (nblocks blocks, produced by source(blk, v)) with the calling warp.
// Called by all 32 lanes of the warp (the group index is warp-uniform).
template <typename Source>
__device__ __forceinline__ void quantize_group_warp(const Source& source, int64_t group,
                                                    int64_t nblocks, int bits, int lane,
                                                    uint8_t* __restrict__ codes,
                                                    uint16_t* __restrict__ scale,
                                                    uint16_t* __restrict__ zero) {
  float lo = bits_to_float(0x7F800000u);   // +inf
  float hi = bits_to_float(0xFF800000u);   // -inf
  bool finite = true;
  const bool has_first = lane < nblocks;
  float first[kBlock];
  if (has_first) {
    source(group, lane, first);
    block_range(first, lo, hi, finite);
  }
  for (int64_t blk = lane + kWarp; blk < nblocks; blk += kWarp) {
    float v[kBlock];
    source(group, blk, v);
    block_range(v, lo, hi, finite);
  }
  warp_range(lo, hi, finite);
  const GroupParams p = group_params(lo, hi, finite, bits);
  if (lane == 0) {
    scale[group] = p.scale_bits;
    zero[group] = p.zero_bits;
  }
  const float levels = float(max_code(bits));
  uint8_t* out = codes + group * group_bytes(nblocks * kBlock, bits);
  if (has_first) encode_block(first, p, finite, levels, bits, out + int64_t(lane) * bits);
  for (int64_t blk = lane + kWarp; blk < nblocks; blk += kWarp) {
    float v[kBlock];
    source(group, blk, v);
    encode_block(v, p, finite, levels, bits, out + blk * bits);
  }
}

// Spike selection order (codec.h select_spikes): value i ranks by (spike_key, then lower
// position), packed as key << 32 | ~i so that a larger rank is a higher priority. All ranks of
// a group differ, and none is 0 or ~0 (i < 2^31 and key <= 0x7FFFFFFF).
__device__ __forceinline__ uint64_t spike_rank(float v, int64_t i) {
  return (uint64_t(spike_key(v)) << 32) | uint64_t(~uint32_t(i));
}

// One selection round over a block: the highest rank below `bound`, and its value.
__device__ __forceinline__ void block_best_below(const float* v, int64_t blk, uint64_t bound,
                                                 uint64_t& best, float& best_v) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    const uint64_t r = spike_rank(v[j], blk * kBlock + j);
    if (r < bound && r > best) {
      best = r;
      best_v = v[j];
    }
  }
}

// The range pass over a block with spikes: min / max over the values that are not spikes (rank
// below `last`, the rank of the k-th spike: the set of v' minus the copies of its first kept
// value, so the same min and max), finiteness over all values, and the lowest kept position.
__device__ __forceinline__ void block_kept_range(const float* v, int64_t blk, uint64_t last,
                                                 float& lo, float& hi, bool& finite,
                                                 int64_t& first, float& first_v) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    const int64_t i = blk * kBlock + j;
    finite = finite && is_finite(v[j]);
    if (spike_rank(v[j], i) < last) {
      lo = v[j] < lo ? v[j] : lo;
      hi = v[j] > hi ? v[j] : hi;
      if (i < first) {
        first = i;
        first_v = v[j];
      }
    }
  }
}

// v' of a block: the spikes (rank >= last) replaced by the first kept value.
__device__ __forceinline__ void block_stand_in(float* v, int64_t blk, uint64_t last,
                                               float stand_in) {
#pragma unroll
  for (int j = 0; j < kBlock; ++j) {
    v[j] = spike_rank(v[j], blk * kBlock + j) >= last ? stand_in : v[j];
  }
}

// Quantize group `group` with k spikes (1 <= k <= 16, k < G) with the calling warp, into records
// of record_bytes(G, bits, k) bytes. Called by all 32 lanes (the group index is warp-uniform).
// No per-group array: k selection rounds each take, over the whole group, the highest rank
// below the previous round's (a lane scans its blocks, then a warp max by __shfl_xor_sync
// carries the value along), which yields select_spikes' positions in its order; lane j keeps
// spike j. The spikes are then identified by rank (>= the k-th spike's), so the range pass and
// the encode pass see v' of docs/format.md. Lane j < k writes spike j's value and position.
// The source is read k + 2 times, except each lane's first block, which stays in registers
// (groups of up to 256 values are read once).
template <typename Source>
__device__ __forceinline__ void quantize_group_spiked_warp(const Source& source, int64_t group,
                                                           int64_t nblocks, int bits, int k,
                                                           int lane,
                                                           uint8_t* __restrict__ codes,
                                                           uint16_t* __restrict__ scale,
                                                           uint16_t* __restrict__ zero) {
  const int64_t g = nblocks * kBlock;
  const bool has_first = lane < nblocks;
  float first_block[kBlock];
  if (has_first) source(group, lane, first_block);

  // 1. Selection.
  uint64_t bound = ~uint64_t(0);
  int64_t my_pos = 0;
  float my_value = 0.0f;
  for (int r = 0; r < k; ++r) {
    uint64_t best = 0;
    float best_v = 0.0f;
    if (has_first) block_best_below(first_block, lane, bound, best, best_v);
    for (int64_t blk = lane + kWarp; blk < nblocks; blk += kWarp) {
      float v[kBlock];
      source(group, blk, v);
      block_best_below(v, blk, bound, best, best_v);
    }
#pragma unroll
    for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
      const uint64_t o = __shfl_xor_sync(kFullMask, best, offset);
      const float ov = __shfl_xor_sync(kFullMask, best_v, offset);
      if (o > best) {
        best = o;
        best_v = ov;
      }
    }
    bound = best;  // k < G: some value is always left, so best is a real rank
    if (lane == r) {
      my_pos = int64_t(~uint32_t(best));
      my_value = best_v;
    }
  }

  // 2. Range of the kept values, finiteness of all, the first kept value.
  float lo = bits_to_float(0x7F800000u);   // +inf
  float hi = bits_to_float(0xFF800000u);   // -inf
  bool finite = true;
  int64_t first = g;
  float stand_in = 0.0f;
  if (has_first) block_kept_range(first_block, lane, bound, lo, hi, finite, first, stand_in);
  for (int64_t blk = lane + kWarp; blk < nblocks; blk += kWarp) {
    float v[kBlock];
    source(group, blk, v);
    block_kept_range(v, blk, bound, lo, hi, finite, first, stand_in);
  }
  warp_range(lo, hi, finite);
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const int64_t o = __shfl_xor_sync(kFullMask, first, offset);
    const float ov = __shfl_xor_sync(kFullMask, stand_in, offset);
    if (o < first) {
      first = o;
      stand_in = ov;
    }
  }
  const GroupParams p = group_params(lo, hi, finite, bits);
  if (lane == 0) {
    scale[group] = p.scale_bits;
    zero[group] = p.zero_bits;
  }

  // 3. Codes of v'.
  const float levels = float(max_code(bits));
  uint8_t* out = codes + group * record_bytes(g, bits, k);
  if (has_first) {
    block_stand_in(first_block, lane, bound, stand_in);
    encode_block(first_block, p, finite, levels, bits, out + int64_t(lane) * bits);
  }
  for (int64_t blk = lane + kWarp; blk < nblocks; blk += kWarp) {
    float v[kBlock];
    source(group, blk, v);
    block_stand_in(v, blk, bound, stand_in);
    encode_block(v, p, finite, levels, bits, out + blk * bits);
  }

  // 4. The spike record: values (bf16, little-endian), then positions.
  if (lane < k) {
    uint8_t* rec = out + group_bytes(g, bits);
    const uint16_t h = spike_bits(my_value, finite);
    rec[2 * lane] = uint8_t(h);
    rec[2 * lane + 1] = uint8_t(h >> 8);
    const int64_t pb = position_bytes(g);
    uint8_t* pos = rec + 2 * k + pb * lane;
    pos[0] = uint8_t(my_pos);
    if (pb == 2) pos[1] = uint8_t(my_pos >> 8);
  }
}

template <typename T>
struct LoadSource {
  const typename T::Storage* __restrict__ x;
  int64_t group_size;
  bool vec;
  __device__ __forceinline__ void operator()(int64_t group, int64_t blk, float* v) const {
    load_block<T>(x + group * group_size + blk * kBlock, vec, v);
  }
};

template <bool kSpiked>
struct SumSource {
  PayloadView in;
  __device__ __forceinline__ void operator()(int64_t group, int64_t blk, float* v) const {
    sum_block<kSpiked>(in, group, blk, v);
  }
};

// ---- kernels ----
// Every kernel is a template on kSpiked (spikes > 0, decided per launch on the host), so the
// spikes = 0 instances are the kernels without spike reserving, unchanged.

template <typename T, bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocks)
    QuantizeKernel(const typename T::Storage* __restrict__ x, int64_t n_groups,
                   int64_t group_size, int bits, int spikes, bool vec,
                   uint8_t* __restrict__ codes, uint16_t* __restrict__ scale,
                   uint16_t* __restrict__ zero) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const LoadSource<T> source{x, group_size, vec};
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_groups;
       g += warps) {
    if constexpr (kSpiked) {
      quantize_group_spiked_warp(source, g, group_size / kBlock, bits, spikes, lane, codes,
                                 scale, zero);
    } else {
      quantize_group_warp(source, g, group_size / kBlock, bits, lane, codes, scale, zero);
    }
  }
}

// Input and output records carry the same number of spikes.
template <bool kSpiked>
__global__ void __launch_bounds__(kThreads, kMinBlocksFused)
    DequantizeSumQuantizeKernel(PayloadView in, int64_t n_out, int out_bits,
                                uint8_t* __restrict__ codes, uint16_t* __restrict__ scale,
                                uint16_t* __restrict__ zero) {
  const int lane = int(threadIdx.x) % kWarp;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const SumSource<kSpiked> source{in};
  for (int64_t g = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; g < n_out;
       g += warps) {
    if constexpr (kSpiked) {
      quantize_group_spiked_warp(source, g, in.group_size / kBlock, out_bits, in.spikes, lane,
                                 codes, scale, zero);
    } else {
      quantize_group_warp(source, g, in.group_size / kBlock, out_bits, lane, codes, scale,
                          zero);
    }
  }
}

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

// ---- rotation (codec.h, docs/format.md "Rotation"): one warp per group, the group in shared
// memory (kWarpsPerBlock * G floats per block, G <= kMaxRotatedGroup). Each butterfly stage
// is split over the lanes; every output is the same single add or subtract as on the CPU.
// With spikes they are selected in the rotated domain (quantize) and put back before the
// inverse transform (dequantize, dequantize_sum). ----

constexpr int64_t kMaxRotatedGroup = 1024;  // 8 warps * 1024 * 4 B = 32 KB of shared memory

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

struct SharedSource {
  const float* s;
  __device__ __forceinline__ void operator()(int64_t, int64_t blk, float* v) const {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = s[blk * kBlock + j];
  }
};

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

// ---- host side ----

ffi::Error LaunchStatus(const char* op) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    return ffi::Error::Internal(std::string(op) + ": CUDA kernel launch failed: " +
                                cudaGetErrorName(err) + ": " + cudaGetErrorString(err));
  }
  return ffi::Error::Success();
}

template <typename T, bool kSpiked>
ffi::Error LaunchQuantize(cudaStream_t stream, const void* x, int64_t n_groups,
                          int64_t group_size, int bits, int spikes, uint8_t* codes,
                          uint16_t* scale, uint16_t* zero) {
  if (n_groups == 0) return ffi::Error::Success();
  const auto* xs = static_cast<const typename T::Storage*>(x);
  QuantizeKernel<T, kSpiked><<<GridFor(n_groups, kWarpsPerBlock), kThreads, 0, stream>>>(
      xs, n_groups, group_size, bits, spikes, Aligned16(xs), codes, scale, zero);
  return LaunchStatus("flashcomm_quantize");
}

template <typename T, bool kSpiked>
ffi::Error LaunchDequantize(cudaStream_t stream, const uint8_t* codes, const uint16_t* scale,
                            const uint16_t* zero, int64_t n_groups, int64_t group_size,
                            int bits, int spikes, void* y) {
  const int64_t total = n_groups * (group_size / kBlock);
  if (total == 0) return ffi::Error::Success();
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeKernel<T, kSpiked><<<GridFor(total, kThreads), kThreads, 0, stream>>>(
      codes, scale, zero, n_groups, group_size, bits, spikes, Aligned16(ys), ys);
  return LaunchStatus("flashcomm_dequantize");
}

template <typename T, bool kSpiked>
ffi::Error LaunchDequantizeSum(cudaStream_t stream, const PayloadView& in, void* y) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  const int64_t total = n_out * (in.group_size / kBlock);
  if (total == 0) return ffi::Error::Success();
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeSumKernel<T, kSpiked><<<GridFor(total, kThreads), kThreads, 0, stream>>>(
      in, n_out, Aligned16(ys), ys);
  return LaunchStatus("flashcomm_dequantize_sum");
}

ffi::Error CheckRotation(int32_t rotation, int64_t group_size, const char* op) {
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rotation must be 0, 1 or 2");
  }
  if (rotation != kRotationNone && ((group_size & (group_size - 1)) != 0 ||
                                    group_size > kMaxRotatedGroup)) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": rotation needs a power-of-two group_size of at most 1024 on CUDA");
  }
  return ffi::Error::Success();
}

size_t RotatedSharedBytes(int64_t group_size) {
  return size_t(kWarpsPerBlock) * size_t(group_size) * sizeof(float);
}

template <typename T, bool kSpiked>
ffi::Error LaunchQuantizeRotated(cudaStream_t stream, const void* x, int64_t n_groups,
                                 int64_t group_size, int bits, int rotation, int spikes,
                                 uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  if (n_groups == 0) return ffi::Error::Success();
  const auto* xs = static_cast<const typename T::Storage*>(x);
  QuantizeRotatedKernel<T, kSpiked><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                                      RotatedSharedBytes(group_size), stream>>>(
      xs, n_groups, int(group_size), bits, rotation, spikes, Aligned16(xs), codes, scale, zero);
  return LaunchStatus("flashcomm_quantize");
}

template <typename T, bool kSpiked>
ffi::Error LaunchDequantizeRotated(cudaStream_t stream, const uint8_t* codes,
                                   const uint16_t* scale, const uint16_t* zero,
                                   int64_t n_groups, int64_t group_size, int bits, int rotation,
                                   int spikes, void* y) {
  if (n_groups == 0) return ffi::Error::Success();
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeRotatedKernel<T, kSpiked><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                                        RotatedSharedBytes(group_size), stream>>>(
      codes, scale, zero, n_groups, int(group_size), bits, rotation, spikes, Aligned16(ys), ys);
  return LaunchStatus("flashcomm_dequantize");
}

template <typename T, bool kSpiked>
ffi::Error LaunchDequantizeSumRotated(cudaStream_t stream, const PayloadView& in, int rotation,
                                      void* y) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  if (n_out == 0) return ffi::Error::Success();
  auto* ys = static_cast<typename T::Storage*>(y);
  DequantizeSumRotatedKernel<T, kSpiked><<<GridFor(n_out, kWarpsPerBlock), kThreads,
                                           RotatedSharedBytes(in.group_size), stream>>>(
      in, n_out, rotation, Aligned16(ys), ys);
  return LaunchStatus("flashcomm_dequantize_sum");
}

// The launcher of one (rotated?, spiked?) path for a runtime element type: calls
// launch(Tag<T>{}) with T = F32, BF16 or F16.
template <typename T>
struct Tag {
  using type = T;
};

template <typename Launch>
ffi::Error ForDtype(ffi::DataType dtype, const char* what, Launch launch) {
  switch (dtype) {
    case ffi::F32:
      return launch(Tag<F32>{});
    case ffi::BF16:
      return launch(Tag<BF16>{});
    case ffi::F16:
      return launch(Tag<F16>{});
    default:
      return ffi::Error::InvalidArgument(what);
  }
}

}  // namespace

ffi::Error Quantize(cudaStream_t stream, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::U8>> codes,
                    ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                    ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                    int64_t group_size, int32_t rotation, int32_t spikes) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, *codes, *scale, *zero, bits, group_size, spikes,
                                         &n_groups);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_quantize"); e.failure()) {
    return e;
  }
  uint8_t* c = codes->typed_data();
  uint16_t* s = scale->typed_data();
  uint16_t* z = zero->typed_data();
  const void* xd = x.untyped_data();
  return ForDtype(x.element_type(), "flashcomm_quantize: x must be f32, bf16 or f16",
                  [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchQuantizeRotated<T, true>(stream, xd, n_groups, group_size, bits,
                                                         rotation, spikes, c, s, z)
                        : LaunchQuantizeRotated<T, false>(stream, xd, n_groups, group_size,
                                                          bits, rotation, 0, c, s, z);
    }
    return spikes > 0 ? LaunchQuantize<T, true>(stream, xd, n_groups, group_size, bits, spikes,
                                                c, s, z)
                      : LaunchQuantize<T, false>(stream, xd, n_groups, group_size, bits, 0, c,
                                                 s, z);
  });
}

ffi::Error Dequantize(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                      ffi::Buffer<ffi::BF16> scale, ffi::Buffer<ffi::BF16> zero,
                      ffi::Result<ffi::AnyBuffer> y, int32_t bits, int64_t group_size,
                      int32_t rotation, int32_t spikes) {
  int64_t n_groups = 0;
  if (ffi::Error e = CheckDequantizeShapes(codes, scale, zero, *y, bits, group_size, spikes,
                                           &n_groups);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize"); e.failure()) {
    return e;
  }
  const uint8_t* c = codes.typed_data();
  const uint16_t* s = scale.typed_data();
  const uint16_t* z = zero.typed_data();
  void* yd = y->untyped_data();
  return ForDtype(y->element_type(), "flashcomm_dequantize: y must be f32, bf16 or f16",
                  [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchDequantizeRotated<T, true>(stream, c, s, z, n_groups,
                                                           group_size, bits, rotation, spikes,
                                                           yd)
                        : LaunchDequantizeRotated<T, false>(stream, c, s, z, n_groups,
                                                            group_size, bits, rotation, 0, yd);
    }
    return spikes > 0 ? LaunchDequantize<T, true>(stream, c, s, z, n_groups, group_size, bits,
                                                  spikes, yd)
                      : LaunchDequantize<T, false>(stream, c, s, z, n_groups, group_size, bits,
                                                   0, yd);
  });
}

ffi::Error DequantizeSum(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                         ffi::Buffer<ffi::BF16> scale, ffi::Buffer<ffi::BF16> zero,
                         ffi::Result<ffi::AnyBuffer> y, int32_t bits, int64_t group_size,
                         int32_t rotation, int32_t spikes) {
  PayloadView in;
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, &in);
      e.failure()) {
    return e;
  }
  if (y->element_count() != size_t(in.batch * in.groups_per_chunk * group_size)) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize_sum: y has the wrong size");
  }
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize_sum");
      e.failure()) {
    return e;
  }
  void* yd = y->untyped_data();
  return ForDtype(y->element_type(), "flashcomm_dequantize_sum: y must be f32, bf16 or f16",
                  [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchDequantizeSumRotated<T, true>(stream, in, rotation, yd)
                        : LaunchDequantizeSumRotated<T, false>(stream, in, rotation, yd);
    }
    return spikes > 0 ? LaunchDequantizeSum<T, true>(stream, in, yd)
                      : LaunchDequantizeSum<T, false>(stream, in, yd);
  });
}

ffi::Error DequantizeSumQuantize(cudaStream_t stream, ffi::Buffer<ffi::U8> codes,
                                 ffi::Buffer<ffi::BF16> scale, ffi::Buffer<ffi::BF16> zero,
                                 ffi::Result<ffi::Buffer<ffi::U8>> out_codes,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> out_scale,
                                 ffi::Result<ffi::Buffer<ffi::BF16>> out_zero, int32_t bits,
                                 int32_t out_bits, int64_t group_size, int32_t spikes) {
  PayloadView in;
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, &in);
      e.failure()) {
    return e;
  }
  int64_t n_out = 0;
  if (ffi::Error e = CheckSumQuantizeOutputs(in, *out_codes, *out_scale, *out_zero, out_bits,
                                             &n_out);
      e.failure()) {
    return e;
  }
  if (n_out == 0) return ffi::Error::Success();
  const int grid = GridFor(n_out, kWarpsPerBlock);
  if (spikes > 0) {
    DequantizeSumQuantizeKernel<true><<<grid, kThreads, 0, stream>>>(
        in, n_out, out_bits, out_codes->typed_data(), out_scale->typed_data(),
        out_zero->typed_data());
  } else {
    DequantizeSumQuantizeKernel<false><<<grid, kThreads, 0, stream>>>(
        in, n_out, out_bits, out_codes->typed_data(), out_scale->typed_data(),
        out_zero->typed_data());
  }
  return LaunchStatus("flashcomm_dequantize_sum_quantize");
}

}  // namespace cuda
}  // namespace flashcomm

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommQuantizeCuda, flashcomm::cuda::Quantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::AnyBuffer>()              // x: (..., group_size)
                                  .Ret<ffi::Buffer<ffi::U8>>()        // codes: (..., group bytes)
                                  .Ret<ffi::Buffer<ffi::BF16>>()      // scale: (...)
                                  .Ret<ffi::Buffer<ffi::BF16>>()      // zero: (...)
                                  .Attr<int32_t>("bits")              // code width, 2..8
                                  .Attr<int64_t>("group_size")        // multiple of 8
                                  .Attr<int32_t>("rotation")          // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));          // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeCuda, flashcomm::cuda::Dequantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::U8>>()        // codes: (..., group bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()      // scale: (...)
                                  .Arg<ffi::Buffer<ffi::BF16>>()      // zero: (...)
                                  .Ret<ffi::AnyBuffer>()              // y: (..., group_size)
                                  .Attr<int32_t>("bits")              // code width, 2..8
                                  .Attr<int64_t>("group_size")        // multiple of 8
                                  .Attr<int32_t>("rotation")          // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));          // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeSumCuda, flashcomm::cuda::DequantizeSum,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes: (..., N, G/chunk, bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // scale: (..., N, G/chunk)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // zero: (..., N, G/chunk)
                                  .Ret<ffi::AnyBuffer>()          // y: (..., G/chunk * group_size)
                                  .Attr<int32_t>("bits")          // code width of the input
                                  .Attr<int64_t>("group_size")    // multiple of 8
                                  .Attr<int32_t>("rotation")      // 0, 1 or 2
                                  .Attr<int32_t>("spikes"));      // kept per group, 0..16

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommDequantizeSumQuantizeCuda,
                              flashcomm::cuda::DequantizeSumQuantize,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()  // stream
                                  .Arg<ffi::Buffer<ffi::U8>>()    // codes: (..., N, G/chunk, bytes)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // scale: (..., N, G/chunk)
                                  .Arg<ffi::Buffer<ffi::BF16>>()  // zero: (..., N, G/chunk)
                                  .Ret<ffi::Buffer<ffi::U8>>()    // codes: (..., G/chunk, bytes')
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // scale: (..., G/chunk)
                                  .Ret<ffi::Buffer<ffi::BF16>>()  // zero: (..., G/chunk)
                                  .Attr<int32_t>("bits")          // code width of the input
                                  .Attr<int32_t>("out_bits")      // code width of the output
                                  .Attr<int64_t>("group_size")    // multiple of 8
                                  .Attr<int32_t>("spikes"));      // in and out, 0..16
