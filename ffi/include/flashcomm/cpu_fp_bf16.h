// bf16 operands of the floating-point formats read where they lie (AVX2): the quantize loops'
// block and group maxima from the bf16 bits, 16 to a register, and the four-vector packing's
// values widened on the way in, instead of a pass that widens the values into an f32 copy and
// two more that read it back (cpu_fp.h: fp4_quantize_batch, fp8_quantize_batch). The same
// bytes: a bf16 value's f32 bits are its bits shifted up 16, and the encoders see the same
// f32 values. Compiled once per instruction set (ffi/cpu/isa_kernels.cc); elsewhere nothing.
#ifndef FLASHCOMM_CPU_FP_BF16_H_
#define FLASHCOMM_CPU_FP_BF16_H_

#include <cstdint>

#include "flashcomm/cpu_fp_lanes.h"

#if FLASHCOMM_LANES == 8 && defined(FC_X86) && defined(__AVX2__)
#define FLASHCOMM_FP_BF16_DIRECT 1

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// Values per register of bf16.
constexpr int64_t kBf16PerReg = 2 * kLanes;

// The bf16 magnitudes (sign cleared) of 16 values at x.
FC_ALWAYS_INLINE __m256i bf16_magnitudes(const uint16_t* x) {
  return _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                          _mm256_set1_epi16(0x7FFF));
}

// Word j of the result: the largest of the 16 words of w[j] (bf16 magnitudes: ordered as
// signed words). The 16 x 16 transpose of in-lane unpacks, a max at every level (45
// operations), as largest_lanes<8> for 32-bit lanes.
FC_ALWAYS_INLINE __m256i largest_words(const __m256i* w) {
  __m256i p[8], q[4], r[2];
  for (int i = 0; i < 8; ++i) {
    p[i] = _mm256_max_epi16(_mm256_unpacklo_epi16(w[2 * i], w[2 * i + 1]),
                            _mm256_unpackhi_epi16(w[2 * i], w[2 * i + 1]));
  }
  for (int i = 0; i < 4; ++i) {
    q[i] = _mm256_max_epi16(_mm256_unpacklo_epi32(p[2 * i], p[2 * i + 1]),
                            _mm256_unpackhi_epi32(p[2 * i], p[2 * i + 1]));
  }
  for (int i = 0; i < 2; ++i) {
    r[i] = _mm256_max_epi16(_mm256_unpacklo_epi64(q[2 * i], q[2 * i + 1]),
                            _mm256_unpackhi_epi64(q[2 * i], q[2 * i + 1]));
  }
  return _mm256_max_epi16(_mm256_permute2x128_si256(r[0], r[1], 0x20),
                          _mm256_permute2x128_si256(r[0], r[1], 0x31));
}

// 16 words of bf16 bits as two vectors of f32 bits (words 0-7, then 8-15).
FC_ALWAYS_INLINE void words_to_f32_bits(__m256i words, ILanes* lo, ILanes* hi) {
  const __m256i t = _mm256_permute4x64_epi64(words, 0xD8);
  *lo = (ILanes)_mm256_unpacklo_epi16(_mm256_setzero_si256(), t);
  *hi = (ILanes)_mm256_unpackhi_epi16(_mm256_setzero_si256(), t);
}

// Asks for the n bytes from x into the cache (the next batch, while this one is encoded: its
// first pass, the maxima, would otherwise wait on memory line by line).
FC_ALWAYS_INLINE void prefetch_bytes(const void* x, int64_t n) {
  for (int64_t i = 0; i < n; i += 64) __builtin_prefetch(static_cast<const char*>(x) + i);
}

// The largest magnitudes (f32 bits) of 16 consecutive runs of kRun values (a multiple of 16)
// from x: lane j of lo (hi) run j (8 + j).
template <int64_t kRun>
FC_ALWAYS_INLINE void bf16_run_maxima(const uint16_t* x, ILanes* lo, ILanes* hi) {
  static_assert(kRun % kBf16PerReg == 0, "whole registers per run");
  __m256i w[16];
  for (int j = 0; j < 16; ++j) {
    w[j] = bf16_magnitudes(x + j * kRun);
    for (int64_t i = kBf16PerReg; i < kRun; i += kBf16PerReg) {
      w[j] = _mm256_max_epi16(w[j], bf16_magnitudes(x + j * kRun + i));
    }
  }
  words_to_f32_bits(largest_words(w), lo, hi);
}

// The largest magnitudes (f32 bits) of 8 groups of g values (a multiple of 16) from x, one
// per lane.
FC_ALWAYS_INLINE ILanes bf16_group_maxima(const uint16_t* x, int64_t g) {
  __m256i w[16];
  for (int j = 0; j < 8; ++j) {
    w[j] = bf16_magnitudes(x + j * g);
    for (int64_t i = kBf16PerReg; i < g; i += kBf16PerReg) {
      w[j] = _mm256_max_epi16(w[j], bf16_magnitudes(x + j * g + i));
    }
    w[8 + j] = _mm256_setzero_si256();
  }
  ILanes lo, hi;
  words_to_f32_bits(largest_words(w), &lo, &hi);
  return lo;
}

// fc_load_four for 32 bf16 values: each register's 16 widened by two in-lane unpacks (values
// 0-3 and 8-11, then 4-7 and 12-15), no copy in between. Each vector's values lie in one
// 16-value run, as with f32 loads: blocks of 16 or 32 keep their vectors. The packs then leave
// the 8-byte pieces in the order 0, 2, 1, 3 (fc_order_four puts them back).
FC_ALWAYS_INLINE void fc_load_four(const uint16_t* v, Lanes* x) {
  for (int r = 0; r < 2; ++r) {
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(v + r * kBf16PerReg));
    x[2 * r] = (Lanes)_mm256_unpacklo_epi16(_mm256_setzero_si256(), a);
    x[2 * r + 1] = (Lanes)_mm256_unpackhi_epi16(_mm256_setzero_si256(), a);
  }
}
FC_ALWAYS_INLINE FcVecI fc_order_four(FcVecI packed, const uint16_t*) {
  return _mm256_permute4x64_epi64(packed, 0xD8);
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif
#endif  // FLASHCOMM_CPU_FP_BF16_H_
