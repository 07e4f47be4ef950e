// long file: the codec's normative arithmetic (docs/format.md), one header so that the CPU and CUDA
// kernels compile the same operations
// The jax_flashcomm wire format: the arithmetic of every codec implementation.
//
// These functions are the single definition of the codec math (docs/format.md). The CPU
// kernels (ffi/cpu) and the CUDA kernels (ffi/cuda) both call them, so the CPU tests exercise
// the arithmetic the GPU runs; the pure-jnp twin (jax_flashcomm/codec/reference.py) mirrors
// them operation for operation. Every float operation here is a single IEEE f32 operation
// (mul and add are never contracted into an FMA), so the codes are bit-identical everywhere.
#ifndef FLASHCOMM_CODEC_H_
#define FLASHCOMM_CODEC_H_

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define FC_HD __host__ __device__ __forceinline__
#else
#define FC_HD inline
#endif

// Each CPU instruction-set build of the kernels (ffi/cpu/isa_kernels.cc, compiled once per ISA
// with its own -m flags) defines FLASHCOMM_ISA, so every inline function of these headers gets
// an ISA-specific symbol: the linker can never merge an AVX-512 copy of an inline function
// into the baseline build's callers. Everything else (handlers, CUDA, tests) uses `generic`.
#ifndef FLASHCOMM_ISA
#define FLASHCOMM_ISA generic
#endif

namespace flashcomm {
inline namespace FLASHCOMM_ISA {

constexpr int kMinBits = 2;
constexpr int kMaxBits = 8;
constexpr int kBlock = 8;  // codes are packed per block of 8 values: 8 * bits bits = bits bytes
constexpr float kFltMin = 1.17549435082228750797e-38f;  // smallest normal f32
constexpr float kFltMax = 3.40282346638528859812e+38f;
constexpr uint16_t kBf16NaN = 0x7FC0;
constexpr uint16_t kBf16Lowest = 0xFF7F;  // most negative finite bf16, -3.3895e38

FC_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

FC_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// Single-rounding f32 arithmetic, never contracted (nvcc contracts a*b+c by default).
FC_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FC_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FC_HD bool is_finite(float f) { return (float_to_bits(f) & 0x7F800000u) != 0x7F800000u; }

// ---- 16-bit float conversions (software, identical on host and device) ----

FC_HD float bf16_to_float(uint16_t h) { return bits_to_float(uint32_t(h) << 16); }

// f32 -> bf16, round to nearest even; NaN stays NaN (quiet), like XLA's convert.
FC_HD uint16_t bf16_from_float(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return uint16_t((u >> 16) | 0x0040u);
  u += 0x7FFFu + ((u >> 16) & 1u);
  return uint16_t(u >> 16);
}

// f32 -> bf16 rounded toward -inf (finite input). May return -inf past the bf16 range.
FC_HD uint16_t bf16_round_down(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t truncated = u & 0xFFFF0000u;  // toward zero
  if ((u & 0x80000000u) && (u & 0x0000FFFFu)) truncated += 0x10000u;  // negative: one more ulp
  return uint16_t(truncated >> 16);
}

// f32 -> bf16 rounded toward +inf (finite input).
FC_HD uint16_t bf16_round_up(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t truncated = u & 0xFFFF0000u;
  if (!(u & 0x80000000u) && (u & 0x0000FFFFu)) truncated += 0x10000u;
  return uint16_t(truncated >> 16);
}

FC_HD float f16_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1Fu;
  uint32_t man = h & 0x3FFu;
  if (exp == 0x1Fu) return bits_to_float(sign | 0x7F800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in f32 (a normal f32)
    float mag = float(man) * 5.9604644775390625e-08f;
    return (sign ? -mag : mag);
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
}

// f32 -> f16, round to nearest even, overflow to inf, subnormals kept; NaN stays NaN.
FC_HD uint16_t f16_from_float(float f) {
  uint32_t u = float_to_bits(f);
  uint16_t sign = uint16_t((u >> 16) & 0x8000u);
  uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return uint16_t(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
  if (a >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (a >= 0x38800000u) {                                   // normal f16
    uint32_t r = a - 0x38000000u;                           // rebias exponent 127 -> 15
    r += 0xFFFu + ((r >> 13) & 1u);
    return uint16_t(sign | (r >> 13));
  }
  if (a < 0x33000000u) return sign;  // below half the smallest subnormal: zero
  // subnormal f16: value = m * 2^-24 with m = a_mantissa_with_hidden >> shift
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | 0x800000u;
  uint32_t shift = 126u - e;  // in 14..24
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return uint16_t(sign | q);
}

// ---- the codec ----

FC_HD int max_code(int bits) { return (1 << bits) - 1; }
FC_HD int64_t group_bytes(int64_t group_size, int bits) { return group_size * bits / 8; }

struct GroupParams {
  uint16_t scale_bits;  // bf16 as stored on the wire
  uint16_t zero_bits;   // bf16 as stored on the wire
  float scale;          // the stored values, decoded
  float zero;
  float inv_scale;      // 1/scale in f32, 0 where scale is 0 or the group is not finite
  float pre;            // 1, or 2^-64 for huge groups (scale >= 2^120), see set_inverse
  float zero_pre;       // zero * pre
};

// 2^120: any group whose range overflows f32 has scale > 2^128 / 255 > 2^120, and 1/scale is
// denormal from 2^126 on.
constexpr float kHugeScale = 1.32922799578491587290e+36f;
constexpr float kTwoPowMinus64 = 5.42101086242752217004e-20f;

// Huge groups (scale >= 2^120) encode in units of 2^64: x - zero could overflow f32 and 1/scale
// could be denormal (and flushed to zero). Scaling by a power of two is exact.
FC_HD void set_inverse(GroupParams* p) {
  p->pre = p->scale >= kHugeScale ? kTwoPowMinus64 : 1.0f;
  p->zero_pre = mul_rn(p->zero, p->pre);
  p->inv_scale = p->scale > 0.0f ? 1.0f / mul_rn(p->scale, p->pre) : 0.0f;
}

// Per-group quantization parameters from the group's min (lo), max (hi) and finiteness.
// zero = lo rounded toward -inf to bf16; scale = (hi - zero) * f32(1 / (2^bits - 1)) rounded toward
// +inf to bf16 and at least the smallest normal f32 when the range is not zero (so no
// flush-to-zero mode can turn a non-constant group into a constant one). A group holding NaN
// or Inf stores scale = NaN, zero = 0 and all-zero codes: it decodes to NaN everywhere.
FC_HD GroupParams group_params(float lo, float hi, bool finite, int bits) {
  GroupParams p;
  if (!finite) {
    p.scale_bits = kBf16NaN;
    p.zero_bits = 0;
    p.scale = bf16_to_float(kBf16NaN);
    p.zero = 0.0f;
    p.inv_scale = 0.0f;
    p.pre = 1.0f;
    p.zero_pre = 0.0f;
    return p;
  }
  // 1/levels rounded to f32, then multiplied: what XLA makes of a division by a constant.
  const float inv_levels = 1.0f / float(max_code(bits));
  uint16_t zero_bits = bf16_round_down(lo);
  if (zero_bits == 0xFF80u) zero_bits = kBf16Lowest;  // lo below the bf16 range: clamp
  const float zero = bf16_to_float(zero_bits);
  // A group entirely below the lowest finite bf16 (f32 values under -3.38953e38) has hi < zero:
  // it is stored as a constant group at the clamped zero.
  float range = add_rn(hi, -zero);
  range = range > 0.0f ? range : 0.0f;
  float scale;
  if (is_finite(range)) {
    scale = mul_rn(range, inv_levels);
  } else {  // hi - zero overflows f32: halve first (exact for values this large)
    scale = mul_rn(mul_rn(add_rn(mul_rn(hi, 0.5f), -mul_rn(zero, 0.5f)), inv_levels), 2.0f);
  }
  if (range > 0.0f && !(scale >= kFltMin)) scale = kFltMin;
  p.zero_bits = zero_bits;
  p.zero = zero;
  p.scale_bits = bf16_round_up(scale);
  p.scale = bf16_to_float(p.scale_bits);
  set_inverse(&p);
  return p;
}

// Parameters read back from the wire (scale NaN marks a non-finite group).
FC_HD GroupParams stored_params(uint16_t scale_bits, uint16_t zero_bits) {
  GroupParams p;
  p.scale_bits = scale_bits;
  p.zero_bits = zero_bits;
  p.scale = bf16_to_float(scale_bits);
  p.zero = bf16_to_float(zero_bits);
  set_inverse(&p);
  return p;
}

// ---- per-value arithmetic, generic over lanes ----
// Each function below is written once for a "lane" type F: a scalar float (host and device),
// or on the host a SIMD vector of floats (Lanes, GCC vector extensions) that the CPU kernels
// use. The operations are the same IEEE ops in the same order either way.

FC_HD float clamp_code(float v, float levels) {
  v = v > 0.0f ? v : 0.0f;  // also maps NaN to 0
  return v < levels ? v : levels;
}

FC_HD float select_finite(float test, float if_finite, float otherwise) {
  return is_finite(test) ? if_finite : otherwise;
}

#if !defined(__CUDACC__)
// FLASHCOMM_LANES f32 lanes on the host: one vector register of the ISA the file is compiled
// for (16 on AVX-512, 8 on AVX2, 4 on SSE2 and NEON). Wider types than the registers make GCC
// split them through the stack.
#ifndef FLASHCOMM_LANES
#define FLASHCOMM_LANES 4
#endif
constexpr int kLanes = FLASHCOMM_LANES;
static_assert(kLanes == 4 || kLanes == 8 || kLanes == 16, "FLASHCOMM_LANES: 4, 8 or 16");
typedef float Lanes __attribute__((vector_size(4 * kLanes)));
typedef uint32_t ULanes __attribute__((vector_size(4 * kLanes)));
typedef int32_t ILanes __attribute__((vector_size(4 * kLanes)));

inline Lanes mul_rn(Lanes a, float b) { return a * b; }
inline Lanes mul_rn(Lanes a, Lanes b) { return a * b; }
inline Lanes add_rn(Lanes a, float b) { return a + b; }
inline Lanes add_rn(Lanes a, Lanes b) { return a + b; }
inline Lanes clamp_code(Lanes v, float levels) {
  const Lanes zero = Lanes{} + 0.0f;
  const Lanes top = Lanes{} + levels;
  v = v > 0.0f ? v : zero;
  return v < levels ? v : top;
}
// Bit reinterpretation between same-sized vectors (a vector cast, not a conversion).
inline ULanes lanes_bits(Lanes a) { return (ULanes)a; }
inline Lanes bits_lanes(ULanes u) { return (Lanes)u; }
inline Lanes select_finite(Lanes test, Lanes if_finite, Lanes otherwise) {
  const ULanes exp = lanes_bits(test) & 0x7F800000u;
  return exp != 0x7F800000u ? if_finite : otherwise;
}
#endif

// (x * pre - zero * pre) * inv_scale clamped to [0, 2^bits - 1], plus 2^23. In
// [2^23, 2^24) the f32 spacing is 1, so the add rounds half-to-even and the low mantissa bits
// of the result are the code: q = bits(encode_biased(x)) - 0x4B000000.
template <typename F>
FC_HD F encode_biased(F x, const GroupParams& p, float levels) {
  F v = mul_rn(add_rn(mul_rn(x, p.pre), -p.zero_pre), p.inv_scale);
  v = clamp_code(v, levels);
  return add_rn(v, 8388608.0f);  // 2^23
}

constexpr uint32_t kEncodeBias = 0x4B000000u;  // bits of 2^23

// q = clamp(round_half_even((x * pre - zero * pre) * inv_scale), 0, 2^bits - 1). Clamping
// before rounding gives the same code.
FC_HD uint32_t encode(float x, const GroupParams& p, float levels) {
  return float_to_bits(encode_biased(x, p, levels)) - kEncodeBias;
}

// x' = fma(q, scale, zero): one rounding. q * scale is exact in f32 (a code of at most 8 bits
// times a bf16 of 8 significant bits), so mul then add is the fma, and an XLA that contracts
// the two into one instruction computes the same bits. Where q * scale overflows (groups
// spanning more than FLT_MAX) the sum is formed from halves, which is exact up to the final
// doubling.
template <typename F>
FC_HD F decode_lanes(F q, const GroupParams& p) {
  const F prod = mul_rn(q, p.scale);
  const F direct = add_rn(prod, p.zero);
  const F halves = mul_rn(add_rn(mul_rn(q, mul_rn(p.scale, 0.5f)), mul_rn(p.zero, 0.5f)), 2.0f);
  return select_finite(prod, direct, halves);
}

FC_HD float decode(uint32_t q, const GroupParams& p) { return decode_lanes(float(q), p); }

// ---- the fused sum's overflow fallback ----
// The fused ops add N decoded chunks in f32 in chunk order. A running total can overflow
// although the exact sum is finite (+3e38 + 3e38 - 3e38 - 3e38). Where an element's plain sum is
// not finite and every chunk's group is finite, that element is summed again from the decoded
// values scaled by 2^-s (s = sum_shift(N), so no partial sum can overflow) and the result is
// multiplied by 2^s: exact scalings, and Inf only where the exact sum itself overflows f32.
FC_HD int sum_shift(int64_t chunks) {
  int s = 1;
  while ((int64_t(1) << s) < chunks) ++s;
  return s;
}

FC_HD float pow2f(int e) { return bits_to_float(uint32_t(127 + e) << 23); }  // -126 <= e <= 127

// Pack 8 codes of `bits` bits LSB-first into `bits` bytes.
FC_HD void pack_block(const uint32_t* q, int bits, uint8_t* out) {
  uint64_t acc = 0;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < kBlock; ++j) acc |= uint64_t(q[j]) << (j * bits);
  for (int k = 0; k < bits; ++k) out[k] = uint8_t(acc >> (8 * k));
}

// Unpack 8 codes of `bits` bits from `bits` bytes.
FC_HD void unpack_block(const uint8_t* in, int bits, uint32_t* q) {
  uint64_t acc = 0;
  for (int k = 0; k < bits; ++k) acc |= uint64_t(in[k]) << (8 * k);
  const uint64_t mask = (uint64_t(1) << bits) - 1;
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int j = 0; j < kBlock; ++j) q[j] = uint32_t((acc >> (j * bits)) & mask);
}

// ---- rotation (docs/format.md, "Rotation") ----
// rotation = 1: each group is multiplied by the orthonormal Walsh-Hadamard matrix H/sqrt(G)
// before quantization, and by it again (its own inverse) after decoding. rotation = 2 also
// multiplies by a fixed diagonal of +-1 signs: forward x -> H (D x) / sqrt(G), inverse
// y -> D (H y) / sqrt(G). G must be a power of two. The butterflies are plain f32 adds and
// subtracts (one rounding each, stage h = 1, 2, 4, ..., G/2: v[j], v[j+h] <- v[j] + v[j+h],
// v[j] - v[j+h] for every j with bit h clear); the 1/sqrt(G) scaling is one multiply per value
// after the last stage, and the sign is applied exactly (it flips the sign bit).
constexpr int kRotationNone = 0;
constexpr int kRotationHadamard = 1;
constexpr int kRotationSignedHadamard = 2;

// RN(1/sqrt(G)) for G = 2^k: 2^-(k/2), times RN(1/sqrt(2)) when k is odd (both exact scalings
// of a correctly rounded constant).
FC_HD float rotation_scale(int64_t g) {
  float c = 1.0f;
  int k = 0;
  while ((int64_t(1) << k) < g) ++k;
  for (int i = 0; i < k / 2; ++i) c = c * 0.5f;
  if (k & 1) c = c * 0.70710678118654752440f;
  return c;
}

// The sign of position i (0 <= i < G) of rotation 2: bit 31 of a 32-bit integer hash of i
// (a murmur3-style finalizer of i * 0x9E3779B1). 1 means -1.
FC_HD uint32_t rotation_sign_bit(uint32_t i) {
  uint32_t h = i * 0x9E3779B1u;
  h ^= h >> 15;
  h *= 0x85EBCA77u;
  h ^= h >> 13;
  h *= 0xC2B2AE35u;
  h ^= h >> 16;
  return h >> 31;
}

// Flip the sign of v when position i's sign is -1 (exact, also for NaN and zeros).
FC_HD float apply_sign(float v, uint32_t i) {
  return bits_to_float(float_to_bits(v) ^ (rotation_sign_bit(i) << 31));
}

// In-place unnormalized Walsh-Hadamard butterflies over g values (g a power of two), in the
// normative stage order. Scalar reference; the CPU and CUDA kernels run the same butterflies
// with other loop orders (each output of a stage is one add or subtract of the same two
// values, so the order of the butterflies within a stage does not change any bit).
FC_HD void hadamard_butterflies(float* v, int64_t g) {
  for (int64_t h = 1; h < g; h *= 2) {
    for (int64_t j0 = 0; j0 < g; j0 += 2 * h) {
      for (int64_t j = j0; j < j0 + h; ++j) {
        const float a = v[j], b = v[j + h];
        v[j] = add_rn(a, b);
        v[j + h] = add_rn(a, -b);
      }
    }
  }
}

// ---- spike reserving (docs/format.md, "Spike reserving") ----
// spikes = k: per group, the k values of largest magnitude travel as bf16 beside the codes,
// with their positions, and the remaining values set the group's range. The group's record on
// the wire is its codes, then k bf16 values (2 bytes each, little-endian), then k positions
// (1 byte each for G <= 256, else 2 bytes little-endian).
constexpr int kMaxSpikes = 16;

FC_HD int64_t position_bytes(int64_t group_size) { return group_size <= 256 ? 1 : 2; }
// The largest group_size that can keep spikes: a position is at most 2 bytes, so a group of
// more than 65536 values would write positions >= 65536 modulo 65536 (a silent wrong answer).
// The handlers reject spikes > 0 above it (ffi_checks.h), as the Python side does at trace time.
constexpr int64_t kMaxSpikeGroupSize = 65536;
// The largest group_size of any payload (the handlers and the Python side share the limit):
// a group's scratch (a few f32 copies of it per thread) stays within what a host can allocate.
constexpr int64_t kMaxGroupSize = int64_t(1) << 24;
FC_HD int64_t spike_bytes(int64_t group_size, int spikes) {
  return int64_t(spikes) * (2 + position_bytes(group_size));
}
// Bytes of one group's record in the codes array: packed codes plus the spike record.
FC_HD int64_t record_bytes(int64_t group_size, int bits, int spikes) {
  return group_bytes(group_size, bits) + spike_bytes(group_size, spikes);
}

// The ranking key of a value: its magnitude's bit pattern (a total order on |x|: NaN above
// inf above every finite value; no float compare, so no flush-to-zero mode changes it).
FC_HD uint32_t spike_key(float v) { return float_to_bits(v) & 0x7FFFFFFFu; }

// Select the k positions of largest key in v[0..g), in descending key order, ties to the
// lowest position (what k rounds of "first argmax of the keys not yet taken" give). One pass
// with an insertion-sorted list of k: a value enters only if its key beats the k-th.
FC_HD void select_spikes(const float* v, int64_t g, int k, int32_t* pos) {
  uint32_t keys[kMaxSpikes];
  int n = 0;
  for (int64_t i = 0; i < g; ++i) {
    const uint32_t key = spike_key(v[i]);
    if (n == k && !(key > keys[k - 1])) continue;
    int j = n < k ? n++ : k - 1;
    while (j > 0 && key > keys[j - 1]) {  // strictly greater: equal keys keep lower positions first
      keys[j] = keys[j - 1];
      pos[j] = pos[j - 1];
      --j;
    }
    keys[j] = key;
    pos[j] = int32_t(i);
  }
}

// The first position of v[0..g) that is not a spike: its value stands in for the spikes in
// the range and encode passes (so they do not widen the range). k < g, so one exists.
FC_HD int64_t first_kept(const int32_t* pos, int k) {
  for (int64_t f = 0;; ++f) {
    bool taken = false;
    for (int j = 0; j < k; ++j) taken = taken || pos[j] == f;
    if (!taken) return f;
  }
}

// A spike's stored value: bf16 rounded to nearest even, saturated to the finite bf16 range
// (a finite f32 above 3.3895e38 would round to inf), a subnormal result stored as a zero of
// its sign (decoded values are never denormal, whatever a platform's flush-to-zero mode does
// with them), NaN for a non-finite group.
FC_HD uint16_t spike_bits(float v, bool group_finite) {
  if (!group_finite) return kBf16NaN;
  const uint16_t h = bf16_from_float(v);
  if ((h & 0x7FFFu) == 0x7F80u) return uint16_t((h & 0x8000u) | 0x7F7Fu);
  if ((h & 0x7F80u) == 0) return uint16_t(h & 0x8000u);
  return h;
}

// Write a group's spike record (values then positions) after its codes.
FC_HD void store_spikes(const uint16_t* values, const int32_t* pos, int k, int64_t g,
                        uint8_t* rec) {
  for (int j = 0; j < k; ++j) {
    rec[2 * j] = uint8_t(values[j]);
    rec[2 * j + 1] = uint8_t(values[j] >> 8);
  }
  uint8_t* p = rec + 2 * k;
  const int64_t pb = position_bytes(g);
  for (int j = 0; j < k; ++j) {
    p[pb * j] = uint8_t(pos[j]);
    if (pb == 2) p[pb * j + 1] = uint8_t(pos[j] >> 8);
  }
}

// Spike j of a record: its f32 value and position (a position >= G, only possible in a
// tampered payload, is never written: decode skips it).
FC_HD float spike_value(const uint8_t* rec, int j) {
  return bf16_to_float(uint16_t(rec[2 * j] | (uint16_t(rec[2 * j + 1]) << 8)));
}
FC_HD int64_t spike_position(const uint8_t* rec, int k, int64_t g, int j) {
  const uint8_t* p = rec + 2 * k;
  return position_bytes(g) == 2 ? int64_t(p[2 * j] | (p[2 * j + 1] << 8)) : int64_t(p[j]);
}

// Overwrite a decoded f32 group's spike positions with the spikes, in record order.
FC_HD void apply_spikes(const uint8_t* rec, int k, int64_t g, float* d) {
  for (int j = 0; j < k; ++j) {
    const int64_t p = spike_position(rec, k, g, j);
    if (p < g) d[p] = spike_value(rec, j);
  }
}

// Clamp to [-max, max]; NaN passes through. A dequantized operand is saturated to its dtype's
// finite range: its values came from that dtype, and the top of a group's grid may overshoot
// the group's max by part of a step (65504 at 2 bits decodes to 3 * 21888 = 65664).
FC_HD float saturate(float v, float max) { return v > max ? max : (v < -max ? -max : v); }

// Element loads and stores for the three operand dtypes, as f32.
// ---- residual add + RMSNorm (docs/fused_norm.md): the arithmetic of the fused epilogue ----
// Sum of squares of a row of H values: kNormLanes running sums, value i added to sum i % 16 in
// order of i (acc = RN(acc + RN(v * v)), never an FMA), then the 16 sums reduced by the fixed
// tree of norm_reduce. Every implementation (CPU builds of any vector width, CUDA, the jnp
// twin) follows this order, so the bits agree.
constexpr int kNormLanes = 16;

FC_HD float norm_reduce(const float* acc) {
  float t[kNormLanes / 2];
  for (int j = 0; j < 8; ++j) t[j] = add_rn(acc[j], acc[j + 8]);
  for (int j = 0; j < 4; ++j) t[j] = add_rn(t[j], t[j + 4]);
  for (int j = 0; j < 2; ++j) t[j] = add_rn(t[j], t[j + 2]);
  return add_rn(t[0], t[1]);
}

FC_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return __builtin_sqrtf(a);
#endif
}

FC_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// 1 / sqrt((sumsq + eps_h) * inv_h), each step one rounding, with eps_h = RN(eps * H) and
// inv_h = RN(1 / H) (a true division), both computed once. The add comes before the multiply
// so that no implementation can contract them into an FMA (XLA's CPU backend contracts
// a * b + c), and the division is a true one (never an rsqrt approximation).
FC_HD float norm_inverse_rms(float sumsq, float inv_h, float eps_h) {
  return div_rn(1.0f, sqrt_rn(mul_rn(add_rn(sumsq, eps_h), inv_h)));
}

struct F32 {
  using Storage = float;
  static constexpr float kMax = kFltMax;
  static FC_HD float load(float v) { return v; }
  static FC_HD float store(float v) { return v; }
};
struct BF16 {
  using Storage = uint16_t;
  static constexpr float kMax = 3.38953138925153547590e+38f;  // 0x7F7F
  static FC_HD float load(uint16_t v) { return bf16_to_float(v); }
  static FC_HD uint16_t store(float v) { return bf16_from_float(v); }
};
struct F16 {
  using Storage = uint16_t;
  static constexpr float kMax = 65504.0f;
  static FC_HD float load(uint16_t v) { return f16_to_float(v); }
  static FC_HD uint16_t store(float v) { return f16_from_float(v); }
};

}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm

#endif  // FLASHCOMM_CODEC_H_
