// The exact all-reduce's sums (cpu_exact_sum.h), compiled in every instruction-set build
// (isa_kernels.cc): values [begin, end) of every rank's x summed element by element in rank
// order, acc = x_0, then acc = acc + x_j for j = 1..N-1 (16-bit floats in f32, rounded once to
// their dtype; integers wrap, as XLA's do), so every build, width and split gives the same bits.
// The lanes are the build's own (kLanes f32 lanes, 16 to 64 bytes): measured on an AMD EPYC
// (Zen 4), the bf16 sum of 3 ranks' 16K values took 28 us in 64-byte vectors compiled for SSE2,
// 58 us in them compiled for AVX2 and 7 us in AVX2's own 32-byte ones.
#ifndef FLASHCOMM_CPU_SUM_LANES_H_
#define FLASHCOMM_CPU_SUM_LANES_H_

#include <cstdint>
#include <cstring>

#include "flashcomm/codec.h"
#include "cpu/cpu_codec_lanes.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_simd.h"

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {

// One vector of the build's width (4 * kLanes bytes) of each summed type.
typedef double F64Lanes __attribute__((vector_size(4 * kLanes)));
typedef uint8_t U8Lanes __attribute__((vector_size(4 * kLanes)));
typedef uint16_t U16Lanes __attribute__((vector_size(4 * kLanes)));
typedef uint64_t U64Lanes __attribute__((vector_size(4 * kLanes)));

template <typename V, typename T>
FC_ALWAYS_INLINE V load_vector(const T* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}

// ys[0]'s values [begin, end) copied into every other y, one pass each (a long memcpy streams
// faster than many short ones).
template <typename T>
FC_ALWAYS_INLINE void copy_to_others(int64_t begin, int64_t end, void* const* ys, int64_t n_ys) {
  for (int64_t k = 1; k < n_ys; ++k) {
    std::memcpy(static_cast<T*>(ys[k]) + begin, static_cast<const T*>(ys[0]) + begin,
                size_t(end - begin) * sizeof(T));
  }
}

// One element at a time into ys[0] (A: the accumulator; load / store: T to A and back): f16,
// and every type's tail.
template <typename T, typename A, typename Load, typename Store>
FC_ALWAYS_INLINE void sum_elements(const void* const* xs, int64_t n_xs, int64_t begin,
                                   int64_t end, void* first, Load load, Store store) {
  T* out = static_cast<T*>(first);
  for (int64_t i = begin; i < end; ++i) {
    A acc = load(static_cast<const T*>(xs[0])[i]);
    for (int64_t j = 1; j < n_xs; ++j) acc = A(acc + load(static_cast<const T*>(xs[j])[i]));
    out[i] = store(acc);
  }
}

// T summed as itself (f32, f64, the unsigned integers), a vector V at a time, a block of 16 KiB
// at a time: the block's partial sums stay in L1 while each rank's x streams past in turn (one
// read stream at a time, as the prefetchers like). A block is read from every x before any y
// is written, so the ys may be the xs (the in-process sum runs in place).
template <typename T, typename V>
FC_ALWAYS_INLINE void sum_native(const void* const* xs, int64_t n_xs, int64_t begin, int64_t end,
                                 void* const* ys, int64_t n_ys) {
  constexpr int64_t kVectorLanes = int64_t(sizeof(V) / sizeof(T));
  constexpr int64_t kBlock = 16 * 1024 / int64_t(sizeof(V));  // vectors per block
  T* first = static_cast<T*>(ys[0]);
  alignas(64) V acc[kBlock];
  int64_t i = begin;
  while (i + kVectorLanes <= end) {
    const int64_t left = (end - i) / kVectorLanes;
    const int64_t vectors = left < kBlock ? left : kBlock;
    const T* x0 = static_cast<const T*>(xs[0]) + i;
    for (int64_t v = 0; v < vectors; ++v) acc[v] = load_vector<V>(x0 + v * kVectorLanes);
    for (int64_t j = 1; j < n_xs; ++j) {
      const T* xj = static_cast<const T*>(xs[j]) + i;
      for (int64_t v = 0; v < vectors; ++v) acc[v] += load_vector<V>(xj + v * kVectorLanes);
    }
    std::memcpy(first + i, acc, size_t(vectors) * sizeof(V));
    i += vectors * kVectorLanes;
  }
  sum_elements<T, T>(xs, n_xs, i, end, first, [](T v) { return v; }, [](T v) { return v; });
  copy_to_others<T>(begin, end, ys, n_ys);
}

// bf16 summed in f32, kLanes at a time, rounded once (bf16_from_float's rounding, lane by lane:
// nearest even, NaN kept quiet).
FC_ALWAYS_INLINE void sum_bf16(const void* const* xs, int64_t n_xs, int64_t begin, int64_t end,
                               void* const* ys, int64_t n_ys) {
  uint16_t* first = static_cast<uint16_t*>(ys[0]);
  int64_t i = begin;
  for (; i + kLanes <= end; i += kLanes) {
    Lanes acc = load_lanes_t<BF16>(static_cast<const uint16_t*>(xs[0]) + i);
    for (int64_t j = 1; j < n_xs; ++j) {
      acc += load_lanes_t<BF16>(static_cast<const uint16_t*>(xs[j]) + i);
    }
    narrow_halves(bf16_bits_lanes(acc), first + i);
  }
  sum_elements<uint16_t, float>(
      xs, n_xs, i, end, first, [](uint16_t v) { return bf16_to_float(v); },
      [](float v) { return bf16_from_float(v); });
  copy_to_others<uint16_t>(begin, end, ys, n_ys);
}

// The sum of `type` (complex: its components, `begin` and `end` counting them) into every y.
inline void sum_ranks(SumType type, const void* const* xs, int64_t n_xs, int64_t begin,
                      int64_t end, void* const* ys, int64_t n_ys) {
  switch (type) {
    case SumType::kF32: return sum_native<float, Lanes>(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kBF16: return sum_bf16(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kF16:
      sum_elements<uint16_t, float>(
          xs, n_xs, begin, end, ys[0], [](uint16_t v) { return f16_to_float(v); },
          [](float v) { return f16_from_float(v); });
      return copy_to_others<uint16_t>(begin, end, ys, n_ys);
    case SumType::kF64:
      return sum_native<double, F64Lanes>(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kU8:
      return sum_native<uint8_t, U8Lanes>(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kU16:
      return sum_native<uint16_t, U16Lanes>(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kU32:
      return sum_native<uint32_t, ULanes>(xs, n_xs, begin, end, ys, n_ys);
    case SumType::kU64:
      return sum_native<uint64_t, U64Lanes>(xs, n_xs, begin, end, ys, n_ys);
  }
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_SUM_LANES_H_
