// The CPU loops of the floating-point group formats (fp_codec.h): quantize, from the lane-wise
// pieces of cpu_fp_lanes.h, the tails scalar; the decode is in cpu_fp_decode.h (included here).
// Compiled once per instruction set with the integer codec (ffi/cpu/isa_kernels.cc). Every
// block (16 or 32 values) is a whole number of vectors; an fp8 group (G values) may end in a
// scalar tail.
#ifndef FLASHCOMM_CPU_FP_H_
#define FLASHCOMM_CPU_FP_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/cpu_fp_decode.h"
#include "flashcomm/cpu_fp_lanes.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// Element codes of n values RN(v * inv) (inv, in every lane: fp_inverse of the block scale, or
// mxfp4's exact power of two), E4M3 bytes (fp8) or E2M1 nibbles from element `first` on (n and
// first even).
template <bool kFp8>
FC_ALWAYS_INLINE void encode_run(const float* v, int64_t n, Lanes inv, int64_t first,
                                 uint8_t* codes) {
  int64_t i = 0;
#if (FLASHCOMM_LANES == 8 && defined(__AVX2__)) || (FLASHCOMM_LANES == 16 && defined(__AVX512BW__))
  if constexpr (kFp8) {
    // Four vectors at a time: the magnitudes' codes (<= 0x7E) packed to bytes with unsigned
    // saturation, the values themselves with signed saturation (which keeps each sign, -0.0's
    // too, in the byte's top bit), then one OR of that bit and one permutation of the 32-bit
    // pieces the in-lane packs interleaved: instead of a shift, an OR and a narrowing per vector.
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      FcVecI c[4], q[4];
      for (int j = 0; j < 4; ++j) {
        const Lanes x = mul_rn(load_lanes(v + i + j * kLanes), inv);
        q[j] = (FcVecI)x;
        c[j] = (FcVecI)e4m3_encode_clamped(abs_min_lanes(x, kE4m3Max));
      }
      const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
      const FcVecI sign = fc_packs_epi16(fc_packs_epi32(q[0], q[1]), fc_packs_epi32(q[2], q[3]));
      const FcVecI bytes = fc_permute_dwords(fc_or_top_bit(mag, sign));
      std::memcpy(codes + first + i, &bytes, sizeof(bytes));
    }
  } else {
    // The same for E2M1: the sign's byte bit 7 shifted to bit 3 (a 16-bit shift by 4 moves
    // each byte's bit 7 there), then two codes to a byte.
    for (; i + 4 * kLanes <= n; i += 4 * kLanes) {
      FcVecI c[4], q[4];
      for (int j = 0; j < 4; ++j) {
        const Lanes x = mul_rn(load_lanes(v + i + j * kLanes), inv);
        q[j] = (FcVecI)x;
        c[j] = (FcVecI)e2m1_encode_clamped(e2m1_magnitude(x));
      }
      const FcVecI mag = fc_packus_epi16(fc_packus_epi32(c[0], c[1]), fc_packus_epi32(c[2], c[3]));
      const FcVecI sign = fc_packs_epi16(fc_packs_epi32(q[0], q[1]), fc_packs_epi32(q[2], q[3]));
      fc_store_nibble_bytes(fc_permute_dwords(fc_or_sign_nibble(mag, sign)),
                            codes + (first + i) / 2);
    }
  }
#endif
  for (; i + kLanes <= n; i += kLanes) {
    const Lanes x = load_lanes(v + i);
    const Lanes q = mul_rn(x, inv);
    // the sign bit moved to the code's top bit with one shift and one AND
    if constexpr (kFp8) {
      narrow_bytes(
          e4m3_encode_clamped(abs_min_lanes(q, kE4m3Max)) | ((lanes_bits(q) >> 24) & 0x80u),
          codes + first + i);
    } else {
      store_nibbles(e2m1_encode_clamped(e2m1_magnitude(q)) | ((lanes_bits(q) >> 28) & 8u),
                    codes + (first + i) / 2);
    }
  }
  for (; i < n; ++i) {
    const float q = mul_rn(v[i], inv[0]);
    const float a = bits_to_float(float_to_bits(q) & 0x7FFFFFFFu);
    if constexpr (kFp8) {
      codes[first + i] = uint8_t(with_sign(e4m3_encode(a), q, 7));
    } else {
      const uint32_t c = with_sign(e2m1_encode(a), q, 3);
      uint8_t& b = codes[(first + i) / 2];
      b = ((first + i) & 1) ? uint8_t((b & 0x0F) | (c << 4)) : uint8_t(c);
    }
  }
}

// One f32 group v (g values, spikes already zeroed, largest magnitude amax) into its record's
// codes and scales. finite: every value of the group, spikes included, is finite.
inline void fp_encode_group(const float* v, int64_t g, int32_t fmt, float amax, bool finite,
                            uint8_t* rec) {
  const int64_t nc = fp_code_bytes(fmt, g), ns = fp_scale_bytes(fmt, g);
  uint8_t* scales = rec + nc;
  if (!finite) {
    std::memset(rec, 0, size_t(nc + ns));
    if (fmt == kFormatFp8) {
      scales[0] = uint8_t(kBf16NaN & 0xFF);
      scales[1] = uint8_t(kBf16NaN >> 8);
    } else if (fmt == kFormatMxfp4) {
      std::memset(scales, int(kE8m0Nan), size_t(ns));
    } else {
      scales[ns - 1] = uint8_t(kE8m0Nan);
    }
    return;
  }
  if (fmt == kFormatFp8) {
    const uint16_t s = fp8_scale_bits(amax);
    scales[0] = uint8_t(s & 0xFF);
    scales[1] = uint8_t(s >> 8);
    encode_run<true>(v, g, Lanes{} + fp_inverse(bf16_to_float(s)), 0, rec);
    return;
  }
  const int64_t block = fp_block(fmt, g), blocks = g / block;
  const uint32_t gbyte = fmt == kFormatNvfp4 ? nvfp4_group_byte(amax) : 0u;
  if (fmt == kFormatNvfp4) scales[blocks] = uint8_t(gbyte);
  const float gscale = e8m0_value(gbyte), down = e8m0_value(254u - gbyte);
  // kChunk blocks at a time: their largest magnitudes, scale codes, scales and inverses
  // lane-wise (fp_codec.h mxfp4_byte, nvfp4_block_code, fp_block_scale and fp_inverse: the same
  // operations).
  constexpr int kChunk = kLanes < 8 ? kLanes : 8;
  for (int64_t b0 = 0; b0 < blocks; b0 += kChunk) {
    const int64_t nb = blocks - b0 < kChunk ? blocks - b0 : kChunk;
    const ILanes am = block_maxima<kChunk>(v + b0 * block, block, nb);
    ULanes code;
    Lanes inv;
    bool nonzero[kChunk];
    if (fmt == kFormatMxfp4) {
      const ILanes e = ((am >> 23) & 0xFF) - 2;
      code = (ULanes)(e < kMxByteMin ? kMxByteMin : e > kMxByteMax ? kMxByteMax : e);
      inv = bits_lanes((254u - code) << 23);
      for (int j = 0; j < kChunk; ++j) nonzero[j] = true;
    } else {
      code = e4m3_encode_lanes(mul_rn(mul_rn(bits_lanes((ULanes)am), kInvE2m1Max), down));
      const Lanes sc = mul_rn(e4m3_decode_lanes(code), gscale);
      inv = 1.0f / (sc > 0.0f ? sc : Lanes{} + 1.0f);
      for (int j = 0; j < kChunk; ++j) nonzero[j] = sc[j] > 0.0f;
    }
    uint8_t code_bytes[kLanes];
    narrow_bytes(code, code_bytes);
    std::memcpy(scales + b0, code_bytes, size_t(nb));
    for (int j = 0; j < nb; ++j) {
      const int64_t b = b0 + j;
      if (nonzero[j]) {
        // the two block sizes as constants, so each inlined loop is laid out for its size
        const Lanes inv_b = __builtin_shuffle(inv, ILanes{} + j);
        if (block == 16) {
          encode_run<false>(v + b * block, 16, inv_b, b * block, rec);
        } else {
          encode_run<false>(v + b * block, 32, inv_b, b * block, rec);
        }
      } else {
        std::memset(rec + b * block / 2, 0, size_t(block / 2));
      }
    }
  }
}

// load_group (g a multiple of kLanes) that also returns the lane-wise largest magnitude's bits
// of the group: one pass over the values instead of two.
template <typename T>
FC_ALWAYS_INLINE ILanes load_group_max(const typename T::Storage* x, int64_t g, float* v) {
  ILanes m = ILanes{};
  for (int64_t i = 0; i < g; i += kLanes) {
    const Lanes a = load_lanes_t<T>(x + i);
    std::memcpy(v + i, &a, sizeof a);
    const ILanes k = (ILanes)(lanes_bits(a) & 0x7FFFFFFFu);
    m = k > m ? k : m;
  }
  return m;
}

// fp8 without spikes, kLanes groups at a time: up to kLanes f32 groups of g values (g a
// multiple of kLanes), one after another in v, into their records. The groups' maxima come from
// one transposing reduction and their scales and inverses lane-wise (fp8_scale_bits and
// fp_inverse's operations, one division for every group), instead of a horizontal reduction and
// a scalar chain per group. The same bytes as fp_quantize_group on each group.
constexpr int64_t kFp8BatchMaxGroup = 512;  // a batch's f32 values stay in L1 / L2
// am: lane j the largest magnitude's bits of group j (block_maxima, or load_group_max's
// vectors through largest_lanes).
inline void fp8_encode_groups(const float* v, int64_t count, int64_t g, ILanes am,
                              uint8_t* records, int64_t stride) {
  const Lanes amax = bits_lanes((ULanes)am);
  Lanes t = mul_rn(amax, kInvE4m3Max);
  t = t > kFp8MinScale ? t : Lanes{} + kFp8MinScale;
  // bf16_round_down / bf16_round_up of t > 0: the truncation, or one ulp more when bits are lost
  const ULanes ut = lanes_bits(t), lo = ut & 0xFFFF0000u;
  const ILanes up = (mul_rn(bits_lanes(lo), kE4m3Max) < amax) & ((ut & 0xFFFFu) != 0u);
  const ULanes s = lo + ((ULanes)up & 0x10000u);
  const Lanes inv = 1.0f / bits_lanes(s);
  for (int64_t j = 0; j < count; ++j) {
    uint8_t* rec = records + j * stride;
    if (uint32_t(am[j]) >= 0x7F800000u) {  // an Inf or a NaN
      fp_encode_group(v + j * g, g, kFormatFp8, bits_to_float(uint32_t(am[j])), false, rec);
      continue;
    }
    rec[g] = uint8_t((s[j] >> 16) & 0xFF);
    rec[g + 1] = uint8_t(s[j] >> 24);
    encode_run<true>(v + j * g, g, __builtin_shuffle(inv, ILanes{} + int32_t(j)), 0, rec);
  }
}

inline void fp8_quantize_groups(const float* v, int64_t count, int64_t g, uint8_t* records,
                                int64_t stride) {
  fp8_encode_groups(v, count, g, block_maxima<kLanes>(v, g, count), records, stride);
}

// count <= kLanes groups of T (no rotation) widened into batch (kLanes * g floats) with their
// maxima in the same pass, then fp8_encode_groups: FpQuantizeOp's fp8 loop (and fp_loop's).
template <typename T>
FC_ALWAYS_INLINE void fp8_quantize_batch(const typename T::Storage* x, int64_t count, int64_t g,
                                         float* batch, uint8_t* records, int64_t stride) {
  ILanes m[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    m[j] = j < count ? load_group_max<T>(x + j * g, g, batch + j * g) : ILanes{};
  }
  fp8_encode_groups(batch, count, g, largest_lanes<kLanes>(m), records, stride);
}


// One f32 group v (overwritten: spikes zeroed) with k spikes into its whole record.
// keys: g int32 of scratch (k > 0).
inline void fp_quantize_group(float* v, int64_t g, int32_t fmt, int k, int32_t* keys,
                              uint8_t* rec) {
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

#endif  // FLASHCOMM_CPU_FP_H_
