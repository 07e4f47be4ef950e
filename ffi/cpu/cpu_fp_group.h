// The floating-point formats' quantize of one group at a time (fp_codec.h): the four-bit block
// scales lane-wise, a group's codes and scales, and a whole record with spikes
// (fp_quantize_group, the reference of cpu_fp.h's batch loops, which give its bytes). Compiled
// once per instruction set (ffi/cpu/isa_kernels.cc).
#ifndef FLASHCOMM_CPU_FP_GROUP_H_
#define FLASHCOMM_CPU_FP_GROUP_H_

#include <cstdint>
#include <cstring>

#include "cpu/cpu_fp_encode.h"
#include "cpu/cpu_fp_lanes.h"
#include "cpu/cpu_spikes.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// At most this many four-bit blocks have their scales computed together (lane-wise).
constexpr int kFp4Chunk = kLanes < 8 ? kLanes : 8;

// The scale codes and inverses of kLanes four-bit blocks, lane-wise, from their largest
// magnitudes am (f32 bits) and, for nvfp4, their groups' E8M0 bytes: fp_codec.h mxfp4_byte,
// nvfp4_block_code, fp_block_scale and fp_inverse, the same operations.
struct Fp4BlockScales {
  ULanes code;  // the blocks' scale codes
  Lanes inv;    // the inverses their elements are multiplied by
  ILanes zero;  // -1 where an nvfp4 block's scale is 0 (its codes are written as 0)
};
FC_ALWAYS_INLINE Fp4BlockScales fp4_block_scales(ILanes am, int32_t fmt, ULanes gbyte) {
  if (fmt == kFormatMxfp4) {
    const ILanes e = ((am >> 23) & 0xFF) - 2;
    const ULanes code = (ULanes)(e < kMxByteMin ? kMxByteMin : e > kMxByteMax ? kMxByteMax : e);
    return {code, bits_lanes((254u - code) << 23), ILanes{}};
  }
  const ULanes code = e4m3_encode_lanes(
      mul_rn(mul_rn(bits_lanes((ULanes)am), kInvE2m1Max), bits_lanes((254u - gbyte) << 23)));
  const Lanes sc = mul_rn(e4m3_decode_lanes(code), bits_lanes(gbyte << 23));
  // a zero scale's block is written as zeros (its inverse only has to be finite)
  return {code, 1.0f / (sc > 0.0f ? sc : Lanes{} + 1.0f), ~(sc > 0.0f)};
}

// Blocks b0 .. b0 + nb - 1 (nb <= kFp4Chunk) of a finite four-bit group v (g values) into rec:
// their scale codes and element codes. am: lane j the largest magnitude's bits of block b0 + j;
// gbyte: nvfp4's group byte (0 for mxfp4). The scales lane-wise (fp4_block_scales).
inline void fp4_encode_blocks(const float* v, int64_t g, int32_t fmt, int64_t b0, int64_t nb,
                              ILanes am, uint32_t gbyte, uint8_t* rec) {
  const int64_t block = fp_block(fmt, g);
  const Fp4BlockScales bs = fp4_block_scales(am, fmt, ULanes{} + gbyte);
  const ILanes zero = bs.zero & (kLaneIndex < int32_t(nb));
  uint8_t* scales = rec + fp_code_bytes(fmt, g) + b0;
  if (nb == kFp4Chunk) {  // a constant size: one store, not a call to memcpy
    uint8_t code_bytes[kLanes];
    narrow_bytes(bs.code, code_bytes);
    std::memcpy(scales, code_bytes, size_t(kFp4Chunk));
  } else {
    for (int j = 0; j < nb; ++j) scales[j] = uint8_t(bs.code[j]);
  }
  // the two block sizes as constants, so each inlined loop is laid out for its size
  if (block == 16) {
    encode_blocks<16>(v + b0 * block, nb * block, bs.inv, b0 * block, rec);
  } else {
    encode_blocks<32>(v + b0 * block, nb * block, bs.inv, b0 * block, rec);
  }
  if (any_lane(zero)) {
    for (int j = 0; j < nb; ++j) {
      if (zero[j]) std::memset(rec + (b0 + j) * block / 2, 0, size_t(block / 2));
    }
  }
}

// One f32 group v (g values, spikes already zeroed, largest magnitude amax) into its record's
// codes and scales. finite: every value of the group, spikes included, is finite.
inline void fp_encode_group(const float* v, int64_t g, int32_t fmt, float amax, bool finite,
                            uint8_t* rec) {
  if (!finite) {
    fp_encode_nonfinite(g, fmt, rec);
    return;
  }
  if (fmt == kFormatFp8) {
    const uint16_t s = fp8_scale_bits(amax);
    rec[g] = uint8_t(s & 0xFF);
    rec[g + 1] = uint8_t(s >> 8);
    encode_e4m3_run(v, g, Lanes{} + fp_inverse(bf16_to_float(s)), rec);
    return;
  }
  const int64_t block = fp_block(fmt, g), blocks = g / block;
  const uint32_t gbyte = fmt == kFormatNvfp4 ? nvfp4_group_byte(amax) : 0u;
  if (fmt == kFormatNvfp4) rec[fp_code_bytes(fmt, g) + blocks] = uint8_t(gbyte);
  for (int64_t b0 = 0; b0 < blocks; b0 += kFp4Chunk) {
    const int64_t nb = blocks - b0 < kFp4Chunk ? blocks - b0 : kFp4Chunk;
    fp4_encode_blocks(v, g, fmt, b0, nb, block_maxima<kFp4Chunk>(v + b0 * block, block, nb),
                      gbyte, rec);
  }
}

// A four-bit group of at most kFp4Chunk blocks without spikes: the group's largest magnitude
// from its blocks' (one pass over the values fewer than max_abs, then fp_encode_group).
inline void fp4_quantize_small_group(const float* v, int64_t g, int32_t fmt, uint8_t* rec) {
  const int64_t block = fp_block(fmt, g), blocks = g / block;
  const ILanes am = block_maxima<kFp4Chunk>(v, block, blocks);
  ILanes m[1] = {am};  // lanes past the last block hold 0 or copies
  const uint32_t amax_bits = uint32_t(largest_lanes<1>(m)[0]);
  if (amax_bits >= 0x7F800000u) {  // an Inf or a NaN
    fp_encode_nonfinite(g, fmt, rec);
    return;
  }
  const uint32_t gbyte = fmt == kFormatNvfp4 ? nvfp4_group_byte(bits_to_float(amax_bits)) : 0u;
  if (fmt == kFormatNvfp4) rec[fp_code_bytes(fmt, g) + blocks] = uint8_t(gbyte);
  fp4_encode_blocks(v, g, fmt, 0, blocks, am, gbyte, rec);
}

// One f32 group v (overwritten: spikes zeroed) with k spikes into its whole record.
// keys: g int32 of scratch (k > 0).
inline void fp_quantize_group(float* v, int64_t g, int32_t fmt, int k, int32_t* keys,
                              uint8_t* rec) {
  if (k == 0 && fmt != kFormatFp8 && g / fp_block(fmt, g) <= kFp4Chunk) {
    fp4_quantize_small_group(v, g, fmt, rec);
    return;
  }
  // The largest magnitude's bits are those of an Inf or a NaN exactly when one is there.
  const float amax = max_abs(v, g);
  const bool finite = float_to_bits(amax) < 0x7F800000u;
  if (k == 0) {
    fp_encode_group(v, g, fmt, amax, finite, rec);
    return;
  }
  int32_t pos[kMaxSpikes];
  float kept[kMaxSpikes];
  select_spikes_lanes(v, g, k, keys, pos);
  for (int j = 0; j < k; ++j) {
    kept[j] = v[pos[j]];
    v[pos[j]] = 0.0f;
  }
  fp_encode_group(v, g, fmt, max_abs(v, g), finite, rec);
  uint16_t values[kMaxSpikes];
  for (int j = 0; j < k; ++j) values[j] = spike_bits(kept[j], finite);
  store_spikes(values, pos, k, g, rec + fp_code_bytes(fmt, g) + fp_scale_bytes(fmt, g));
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_GROUP_H_
