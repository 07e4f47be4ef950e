// Host loops of spike reserving (docs/format.md, "Spike reserving"): quantize a group with its
// k largest-magnitude values kept in bf16, and put them back after decoding. The arithmetic is
// codec.h's (select_spikes, spike_bits, apply_spikes); the codes are cpu_codec.h's.
#ifndef FLASHCOMM_CPU_SPIKES_H_
#define FLASHCOMM_CPU_SPIKES_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

__attribute__((always_inline)) inline int32_t max_key(const int32_t* keys, int64_t g) {
  int64_t i = 0;
  int32_t best = -1;
  if (g >= kLanes) {
    ILanes m = load_ilanes(keys);
    for (i = kLanes; i + kLanes <= g; i += kLanes) {
      const ILanes a = load_ilanes(keys + i);
      m = a > m ? a : m;
    }
    best = reduce_imax(m);
  }
  for (; i < g; ++i) best = keys[i] > best ? keys[i] : best;
  return best;
}

// The key of each value of v (spike_key) as int32 lanes.
__attribute__((always_inline)) inline ILanes key_lanes(const float* v) {
  return (ILanes)(lanes_bits(load_lanes(v)) & 0x7FFFFFFFu);
}

// The largest key (spike_key: the magnitude's bits) of the g values of v, 0 for none; also the
// group maximum of the FP formats (cpu_fp.h max_abs).
__attribute__((always_inline)) inline int32_t max_key_of(const float* v, int64_t g) {
  int64_t i = 0;
  int32_t best = 0;
  if (g >= kLanes) {
    ILanes m = key_lanes(v);
    for (i = kLanes; i + kLanes <= g; i += kLanes) {
      const ILanes a = key_lanes(v + i);
      m = a > m ? a : m;
    }
    best = reduce_imax(m);
  }
  for (; i < g; ++i) {
    const int32_t key = int32_t(spike_key(v[i]));
    best = key > best ? key : best;
  }
  return best;
}

// codec.h select_spikes, as its definition reads: k rounds of "the first position of the
// largest key not yet taken". Each round is a vector max over the keys and a scan for its
// first occurrence; a taken key becomes -1 (keys are non-negative as int32). keys: g scratch.
// One spike (the 4-bit default) is one round on v itself: the keys are never stored.
__attribute__((always_inline)) inline void select_spikes_lanes(const float* v, int64_t g, int k,
                                                               int32_t* keys, int32_t* pos) {
  if (k == 1 && g >= kLanes) {
    // One pass with no branch on the data (a search loop's exit would mispredict): each lane
    // keeps its largest key and where it first came, then the first position among the lanes
    // that hold the largest; a scalar tail wins only with a larger key (it comes later).
    ILanes m = key_lanes(v), at = kLaneIndex;
    int64_t i = kLanes;
    for (; i + kLanes <= g; i += kLanes) {
      const ILanes key = key_lanes(v + i);
      const ILanes larger = key > m;
      m = larger ? key : m;
      at = larger ? kLaneIndex + int32_t(i) : at;
    }
    int32_t best = reduce_imax(m);
    int32_t p = -reduce_imax(-(m == best ? at : ILanes{} + INT32_MAX));
    for (; i < g; ++i) {
      const int32_t key = int32_t(spike_key(v[i]));
      p = key > best ? int32_t(i) : p;
      best = key > best ? key : best;
    }
    pos[0] = p;
    return;
  }
  if (k == 1) {
    const int32_t best = max_key_of(v, g);
    int64_t at = 0;
    while (int32_t(spike_key(v[at])) != best) ++at;
    pos[0] = int32_t(at);
    return;
  }
  int64_t i = 0;
  for (; i + kLanes <= g; i += kLanes) {
    const ILanes key = key_lanes(v + i);
    std::memcpy(keys + i, &key, sizeof key);
  }
  for (; i < g; ++i) keys[i] = int32_t(spike_key(v[i]));
  for (int j = 0; j < k; ++j) {
    const int32_t best = max_key(keys, g);
    int64_t at = 0;
    for (; at + kLanes <= g; at += kLanes) {  // the vector holding the first occurrence
      if (any_lane(load_ilanes(keys + at) == best)) break;
    }
    while (keys[at] != best) ++at;
    pos[j] = int32_t(at);
    keys[at] = -1;
  }
}

// One group of T widened to f32 (exact), vector by vector.
template <typename T>
__attribute__((always_inline)) inline void load_group(const typename T::Storage* x, int64_t g,
                                                      float* v) {
  int64_t i = 0;
  for (; i + kLanes <= g; i += kLanes) {
    const Lanes a = load_lanes_t<T>(x + i);
    std::memcpy(v + i, &a, sizeof a);
  }
  for (; i < g; ++i) v[i] = T::load(x[i]);
}

// The k spikes of each of count f32 groups of g values one after another in batch: selected
// (select_spikes_lanes), kept, and replaced in the group by its first kept value (kStandIn:
// the integer codec, so they do not widen its range) or by zero (the FP formats, whose scales
// come from maxima). finite[j]: whether group j's spikes are finite (its largest magnitude).
template <bool kStandIn>
inline void take_spikes(float* batch, int64_t count, int64_t g, int k, int32_t* keys,
                        int32_t (*pos)[kMaxSpikes], float (*kept)[kMaxSpikes], bool* finite) {
  for (int64_t j = 0; j < count; ++j) {
    float* v = batch + j * g;
    select_spikes_lanes(v, g, k, keys, pos[j]);
    finite[j] = is_finite(v[pos[j][0]]);  // the first spike holds the largest magnitude
    for (int s = 0; s < k; ++s) kept[j][s] = v[pos[j][s]];
    const float stand_in = kStandIn ? v[first_kept(pos[j], k)] : 0.0f;
    for (int s = 0; s < k; ++s) v[pos[j][s]] = stand_in;
  }
}

// The end of a spiked batch (quantize_spiked_groups): the groups whose spikes held an Inf or a
// NaN rewritten as quantize_one writes a non-finite group (NaN scale, zero 0, zero codes), and
// every group's spike record stored after its codes.
inline void finish_spiked_records(int64_t count, int64_t g, int bits, int k,
                                  const int32_t (*pos)[kMaxSpikes],
                                  const float (*kept)[kMaxSpikes], const bool* spikes_finite,
                                  uint8_t* rec, int64_t stride, uint16_t* scale, uint16_t* zero) {
  const int64_t nbytes = group_bytes(g, bits);
  for (int64_t j = 0; j < count; ++j) {
    uint8_t* r = rec + j * stride;
    if (!spikes_finite[j]) {
      scale[j] = kBf16NaN;
      zero[j] = 0;
      std::memset(r, 0, size_t(nbytes));
    }
    const bool finite = scale[j] != kBf16NaN;  // (a finite group's scale is a finite bf16)
    uint16_t values[kMaxSpikes];
    for (int s = 0; s < k; ++s) values[s] = spike_bits(kept[j][s], finite);
    store_spikes(values, pos[j], k, g, r + nbytes);
  }
}

// Quantize 1 <= count <= kQuantizeBatch f32 groups of g values one after another in batch
// (overwritten: each group's k spikes replaced by its first kept value, so they do not widen
// its range) into their records, `stride` bytes apart from rec (codes, then the spike record),
// scales and zeros: the spikes selected group by group, the groups quantized together by
// quantize_groups (parameters lane-wise, instead of a scalar chain per group), then
// finish_spiked_records. keys: g int32 of scratch.
inline void quantize_spiked_groups(float* batch, int64_t count, int64_t g, int bits, int k,
                                   int32_t* keys, uint8_t* rec, int64_t stride, uint16_t* scale,
                                   uint16_t* zero) {
  int32_t pos[kQuantizeBatch][kMaxSpikes];
  float kept[kQuantizeBatch][kMaxSpikes];
  bool spikes_finite[kQuantizeBatch];
  take_spikes</*kStandIn=*/true>(batch, count, g, k, keys, pos, kept, spikes_finite);
  quantize_groups<F32>(batch, count, g, bits, rec, scale, zero, stride);
  finish_spiked_records(count, g, bits, k, pos, kept, spikes_finite, rec, stride, scale, zero);
}


// A group's spikes (its spike record: k spikes) stored over its g decoded values at y as
// store_group stores them (saturated to T's range); positions past the group skipped, a
// position given twice taking the later spike (apply_spikes's order).
template <typename T>
FC_ALWAYS_INLINE void store_spikes_over(const uint8_t* spikes, int k, int64_t g,
                                        typename T::Storage* y) {
  for (int j = 0; j < k; ++j) {
    const int64_t p = spike_position(spikes, k, g, j);
    const float v = flashcomm::saturate(spike_value(spikes, j), T::kMax);
    if (p < g) y[p] = T::store(v);
  }
}

// A chunk's group with spikes added to the f32 sum acc in one pass: decode_into(acc) adds the
// decoded values (spikes not put back); at the spikes' positions the sum before (kept aside)
// plus the spike instead. The same sums as adding the group with its spikes put back.
template <typename Decode>
FC_ALWAYS_INLINE void add_spiked(const uint8_t* spikes, int k, int64_t g, float* acc,
                                 Decode&& decode_into) {
  int64_t at[kMaxSpikes];
  float before[kMaxSpikes];
  for (int j = 0; j < k; ++j) {
    at[j] = spike_position(spikes, k, g, j);
    before[j] = at[j] < g ? acc[at[j]] : 0.0f;
  }
  decode_into(acc);
  for (int j = 0; j < k; ++j) {
    if (at[j] < g) acc[at[j]] = add_rn(before[j], spike_value(spikes, j));
  }
}

// Decode one group's record into f32 values at out, spikes put back.
inline void decode_spiked_group(const uint8_t* rec, uint16_t scale, uint16_t zero, int64_t g,
                                int bits, int k, float* out) {
  decode_group(rec, scale, zero, g, bits, false, out);
  apply_spikes(rec + group_bytes(g, bits), k, g, out);
}

// Eight decoded values (block b of a group's record), spikes put back.
inline void decode_spiked_block(const uint8_t* rec, const GroupParams& p, int64_t g, int bits,
                                int k, int64_t block, float* d) {
  uint32_t q[kBlock];
  unpack_block(rec + block * bits, bits, q);
  for (int j = 0; j < kBlock; ++j) d[j] = decode(q[j], p);
  const uint8_t* spikes = rec + group_bytes(g, bits);
  for (int j = 0; j < k; ++j) {
    const int64_t at = spike_position(spikes, k, g, j) - block * kBlock;
    if (at >= 0 && at < kBlock) d[at] = spike_value(spikes, j);
  }
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_SPIKES_H_
