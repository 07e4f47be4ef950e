// The CPU loops of the floating-point group formats (fp_codec.h): quantize in batches (one group
// at a time: cpu_fp_group.h), from the element encoders of cpu_fp_encode.h; the decode is in
// cpu_fp_decode.h (both included here). Compiled once per instruction set with the integer codec
// (ffi/cpu/isa_kernels.cc). Every block (16 or 32 values) is a whole number of vectors; an fp8
// group (G values) may end in a scalar tail.
#ifndef FLASHCOMM_CPU_FP_H_
#define FLASHCOMM_CPU_FP_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cpu/cpu_fp_bf16.h"
#include "cpu/cpu_fp_decode.h"
#include "cpu/cpu_fp_encode.h"
#include "cpu/cpu_fp_group.h"
#include "cpu/cpu_fp_lanes.h"

// These headers quantize the four-bit formats in batches of blocks (fp4_quantize_batch):
// benchmarks/native/fp_ab.cc, which compiles older revisions too, looks for it.
#define FLASHCOMM_FP4_BATCH 1

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// fp4_block_scales of kLanes blocks whose lanes form groups of kPerGroup blocks, with each
// group's largest magnitude (and nvfp4 byte) from its lanes.
struct Fp4Scales : Fp4BlockScales {
  ULanes gbyte;  // nvfp4: the group's E8M0 byte, in each of its lanes
  ILanes gm;     // the group's largest magnitude, in each of its lanes
};
template <int kPerGroup>
FC_ALWAYS_INLINE Fp4Scales fp4_scales(ILanes am, int32_t fmt) {
  ILanes gm = am;
  for (int s = 1; s < kPerGroup; s *= 2) {
    const ILanes o = __builtin_shuffle(gm, kLaneIndex ^ s);
    gm = o > gm ? o : gm;
  }
  const ILanes e = ((gm >> 23) & 0xFF) - 10;
  const ULanes gbyte = fmt == kFormatNvfp4
      ? (ULanes)(e < kNvByteMin ? kNvByteMin : e > kNvByteMax ? kNvByteMax : e)
      : ULanes{};
  return {fp4_block_scales(am, fmt, gbyte), gbyte, gm};
}

// Vectors of block scales per four-bit batch: independent chains of scale arithmetic (each a
// long dependent sequence) that the core can run side by side. Two against one: nvfp4 0.80-0.88x
// the time; four against two: 0.94-0.97x on AVX2 (where an nvfp4 group of 128 fills a
// vector), no gain on AVX-512 (benchmarks/native/fp_ab.sh).
constexpr int kFp4BatchVecs = kLanes == 8 ? 4 : 2;

// Four-bit groups without spikes, kFp4BatchVecs * kLanes blocks at a time: the groups of
// kPerGroup blocks of kBlock values, one after another in v (kFp4BatchVecs * kLanes * kBlock
// floats; the values of missing groups are read and not stored). The blocks' maxima come from
// transposing reductions, each group's from kPerGroup lanes, and the scale codes and inverses
// of every block of the batch lane-wise (fp_encode_group's operations): one division per
// kLanes blocks. count: the groups present (at least 1). The same bytes as fp_quantize_group
// on each group.
// In: float, or bf16 bits (FLASHCOMM_FP_BF16_DIRECT). am: the blocks' largest magnitudes
// (block_maxima's, or bf16_block_maxima's), lane j of am[t] block t * kLanes + j.
template <int kBlock, int kPerGroup, typename In>
inline void fp4_encode_batch(const In* v, const ILanes* am, int32_t fmt, int64_t count,
                             uint8_t* records, int64_t stride) {
  static_assert(kPerGroup <= kLanes && kLanes % kPerGroup == 0, "whole groups per vector");
  constexpr int64_t g = kBlock * kPerGroup, kPerVec = kLanes / kPerGroup;
  Fp4Scales sc[kFp4BatchVecs];
  uint8_t code_bytes[kFp4BatchVecs][kLanes];
  uint32_t nonfinite[kFp4BatchVecs], zeros[kFp4BatchVecs];
  for (int t = 0; t < kFp4BatchVecs; ++t) {
    sc[t] = fp4_scales<kPerGroup>(am[t], fmt);
    narrow_bytes(sc[t].code, code_bytes[t]);
    nonfinite[t] = lane_bits(sc[t].gm >= 0x7F800000);
    zeros[t] = lane_bits(sc[t].zero);
  }
  constexpr uint32_t kGroupLanes = (1u << kPerGroup) - 1u;
  for (int64_t j = 0; j < count; ++j) {
    uint8_t* rec = records + j * stride;
    const int64_t t = j / kPerVec;
    const int32_t lane0 = int32_t(j % kPerVec * kPerGroup);
    if ((nonfinite[t] >> lane0) & 1u) {
      fp_encode_nonfinite(g, fmt, rec);
      continue;
    }
    std::memcpy(rec + g / 2, code_bytes[t] + lane0, size_t(kPerGroup));
    if (fmt == kFormatNvfp4) rec[g / 2 + kPerGroup] = uint8_t(sc[t].gbyte[lane0]);
    if constexpr (kLanes < 16) {
      // AVX2: this group's block inverses from lane 0 on (one permutation), then the loop
      // unrolled, each block's lane a constant: 0.83-0.94x the time of the rolled loop (on
      // AVX-512, 1.02-1.06x: rolled there)
      const Lanes inv_g = __builtin_shuffle(sc[t].inv, (kLaneIndex + lane0) & (kLanes - 1));
      encode_blocks<kBlock, true>(v + j * g, g, inv_g, 0, rec);
    } else {
      encode_blocks<kBlock>(v + j * g, g, sc[t].inv, 0, rec, lane0);
    }
    if (const uint32_t z = (zeros[t] >> lane0) & kGroupLanes) {
      for (int b = 0; b < kPerGroup; ++b) {
        if ((z >> b) & 1u) std::memset(rec + b * kBlock / 2, 0, size_t(kBlock / 2));
      }
    }
  }
}

// Whether fp4_quantize_batch takes groups of g values in format fmt (four-bit, no spikes): a
// group of 2, 4 or 8 mxfp4 blocks, or 4, 8 or 16 nvfp4 blocks, at most kLanes.
FC_ALWAYS_INLINE bool fp4_batch_takes(int32_t fmt, int64_t g) {
  if (fmt == kFormatMxfp4) return (g == 64 || g == 128 || g == 256) && g / 32 <= kLanes;
  if (fmt == kFormatNvfp4) return (g == 64 || g == 128 || g == 256) && g / 16 <= kLanes;
  return false;
}

// The f32 values of a four-bit batch (the scratch fp4_quantize_batch needs).
FC_ALWAYS_INLINE int64_t fp4_batch_floats(int32_t fmt, int64_t g) {
  return kFp4BatchVecs * kLanes * fp_block(fmt, g);
}

// Groups of g values per fp4_quantize_batch call (fp4_batch_takes(fmt, g)).
FC_ALWAYS_INLINE int64_t fp4_batch_groups(int32_t fmt, int64_t g) {
  return kFp4BatchVecs * kLanes * fp_block(fmt, g) / g;
}

// f(block, per_group) with the batch layout of four-bit groups of g values in format fmt
// (fp4_batch_takes(fmt, g)) as std::integral_constant: kBlock values per block, kPerGroup
// blocks per group.
template <typename F>
FC_ALWAYS_INLINE void with_fp4_layout(int32_t fmt, int64_t g, F&& f) {
  using I16 = std::integral_constant<int, 16>;
  using I32 = std::integral_constant<int, 32>;
  const int64_t blocks = g / fp_block(fmt, g);
  if (fmt == kFormatMxfp4) {
    if (blocks == 2) return f(I32{}, std::integral_constant<int, 2>{});
    if (blocks == 4) return f(I32{}, std::integral_constant<int, 4>{});
    if constexpr (kLanes >= 8) f(I32{}, std::integral_constant<int, 8>{});
  } else {
    if (blocks == 4) return f(I16{}, std::integral_constant<int, 4>{});
    if constexpr (kLanes >= 8) {
      if (blocks == 8) return f(I16{}, std::integral_constant<int, 8>{});
    }
    if constexpr (kLanes >= 16) f(I16{}, std::integral_constant<int, 16>{});
  }
}

// fp4_encode_batch on 1 <= count <= fp4_batch_groups(fmt, g) f32 groups of g values
// (fp4_batch_takes(fmt, g)), one after another in batch (fp4_batch_floats(fmt, g); the rest
// zeroed here).
inline void fp4_quantize_groups(float* batch, int64_t count, int64_t g, int32_t fmt,
                                uint8_t* records, int64_t stride) {
  const int64_t full = fp4_batch_groups(fmt, g);
  if (count < full) std::memset(batch + count * g, 0, size_t((full - count) * g) * sizeof(float));
  with_fp4_layout(fmt, g, [&](auto block, auto per_group) {
    constexpr int kBlock = decltype(block)::value;
    ILanes am[kFp4BatchVecs];
    for (int t = 0; t < kFp4BatchVecs; ++t) {
      am[t] = block_maxima<kLanes, kBlock>(batch + t * kLanes * kBlock);
    }
    fp4_encode_batch<kBlock, decltype(per_group)::value>(batch, am, fmt, count, records, stride);
  });
}

#ifdef FLASHCOMM_FP_BF16_DIRECT
// fp4_encode_batch on a full batch (fp4_batch_groups(fmt, g) groups) of bf16 at x, read where
// it lies (cpu_fp_bf16.h).
inline void fp4_encode_bf16_batch(const uint16_t* x, int64_t g, int32_t fmt, uint8_t* records,
                                  int64_t stride) {
  with_fp4_layout(fmt, g, [&](auto block, auto per_group) {
    constexpr int kBlock = decltype(block)::value;
    static_assert(kFp4BatchVecs * kLanes == 32, "bf16_block_maxima's 32 blocks");
    ILanes am[kFp4BatchVecs];
    bf16_block_maxima<kBlock>(x, am);
    fp4_encode_batch<kBlock, decltype(per_group)::value>(x, am, fmt, fp4_batch_groups(fmt, g),
                                                         records, stride);
  });
}
#endif

// count groups of T into their records (fp4_quantize_groups): FpQuantizeOp's four-bit loop
// without rotation (and fp_loop's). A full batch of bf16 on AVX2 or AVX-512 is read where it
// lies (cpu_fp_bf16.h); otherwise the groups are widened into batch first.
template <typename T>
FC_ALWAYS_INLINE void fp4_quantize_batch(const typename T::Storage* x, int64_t count, int64_t g,
                                         int32_t fmt, float* batch, uint8_t* records,
                                         int64_t stride) {
#ifdef FLASHCOMM_FP_BF16_DIRECT
  if constexpr (std::is_same_v<T, BF16>) {
    if (count == fp4_batch_groups(fmt, g)) {
      prefetch_bytes(x + count * g, 2 * count * g);
      fp4_encode_bf16_batch(x, g, fmt, records, stride);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < count; ++j) load_group<T>(x + j * g, g, batch + j * g);
  fp4_quantize_groups(batch, count, g, fmt, records, stride);
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
// In: float, or bf16 bits (FLASHCOMM_FP_BF16_DIRECT, g a multiple of 4 * kLanes).
template <typename In>
inline void fp8_encode_groups(const In* v, int64_t count, int64_t g, ILanes am,
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
      fp_encode_nonfinite(g, kFormatFp8, rec);
      continue;
    }
    rec[g] = uint8_t((s[j] >> 16) & 0xFF);
    rec[g + 1] = uint8_t(s[j] >> 24);
    encode_e4m3_run(v + j * g, g, __builtin_shuffle(inv, ILanes{} + int32_t(j)), rec);
  }
}

inline void fp8_quantize_groups(const float* v, int64_t count, int64_t g, uint8_t* records,
                                int64_t stride) {
  fp8_encode_groups(v, count, g, block_maxima<kLanes>(v, g, count), records, stride);
}

// Whether fp8_quantize_batch reads a full batch of bf16 groups of g values where they lie.
FC_ALWAYS_INLINE bool fp8_bf16_direct_takes(int64_t g) { return g % (4 * kLanes) == 0; }

// count <= kLanes groups of T (no rotation) widened into batch (kLanes * g floats) with their
// maxima in the same pass, then fp8_encode_groups: FpQuantizeOp's fp8 loop (and fp_loop's).
template <typename T>
FC_ALWAYS_INLINE void fp8_quantize_batch(const typename T::Storage* x, int64_t count, int64_t g,
                                         float* batch, uint8_t* records, int64_t stride) {
#ifdef FLASHCOMM_FP_BF16_DIRECT
  if constexpr (std::is_same_v<T, BF16>) {  // bf16 read where it lies (cpu_fp_bf16.h)
    if (count == kLanes && fp8_bf16_direct_takes(g)) {
      prefetch_bytes(x + kLanes * g, kLanes * g * 2);
      fp8_encode_groups(x, count, g, bf16_group_maxima(x, g), records, stride);
      return;
    }
  }
#endif
  ILanes m[kLanes];
  for (int64_t j = 0; j < kLanes; ++j) {
    m[j] = j < count ? load_group_max<T>(x + j * g, g, batch + j * g) : ILanes{};
  }
  fp8_encode_groups(batch, count, g, largest_lanes<kLanes>(m), records, stride);
}

// Groups of g values in format fmt that the batch loops (fp8_quantize_groups,
// fp4_quantize_groups) encode together; 0 where they do not take such groups.
FC_ALWAYS_INLINE int64_t fp_batch_groups(int32_t fmt, int64_t g) {
  if (fmt == kFormatFp8) return g % kLanes == 0 && g <= kFp8BatchMaxGroup ? kLanes : 0;
  return fp4_batch_takes(fmt, g) ? fp4_batch_groups(fmt, g) : 0;
}

// The f32 scratch of such a batch.
FC_ALWAYS_INLINE int64_t fp_batch_floats(int32_t fmt, int64_t g) {
  return fmt == kFormatFp8 ? kLanes * g : fp4_batch_floats(fmt, g);
}

// The batch loop of fmt on 1 <= count <= fp_batch_groups(fmt, g) f32 groups in batch: the same
// bytes as fp_quantize_group without spikes on each.
inline void fp_quantize_groups(float* batch, int64_t count, int64_t g, int32_t fmt,
                               uint8_t* records, int64_t stride) {
  if (fmt == kFormatFp8) {
    fp8_quantize_groups(batch, count, g, records, stride);
  } else {
    fp4_quantize_groups(batch, count, g, fmt, records, stride);
  }
}

// The end of a spiked FP batch: the records of the groups that held an Inf or a NaN (finite[j]
// false: their largest magnitude) rewritten as fp_encode_group writes them, and every record's
// k spikes stored.
inline void fp_finish_spiked_records(int64_t count, int64_t g, int32_t fmt, int k,
                                     const int32_t (*pos)[kMaxSpikes],
                                     const float (*kept)[kMaxSpikes], const bool* finite,
                                     uint8_t* records, int64_t stride) {
  for (int64_t j = 0; j < count; ++j) {
    uint8_t* rec = records + j * stride;
    if (!finite[j]) fp_encode_nonfinite(g, fmt, rec);
    uint16_t values[kMaxSpikes];
    for (int s = 0; s < k; ++s) values[s] = spike_bits(kept[j][s], finite[j]);
    store_spikes(values, pos[j], k, g, rec + fp_code_bytes(fmt, g) + fp_scale_bytes(fmt, g));
  }
}

// fp_quantize_group with k > 0 spikes on 1 <= count <= fp_batch_groups(fmt, g) f32 groups of g
// values one after another in batch (spikes zeroed there): each group's spikes selected and
// kept as fp_quantize_group keeps them, the spike-free groups encoded together by
// fp_quantize_groups (the same bytes as fp_encode_group on each finite group), then the
// records of the groups that held an Inf or a NaN rewritten as fp_encode_group writes them,
// and every record's spikes.
inline void fp_quantize_spiked_groups(float* batch, int64_t count, int64_t g, int32_t fmt, int k,
                                      int32_t* keys, uint8_t* records, int64_t stride) {
  constexpr int64_t kMaxBatch = 16;  // fp8: kLanes groups; four-bit: fp4_batch_groups <= 16
  int32_t pos[kMaxBatch][kMaxSpikes];
  float kept[kMaxBatch][kMaxSpikes];
  bool finite[kMaxBatch];
  take_spikes</*kStandIn=*/false>(batch, count, g, k, keys, pos, kept, finite);
  fp_quantize_groups(batch, count, g, fmt, records, stride);
  fp_finish_spiked_records(count, g, fmt, k, pos, kept, finite, records, stride);
}

// fp_quantize_spiked_groups on 1 <= count <= fp_batch_groups(fmt, g) groups of T at x
// (no rotation; batch: fp_batch_floats(fmt, g) of scratch): FpQuantizeOp's loop with spikes.
// A full batch of bf16 with one spike per group (the four-bit default) is not widened: each
// group's words are copied to the scratch with the spike taken out on the way
// (take_bf16_spike), then encoded as bf16 (the same values, and so the same bytes).
template <typename T>
FC_ALWAYS_INLINE void fp_quantize_spiked_batch(const typename T::Storage* x, int64_t count,
                                               int64_t g, int32_t fmt, int k, float* batch,
                                               int32_t* keys, uint8_t* records, int64_t stride) {
#ifdef FLASHCOMM_FP_BF16_DIRECT
  if constexpr (std::is_same_v<T, BF16>) {
    const bool fp8 = fmt == kFormatFp8;
    if (k == 1 && count == fp_batch_groups(fmt, g) && (!fp8 || fp8_bf16_direct_takes(g))) {
      constexpr int64_t kMaxBatch = 16;  // as fp_quantize_spiked_groups's
      auto* words = reinterpret_cast<uint16_t*>(batch);  // count * g words: half the scratch
      int32_t pos[kMaxBatch][kMaxSpikes];
      float kept[kMaxBatch][kMaxSpikes];
      bool finite[kMaxBatch];
      prefetch_bytes(x + count * g, 2 * count * g);
      for (int64_t j = 0; j < count; ++j) {
        uint16_t spike;
        pos[j][0] = int32_t(take_bf16_spike(x + j * g, g, words + j * g, &spike));
        kept[j][0] = BF16::load(spike);
        finite[j] = (spike & 0x7FFFu) < 0x7F80u;  // the largest magnitude's
      }
      if (fp8) {
        fp8_encode_groups(words, count, g, bf16_group_maxima(words, g), records, stride);
      } else {
        fp4_encode_bf16_batch(words, g, fmt, records, stride);
      }
      fp_finish_spiked_records(count, g, fmt, 1, pos, kept, finite, records, stride);
      return;
    }
  }
#endif
  for (int64_t j = 0; j < count; ++j) load_group<T>(x + j * g, g, batch + j * g);
  fp_quantize_spiked_groups(batch, count, g, fmt, k, keys, records, stride);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_FP_H_
