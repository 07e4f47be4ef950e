// long file: the integer codec's vector loops (quantize, dequantize, the sums) over one set of lane
// helpers, compiled together in each instruction-set build
// Host loops over one group for the codec (docs/format.md). The arithmetic is codec.h; these
// loops only arrange it in vectors of kLanes f32 lanes (cpu_simd.h): the code width is a
// template parameter (constant shifts), the range pass keeps independent lanes, encode and
// decode are branch-free elementwise loops, and packing works on blocks of 8 codes. This file
// is compiled once per instruction set (ffi/cpu/isa_kernels.cc, kLanes = the ISA's register
// width) and the build is picked at load time (ffi/cpu/dispatch.cc): every operation is a
// correctly rounded IEEE op (no FMA contraction), so every build gives the same bits. The
// rotation's loops are in cpu_rotation.h.
// The loads and the bit packing are in cpu_codec_lanes.h, the decode loops in
// cpu_codec_decode.h; this header has the range pass, the group parameters, the encode and the
// quantize loops, and includes both.

#ifndef FLASHCOMM_CPU_CODEC_H_
#define FLASHCOMM_CPU_CODEC_H_

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec_decode.h"
#include "cpu/cpu_codec_lanes.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// One group of T's min, max and finiteness (g a multiple of 8).
template <typename T>
__attribute__((always_inline)) inline void load_range(const typename T::Storage* x, int64_t g,
                                                      float* lo, float* hi, bool* finite) {
  float l = T::load(x[0]), h = l;
  bool ok = true;
  int64_t i = 0;
  if (g >= kLanes) {
    Lanes lo_l = load_lanes_t<T>(x), hi_l = lo_l;
    ILanes bad_l = ILanes{};
    if constexpr (std::is_same_v<T, BF16>) {
      for (; i + 2 * kLanes <= g; i += 2 * kLanes) {
        Lanes a, b;
        load_bf16_pairs(x + i, &a, &b);
        lo_l = a < lo_l ? a : lo_l;
        hi_l = a > hi_l ? a : hi_l;
        lo_l = b < lo_l ? b : lo_l;
        hi_l = b > hi_l ? b : hi_l;
        bad_l |= ((lanes_bits(a) & 0x7F800000u) == 0x7F800000u) |
                 ((lanes_bits(b) & 0x7F800000u) == 0x7F800000u);
      }
    }
    for (; i + kLanes <= g; i += kLanes) {
      const Lanes a = load_lanes_t<T>(x + i);
      lo_l = a < lo_l ? a : lo_l;
      hi_l = a > hi_l ? a : hi_l;
      bad_l |= (lanes_bits(a) & 0x7F800000u) == 0x7F800000u;
    }
    l = reduce_min(lo_l);
    h = reduce_max(hi_l);
    ok = !any_lane(bad_l);
  }
  for (; i < g; ++i) {
    const float a = T::load(x[i]);
    l = a < l ? a : l;
    h = a > h ? a : h;
    ok = ok && is_finite(a);
  }
  // -0.0 and +0.0 compare equal; store +0 so the result does not depend on the order of
  // the reduction.
  *lo = l == 0.0f ? 0.0f : l;
  *hi = h == 0.0f ? 0.0f : h;
  *finite = ok;
}

// codec.h's encode of kLanes values of a group, before the clamp and rounding. kDropPre: the
// group's pre is 1 and the flush mode makes x * 1 the same operand as x
// (unit_multiply_is_identity; encode_group decides), so the multiply is left out: the same
// bits, one op fewer.
template <bool kDropPre = false>
FC_ALWAYS_INLINE Lanes encode_scaled_lanes(Lanes x, const GroupParams& p) {
  if constexpr (kDropPre) return mul_rn(add_rn(x, -p.zero_pre), p.inv_scale);
  return mul_rn(add_rn(mul_rn(x, p.pre), -p.zero_pre), p.inv_scale);
}

// The codes of kLanes values of a group: codec.h's encode, lane-wise (code_lanes).
template <bool kDropPre = false>
FC_ALWAYS_INLINE ULanes encode_code_lanes(Lanes x, const GroupParams& p, float levels) {
  return code_lanes(encode_scaled_lanes<kDropPre>(x, p), levels);
}

// Encode and pack one group of T (read again from x: it is in L1 after the range pass, and
// widening bf16 again is cheaper than storing and reloading f32). kDropPre: encode_scaled_lanes's.
template <typename T, int BITS, bool kDropPre = false>
__attribute__((always_inline)) inline void encode_pack(const typename T::Storage* v, int64_t g,
                                                       const GroupParams& p, uint8_t* codes) {
  const float levels = float(max_code(BITS));
  uint8_t staged[kChunk];
  for (int64_t i0 = 0; i0 < g; i0 += kChunk) {
    const int64_t n = g - i0 < kChunk ? g - i0 : kChunk;
    uint8_t* out = codes + i0 / kBlock * BITS;
    uint8_t* q = BITS == 8 ? out : staged;  // 8-bit codes are their own packing
    int64_t j = 0;
    // bf16, and f32 (the fused op's sums, spiked groups): staged code bytes stored 8 at a time
    // under the packing's wide loads stall them (int4 with a spike: 0.89-0.90x the time)
    constexpr bool kPairs = std::is_same_v<T, BF16> || std::is_same_v<T, F32>;
    if constexpr (kPairs && kPackPairs<BITS>) {
      // 4 * kLanes values per step: two runs of codes packed together.
      for (; j + 4 * kLanes <= n; j += 4 * kLanes) {
        Lanes e0, o0, e1, o1;
        load_pairs<T>(v + i0 + j, &e0, &o0);
        load_pairs<T>(v + i0 + j + 2 * kLanes, &e1, &o1);
        pack_two_runs<BITS>(pack_lanes_input(encode_scaled_lanes<kDropPre>(e0, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(o0, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(e1, p), levels),
                            pack_lanes_input(encode_scaled_lanes<kDropPre>(o1, p), levels),
                            out + j / kBlock * BITS, j + 6 * kLanes <= n);
      }
    }
    if constexpr (kPairs) {
      for (; j + 2 * kLanes <= n; j += 2 * kLanes) {
        Lanes even, odd;
        load_pairs<T>(v + i0 + j, &even, &odd);
        const ULanes ce = encode_code_lanes<kDropPre>(even, p, levels);
        const ULanes co = encode_code_lanes<kDropPre>(odd, p, levels);
        if constexpr (kPackPairs<BITS>) {
          pack_pairs<BITS>(ce, co, out + j / kBlock * BITS, j + 2 * kLanes < n);
        } else {
          narrow_byte_pairs(ce | (co << 16), q + j);
        }
      }
    }
    const int64_t packed = kPackPairs<BITS> ? j : 0;  // codes [0, packed) are packed already
    for (; j + kLanes <= n; j += kLanes) {
      narrow_bytes(encode_code_lanes<kDropPre>(load_lanes_t<T>(v + i0 + j), p, levels), q + j);
    }
    for (; j < n; ++j) q[j] = uint8_t(encode(T::load(v[i0 + j]), p, levels));
    if (BITS == 4) {  // the same LSB-first layout, as one vectorizable loop
      for (int64_t k = packed / 2; k < n / 2; ++k) {
        out[k] = uint8_t(q[2 * k] | (q[2 * k + 1] << 4));
      }
    } else if (BITS != 8) {
      int64_t b = packed;
      if (BITS == 6 && kPack6Vector) {
        for (; b + 16 <= n; b += 16) pack6_16(q + b, out + b / kBlock * BITS);
      }
      for (; b < n; b += kBlock) pack_block_t<BITS>(q + b, out + b / kBlock * BITS);
    }
  }
}

// Encode and pack one group with its parameters (all-zero codes for a non-finite group).
// kDropPre: compile the encode without the multiply by pre too, used where pre is 1 and
// unit_multiply (unit_multiply_is_identity() of the calling thread, read once per call); only
// for the hot paths (bf16 and the fused op's f32 sums at the default group size, 8/6/4 bits),
// each such variant costing compile time.
template <typename T, bool kDropPre = false>
__attribute__((always_inline)) inline void encode_group(const typename T::Storage* x, int64_t g,
                                                        int bits, const GroupParams& p,
                                                        uint8_t* codes,
                                                        bool unit_multiply = false) {
  if (!is_finite(p.scale)) {
    std::memset(codes, 0, size_t(group_bytes(g, bits)));
    return;
  }
  if constexpr (kDropPre) {
    if (unit_multiply && p.pre == 1.0f) {
      switch (bits) {
        case 8: return encode_pack<T, 8, true>(x, g, p, codes);
        case 6: return encode_pack<T, 6, true>(x, g, p, codes);
        case 4: return encode_pack<T, 4, true>(x, g, p, codes);
        default: break;
      }
    }
  }
  switch (bits) {
    case 2: return encode_pack<T, 2>(x, g, p, codes);
    case 3: return encode_pack<T, 3>(x, g, p, codes);
    case 4: return encode_pack<T, 4>(x, g, p, codes);
    case 5: return encode_pack<T, 5>(x, g, p, codes);
    case 6: return encode_pack<T, 6>(x, g, p, codes);
    case 7: return encode_pack<T, 7>(x, g, p, codes);
    default: return encode_pack<T, 8>(x, g, p, codes);
  }
}

// Quantize one group; `others_finite` false makes it a non-finite group whatever its values
// (spike reserving: a non-finite spike). Returns whether the group is finite.
template <typename T>
__attribute__((always_inline)) inline bool quantize_one(const typename T::Storage* x, int64_t g,
                                                        int bits, uint8_t* codes,
                                                        uint16_t* scale, uint16_t* zero,
                                                        bool others_finite = true) {
  float lo, hi;
  bool finite;
  load_range<T>(x, g, &lo, &hi, &finite);
  finite = finite && others_finite;
  const GroupParams p = group_params(lo, hi, finite, bits);
  *scale = p.scale_bits;
  *zero = p.zero_bits;
  encode_group<T>(x, g, bits, p, codes);
  return finite;
}

// One group's (g >= kLanes values of T) range as lanes: lo and hi, each lane the min / max of
// the values it met that are not NaN (a lane that met only NaN keeps +inf / -inf), and nan,
// lanes that met a NaN. The group is finite when no lane met a NaN and lo and hi are finite.
template <typename T>
__attribute__((always_inline)) inline void range_lanes(const typename T::Storage* x, int64_t g,
                                                       Lanes* lo, Lanes* hi, ILanes* nan) {
  const float inf = bits_to_float(0x7F800000u);
  Lanes l = Lanes{} + inf, h = Lanes{} - inf;
  ILanes bad = ILanes{};
  int64_t i = 0;
  if constexpr (std::is_same_v<T, BF16>) {
    for (; i + 2 * kLanes <= g; i += 2 * kLanes) {
      Lanes a, b;
      load_bf16_pairs(x + i, &a, &b);
      l = a < l ? a : l;  // minps / maxps: NaN in a keeps l
      h = a > h ? a : h;
      l = b < l ? b : l;
      h = b > h ? b : h;
      bad |= unordered(a, b);
    }
  }
  for (; i < g; i += kLanes) {
    // The last vector may overlap the previous one (g not a multiple of kLanes): min, max and
    // the NaN test do not mind seeing a value twice.
    const Lanes a = load_lanes_t<T>(x + (i + kLanes <= g ? i : g - kLanes));
    l = a < l ? a : l;
    h = a > h ? a : h;
    bad |= unordered(a, a);
  }
  *lo = l;
  *hi = h;
  *nan = bad;
}

// ---- the range of bf16 groups on their bit patterns ----
// A bf16 value's order is its bit pattern's: among values with the sign bit clear, the signed
// 16-bit order; among those with it set, the unsigned order reversed. So three integer
// reductions of the raw 16-bit patterns give a group's min, max and finiteness:
//   smax (signed max): the largest value when one has the sign bit clear (>= 0x7F80: +Inf, NaN);
//   umax (unsigned max): the most negative value when one has the sign bit set (>= 0xFF80:
//     -Inf, NaN);
//   smin (signed min): the smallest value when none has the sign bit set, the largest when all
//     have it.
// One integer min / max per 2 * kLanes values and reduction, against a widening, two float
// min / max per kLanes values and a NaN test in range_lanes. (Not used with 16 lanes: the
// AVX-512 build keeps range_lanes.)
typedef int16_t Words __attribute__((vector_size(4 * kLanes)));
typedef uint16_t UWords __attribute__((vector_size(4 * kLanes)));
template <typename T>
constexpr bool kWordRange = std::is_same_v<T, BF16> && kLanes <= 8;

FC_ALWAYS_INLINE ULanes max_words(ULanes a, ULanes b) {
  return (ULanes)((Words)a > (Words)b ? (Words)a : (Words)b);
}
FC_ALWAYS_INLINE ULanes min_words(ULanes a, ULanes b) {
  return (ULanes)((Words)a < (Words)b ? (Words)a : (Words)b);
}
FC_ALWAYS_INLINE ULanes umax_words(ULanes a, ULanes b) {
  return (ULanes)((UWords)a > (UWords)b ? (UWords)a : (UWords)b);
}

// One bf16 group's (g >= 2 * kLanes values, a multiple of 8) smax, smin and umax, each as a
// vector of 2 * kLanes 16-bit lanes (to be reduced over them).
FC_ALWAYS_INLINE void range_words(const uint16_t* x, int64_t g, ULanes* smax, ULanes* smin,
                                  ULanes* umax) {
  ULanes h;
  std::memcpy(&h, x + g - 2 * kLanes, sizeof h);  // may overlap the others (min / max do not mind)
  ULanes hi = h, lo = h, top = h;
  for (int64_t i = 0; i + 2 * kLanes < g; i += 2 * kLanes) {
    std::memcpy(&h, x + i, sizeof h);
    hi = max_words(hi, h);
    lo = min_words(lo, h);
    top = umax_words(top, h);
  }
  *smax = hi;
  *smin = lo;
  *umax = top;
}

// kLanes groups' lo, hi and non-finite lanes (group_params_lanes's inputs) from their
// range_words reduced to one 16-bit lane each (the low half of each 32-bit lane).
FC_ALWAYS_INLINE void range_from_words(ULanes smax, ULanes smin, ULanes umax, Lanes* lo,
                                       Lanes* hi, ILanes* bad) {
  const ILanes smax_i = ((ILanes)(smax << 16)) >> 16;  // sign-extended
  const ULanes umax_u = umax & 0xFFFFu;
  const ULanes hi_bits = smax_i >= 0 ? smax & 0xFFFFu : smin & 0xFFFFu;
  const ULanes lo_bits = umax_u >= 0x8000u ? umax_u : smin & 0xFFFFu;
  *hi = bits_lanes(hi_bits << 16);
  *lo = bits_lanes(lo_bits << 16);
  *bad = (smax_i >= 0x7F80) | (ILanes)(umax_u >= 0xFF80u);
}

// The ranges of the kLanes groups s0 .. s0 + kLanes - 1 of the m groups (g values each) at x,
// one per lane of lo, hi and bad (group_params_lanes's inputs): each group's range_words or
// range_lanes, reduced to one lane by reduce_lanes (kLanes groups in a few shuffles).
template <typename T>
FC_ALWAYS_INLINE void ranges_lanes(const typename T::Storage* x, int64_t g, int64_t s0,
                                   int64_t m, Lanes* lo, Lanes* hi, ILanes* bad) {
  // Slot s ends in lane kReducedLanes.lane[s]: it takes that group (past the last group, the
  // first one again).
  auto group = [&](int s) {
    return x + (s0 + kReducedLanes.lane[s] < m ? s0 + kReducedLanes.lane[s] : s0) * g;
  };
  if constexpr (kWordRange<T>) {
    if (g >= 2 * kLanes) {
      ULanes smax[kLanes], smin[kLanes], umax[kLanes];
#pragma GCC unroll 16
      for (int s = 0; s < kLanes; ++s) range_words(group(s), g, &smax[s], &smin[s], &umax[s]);
      ULanes a = reduce_lanes(smax, max_words), b = reduce_lanes(smin, min_words),
             c = reduce_lanes(umax, umax_words);
      a = max_words(a, a >> 16);  // the two 16-bit halves of each lane
      b = min_words(b, b >> 16);
      c = umax_words(c, c >> 16);
      return range_from_words(a, b, c, lo, hi, bad);
    }
  }
  Lanes l[kLanes], h[kLanes];
  ILanes nan[kLanes];
#pragma GCC unroll 16
  for (int s = 0; s < kLanes; ++s) range_lanes<T>(group(s), g, &l[s], &h[s], &nan[s]);
  *lo = reduce_lanes(l, [](Lanes a, Lanes b) { return a < b ? a : b; });
  *hi = reduce_lanes(h, [](Lanes a, Lanes b) { return a > b ? a : b; });
  *bad = reduce_lanes(nan, [](ILanes a, ILanes b) { return a | b; });
}

// The parameters of kLanes groups, one per lane (codec.h's group_params, lane-wise: the same
// IEEE operations on each lane).
struct ParamLanes {
  ULanes scale_bits, zero_bits;
  Lanes scale, zero, inv_scale, pre, zero_pre;
};

// lo, hi, nan: per lane, one group's range_lanes reduced over its lanes.
__attribute__((always_inline)) inline void group_params_lanes(Lanes lo, Lanes hi, ILanes nan,
                                                              int bits, ParamLanes* p) {
  const Lanes zeros = Lanes{};
  const ULanes exp_mask = ULanes{} + 0x7F800000u;
  lo = lo == 0.0f ? zeros : lo;  // -0 -> +0 (load_range)
  hi = hi == 0.0f ? zeros : hi;
  const ILanes finite = ~nan & ((lanes_bits(lo) & exp_mask) != exp_mask) &
                        ((lanes_bits(hi) & exp_mask) != exp_mask);
  const float inv_levels = 1.0f / float(max_code(bits));
  // zero: bf16_round_down(lo), clamped to the lowest finite bf16.
  const ULanes u = lanes_bits(lo);
  const ILanes down = ((u & 0x80000000u) != 0) & ((u & 0x0000FFFFu) != 0);
  ULanes zb = ((u & 0xFFFF0000u) + ((ULanes)down & 0x10000u)) >> 16;
  zb = zb == 0xFF80u ? ULanes{} + uint32_t(kBf16Lowest) : zb;
  const Lanes zero = bits_lanes(zb << 16);
  Lanes range = add_rn(hi, -zero);
  range = range > 0.0f ? range : zeros;
  const Lanes direct = mul_rn(range, inv_levels);
  const Lanes halves =
      mul_rn(mul_rn(add_rn(mul_rn(hi, 0.5f), -mul_rn(zero, 0.5f)), inv_levels), 2.0f);
  Lanes scale = select_finite(range, direct, halves);
  scale = (range > 0.0f) & ~(scale >= kFltMin) ? Lanes{} + kFltMin : scale;
  // scale: bf16_round_up.
  const ULanes su = lanes_bits(scale);
  const ILanes up = ((su & 0x80000000u) == 0) & ((su & 0x0000FFFFu) != 0);
  const ULanes sb = ((su & 0xFFFF0000u) + ((ULanes)up & 0x10000u)) >> 16;
  const Lanes sc = bits_lanes(sb << 16);
  // set_inverse.
  const Lanes ones = Lanes{} + 1.0f;
  const Lanes pre = sc >= kHugeScale ? Lanes{} + kTwoPowMinus64 : ones;
  const Lanes zero_pre = mul_rn(zero, pre);
  const Lanes inv = sc > 0.0f ? ones / mul_rn(sc, pre) : zeros;
  // A group holding NaN or Inf: scale NaN, zero 0, all-zero codes.
  p->scale_bits = finite ? sb : ULanes{} + uint32_t(kBf16NaN);
  p->zero_bits = finite ? zb : ULanes{};
  p->scale = finite ? sc : bits_lanes(ULanes{} + (uint32_t(kBf16NaN) << 16));
  p->zero = finite ? zero : zeros;
  p->inv_scale = finite ? inv : zeros;
  p->pre = finite ? pre : ones;
  p->zero_pre = finite ? zero_pre : zeros;
}

// Groups per batch of quantize_groups (a multiple of kLanes).
constexpr int64_t kQuantizeBatch = kLanes > 16 ? kLanes : 16;

// Quantize n_groups groups of g elements of T: codes (g * bits / 8 bytes each), bf16 scale
// and zero. Groups go in batches: the ranges and parameters of a batch first, then its codes.
// The parameters of kLanes groups are computed at once, one group per lane: each group's range
// is reduced to one lane by reduce_lanes (kLanes groups in a few shuffles), and group_params
// runs lane-wise. While a batch is encoded, the next batch's operand and code bytes are
// prefetched, so that its range pass reads from the cache (measured ~1.15x with the operand in
// main memory, no change from L3). G: the group size when known at compile time, else 0.
// stride: bytes from one group's codes to the next's (0: the codes' own bytes, back to back).
template <typename T, int64_t G>
FC_ALWAYS_INLINE void quantize_groups_of(const typename T::Storage* x, int64_t n_groups,
                                         int64_t group_size, int bits, uint8_t* codes,
                                         uint16_t* scale, uint16_t* zero, int64_t stride) {
  const int64_t g = G != 0 ? G : group_size;
  constexpr int64_t kBatch = kQuantizeBatch;
  const int64_t nbytes = group_bytes(g, bits), step = stride != 0 ? stride : nbytes;
  if (g < kLanes) {  // G = 8 with 16 lanes: one group at a time
    for (int64_t k = 0; k < n_groups; ++k) {
      quantize_one<T>(x + k * g, g, bits, codes + k * step, scale + k, zero + k);
    }
    return;
  }
  alignas(64) uint16_t sb[kBatch], zb[kBatch];
  alignas(64) float sc[kBatch], ze[kBatch], inv[kBatch], pre[kBatch], zp[kBatch];
  constexpr bool kDropPre = G == kDefaultGroupSize && !std::is_same_v<T, F16>;
  const bool unit_multiply = kDropPre && unit_multiply_is_identity();
  for (int64_t k0 = 0; k0 < n_groups; k0 += kBatch) {
    const int64_t m = n_groups - k0 < kBatch ? n_groups - k0 : kBatch;
    for (int64_t s0 = 0; s0 < m; s0 += kLanes) {
      Lanes l, h;
      ILanes n;
      ranges_lanes<T>(x + k0 * g, g, s0, m, &l, &h, &n);
      ParamLanes p;
      group_params_lanes(l, h, n, bits, &p);
      narrow_halves(p.scale_bits, sb + s0);
      narrow_halves(p.zero_bits, zb + s0);
      store_lanes(sc + s0, p.scale);
      store_lanes(ze + s0, p.zero);
      store_lanes(inv + s0, p.inv_scale);
      store_lanes(pre + s0, p.pre);
      store_lanes(zp + s0, p.zero_pre);
    }
    std::memcpy(scale + k0, sb, size_t(m) * sizeof(uint16_t));
    std::memcpy(zero + k0, zb, size_t(m) * sizeof(uint16_t));
    for (int64_t k = 0; k < m; ++k) {
      const GroupParams p = {sb[k], zb[k], sc[k], ze[k], inv[k], pre[k], zp[k]};
      if (k0 + kBatch + k < n_groups) {
        const char* next = reinterpret_cast<const char*>(x + (k0 + kBatch + k) * g);
        for (int64_t b = 0; b < g * int64_t(sizeof(*x)); b += 64) __builtin_prefetch(next + b);
        uint8_t* out = codes + (k0 + kBatch + k) * step;
        for (int64_t b = 0; b < nbytes; b += 64) __builtin_prefetch(out + b, 1);
      }
      encode_group<T, kDropPre>(x + (k0 + k) * g, g, bits, p, codes + (k0 + k) * step,
                                unit_multiply);
    }
  }
}

template <typename T>
void quantize_groups(const typename T::Storage* x, int64_t n_groups, int64_t g, int bits,
                     uint8_t* codes, uint16_t* scale, uint16_t* zero, int64_t stride = 0) {
  if (g == kDefaultGroupSize) {
    return quantize_groups_of<T, kDefaultGroupSize>(x, n_groups, g, bits, codes, scale, zero,
                                                    stride);
  }
  return quantize_groups_of<T, 0>(x, n_groups, g, bits, codes, scale, zero, stride);
}

// Quantize one group of f32 values: its codes (g * bits / 8 bytes), bf16 scale and zero.
inline void quantize_group(const float* v, int64_t g, int bits, uint8_t* codes,
                                           uint16_t* scale, uint16_t* zero) {
  quantize_one<F32>(v, g, bits, codes, scale, zero);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CODEC_H_
