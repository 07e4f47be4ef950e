// bf16 operands of the floating-point formats read where they lie (AVX2, AVX-512): the quantize
// loops' block and group maxima from the bf16 bits, a register of them at a time, and the
// four-vector packing's values widened on the way in, instead of a pass that widens the values
// into an f32 copy and two more that read it back (cpu_fp.h: fp4_quantize_batch,
// fp8_quantize_batch); and the spike of a group taken out as its words are copied
// (take_bf16_spike: the FP formats' and the integer codec's one-spike quantize). The same
// bytes: a bf16 value's f32 bits are its bits shifted up 16, and the encoders see the same f32
// values. Compiled once per instruction set (ffi/cpu/isa_kernels.cc); elsewhere nothing.
#ifndef FLASHCOMM_CPU_FP_BF16_H_
#define FLASHCOMM_CPU_FP_BF16_H_

#include <cstdint>

#include "cpu/cpu_fp_lanes.h"

#if (FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)) || \
    (FLASHCOMM_LANES == 16 && defined(FC_X86) && defined(__AVX512BW__))
#define FLASHCOMM_FP_BF16_DIRECT 1

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// bf16 values per register.
constexpr int64_t kBf16PerReg = 2 * kLanes;

// Asks for the n bytes from x into the cache (the next batch, while this one is encoded: its
// first pass, the maxima, would otherwise wait on memory line by line).
FC_ALWAYS_INLINE void prefetch_bytes(const void* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(static_cast<const char*>(x) + i);
}

// The largest of m's eight words (as signed words).
FC_ALWAYS_INLINE int32_t largest_word_128(__m128i m) {
  m = _mm_max_epi16(m, _mm_shuffle_epi32(m, 0x4E));
  m = _mm_max_epi16(m, _mm_shuffle_epi32(m, 0xB1));
  m = _mm_max_epi16(m, _mm_shufflelo_epi16(m, 0xB1));
  return int16_t(_mm_cvtsi128_si32(m));
}

#if FLASHCOMM_LANES == 8
typedef __m256i Bf16Reg;
FC_ALWAYS_INLINE Bf16Reg load_words(const uint16_t* x) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
}
FC_ALWAYS_INLINE Bf16Reg and_words(Bf16Reg a, int16_t m) {
  return _mm256_and_si256(a, _mm256_set1_epi16(m));
}
FC_ALWAYS_INLINE Bf16Reg max_words(Bf16Reg a, Bf16Reg b) { return _mm256_max_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpacklo16(Bf16Reg a, Bf16Reg b) { return _mm256_unpacklo_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpackhi16(Bf16Reg a, Bf16Reg b) { return _mm256_unpackhi_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpacklo32(Bf16Reg a, Bf16Reg b) { return _mm256_unpacklo_epi32(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpackhi32(Bf16Reg a, Bf16Reg b) { return _mm256_unpackhi_epi32(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpacklo64(Bf16Reg a, Bf16Reg b) { return _mm256_unpacklo_epi64(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpackhi64(Bf16Reg a, Bf16Reg b) { return _mm256_unpackhi_epi64(a, b); }
FC_ALWAYS_INLINE void store_words(uint16_t* y, Bf16Reg a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(y), a);
}
// The largest of a's words (as signed words).
FC_ALWAYS_INLINE int32_t largest_word(Bf16Reg a) {
  return largest_word_128(
      _mm_max_epi16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)));
}
// Word-wise: a > b (signed) as a mask; b where mask m is set, a elsewhere; 0, 1, ...; w; a + b.
FC_ALWAYS_INLINE Bf16Reg greater_words(Bf16Reg a, Bf16Reg b) { return _mm256_cmpgt_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg select_words(Bf16Reg m, Bf16Reg a, Bf16Reg b) {
  return _mm256_blendv_epi8(a, b, m);
}
FC_ALWAYS_INLINE Bf16Reg word_iota() {
  return _mm256_setr_epi16(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
FC_ALWAYS_INLINE Bf16Reg set_words(int16_t w) { return _mm256_set1_epi16(w); }
FC_ALWAYS_INLINE Bf16Reg add_words(Bf16Reg a, Bf16Reg b) { return _mm256_add_epi16(a, b); }
// The smallest of at's words (unsigned) among those where m's equal w.
FC_ALWAYS_INLINE int32_t least_word_where_equal(Bf16Reg m, int16_t w, Bf16Reg at) {
  const __m256i c = _mm256_or_si256(at, _mm256_xor_si256(_mm256_cmpeq_epi16(m, set_words(w)),
                                                         _mm256_set1_epi16(-1)));
  const __m128i h = _mm_min_epu16(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
  return _mm_cvtsi128_si32(_mm_minpos_epu16(h)) & 0xFFFF;
}
#else
typedef __m512i Bf16Reg;
FC_ALWAYS_INLINE Bf16Reg load_words(const uint16_t* x) { return _mm512_loadu_si512(x); }
FC_ALWAYS_INLINE Bf16Reg and_words(Bf16Reg a, int16_t m) {
  return _mm512_and_si512(a, _mm512_set1_epi16(m));
}
FC_ALWAYS_INLINE Bf16Reg max_words(Bf16Reg a, Bf16Reg b) { return _mm512_max_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpacklo16(Bf16Reg a, Bf16Reg b) { return _mm512_unpacklo_epi16(a, b); }
FC_ALWAYS_INLINE Bf16Reg unpackhi16(Bf16Reg a, Bf16Reg b) { return _mm512_unpackhi_epi16(a, b); }
// (the all-lanes mask forms of AVX-512F's: their undefined pass-through operand makes GCC 12 warn)
FC_ALWAYS_INLINE Bf16Reg unpacklo32(Bf16Reg a, Bf16Reg b) {
  return _mm512_maskz_unpacklo_epi32(0xFFFF, a, b);
}
FC_ALWAYS_INLINE Bf16Reg unpackhi32(Bf16Reg a, Bf16Reg b) {
  return _mm512_maskz_unpackhi_epi32(0xFFFF, a, b);
}
FC_ALWAYS_INLINE Bf16Reg unpacklo64(Bf16Reg a, Bf16Reg b) {
  return _mm512_maskz_unpacklo_epi64(0xFF, a, b);
}
FC_ALWAYS_INLINE Bf16Reg unpackhi64(Bf16Reg a, Bf16Reg b) {
  return _mm512_maskz_unpackhi_epi64(0xFF, a, b);
}
FC_ALWAYS_INLINE void store_words(uint16_t* y, Bf16Reg a) { _mm512_storeu_si512(y, a); }
FC_ALWAYS_INLINE int32_t largest_word(Bf16Reg a) {
  const __m256i h = _mm256_max_epi16(_mm512_castsi512_si256(a),
                                     _mm512_maskz_extracti64x4_epi64(0xF, a, 1));
  return largest_word_128(_mm_max_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}
FC_ALWAYS_INLINE __mmask32 greater_words(Bf16Reg a, Bf16Reg b) {
  return _mm512_cmpgt_epi16_mask(a, b);
}
FC_ALWAYS_INLINE Bf16Reg select_words(__mmask32 m, Bf16Reg a, Bf16Reg b) {
  return _mm512_mask_blend_epi16(m, a, b);
}
FC_ALWAYS_INLINE Bf16Reg word_iota() {
  return _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                          15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
}
FC_ALWAYS_INLINE Bf16Reg set_words(int16_t w) { return _mm512_set1_epi16(w); }
FC_ALWAYS_INLINE Bf16Reg add_words(Bf16Reg a, Bf16Reg b) { return _mm512_add_epi16(a, b); }
FC_ALWAYS_INLINE int32_t least_word_where_equal(Bf16Reg m, int16_t w, Bf16Reg at) {
  const __m512i c = _mm512_mask_blend_epi16(_mm512_cmpeq_epi16_mask(m, set_words(w)),
                                            _mm512_set1_epi16(-1), at);
  const __m256i q = _mm256_min_epu16(_mm512_castsi512_si256(c),
                                     _mm512_maskz_extracti64x4_epi64(0xF, c, 1));
  const __m128i h = _mm_min_epu16(_mm256_castsi256_si128(q), _mm256_extracti128_si256(q, 1));
  return _mm_cvtsi128_si32(_mm_minpos_epu16(h)) & 0xFFFF;
}
#endif

// One spike of a bf16 group of g values (a multiple of kBf16PerReg, below 2^16):
// select_spikes_lanes with k = 1 on the widened values (the first position of the largest
// magnitude: a bf16 word's magnitude bits order as its f32's), with the group's words copied to
// y on the way and the spike's word there replaced: zeroed, as fp_quantize_spiked_groups zeroes
// it, or (kStandIn) the first value that is not the spike, as quantize_spiked_groups does. One
// pass, no branch on the data: each word lane keeps its largest magnitude and where it first
// came, then the first position among the lanes that hold the group's largest. Returns the
// position; *spike: the spike's bits.
template <bool kStandIn = false>
FC_ALWAYS_INLINE int64_t take_bf16_spike(const uint16_t* x, int64_t g, uint16_t* y,
                                         uint16_t* spike) {
  const Bf16Reg iota = word_iota();
  Bf16Reg a = load_words(x);
  store_words(y, a);
  Bf16Reg m = and_words(a, 0x7FFF), at = iota;
  for (int64_t i = kBf16PerReg; i < g; i += kBf16PerReg) {
    a = load_words(x + i);
    store_words(y + i, a);
    const Bf16Reg key = and_words(a, 0x7FFF);
    const auto larger = greater_words(key, m);
    m = max_words(m, key);
    at = select_words(larger, at, add_words(iota, set_words(int16_t(i))));
  }
  const int64_t pos = least_word_where_equal(m, int16_t(largest_word(m)), at);
  *spike = x[pos];
  y[pos] = kStandIn ? x[pos == 0 ? 1 : 0] : 0;
  return pos;
}

// quantize_spiked_groups with k = 1 on count groups of bf16 at x, not widened: each group's
// words copied to words (count * g of scratch) with the spike taken out on the way
// (take_bf16_spike, its stand-in in place), then quantized as bf16 (the same values, and so
// the same bytes). g: a multiple of kBf16PerReg, below 2^16.
inline void quantize_bf16_spiked_groups(const uint16_t* x, int64_t count, int64_t g, int bits,
                                        uint16_t* words, uint8_t* rec, int64_t stride,
                                        uint16_t* scale, uint16_t* zero) {
  int32_t pos[kQuantizeBatch][kMaxSpikes];
  float kept[kQuantizeBatch][kMaxSpikes];
  bool spikes_finite[kQuantizeBatch];
  for (int64_t j = 0; j < count; ++j) {
    uint16_t spike;
    pos[j][0] = int32_t(take_bf16_spike</*kStandIn=*/true>(x + j * g, g, words + j * g, &spike));
    kept[j][0] = BF16::load(spike);
    spikes_finite[j] = (spike & 0x7FFFu) < 0x7F80u;
  }
  quantize_groups<BF16>(words, count, g, bits, rec, scale, zero, stride);
  finish_spiked_records(count, g, bits, 1, pos, kept, spikes_finite, rec, stride, scale, zero);
}

// The bf16 magnitudes (sign cleared: ordered as signed words) of a register of values at x,
// the largest of the n registers' values word by word (n >= 1).
FC_ALWAYS_INLINE Bf16Reg bf16_run_max(const uint16_t* x, int64_t n) {
  Bf16Reg m = and_words(load_words(x), 0x7FFF);
  for (int64_t i = 1; i < n; ++i) {
    m = max_words(m, and_words(load_words(x + i * kBf16PerReg), 0x7FFF));
  }
  return m;
}

// The in-lane levels of a transposing reduction, as largest_lanes does for 32-bit lanes:
// kCount registers of words (a multiple of 8) into kCount / 8, where word j of each 128-bit lane
// of w[k] is the largest of that lane's words of input 8k + j (three levels of unpacks and
// maxima).
template <int kCount>
FC_ALWAYS_INLINE void reduce_in_lanes(Bf16Reg* w) {
  for (int i = 0; i < kCount / 2; ++i) {
    w[i] = max_words(unpacklo16(w[2 * i], w[2 * i + 1]), unpackhi16(w[2 * i], w[2 * i + 1]));
  }
  for (int i = 0; i < kCount / 4; ++i) {
    w[i] = max_words(unpacklo32(w[2 * i], w[2 * i + 1]), unpackhi32(w[2 * i], w[2 * i + 1]));
  }
  for (int i = 0; i < kCount / 8; ++i) {
    w[i] = max_words(unpacklo64(w[2 * i], w[2 * i + 1]), unpackhi64(w[2 * i], w[2 * i + 1]));
  }
}

#if FLASHCOMM_LANES == 8
// Two in-lane results (8 inputs each) to one register: word j the largest of input j (j < 16).
FC_ALWAYS_INLINE Bf16Reg across_lanes(Bf16Reg a, Bf16Reg b) {
  return max_words(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

// 16 words of bf16 bits as two vectors of f32 bits (words 0-7, then 8-15).
FC_ALWAYS_INLINE void words_to_f32_bits(Bf16Reg words, ILanes* lo, ILanes* hi) {
  const __m256i t = _mm256_permute4x64_epi64(words, 0xD8);
  *lo = (ILanes)_mm256_unpacklo_epi16(_mm256_setzero_si256(), t);
  *hi = (ILanes)_mm256_unpackhi_epi16(_mm256_setzero_si256(), t);
}

// The largest magnitudes (f32 bits) of 32 blocks of kBlock values from x: lane j of am[t]
// block 8t + j.
template <int64_t kBlock>
FC_ALWAYS_INLINE void bf16_block_maxima(const uint16_t* x, ILanes* am) {
  static_assert(kBlock % kBf16PerReg == 0, "whole registers per block");
  for (int h = 0; h < 2; ++h) {
    Bf16Reg w[16];
    for (int j = 0; j < 16; ++j) {
      w[j] = bf16_run_max(x + (16 * h + j) * kBlock, kBlock / kBf16PerReg);
    }
    reduce_in_lanes<16>(w);
    words_to_f32_bits(across_lanes(w[0], w[1]), &am[2 * h], &am[2 * h + 1]);
  }
}

// The largest magnitudes (f32 bits) of kLanes groups of g values (a multiple of 16) from x.
FC_ALWAYS_INLINE ILanes bf16_group_maxima(const uint16_t* x, int64_t g) {
  Bf16Reg w[16];
  for (int j = 0; j < 8; ++j) {
    w[j] = bf16_run_max(x + j * g, g / kBf16PerReg);
    w[8 + j] = _mm256_setzero_si256();
  }
  reduce_in_lanes<16>(w);
  ILanes lo, hi;
  words_to_f32_bits(across_lanes(w[0], w[1]), &lo, &hi);
  return lo;
}

// fc_load_four for 32 bf16 values: each register's 16 widened by two in-lane unpacks (values
// 0-3 and 8-11, then 4-7 and 12-15), no copy in between. Each vector's values lie in one
// 16-value run, as with f32 loads: blocks of 16 or 32 keep their vectors. The packs then leave
// the 8-byte pieces in the order 0, 2, 1, 3 (fc_order_four puts them back).
FC_ALWAYS_INLINE void fc_load_four(const uint16_t* v, Lanes* x) {
  for (int r = 0; r < 2; ++r) {
    const __m256i a = load_words(v + r * kBf16PerReg);
    x[2 * r] = (Lanes)_mm256_unpacklo_epi16(_mm256_setzero_si256(), a);
    x[2 * r + 1] = (Lanes)_mm256_unpackhi_epi16(_mm256_setzero_si256(), a);
  }
}
FC_ALWAYS_INLINE FcVecI fc_order_four(FcVecI packed, const uint16_t*) {
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

// Four-bit decode straight to bf16. Where a block scale s is +0 (a -0 would flip the zeros'
// signs against the tables' sign bit), or at least 2^-120 with 6 s
// within bf16's range, every value e2m1 * s is exact in f32 (at most 2 + 4 significant bits)
// and so in bf16: store_plain's rounding keeps the product's top 16 bits. The 16 products of a
// block then form a byte table per 128-bit lane (low bytes, high bytes) that one byte shuffle
// each looks up for 16 codes, instead of widening, decoding and multiplying 8 lanes at a time.
FC_ALWAYS_INLINE bool e2m1_bf16_exact(float s) {
  return float_to_bits(s) == 0u || (s >= 0x1p-120f && mul_rn(s, 6.0f) <= BF16::kMax);
}

// 32 four-bit codes (16 bytes at codes, the even code low) of blocks with scales s0 (values
// 0-15) and s1 (16-31), both e2m1_bf16_exact, decoded and stored as 32 bf16 at y. The tables,
// both blocks at once (one per 128-bit lane): the 8 products of the E2M1 grid in f32, their
// top halves packed to words, then the words' low bytes and high bytes packed to 16-byte tables
// (the negative codes' entries: the positive ones with the sign bit).
FC_ALWAYS_INLINE void e2m1_bf16_decode32(const uint8_t* codes, float s0, float s1, uint16_t* y) {
  const __m256 s = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
  const __m256 grid_lo = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 0.0f, 0.5f, 1.0f, 1.5f);
  const __m256 grid_hi = _mm256_setr_ps(2.0f, 3.0f, 4.0f, 6.0f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256i words =  // lane L: the bf16 of codes 0-7 times sL
      _mm256_packus_epi32(_mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(grid_lo, s)), 16),
                          _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(grid_hi, s)), 16));
  const __m256i low = _mm256_and_si256(words, _mm256_set1_epi16(0xFF));
  const __m256i high = _mm256_srli_epi16(words, 8);
  const __m256i lo = _mm256_packus_epi16(low, low);
  const __m256i hi = _mm256_packus_epi16(high, _mm256_or_si256(high, _mm256_set1_epi16(0x80)));
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i nibble = _mm_set1_epi8(0x0F);
  const __m128i even = _mm_and_si128(b, nibble), odd = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
  const __m256i c = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(even, odd)),
                                            _mm_unpackhi_epi8(even, odd), 1);
  const __m256i vlo = _mm256_shuffle_epi8(lo, c), vhi = _mm256_shuffle_epi8(hi, c);
  const __m256i w0 = _mm256_unpacklo_epi8(vlo, vhi);  // values 0-7 | 16-23
  const __m256i w1 = _mm256_unpackhi_epi8(vlo, vhi);  // values 8-15 | 24-31
  auto* out = reinterpret_cast<__m256i*>(y);
  _mm256_storeu_si256(out, _mm256_permute2x128_si256(w0, w1, 0x20));
  _mm256_storeu_si256(out + 1, _mm256_permute2x128_si256(w0, w1, 0x31));
}
#define FLASHCOMM_E2M1_BF16_TABLES 1
#else
// Each 128-bit lane k of the result: the larger of lanes 2k and 2k + 1 of a ++ b, word by word.
FC_ALWAYS_INLINE Bf16Reg lane_pairs(Bf16Reg a, Bf16Reg b) {
  return max_words(_mm512_maskz_shuffle_i64x2(0xFF, a, b, 0x88),
                   _mm512_maskz_shuffle_i64x2(0xFF, a, b, 0xDD));
}

// 32 words of bf16 bits as two vectors of f32 bits (words 0-15, then 16-31).
FC_ALWAYS_INLINE Lanes widen_bf16(__m256i a) {
  return (Lanes)_mm512_maskz_slli_epi32(0xFFFF, _mm512_maskz_cvtepu16_epi32(0xFFFF, a), 16);
}
FC_ALWAYS_INLINE void words_to_f32_bits(Bf16Reg words, ILanes* lo, ILanes* hi) {
  *lo = (ILanes)widen_bf16(_mm512_maskz_extracti64x4_epi64(0xF, words, 0));
  *hi = (ILanes)widen_bf16(_mm512_maskz_extracti64x4_epi64(0xF, words, 1));
}

// The largest magnitudes (f32 bits) of 32 blocks of kBlock values from x: lane j of am[t]
// block 16t + j. A block of 32 is a register; two blocks of 16 share
// one (its 128-bit lanes 0-1 and 2-3), and their maxima leave the lane pairs interleaved.
template <int64_t kBlock>
FC_ALWAYS_INLINE void bf16_block_maxima(const uint16_t* x, ILanes* am) {
  static_assert(kBlock == 16 || kBlock == 32, "blocks of 16 or 32");
  if constexpr (kBlock == 32) {
    Bf16Reg w[32];
    for (int j = 0; j < 32; ++j) w[j] = bf16_run_max(x + j * kBlock, 1);
    reduce_in_lanes<32>(w);
    words_to_f32_bits(lane_pairs(lane_pairs(w[0], w[1]), lane_pairs(w[2], w[3])), &am[0], &am[1]);
  } else {
    Bf16Reg w[16];
    for (int j = 0; j < 16; ++j) w[j] = bf16_run_max(x + j * kBf16PerReg, 1);
    reduce_in_lanes<16>(w);
    // word p: block p, from 128-bit lane 2 (p / 16) + p % 2, word (p % 16) / 2
    const __m512i order = _mm512_set_epi16(
        31, 23, 30, 22, 29, 21, 28, 20, 27, 19, 26, 18, 25, 17, 24, 16,
        15, 7, 14, 6, 13, 5, 12, 4, 11, 3, 10, 2, 9, 1, 8, 0);
    words_to_f32_bits(_mm512_permutexvar_epi16(order, lane_pairs(w[0], w[1])), &am[0], &am[1]);
  }
}

// The largest magnitudes (f32 bits) of kLanes groups of g values (a multiple of 32) from x.
FC_ALWAYS_INLINE ILanes bf16_group_maxima(const uint16_t* x, int64_t g) {
  Bf16Reg w[16];
  for (int j = 0; j < 16; ++j) w[j] = bf16_run_max(x + j * g, g / kBf16PerReg);
  reduce_in_lanes<16>(w);
  const Bf16Reg pairs = lane_pairs(w[0], w[1]);
  ILanes lo, hi;
  words_to_f32_bits(lane_pairs(pairs, pairs), &lo, &hi);
  return lo;
}

// fc_load_four for 64 bf16 values: 16 at a time widened in order (vpmovzxwd, a shift), so
// the packed bytes keep fc_order_four's f32 order.
FC_ALWAYS_INLINE void fc_load_four(const uint16_t* v, Lanes* x) {
  for (int j = 0; j < 4; ++j) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + j * kLanes));
    x[j] = widen_bf16(a);
  }
}
#endif

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif
#endif  // FLASHCOMM_CPU_FP_BF16_H_
