// Warp-per-group quantization of the codec kernels (quantize, its rotated form and the fused
// dequantize_sum_quantize): the warp's min / max / finiteness reductions, encoding and
// packing, and the spike selection rounds (docs/cuda.md, "Spike reserving"). Every arithmetic
// step is a call into flashcomm/codec.h.
#ifndef FLASHCOMM_CUDA_CODEC_QUANTIZE_CUH_
#define FLASHCOMM_CUDA_CODEC_QUANTIZE_CUH_

#include "codec_device.cuh"

namespace flashcomm {
namespace cuda {
namespace {

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

// Min / max / all-finite over each aligned segment of `width` lanes (a power of two <= 32; the
// whole warp by default), called by all 32 lanes. Lanes without blocks hold (+inf, -inf, true).
// Every lane of a segment gets the same result: for finite groups min and max do not depend on
// the reduction order except for the sign of zero, which is canonicalized to +0 as in
// cpu::load_range; for non-finite groups lo and hi are not used.
__device__ __forceinline__ void warp_range(float& lo, float& hi, bool& finite,
                                           int width = kWarp) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    if (offset >= width) continue;  // warp-uniform
    const float l = __shfl_xor_sync(kFullMask, lo, offset);
    const float h = __shfl_xor_sync(kFullMask, hi, offset);
    lo = l < lo ? l : lo;
    hi = h > hi ? h : hi;
  }
  const unsigned all = __ballot_sync(kFullMask, finite);
  const unsigned segment = width == kWarp ? kFullMask
      : ((1u << width) - 1u) << ((int(threadIdx.x) % kWarp) & ~(width - 1));
  finite = (all & segment) == segment;
  lo = lo == 0.0f ? 0.0f : lo;
  hi = hi == 0.0f ? 0.0f : hi;
}

// Lanes per group for groups of `nblocks` blocks: the whole warp from 32 blocks on, else the
// smallest power of two >= nblocks, so that a warp quantizes kWarp / width groups at once
// (G = 128: two groups of 16 lanes, where one group would leave half the warp idle).
__host__ __device__ inline int SubWarpWidth(int64_t nblocks) {
  int width = 1;
  while (width < nblocks && width < kWarp) width *= 2;
  return width;
}

__device__ __forceinline__ void encode_block(const float* v, const GroupParams& p, bool finite,
                                             float levels, int bits, uint8_t* __restrict__ out) {
  uint32_t q[kBlock];
#pragma unroll
  for (int j = 0; j < kBlock; ++j) q[j] = finite ? encode(v[j], p, levels) : 0u;
  store_codes(q, bits, out);
}

// Quantize group `group` (nblocks blocks, produced by source(group, blk, v)) with a segment of
// `width` lanes (the whole warp by default; `lane` is the lane within the segment). Called by
// all 32 lanes of the warp, each segment with its own group; a segment with `active` false
// (past the last group) takes part in the shuffles only.
template <typename Source>
__device__ __forceinline__ void quantize_group_warp(const Source& source, int64_t group,
                                                    int64_t nblocks, int bits, int lane,
                                                    uint8_t* __restrict__ codes,
                                                    uint16_t* __restrict__ scale,
                                                    uint16_t* __restrict__ zero,
                                                    int width = kWarp, bool active = true) {
  float lo = bits_to_float(0x7F800000u);   // +inf
  float hi = bits_to_float(0xFF800000u);   // -inf
  bool finite = true;
  const int64_t blocks = active ? nblocks : 0;
  const bool has_first = lane < blocks;
  float first[kBlock];
  if (has_first) {
    source(group, lane, first);
    block_range(first, lo, hi, finite);
  }
  for (int64_t blk = lane + width; blk < blocks; blk += width) {
    float v[kBlock];
    source(group, blk, v);
    block_range(v, lo, hi, finite);
  }
  warp_range(lo, hi, finite, width);
  if (!active) return;
  const GroupParams p = group_params(lo, hi, finite, bits);
  if (lane == 0) {
    scale[group] = p.scale_bits;
    zero[group] = p.zero_bits;
  }
  const float levels = float(max_code(bits));
  uint8_t* out = codes + group * group_bytes(nblocks * kBlock, bits);
  if (has_first) encode_block(first, p, finite, levels, bits, out + int64_t(lane) * bits);
  for (int64_t blk = lane + width; blk < blocks; blk += width) {
    float v[kBlock];
    source(group, blk, v);
    encode_block(v, p, finite, levels, bits, out + blk * bits);
  }
}

// Quantize groups 0 .. n_groups - 1 of `source`, kWarp / width of them per warp at a time
// (width = SubWarpWidth(nblocks)), grid-stride over the calling kernel's warps.
template <typename Source>
__device__ __forceinline__ void quantize_groups_subwarp(const Source& source, int64_t n_groups,
                                                        int64_t nblocks, int bits, int width,
                                                        uint8_t* __restrict__ codes,
                                                        uint16_t* __restrict__ scale,
                                                        uint16_t* __restrict__ zero) {
  const int lane = int(threadIdx.x) % kWarp;
  const int per_warp = kWarp / width;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t w = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp;
       w * per_warp < n_groups; w += warps) {
    const int64_t g = w * per_warp + lane / width;
    const bool active = g < n_groups;
    quantize_group_warp(source, active ? g : 0, nblocks, bits, lane % width, codes, scale,
                        zero, width, active);
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
  // long function: one warp's spiked quantization of a group, step for step codec.h's; its steps
  // share the lanes' registers
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

// The rotated group in shared memory (QuantizeRotatedKernel).
struct SharedSource {
  const float* s;
  __device__ __forceinline__ void operator()(int64_t, int64_t blk, float* v) const {
#pragma unroll
    for (int j = 0; j < kBlock; ++j) v[j] = s[blk * kBlock + j];
  }
};

}  // namespace
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_CODEC_QUANTIZE_CUH_
