// Kernels of the floating-point group formats on CUDA (fp8, mxfp4, nvfp4; handlers:
// fp_handlers.cc): one warp per group, the group in shared memory as f32 (kWarpsPerBlock * G
// floats per block, G <= kMaxRotatedGroup), every arithmetic step a call into
// flashcomm/fp_codec.h and codec.h as on the CPU (ffi/cpu/cpu_fp.h), so the
// records are the CPU's bit for bit (tests/gpu/test_gpu_fp_formats.py, run on an H200).
#include <cuda_runtime.h>

#include <cstdint>

#include "codec_device.cuh"
#include "flashcomm/codec.h"
#include "flashcomm/fp_codec.h"
#include "launch.h"

namespace flashcomm {
namespace cuda {
namespace {

__device__ __forceinline__ uint32_t warp_max_u32(uint32_t v, int width = kWarp) {
  for (int off = width / 2; off > 0; off /= 2) {
    const uint32_t o = __shfl_xor_sync(kFullMask, v, off, width);
    v = o > v ? o : v;
  }
  return v;
}

__device__ __forceinline__ uint64_t warp_max_u64(uint64_t v) {
  for (int off = kWarp / 2; off > 0; off /= 2) {
    const uint64_t o = __shfl_xor_sync(kFullMask, v, off);
    v = o > v ? o : v;
  }
  return v;
}

// The group's largest magnitude (f32 bits; an Inf or NaN gives bits >= 0x7F800000).
__device__ __forceinline__ uint32_t group_amax_bits(const float* s, int g, int lane) {
  uint32_t m = 0;
  for (int i = lane; i < g; i += kWarp) {
    const uint32_t a = float_to_bits(s[i]) & 0x7FFFFFFFu;
    m = a > m ? a : m;
  }
  return warp_max_u32(m);
}

// codec.h select_spikes over the warp: k rounds of "the first position of the largest key not
// yet taken" (a 64-bit max of (key + 1, ~position)).
// pos: the warp's kMaxSpikes positions in shared memory.
__device__ __forceinline__ void select_spikes_warp(const float* s, int g, int k, int lane,
                                                   int32_t* pos) {
  for (int j = 0; j < k; ++j) {
    uint64_t best = 0;
    for (int i = lane; i < g; i += kWarp) {
      bool taken = false;
      for (int t = 0; t < j; ++t) taken = taken || pos[t] == i;
      const uint64_t key = uint64_t((float_to_bits(s[i]) & 0x7FFFFFFFu) + 1u);
      const uint64_t cand = taken ? 0 : (key << 32) | uint64_t(0xFFFFFFFFu - uint32_t(i));
      best = cand > best ? cand : best;
    }
    best = warp_max_u64(best);
    if (lane == 0) pos[j] = int32_t(0xFFFFFFFFu - uint32_t(best & 0xFFFFFFFFu));
    __syncwarp();
  }
}

// E2M1 code c of element i (lane-strided, i = base + lane): the even lane writes its byte with
// its odd neighbour's code in the high nibble.
__device__ __forceinline__ void store_nibble_pair(uint32_t c, int i, bool active, uint8_t* codes) {
  const uint32_t next = __shfl_down_sync(kFullMask, c, 1);
  if (active && (i & 1) == 0) codes[i / 2] = uint8_t(c | (next << 4));
}

// cpu_fp.h fp_encode_group, one warp: s (G f32, spikes zeroed), amax its largest magnitude.
__device__ __forceinline__ void encode_group_warp(const float* s, int g, int32_t fmt,
                                                  float amax, bool finite, int lane,
                                                  uint8_t* rec) {
  const int nc = int(fp_code_bytes(fmt, g)), ns = int(fp_scale_bytes(fmt, g));
  uint8_t* scales = rec + nc;
  if (!finite) {
    for (int i = lane; i < nc + ns; i += kWarp) {
      uint8_t b = 0;
      if (i >= nc) {
        const int j = i - nc;
        if (fmt == kFormatFp8) b = uint8_t(j == 0 ? (kBf16NaN & 0xFF) : (kBf16NaN >> 8));
        if (fmt == kFormatMxfp4 || (fmt == kFormatNvfp4 && j == ns - 1)) b = uint8_t(kE8m0Nan);
      }
      rec[i] = b;
    }
    return;
  }
  if (fmt == kFormatFp8) {
    const uint16_t sb = fp8_scale_bits(amax);
    if (lane == 0) {
      scales[0] = uint8_t(sb & 0xFF);
      scales[1] = uint8_t(sb >> 8);
    }
    const float inv = fp_inverse(bf16_to_float(sb));
    for (int i = lane; i < g; i += kWarp) {
      const float q = mul_rn(s[i], inv);
      rec[i] = uint8_t(with_sign(e4m3_encode(bits_to_float(float_to_bits(q) & 0x7FFFFFFFu)), q,
                                 7));
    }
    return;
  }
  if (fmt == kFormatMxfp4) {
    for (int b = 0; b < g / 32; ++b) {
      const int i = b * 32 + lane;
      const uint32_t amax_b = warp_max_u32(float_to_bits(s[i]) & 0x7FFFFFFFu);
      const uint32_t byte = mxfp4_byte(bits_to_float(amax_b));
      if (lane == 0) scales[b] = uint8_t(byte);
      const float q = mul_rn(s[i], e8m0_value(254u - byte));
      const uint32_t c =
          with_sign(e2m1_encode(bits_to_float(float_to_bits(q) & 0x7FFFFFFFu)), q, 3);
      store_nibble_pair(c, i, true, rec);
    }
    return;
  }
  const uint32_t gbyte = nvfp4_group_byte(amax);
  if (lane == 0) scales[g / 16] = uint8_t(gbyte);
  const float gscale = e8m0_value(gbyte);
  for (int base = 0; base < g; base += kWarp) {  // two blocks of 16 per pass
    const int i = base + lane;
    const bool active = i < g;
    const float v = active ? s[i] : 0.0f;
    const uint32_t amax_b = warp_max_u32(float_to_bits(v) & 0x7FFFFFFFu, 16);
    const uint32_t code = nvfp4_block_code(bits_to_float(amax_b), gbyte);
    if (active && (lane & 15) == 0) scales[i / 16] = uint8_t(code);
    const float sc = mul_rn(e4m3_decode(code), gscale);
    uint32_t c = 0;
    if (sc > 0.0f) {
      const float q = mul_rn(v, fp_inverse(sc));
      c = with_sign(e2m1_encode(bits_to_float(float_to_bits(q) & 0x7FFFFFFFu)), q, 3);
    }
    store_nibble_pair(c, i, active, rec);
  }
}

// Shared memory of a block: each warp's group (G f32), then each warp's spike scratch
// (kMaxSpikes positions and kMaxSpikes stored values).
constexpr int kSpikeScratch = 2 * kMaxSpikes;
inline size_t FpSharedBytes(int64_t group_size) {
  return RotatedSharedBytes(group_size) + size_t(kWarpsPerBlock) * kSpikeScratch * 4;
}
__device__ __forceinline__ int32_t* spike_scratch(float* smem, int g) {
  return reinterpret_cast<int32_t*>(smem + kWarpsPerBlock * g) +
         (threadIdx.x / kWarp) * kSpikeScratch;
}

// cpu_fp.h fp_quantize_group, one warp: s (G f32) into its whole record (spikes zeroed in s).
// scratch: the warp's spike scratch.
__device__ __forceinline__ void quantize_group_warp(float* s, int g, int32_t fmt, int k,
                                                    int lane, int32_t* scratch, uint8_t* rec) {
  const uint32_t all_bits = group_amax_bits(s, g, lane);
  const bool finite = all_bits < 0x7F800000u;
  if (k == 0) {
    encode_group_warp(s, g, fmt, bits_to_float(all_bits), finite, lane, rec);
    __syncwarp();
    return;
  }
  int32_t* pos = scratch;
  int32_t* values = scratch + kMaxSpikes;
  select_spikes_warp(s, g, k, lane, pos);
  if (lane < k) values[lane] = spike_bits(s[pos[lane]], finite);
  __syncwarp();
  if (lane < k) s[pos[lane]] = 0.0f;
  __syncwarp();
  encode_group_warp(s, g, fmt, bits_to_float(group_amax_bits(s, g, lane)), finite, lane, rec);
  if (lane < k) {  // codec.h store_spikes, one spike per lane
    uint8_t* spk = rec + fp_code_bytes(fmt, g) + fp_scale_bytes(fmt, g);
    const int pb = int(position_bytes(g));
    spk[2 * lane] = uint8_t(values[lane] & 0xFF);
    spk[2 * lane + 1] = uint8_t(values[lane] >> 8);
    spk[2 * k + pb * lane] = uint8_t(pos[lane]);
    if (pb == 2) spk[2 * k + pb * lane + 1] = uint8_t(pos[lane] >> 8);
  }
  __syncwarp();
}

// Element i of a record decoded, spikes put back (a spike's position holds its value).
__device__ __forceinline__ float decode_element(const uint8_t* rec, int g, int32_t fmt, int k,
                                                int i) {
  const int nc = int(fp_code_bytes(fmt, g)), ns = int(fp_scale_bytes(fmt, g));
  const int block = int(fp_block(fmt, g));
  float v = mul_rn(fp_element(fmt, rec, i), fp_block_scale(fmt, rec + nc, g, i / block));
  const uint8_t* spk = rec + nc + ns;
  for (int j = 0; j < k; ++j) {
    if (spike_position(spk, k, g, j) == i) v = spike_value(spk, j);
  }
  return v;
}

template <typename T>
__device__ __forceinline__ void load_group_warp(const typename T::Storage* x, int g, int rotation,
                                                int lane, float* s) {
  for (int i = lane; i < g; i += kWarp) {
    const float v = T::load(x[i]);
    s[i] = rotation == kRotationSignedHadamard ? apply_sign(v, uint32_t(i)) : v;
  }
  __syncwarp();
  if (rotation != kRotationNone) warp_hadamard_scaled(s, g, lane);
}

// s (G f32) rotated back if asked, saturated and stored as T.
template <typename T>
__device__ __forceinline__ void store_group_warp(float* s, int g, int rotation, int lane,
                                                 typename T::Storage* y) {
  if (rotation != kRotationNone) {
    unrotate_store<T>(s, g, rotation, /*saturating=*/true, /*vec=*/false, lane, y);
    return;
  }
  for (int i = lane; i < g; i += kWarp) y[i] = T::store(saturate(s[i], T::kMax));
  __syncwarp();
}

// The f32 sum over the chunks (in order) of output group o into s.
__device__ __forceinline__ void sum_group_warp(const uint8_t* records, int64_t o,
                                               const FpChunkArgs& in, int lane, float* s) {
  const int g = int(in.group_size);
  const int64_t stride = fp_record_bytes(in.format, g, in.spikes);
  const int64_t batch = o / in.groups_per_chunk, k = o % in.groups_per_chunk;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const uint8_t* rec = records + ((batch * in.chunks + c) * in.groups_per_chunk + k) * stride;
    for (int i = lane; i < g; i += kWarp) {
      const float v = decode_element(rec, g, in.format, in.spikes, i);
      s[i] = c == 0 ? v : add_rn(s[i], v);
    }
  }
  __syncwarp();
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    FpQuantizeKernel(const typename T::Storage* __restrict__ x, int64_t n_groups, int g,
                     int32_t fmt, int rotation, int spikes, uint8_t* __restrict__ records) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  float* s = smem + (threadIdx.x / kWarp) * g;
  const int64_t stride = fp_record_bytes(fmt, g, spikes);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t grp = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; grp < n_groups;
       grp += warps) {
    load_group_warp<T>(x + grp * g, g, rotation, lane, s);
    quantize_group_warp(s, g, fmt, spikes, lane, spike_scratch(smem, g), records + grp * stride);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    FpDequantizeKernel(const uint8_t* __restrict__ records, int64_t n_groups, int g, int32_t fmt,
                       int rotation, int spikes, typename T::Storage* __restrict__ y) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  float* s = smem + (threadIdx.x / kWarp) * g;
  const int64_t stride = fp_record_bytes(fmt, g, spikes);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t grp = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; grp < n_groups;
       grp += warps) {
    for (int i = lane; i < g; i += kWarp) {
      s[i] = decode_element(records + grp * stride, g, fmt, spikes, i);
    }
    __syncwarp();
    store_group_warp<T>(s, g, rotation, lane, y + grp * g);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    FpDequantizeSumKernel(const uint8_t* __restrict__ records, FpChunkArgs in, int rotation,
                          typename T::Storage* __restrict__ y) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  const int g = int(in.group_size);
  float* s = smem + (threadIdx.x / kWarp) * g;
  const int64_t n_out = in.batch * in.groups_per_chunk;
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t o = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; o < n_out;
       o += warps) {
    sum_group_warp(records, o, in, lane, s);
    store_group_warp<T>(s, g, rotation, lane, y + o * g);
  }
}

__global__ void __launch_bounds__(kThreads)
    FpDequantizeSumQuantizeKernel(const uint8_t* __restrict__ records, FpChunkArgs in,
                                  int32_t out_fmt, int out_spikes, uint8_t* __restrict__ out) {
  extern __shared__ float smem[];
  const int lane = int(threadIdx.x) % kWarp;
  const int g = int(in.group_size);
  float* s = smem + (threadIdx.x / kWarp) * g;
  const int64_t n_out = in.batch * in.groups_per_chunk;
  const int64_t stride = fp_record_bytes(out_fmt, g, out_spikes);
  const int64_t warps = int64_t(gridDim.x) * kWarpsPerBlock;
  for (int64_t o = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarp; o < n_out;
       o += warps) {
    sum_group_warp(records, o, in, lane, s);
    quantize_group_warp(s, g, out_fmt, out_spikes, lane, spike_scratch(smem, g), out + o * stride);
  }
}

}  // namespace

template <typename T>
cudaError_t LaunchFpQuantize(cudaStream_t stream, const void* x, int64_t n_groups,
                             int64_t group_size, int32_t format, int rotation, int spikes,
                             uint8_t* records) {
  if (n_groups == 0) return cudaSuccess;
  FpQuantizeKernel<T><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                        FpSharedBytes(group_size), stream>>>(
      static_cast<const typename T::Storage*>(x), n_groups, int(group_size), format, rotation,
      spikes, records);
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchFpDequantize(cudaStream_t stream, const uint8_t* records, int64_t n_groups,
                               int64_t group_size, int32_t format, int rotation, int spikes,
                               void* y) {
  if (n_groups == 0) return cudaSuccess;
  FpDequantizeKernel<T><<<GridFor(n_groups, kWarpsPerBlock), kThreads,
                          FpSharedBytes(group_size), stream>>>(
      records, n_groups, int(group_size), format, rotation, spikes,
      static_cast<typename T::Storage*>(y));
  return cudaGetLastError();
}

template <typename T>
cudaError_t LaunchFpDequantizeSum(cudaStream_t stream, const uint8_t* records,
                                  const FpChunkArgs& in, int rotation, void* y) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  if (n_out == 0) return cudaSuccess;
  FpDequantizeSumKernel<T><<<GridFor(n_out, kWarpsPerBlock), kThreads,
                             FpSharedBytes(in.group_size), stream>>>(
      records, in, rotation, static_cast<typename T::Storage*>(y));
  return cudaGetLastError();
}

cudaError_t LaunchFpDequantizeSumQuantize(cudaStream_t stream, const uint8_t* records,
                                          const FpChunkArgs& in, int32_t out_format,
                                          int out_spikes, uint8_t* out) {
  const int64_t n_out = in.batch * in.groups_per_chunk;
  if (n_out == 0) return cudaSuccess;
  FpDequantizeSumQuantizeKernel<<<GridFor(n_out, kWarpsPerBlock), kThreads,
                                  FpSharedBytes(in.group_size), stream>>>(
      records, in, out_format, out_spikes, out);
  return cudaGetLastError();
}

#define INSTANTIATE(T)                                                                        \
  template cudaError_t LaunchFpQuantize<T>(cudaStream_t, const void*, int64_t, int64_t,       \
                                           int32_t, int, int, uint8_t*);                      \
  template cudaError_t LaunchFpDequantize<T>(cudaStream_t, const uint8_t*, int64_t, int64_t,  \
                                             int32_t, int, int, void*);                       \
  template cudaError_t LaunchFpDequantizeSum<T>(cudaStream_t, const uint8_t*,                 \
                                                const FpChunkArgs&, int, void*);
INSTANTIATE(F32)
INSTANTIATE(BF16)
INSTANTIATE(F16)
#undef INSTANTIATE

}  // namespace cuda
}  // namespace flashcomm
