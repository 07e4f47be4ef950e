// long file: the codec's C++ test program: every op against the scalar reference, one ctest entry
// C++ tests of the CPU codec: the handler bodies of ffi/cpu/codec_handlers.cc (called through
// cpu/cpu_ops.h on XLA_FFI_Buffer views of heap buffers of exact sizes, so that
// AddressSanitizer catches any out-of-bounds access) and the 16-bit float conversions of
// flashcomm/codec.h. Self-contained: prints failures, then "N passed, M failed"; exits
// nonzero on any failure. Built and run by ctest with -DFLASHCOMM_CPU_TESTS=ON
// (ffi/tests/run_sanitizers.sh builds it with ASan and UBSan).
#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "flashcomm/codec.h"
#include "cpu/cpu_alloc.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_gather.h"
#include "cpu/cpu_ops.h"
#include "flashcomm/ffi_checks.h"
#include "harness.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace flashcomm;  // NOLINT

namespace {

using namespace test;  // NOLINT

ffi::Error CallQuantize(const XLA_FFI_Buffer* x, Codes& codes, Bf16s& scale, Bf16s& zero,
                        int bits, int64_t g) {
  return cpu::Quantize(ffi::AnyBuffer(x), ffi::Buffer<ffi::U8>(codes.view()),
                       ffi::Buffer<ffi::BF16>(scale.view()), ffi::Buffer<ffi::BF16>(zero.view()),
                       bits, g, /*rotation=*/0, /*spikes=*/0);
}

ffi::Error CallDequantize(const Codes& codes, const Bf16s& scale, const Bf16s& zero,
                          const XLA_FFI_Buffer* y, int bits, int64_t g) {
  return cpu::Dequantize(ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
                         ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y), bits, g,
                         /*rotation=*/0, /*spikes=*/0);
}

ffi::Error CallDequantizeSum(const Codes& codes, const Bf16s& scale, const Bf16s& zero,
                             const XLA_FFI_Buffer* y, int bits, int64_t g) {
  return cpu::DequantizeSum(ffi::Buffer<ffi::U8>(codes.view()),
                            ffi::Buffer<ffi::BF16>(scale.view()),
                            ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y), bits, g,
                         /*rotation=*/0, /*spikes=*/0);
}

ffi::Error CallDequantizeSumQuantize(const Codes& codes, const Bf16s& scale, const Bf16s& zero,
                                     Codes& out_codes, Bf16s& out_scale, Bf16s& out_zero,
                                     int bits, int out_bits, int64_t g) {
  return cpu::DequantizeSumQuantize(
      ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
      ffi::Buffer<ffi::BF16>(zero.view()), ffi::Buffer<ffi::U8>(out_codes.view()),
      ffi::Buffer<ffi::BF16>(out_scale.view()), ffi::Buffer<ffi::BF16>(out_zero.view()), bits,
      out_bits, g, /*spikes=*/0, /*out_spikes=*/0);
}

// ---------------------------------------------------------------------------------------------
// Straightforward scalar references (one value at a time, codes addressed bit by bit).

// Code j of a group: bits [j*bits, (j+1)*bits) of the group's bytes, LSB-first.
uint32_t CodeAt(const uint8_t* codes, int bits, int64_t j) {
  uint32_t q = 0;
  for (int t = 0; t < bits; ++t) {
    const int64_t pos = j * bits + t;
    q |= uint32_t((codes[pos / 8] >> (pos % 8)) & 1u) << t;
  }
  return q;
}

void SetCode(uint8_t* codes, int bits, int64_t j, uint32_t q) {
  for (int t = 0; t < bits; ++t) {
    const int64_t pos = j * bits + t;
    if ((q >> t) & 1u) codes[pos / 8] = uint8_t(codes[pos / 8] | (1u << (pos % 8)));
  }
}

// Quantize one group of f32 values the obvious way: min/max scan, codec.h's group_params and
// encode, bit-by-bit packing. codes must hold group_bytes(g, bits) zeroed bytes.
void RefQuantizeGroup(const float* v, int64_t g, int bits, uint8_t* codes, uint16_t* scale,
                      uint16_t* zero) {
  bool finite = true;
  float lo = 0.0f, hi = 0.0f;
  for (int64_t i = 0; i < g; ++i) {
    if (!std::isfinite(v[i])) finite = false;
    if (i == 0 || v[i] < lo) lo = v[i];
    if (i == 0 || v[i] > hi) hi = v[i];
  }
  if (lo == 0.0f) lo = 0.0f;  // +0, whatever the sign of the zero found
  if (hi == 0.0f) hi = 0.0f;
  const GroupParams p = group_params(lo, hi, finite, bits);
  *scale = p.scale_bits;
  *zero = p.zero_bits;
  if (!finite) return;
  for (int64_t i = 0; i < g; ++i) SetCode(codes, bits, i, encode(v[i], p, float(max_code(bits))));
}

float RefDecode(const uint8_t* codes, uint16_t scale, uint16_t zero, int bits, int64_t j) {
  return decode(CodeAt(codes, bits, j), stored_params(scale, zero));
}

// Same bits, or both NaN.
template <typename T>
bool SameValue(typename T::Storage a, typename T::Storage b) {
  return std::memcmp(&a, &b, sizeof a) == 0 || (std::isnan(T::load(a)) && std::isnan(T::load(b)));
}

// Half an ulp of T at magnitude |v| (0 for f32: the bound's slack covers f32 rounding).
template <typename T>
double HalfUlp(double v);
template <>
double HalfUlp<F32>(double) { return 0.0; }
template <>
double HalfUlp<BF16>(double v) {
  int e = 0;
  std::frexp(std::fabs(v), &e);  // |v| = m 2^e, m in [0.5, 1)
  return 0.5 * std::ldexp(1.0, std::max(e - 8, -133));
}
template <>
double HalfUlp<F16>(double v) {
  int e = 0;
  std::frexp(std::fabs(v), &e);
  return 0.5 * std::ldexp(1.0, std::max(e - 11, -24));
}

// ---------------------------------------------------------------------------------------------
// Inputs.

struct Rng {
  std::mt19937 gen{12345u};
  uint32_t u32() { return uint32_t(gen()); }
  double uniform() { return double(u32()) / 4294967296.0; }  // [0, 1)
  double normal() {  // Irwin-Hall: deterministic across standard libraries
    double s = 0.0;
    for (int i = 0; i < 12; ++i) s += uniform();
    return s - 6.0;
  }
};

// Group kinds: the error bound must hold for each; see FillGroup.
enum Kind {
  kGaussian,
  kOutlier,
  kNegative,
  kTiny,
  kHugeOrMax,
  kConstantExact,
  kConstantInexact,
  kZeros,
  kMixedScale,
  kNumKinds
};

// Group values as f32, already representable in T. The largest magnitude for T: near 3e38 for
// f32 and bf16, near 65504 for f16.
template <typename T>
void FillGroup(Rng& rng, Kind kind, float* v, int64_t g) {
  const double big = T::kMax;
  auto put = [&](int64_t i, double x) {
    x = std::max(-big, std::min(big, x));
    v[i] = T::load(T::store(float(x)));
  };
  for (int64_t i = 0; i < g; ++i) {
    switch (kind) {
      case kGaussian: put(i, rng.normal() * 3.0 + 0.5); break;
      case kOutlier: put(i, i == g / 3 ? -1000.0 : rng.normal()); break;
      case kNegative: put(i, -5.0 - std::fabs(rng.normal())); break;
      case kTiny: put(i, rng.normal() * 1e-39); break;  // f32/bf16 subnormals; f16 zeros
      case kHugeOrMax: put(i, (rng.uniform() * 2.0 - 1.0) * big); break;
      case kConstantExact: put(i, -2.75); break;
      case kConstantInexact:  // not a bf16 (f32, f16); bf16 inputs are always bf16s
        v[i] = std::is_same<T, F32>::value ? 1.0000001f
               : std::is_same<T, F16>::value ? 1.0009765625f : 3.0f;
        break;
      case kZeros: v[i] = (i % 2) ? -0.0f : 0.0f; break;
      case kMixedScale: put(i, rng.normal() * std::ldexp(1.0, int(rng.u32() % 20) - 10)); break;
      default: break;
    }
  }
  if (kind == kHugeOrMax && g >= 2) {  // the extremes of T's range
    v[0] = T::load(T::store(float(big)));
    v[g - 1] = T::load(T::store(float(-big)));
  }
}

// ---------------------------------------------------------------------------------------------
// Tests.

// Quantize then dequantize through the handlers, for one dtype, bits and group size.
template <typename T>
void TestRoundTrip(Rng& rng, int bits, int64_t g) {
  // long function: a test table: every value kind, dtype and rotation of one width and group size
  using S = typename T::Storage;
  const int64_t n_groups = kNumKinds + 3;  // + a NaN group, a +Inf group and a -Inf group
  const int64_t nb = group_bytes(g, bits);
  const std::string tag = Fmt("%s bits=%d g=%lld", NameOf<T>(), bits, (long long)g);

  std::vector<float> xf(size_t(n_groups * g));
  for (int64_t k = 0; k < kNumKinds; ++k) FillGroup<T>(rng, Kind(k), &xf[size_t(k * g)], g);
  const int64_t nan_group = kNumKinds, pinf_group = kNumKinds + 1, ninf_group = kNumKinds + 2;
  for (int64_t k = nan_group; k < n_groups; ++k) FillGroup<T>(rng, kGaussian, &xf[size_t(k * g)], g);
  xf[size_t(nan_group * g + g / 2)] = std::numeric_limits<float>::quiet_NaN();
  xf[size_t(pinf_group * g + g - 1)] = std::numeric_limits<float>::infinity();
  xf[size_t(ninf_group * g)] = -std::numeric_limits<float>::infinity();

  Array<S> x({n_groups, g}, DtypeOf<T>());
  for (size_t i = 0; i < xf.size(); ++i) x.data[i] = T::store(xf[i]);
  Codes codes({n_groups, nb}, XLA_FFI_DataType_U8, 0xA5);
  Bf16s scale({n_groups}, XLA_FFI_DataType_BF16, 0xDEAD);
  Bf16s zero({n_groups}, XLA_FFI_DataType_BF16, 0xDEAD);
  ffi::Error e = CallQuantize(x.view(), codes, scale, zero, bits, g);
  CHECK(e.success(), tag + " quantize: " + e.message());

  // Byte-exact against the scalar reference.
  std::vector<uint8_t> ref_codes(size_t(n_groups * nb), 0);
  int64_t bad = 0, first_bad = -1;
  for (int64_t k = 0; k < n_groups; ++k) {
    uint16_t rs = 0, rz = 0;
    RefQuantizeGroup(&xf[size_t(k * g)], g, bits, &ref_codes[size_t(k * nb)], &rs, &rz);
    const bool ok = rs == scale.data[size_t(k)] && rz == zero.data[size_t(k)] &&
                    std::memcmp(&ref_codes[size_t(k * nb)], &codes.data[size_t(k * nb)],
                                size_t(nb)) == 0;
    if (!ok && bad++ == 0) first_bad = k;
  }
  CHECK(bad == 0, tag + Fmt(" quantize matches the scalar reference (first bad group %lld)",
                            (long long)first_bad));

  // Non-finite groups: scale NaN, zero 0, codes 0.
  for (int64_t k : {nan_group, pinf_group, ninf_group}) {
    bool zero_codes = true;
    for (int64_t i = 0; i < nb; ++i) zero_codes &= codes.data[size_t(k * nb + i)] == 0;
    CHECK(scale.data[size_t(k)] == kBf16NaN && zero.data[size_t(k)] == 0 && zero_codes,
          tag + Fmt(" non-finite group %lld: scale NaN, zero 0, codes 0", (long long)k));
  }
  // Constant groups: scale 0 and codes 0 when the constant is a bf16; decode exact (below).
  for (int64_t k : {int64_t(kConstantExact), int64_t(kZeros)}) {
    bool zero_codes = true;
    for (int64_t i = 0; i < nb; ++i) zero_codes &= codes.data[size_t(k * nb + i)] == 0;
    CHECK(scale.data[size_t(k)] == 0 && zero_codes,
          tag + Fmt(" constant group %lld: scale 0, codes 0", (long long)k));
  }

  Array<S> y({n_groups, g}, DtypeOf<T>(), S(0x5A));
  e = CallDequantize(codes, scale, zero, y.view(), bits, g);
  CHECK(e.success(), tag + " dequantize: " + e.message());

  // Bit-exact against the scalar reference decode (saturated to T's range).
  bad = 0;
  for (int64_t k = 0; k < n_groups; ++k) {
    for (int64_t i = 0; i < g; ++i) {
      const float d = RefDecode(&codes.data[size_t(k * nb)], scale.data[size_t(k)],
                                zero.data[size_t(k)], bits, i);
      const S want = T::store(saturate(d, T::kMax));
      if (!SameValue<T>(want, y.data[size_t(k * g + i)])) ++bad;
    }
  }
  CHECK(bad == 0, tag + Fmt(" dequantize matches the scalar reference (%lld bad)", (long long)bad));

  // The error bound, group by group.
  const double eps = FLT_EPSILON, L = max_code(bits);
  for (int64_t k = 0; k < n_groups; ++k) {
    const double s = bf16_to_float(scale.data[size_t(k)]);
    const double z = bf16_to_float(zero.data[size_t(k)]);
    const bool nonfinite = k >= nan_group;
    if (nonfinite) {
      bool all_nan = true;
      for (int64_t i = 0; i < g; ++i) all_nan &= std::isnan(T::load(y.data[size_t(k * g + i)]));
      CHECK(all_nan, tag + Fmt(" non-finite group %lld decodes to NaN", (long long)k));
      continue;
    }
    const double slack = 4.0 * eps * s * L + eps * std::max(std::fabs(z), std::fabs(z + L * s)) +
                         3.0 * double(FLT_MIN);
    double worst = 0.0;
    int64_t worst_i = -1;
    for (int64_t i = 0; i < g; ++i) {
      const double xv = xf[size_t(k * g + i)];
      const double yv = T::load(y.data[size_t(k * g + i)]);
      const double err = std::fabs(yv - xv);
      const double bound = s / 2.0 + slack + HalfUlp<T>(std::max(std::fabs(xv), std::fabs(yv)));
      if (!(err <= bound) && (worst_i < 0 || err - bound > worst)) {
        worst = err - bound;
        worst_i = i;
      }
    }
    CHECK(worst_i < 0,
          tag + Fmt(" group %lld (kind %lld) |x'-x| <= scale/2 + slack (worst i=%lld excess %g, "
                    "scale %g)",
                    (long long)k, (long long)k, (long long)worst_i, worst, s));
    if (k == kConstantExact || k == kZeros) {
      bool exact = true;
      for (int64_t i = 0; i < g; ++i) {
        exact &= T::load(y.data[size_t(k * g + i)]) == xf[size_t(k * g + i)];
      }
      CHECK(exact, tag + Fmt(" constant group %lld decodes exactly", (long long)k));
    }
  }
}

// LSB-first packing: codes and bytes worked out by hand.
void TestPacking() {
  struct Case {
    int bits;
    uint32_t q[8];
    std::vector<uint8_t> bytes;
  };
  // bits=3: 5,3,7,0,1,6,2,4 -> bit stream (LSB first) 101 110 111 000 100 011 010 001
  //   byte0 = 5 | 3<<3 | (7&3)<<6 = 0xDD; byte1 = 7>>2 | 0<<1 | 1<<4 | (6&1)<<7 = 0x11;
  //   byte2 = 6>>1 | 2<<2 | 4<<5 = 0x8B.
  // bits=5: 31,0,17,4,9,22,1,30 -> byte0 = 31 | (0&7)<<5 = 0x1F; byte1 = 0>>3 | 17<<2 | (4&1)<<7
  //   = 0x44; byte2 = 4>>1 | 9<<4 = 0x92; byte3 = 9>>4 | 22<<1 | (1&1)<<6 = 0x6C... (1 & 0x3)<<6
  //   = 0x40 -> 0x2C|0x40 = 0x6C; byte4 = 1>>2 | 30<<3 = 0xF0.
  const Case cases[] = {
      {3, {5, 3, 7, 0, 1, 6, 2, 4}, {0xDD, 0x11, 0x8B}},
      {5, {31, 0, 17, 4, 9, 22, 1, 30}, {0x1F, 0x44, 0x92, 0x6C, 0xF0}},
  };
  for (const Case& c : cases) {
    const std::string tag = Fmt("packing bits=%d", c.bits);
    // Values 0..2^bits-1 with both ends present: zero 0, scale 1 (bf16 round-up of
    // L * f32(1/L)), so the codes are the values.
    Array<float> x({1, 8}, XLA_FFI_DataType_F32);
    for (int j = 0; j < 8; ++j) x.data[size_t(j)] = float(c.q[j]);
    Codes codes({1, c.bits}, XLA_FFI_DataType_U8);
    Bf16s scale({1}, XLA_FFI_DataType_BF16), zero({1}, XLA_FFI_DataType_BF16);
    ffi::Error e = CallQuantize(x.view(), codes, scale, zero, c.bits, 8);
    CHECK(e.success(), tag + " quantize: " + e.message());
    CHECK(scale.data[0] == 0x3F80 && zero.data[0] == 0x0000, tag + " scale 1, zero 0");
    CHECK(codes.data == c.bytes,
          tag + Fmt(" bytes %02x %02x %02x...", codes.data[0], codes.data[1], codes.data[2]));
    // And back: the hand-made bytes decode to the values.
    Array<float> y({1, 8}, XLA_FFI_DataType_F32);
    Codes in({1, c.bits}, XLA_FFI_DataType_U8);
    in.data = c.bytes;
    in.buf.data = in.data.data();
    e = CallDequantize(in, scale, zero, y.view(), c.bits, 8);
    CHECK(e.success() && y.data == x.data, tag + " hand-made bytes decode to the codes");
  }
  // Every code value in every position, for every width: pack via the handler, read bit by bit.
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    const int L = max_code(bits);
    const int64_t g = 8 * int64_t(L + 1);
    Array<float> x({1, g}, XLA_FFI_DataType_F32);
    for (int64_t i = 0; i < g; ++i) x.data[size_t(i)] = float((i * 7 + i / 8) % (L + 1));
    x.data[0] = 0.0f;
    x.data[1] = float(L);
    Codes codes({1, group_bytes(g, bits)}, XLA_FFI_DataType_U8);
    Bf16s scale({1}, XLA_FFI_DataType_BF16), zero({1}, XLA_FFI_DataType_BF16);
    ffi::Error e = CallQuantize(x.view(), codes, scale, zero, bits, g);
    bool ok = e.success() && scale.data[0] == 0x3F80 && zero.data[0] == 0;
    for (int64_t i = 0; i < g && ok; ++i) ok = CodeAt(codes.data.data(), bits, i) == uint32_t(x.data[size_t(i)]);
    CHECK(ok, Fmt("packing bits=%d: code i at bits [i*bits, (i+1)*bits) LSB-first", bits));
  }
}

// Huge groups: values near +-3e38 in f32 and bf16 (range overflows f32, scale >= 2^120).
void TestHuge() {
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    const std::string tag = Fmt("huge bits=%d", bits);
    const float vals[16] = {3.0e38f, -3.0e38f, kFltMax, -kFltMax, 1.0e38f, -1.0e38f, 0.0f, 1.0f,
                            2.9e38f, -2.9e38f, 1e36f,   -1e36f,   5e37f,  -5e37f,  3.3e38f, -3.3e38f};
    Array<float> x({2, 8}, XLA_FFI_DataType_F32);
    std::memcpy(x.data.data(), vals, sizeof vals);
    Codes codes({2, bits}, XLA_FFI_DataType_U8);
    Bf16s scale({2}, XLA_FFI_DataType_BF16), zero({2}, XLA_FFI_DataType_BF16);
    ffi::Error e = CallQuantize(x.view(), codes, scale, zero, bits, 8);
    CHECK(e.success(), tag + " quantize: " + e.message());
    bool finite_params = true;
    for (int k = 0; k < 2; ++k) {
      finite_params &= std::isfinite(bf16_to_float(scale.data[size_t(k)])) &&
                       std::isfinite(bf16_to_float(zero.data[size_t(k)])) &&
                       bf16_to_float(scale.data[size_t(k)]) >= kHugeScale;
    }
    CHECK(finite_params, tag + " scale finite and >= 2^120, zero finite");
    Array<float> y({2, 8}, XLA_FFI_DataType_F32);
    e = CallDequantize(codes, scale, zero, y.view(), bits, 8);
    CHECK(e.success(), tag + " dequantize: " + e.message());
    bool ok = true;
    for (int k = 0; k < 2; ++k) {
      const double s = bf16_to_float(scale.data[size_t(k)]);
      const double z = bf16_to_float(zero.data[size_t(k)]);
      const double L = max_code(bits);
      const double slack =
          4.0 * FLT_EPSILON * s * L + FLT_EPSILON * std::max(std::fabs(z), std::fabs(z + L * s));
      for (int i = 0; i < 8; ++i) {
        const float yv = y.data[size_t(k * 8 + i)];
        ok &= std::isfinite(yv) &&
              std::fabs(double(yv) - double(vals[k * 8 + i])) <= s / 2.0 + slack;
      }
    }
    CHECK(ok, tag + " decodes finite, within scale/2 + slack");
  }
}

// Flush modes (x86 MXCSR: none, FTZ, DAZ, both). The kernels leave encode's multiply by
// pre = 1 out where the mode makes x * 1 the same operand as x (unit_multiply_is_identity);
// in each mode the codes must be those of codec.h's scalar encode, multiply included, in that
// mode, from the stored scale and zero. The groups mix denormals with small normal values, so
// that a denormal flushed by x * 1 (FTZ without DAZ) changes codes: dropping the multiply in
// that mode fails this test.
template <typename T>
void TestFlushModes(Rng& rng) {
#if defined(__x86_64__) || defined(__i386__)
  using S = typename T::Storage;
  const unsigned saved = _mm_getcsr();
  const struct {
    unsigned csr;
    const char* name;
  } modes[] = {{0u, "none"}, {0x8000u, "FTZ"}, {0x0040u, "DAZ"}, {0x8040u, "FTZ+DAZ"}};
  for (const auto& mode : modes) {
    for (int bits : {8, 6, 4}) {
      for (int64_t g : {24, 128}) {
        const int64_t n_groups = 8;
        const int64_t nb = group_bytes(g, bits);
        std::vector<float> xf(size_t(n_groups * g));
        for (int64_t i = 0; i < n_groups * g; ++i) {
          const double sign = rng.u32() % 2 ? 1.0 : -1.0;
          const double x = rng.u32() % 2 ? std::ldexp(rng.uniform(), -126)       // denormal
                                         : std::ldexp(1.0 + 3.0 * rng.uniform(), -126);
          xf[size_t(i)] = T::load(T::store(float(sign * x)));
        }
        Array<S> x({n_groups, g}, DtypeOf<T>());
        for (size_t i = 0; i < xf.size(); ++i) x.data[i] = T::store(xf[i]);
        Codes codes({n_groups, nb}, XLA_FFI_DataType_U8);
        Bf16s scale({n_groups}, XLA_FFI_DataType_BF16), zero({n_groups}, XLA_FFI_DataType_BF16);
        _mm_setcsr((saved & ~0x8040u) | mode.csr);
        const ffi::Error e = CallQuantize(x.view(), codes, scale, zero, bits, g);
        int64_t bad = 0;
        for (int64_t k = 0; k < n_groups && e.success(); ++k) {
          const GroupParams p = stored_params(scale.data[size_t(k)], zero.data[size_t(k)]);
          for (int64_t i = 0; i < g; ++i) {
            const uint32_t want = encode(T::load(x.data[size_t(k * g + i)]), p,
                                         float(max_code(bits)));
            bad += CodeAt(&codes.data[size_t(k * nb)], bits, i) != want;
          }
        }
        _mm_setcsr(saved);
        const std::string tag =
            Fmt("%s bits=%d g=%lld mode %s", NameOf<T>(), bits, (long long)g, mode.name);
        CHECK(e.success(), tag + " quantize: " + e.message());
        CHECK(bad == 0, tag + Fmt(" codes = the scalar encode in the same mode (%lld bad)",
                                  (long long)bad));
      }
    }
  }
#else
  (void)rng;
#endif
}

// Fused sums over N=4 chunks: dequantize_sum (each dtype) and dequantize_sum_quantize
// (out_bits != bits) against the reference loop.
template <typename T>
void TestSum(Rng& rng, int bits, int out_bits, int64_t g, bool with_nan) {
  using S = typename T::Storage;
  const int64_t batch = 2, chunks = 4, gpc = 3;
  const int64_t n_groups = batch * chunks * gpc;
  const int64_t nb = group_bytes(g, bits), out_nb = group_bytes(g, out_bits);
  const std::string tag = Fmt("sum %s bits=%d->%d g=%lld%s", NameOf<T>(), bits, out_bits,
                              (long long)g, with_nan ? " nan" : "");

  // Payload from quantizing f32 data of shape (batch, chunks, gpc, g).
  Array<float> x({batch, chunks, gpc * g}, XLA_FFI_DataType_F32);
  for (int64_t k = 0; k < n_groups; ++k) {
    FillGroup<F32>(rng, Kind(k % 3 == 2 ? kOutlier : kGaussian), &x.data[size_t(k * g)], g);
  }
  // One non-finite group: chunk 2 of (batch 1, group 1).
  const int64_t nan_b = 1, nan_k = 1;
  if (with_nan) x.data[size_t(((nan_b * chunks + 2) * gpc + nan_k) * g + 3)] = NAN;
  Codes codes({batch, chunks, gpc, nb}, XLA_FFI_DataType_U8);
  Bf16s scale({batch, chunks, gpc}, XLA_FFI_DataType_BF16);
  Bf16s zero({batch, chunks, gpc}, XLA_FFI_DataType_BF16);
  ffi::Error e = CallQuantize(x.view(), codes, scale, zero, bits, g);
  CHECK(e.success(), tag + " quantize: " + e.message());

  // The reference: sum chunk 0..3 in order, in f32, value by value.
  std::vector<float> ref(size_t(batch * gpc * g));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t k = 0; k < gpc; ++k) {
      for (int64_t i = 0; i < g; ++i) {
        float acc = 0.0f;
        for (int64_t c = 0; c < chunks; ++c) {
          const int64_t grp = (b * chunks + c) * gpc + k;
          const float d = RefDecode(&codes.data[size_t(grp * nb)], scale.data[size_t(grp)],
                                    zero.data[size_t(grp)], bits, i);
          acc = c == 0 ? d : acc + d;
        }
        ref[size_t((b * gpc + k) * g + i)] = acc;
      }
    }
  }

  Array<S> y({batch, gpc * g}, DtypeOf<T>(), S(0x77));
  e = CallDequantizeSum(codes, scale, zero, y.view(), bits, g);
  CHECK(e.success(), tag + " dequantize_sum: " + e.message());
  int64_t bad = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    if (!SameValue<T>(T::store(ref[i]), y.data[i])) ++bad;
  }
  CHECK(bad == 0, tag + Fmt(" dequantize_sum == reference loop (%lld bad)", (long long)bad));

  if (!std::is_same<T, F32>::value) return;  // the fused requantization works in f32 only
  Codes oc({batch, gpc, out_nb}, XLA_FFI_DataType_U8, 0xA5);
  Bf16s os({batch, gpc}, XLA_FFI_DataType_BF16, 0xDEAD), oz({batch, gpc}, XLA_FFI_DataType_BF16, 0xDEAD);
  e = CallDequantizeSumQuantize(codes, scale, zero, oc, os, oz, bits, out_bits, g);
  CHECK(e.success(), tag + " dequantize_sum_quantize: " + e.message());
  bad = 0;
  for (int64_t o = 0; o < batch * gpc; ++o) {
    std::vector<uint8_t> rc(size_t(out_nb), 0);
    uint16_t rs = 0, rz = 0;
    RefQuantizeGroup(&ref[size_t(o * g)], g, out_bits, rc.data(), &rs, &rz);
    if (rs != os.data[size_t(o)] || rz != oz.data[size_t(o)] ||
        std::memcmp(rc.data(), &oc.data[size_t(o * out_nb)], size_t(out_nb)) != 0) {
      ++bad;
    }
  }
  CHECK(bad == 0, tag + Fmt(" dequantize_sum_quantize == reference loop + quantize (%lld bad)",
                            (long long)bad));
  if (with_nan) {
    const int64_t o = nan_b * gpc + nan_k;
    CHECK(os.data[size_t(o)] == kBf16NaN && oz.data[size_t(o)] == 0,
          tag + " a NaN chunk makes the summed group non-finite (scale NaN, zero 0)");
    bool others_finite = true;
    for (int64_t q = 0; q < batch * gpc; ++q) {
      if (q != o) others_finite &= std::isfinite(bf16_to_float(os.data[size_t(q)]));
    }
    CHECK(others_finite, tag + " the other summed groups stay finite");
  }
}

// Invalid arguments: an ffi::Error, and the outputs untouched.
void TestInvalidArguments() {
  Array<float> x({2, 16}, XLA_FFI_DataType_F32, 1.0f);
  x.data[3] = 2.0f;
  struct Bad {
    int bits;
    int64_t g;
    int64_t code_bytes;
    int64_t n_scale;
    const char* what;
  };
  const Bad bads[] = {
      {1, 16, 2 * 2, 2, "bits 1"},
      {9, 16, 2 * 18, 2, "bits 9"},
      {4, 12, 2 * 6, 2, "group_size 12"},
      {4, 0, 0, 2, "group_size 0"},
      {4, 16, 2 * 8 - 1, 2, "codes one byte short"},
      {4, 16, 2 * 8, 1, "scale one short"},
      {4, 24, 12, 2, "operand not whole groups"},
  };
  for (const Bad& b : bads) {
    Codes codes({std::max<int64_t>(b.code_bytes, 0)}, XLA_FFI_DataType_U8, 0xA5);
    Bf16s scale({b.n_scale}, XLA_FFI_DataType_BF16, 0xBEEF), zero({b.n_scale}, XLA_FFI_DataType_BF16, 0xBEEF);
    ffi::Error e = CallQuantize(x.view(), codes, scale, zero, b.bits, b.g);
    bool untouched = true;
    for (uint8_t c : codes.data) untouched &= c == 0xA5;
    for (uint16_t s : scale.data) untouched &= s == 0xBEEF;
    CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument && untouched,
          std::string("quantize rejects ") + b.what);
  }
  {
    Codes codes({16}, XLA_FFI_DataType_U8, 0xA5);
    Bf16s scale({2}, XLA_FFI_DataType_BF16, 0xBEEF), zero({1}, XLA_FFI_DataType_BF16, 0xBEEF);
    ffi::Error e = CallQuantize(x.view(), codes, scale, zero, 4, 16);
    CHECK(e.failure() && codes.data[0] == 0xA5 && zero.data[0] == 0xBEEF,
          "quantize rejects zero one short");
    Array<float> y({2, 16}, XLA_FFI_DataType_F32, 7.0f);
    e = CallDequantize(codes, scale, zero, y.view(), 4, 16);
    CHECK(e.failure() && y.data[0] == 7.0f, "dequantize rejects zero one short");
  }
  // Wrong dtype.
  Array<int32_t> xi({1, 8}, XLA_FFI_DataType_S32);
  Codes c8({1, 4}, XLA_FFI_DataType_U8);
  Bf16s s1({1}, XLA_FFI_DataType_BF16), z1({1}, XLA_FFI_DataType_BF16);
  CHECK(CallQuantize(xi.view(), c8, s1, z1, 4, 8).failure(), "quantize rejects s32");
  Array<int32_t> yi({1, 8}, XLA_FFI_DataType_S32);
  CHECK(CallDequantize(c8, s1, z1, yi.view(), 4, 8).failure(), "dequantize rejects s32");
  Array<float> y7({1, 7}, XLA_FFI_DataType_F32);
  CHECK(CallDequantize(c8, s1, z1, y7.view(), 4, 8).failure(), "dequantize rejects a short y");
  // Chunked payloads: rank < 2, y of the wrong size, bad out_bits, short outputs.
  Codes cc({2, 3, 4}, XLA_FFI_DataType_U8);
  Bf16s sc({2, 3}, XLA_FFI_DataType_BF16), zc({2, 3}, XLA_FFI_DataType_BF16);
  Bf16s s6({6}, XLA_FFI_DataType_BF16), z6({6}, XLA_FFI_DataType_BF16);
  Array<float> y24({3, 8}, XLA_FFI_DataType_F32), y16({2, 8}, XLA_FFI_DataType_F32);
  CHECK(CallDequantizeSum(cc, s6, z6, y24.view(), 4, 8).failure(),
        "dequantize_sum rejects rank-1 scale");
  CHECK(CallDequantizeSum(cc, sc, zc, y16.view(), 4, 8).failure(),
        "dequantize_sum rejects y of the wrong size");
  CHECK(CallDequantizeSum(cc, sc, zc, y24.view(), 4, 8).success(),
        "dequantize_sum accepts (2 chunks, 3 groups) -> 24 values");
  Codes oc({3, 3}, XLA_FFI_DataType_U8), oc_short({3, 3 - 1}, XLA_FFI_DataType_U8);
  Bf16s os({3}, XLA_FFI_DataType_BF16), oz({3}, XLA_FFI_DataType_BF16);
  CHECK(CallDequantizeSumQuantize(cc, sc, zc, oc, os, oz, 4, 9, 8).failure(),
        "dequantize_sum_quantize rejects out_bits 9");
  CHECK(CallDequantizeSumQuantize(cc, sc, zc, oc_short, os, oz, 4, 3, 8).failure(),
        "dequantize_sum_quantize rejects short out codes");
  CHECK(CallDequantizeSumQuantize(cc, sc, zc, oc, os, oz, 4, 3, 8).success(),
        "dequantize_sum_quantize accepts matching outputs");
}

// ---------------------------------------------------------------------------------------------
// 16-bit conversions against references computed in double.

double F16Value(uint16_t h) {  // finite f16 bits -> value
  const int e = (h >> 10) & 0x1F, m = h & 0x3FF;
  const double mag = e == 0 ? std::ldexp(double(m), -24) : std::ldexp(double(1024 + m), e - 25);
  return (h & 0x8000) ? -mag : mag;
}

// f32 -> f16 bits, round to nearest even, in double (exact for f32 inputs).
uint16_t RefF16(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  const double a = std::fabs(double(f));
  if (a >= 65520.0) return uint16_t(sign | 0x7C00);
  if (a == 0.0) return sign;
  int x = 0;
  std::frexp(a, &x);  // a in [2^(x-1), 2^x)
  const int e = std::max(x - 1, -14);
  const double ulp = std::ldexp(1.0, e - 10);
  const double q = a / ulp;  // exact: a power-of-two scaling
  double n = std::floor(q);
  const double rem = q - n;
  if (rem > 0.5 || (rem == 0.5 && std::fmod(n, 2.0) == 1.0)) n += 1.0;
  if (e == -14 && n < 1024) return uint16_t(sign | uint16_t(n));  // subnormal (or 1024: normal)
  return uint16_t(sign | ((uint32_t(e + 15) << 10) + uint32_t(n - 1024)));
}

// f32 -> bf16 bits; mode 0 nearest even, -1 toward -inf, +1 toward +inf (finite, non-NaN f).
double Bf16Value(uint16_t h) {  // bits -> value, the +-inf pattern read as +-2^128
  if ((h & 0x7FFF) == 0x7F80) return (h & 0x8000) ? -std::ldexp(1.0, 128) : std::ldexp(1.0, 128);
  return double(bf16_to_float(h));
}
uint16_t RefBf16(float f, int mode) {
  const uint32_t u = float_to_bits(f);
  const uint16_t t = uint16_t(u >> 16);  // truncation toward zero
  if ((u & 0xFFFF) == 0) return t;
  const uint16_t away = uint16_t(t + 1);  // next magnitude, same sign
  const double v = f, vt = Bf16Value(t), va = Bf16Value(away);
  const uint16_t lower = v > 0 ? t : away, upper = v > 0 ? away : t;
  if (mode < 0) return lower;
  if (mode > 0) return upper;
  const double dt = std::fabs(v - vt), da = std::fabs(va - v);
  if (dt != da) return dt < da ? t : away;
  return (t & 1) ? away : t;
}

void TestConversions(Rng& rng) {
  // long function: a test table: every f16 bit pattern, then the bf16 and f32 edge cases
  // All f16 bit patterns: f16 -> f32 exact, f32 -> f16 back to the same bits (NaN: quieted).
  int64_t bad_to = 0, bad_back = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = uint16_t(h);
    const float f = f16_to_float(b);
    const bool is_nan = (b & 0x7C00) == 0x7C00 && (b & 0x3FF) != 0;
    const bool is_inf = (b & 0x7FFF) == 0x7C00;
    if (is_nan) {
      bad_to += !std::isnan(f);
      bad_back += f16_from_float(f) != uint16_t(b | 0x0200);
    } else if (is_inf) {
      bad_to += !(std::isinf(f) && std::signbit(f) == bool(b & 0x8000));
      bad_back += f16_from_float(f) != b;
    } else {
      bad_to += !(double(f) == F16Value(b) && std::signbit(f) == bool(b & 0x8000));
      bad_back += f16_from_float(f) != b;
    }
  }
  CHECK(bad_to == 0, Fmt("f16_to_float exact on all 65536 patterns (%lld bad)", (long long)bad_to));
  CHECK(bad_back == 0, Fmt("f16 -> f32 -> f16 is the identity (%lld bad)", (long long)bad_back));

  // Ties between neighbouring f16 values go to the even one; just off the tie, to the nearer.
  int64_t bad_tie = 0, bad_near = 0;
  for (uint32_t h = 0; h < 0x7BFF; ++h) {  // finite h, h+1 (positive; negative mirrored)
    const double lo = F16Value(uint16_t(h)), hi = F16Value(uint16_t(h + 1));
    const float mid = float((lo + hi) / 2.0);  // exact in f32
    const uint16_t even = (h & 1) ? uint16_t(h + 1) : uint16_t(h);
    bad_tie += f16_from_float(mid) != even;
    bad_tie += f16_from_float(-mid) != uint16_t(even | 0x8000);
    bad_near += f16_from_float(std::nextafter(mid, 0.0f)) != uint16_t(h);
    bad_near += f16_from_float(std::nextafter(mid, 1e9f)) != uint16_t(h + 1);
  }
  CHECK(bad_tie == 0, Fmt("f16_from_float: ties to even (%lld bad)", (long long)bad_tie));
  CHECK(bad_near == 0, Fmt("f16_from_float: off the tie, the nearer (%lld bad)", (long long)bad_near));
  CHECK(f16_from_float(65519.996f) == 0x7BFF && f16_from_float(65520.0f) == 0x7C00 &&
            f16_from_float(-65520.0f) == 0xFC00 && f16_from_float(1e30f) == 0x7C00,
        "f16_from_float: overflow to inf from 65520 on");
  CHECK(f16_from_float(std::ldexp(1.0f, -25)) == 0x0000 &&
            f16_from_float(std::nextafter(std::ldexp(1.0f, -25), 1.0f)) == 0x0001 &&
            f16_from_float(std::ldexp(3.0f, -25)) == 0x0002 && f16_from_float(-0.0f) == 0x8000 &&
            f16_from_float(1e-30f) == 0x0000,
        "f16_from_float: underflow and the smallest subnormal");

  // Random f32 bit patterns (all exponents) against the double references.
  int64_t bad_f16 = 0, bad_bf16 = 0, bad_down = 0, bad_up = 0;
  for (int i = 0; i < 2000000; ++i) {
    uint32_t u = rng.u32();
    if (i % 2) u = (u & 0x807FFFFFu) | ((0x64u + (u >> 24) % 0x30u) << 23); // f16's range
    const float f = bits_to_float(u);
    if (std::isnan(f)) {
      bad_f16 += !std::isnan(f16_to_float(f16_from_float(f)));
      bad_bf16 += !std::isnan(bf16_to_float(bf16_from_float(f)));
      continue;
    }
    bad_f16 += f16_from_float(f) != RefF16(f);
    if (std::isinf(f)) {
      bad_bf16 += bf16_from_float(f) != uint16_t(u >> 16);
      continue;
    }
    bad_bf16 += bf16_from_float(f) != RefBf16(f, 0);
    bad_down += bf16_round_down(f) != RefBf16(f, -1);
    bad_up += bf16_round_up(f) != RefBf16(f, +1);
  }
  CHECK(bad_f16 == 0, Fmt("f16_from_float == RNE reference on 2M f32 (%lld bad)", (long long)bad_f16));
  CHECK(bad_bf16 == 0, Fmt("bf16_from_float == RNE reference on 2M f32 (%lld bad)", (long long)bad_bf16));
  CHECK(bad_down == 0, Fmt("bf16_round_down == reference (%lld bad)", (long long)bad_down));
  CHECK(bad_up == 0, Fmt("bf16_round_up == reference (%lld bad)", (long long)bad_up));

  // bf16: all patterns round-trip; ties to even.
  int64_t bad_rt = 0, bad_btie = 0;
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t b = uint16_t(h);
    const float f = bf16_to_float(b);
    if (std::isnan(f)) {
      bad_rt += bf16_from_float(f) != uint16_t(b | 0x0040);
      continue;
    }
    bad_rt += bf16_from_float(f) != b;
    if ((b & 0x7FFF) < 0x7F80) {
      const float mid = bits_to_float((uint32_t(b) << 16) | 0x8000u);  // halfway to the next
      bad_btie += bf16_from_float(mid) != ((b & 1) ? uint16_t(b + 1) : b);
    }
  }
  CHECK(bad_rt == 0, Fmt("bf16 -> f32 -> bf16 is the identity (%lld bad)", (long long)bad_rt));
  CHECK(bad_btie == 0, Fmt("bf16_from_float: ties to even (%lld bad)", (long long)bad_btie));
  CHECK(bf16_from_float(kFltMax) == 0x7F80 && bf16_from_float(-kFltMax) == 0xFF80,
        "bf16_from_float: FLT_MAX rounds to inf");
}

}  // namespace

// Spike reserving (docs/format.md): the k largest |x| of a group come back as their bf16
// values at their positions (selected with ties to the lowest position), the other values
// within the group's step; fused sums and a tampered position run clean under the sanitizers.
void TestSpikes(Rng& rng, int64_t g, int k, int32_t rotation) {
  // long function: a test table: the spiked payload through every op, against the unspiked one
  const int bits = 4;
  const int64_t groups = 4;
  const int64_t rec = record_bytes(g, bits, k);
  Array<float> x({groups, g}, XLA_FFI_DataType_F32);
  for (auto& v : x.data) v = float(rng.normal());
  for (int64_t r = 0; r < groups; ++r) x.data[size_t(r * g + (r * 7) % g)] *= 80.0f;
  x.data[size_t(g + 1)] = 50.0f;  // a tie with another 50 in group 1
  x.data[size_t(g + 3)] = -50.0f;
  Codes codes({groups, rec}, XLA_FFI_DataType_U8);
  Bf16s scale({groups}, XLA_FFI_DataType_BF16), zero({groups}, XLA_FFI_DataType_BF16);
  ffi::Error e = cpu::Quantize(ffi::AnyBuffer(x.view()), ffi::Buffer<ffi::U8>(codes.view()),
                               ffi::Buffer<ffi::BF16>(scale.view()),
                               ffi::Buffer<ffi::BF16>(zero.view()), bits, g, rotation, k);
  CHECK(e.success(), Fmt("spikes quantize g=%lld k=%d", (long long)g, k));
  Array<float> y({groups, g}, XLA_FFI_DataType_F32);
  e = cpu::Dequantize(ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
                      ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y.view()), bits, g,
                      rotation, k);
  CHECK(e.success(), "spikes dequantize");
  if (rotation == kRotationNone) {
    for (int64_t r = 0; r < groups; ++r) {
      const float* xs = x.data.data() + r * g;
      int32_t want[kMaxSpikes];
      select_spikes(xs, g, k, want);
      const uint8_t* sp = codes.data.data() + r * rec + group_bytes(g, bits);
      const float step = bf16_to_float(scale.data[size_t(r)]);
      for (int j = 0; j < k; ++j) {
        CHECK(spike_position(sp, k, g, j) == want[j], Fmt("spike %d position", j));
        CHECK(y.data[size_t(r * g + want[j])] == bf16_to_float(bf16_from_float(xs[want[j]])),
              Fmt("spike %d value", j));
      }
      for (int64_t i = 0; i < g; ++i) {
        bool spike = false;
        for (int j = 0; j < k; ++j) spike = spike || want[j] == i;
        if (!spike) {
          CHECK(std::fabs(y.data[size_t(r * g + i)] - xs[i]) <= 0.5f * step * 1.001f + 1e-30f,
                Fmt("kept value %lld within half a step", (long long)i));
        }
      }
    }
    // ties: group 1's two values of magnitude 50 at positions 1 and 3 are taken in that order
    const uint8_t* sp1 = codes.data.data() + rec + group_bytes(g, bits);
    if (k >= 2 && (7 % g) != 1 && (7 % g) != 3) {
      int found1 = -1, found3 = -1;
      for (int j = 0; j < k; ++j) {
        if (spike_position(sp1, k, g, j) == 1) found1 = j;
        if (spike_position(sp1, k, g, j) == 3) found3 = j;
      }
      CHECK(found1 >= 0 && found3 > found1, "ties to the lowest position first");
    }
  }
  // the fused sums over 2 chunks of 2 groups, with spikes in and out
  Codes chunked({2, 2, rec}, XLA_FFI_DataType_U8);
  chunked.data = codes.data;
  chunked.buf.data = chunked.data.data();
  Bf16s cs({2, 2}, XLA_FFI_DataType_BF16), cz({2, 2}, XLA_FFI_DataType_BF16);
  cs.data = scale.data, cz.data = zero.data;
  cs.buf.data = cs.data.data(), cz.buf.data = cz.data.data();
  Array<float> sum({2 * g}, XLA_FFI_DataType_F32);
  e = cpu::DequantizeSum(ffi::Buffer<ffi::U8>(chunked.view()), ffi::Buffer<ffi::BF16>(cs.view()),
                         ffi::Buffer<ffi::BF16>(cz.view()), ffi::AnyBuffer(sum.view()), bits, g,
                         rotation, k);
  CHECK(e.success(), "spikes dequantize_sum");
  Codes oc({2, record_bytes(g, 8, k)}, XLA_FFI_DataType_U8);
  Bf16s os({2}, XLA_FFI_DataType_BF16), oz({2}, XLA_FFI_DataType_BF16);
  e = cpu::DequantizeSumQuantize(
      ffi::Buffer<ffi::U8>(chunked.view()), ffi::Buffer<ffi::BF16>(cs.view()),
      ffi::Buffer<ffi::BF16>(cz.view()), ffi::Buffer<ffi::U8>(oc.view()),
      ffi::Buffer<ffi::BF16>(os.view()), ffi::Buffer<ffi::BF16>(oz.view()), bits, 8, g, k, k);
  CHECK(e.success(), "spikes dequantize_sum_quantize");
  // Per-phase spikes: the output's own count (here 0, k and 1), bit-equal to quantizing the f32
  // sum with that count (unrotated: dequantize_sum rotates back, the fused op does not).
  for (int ko : {0, k, 1}) {
    if (rotation != kRotationNone || ko >= g) continue;
    Codes mc({2, record_bytes(g, 8, ko)}, XLA_FFI_DataType_U8);
    Codes wc({2, record_bytes(g, 8, ko)}, XLA_FFI_DataType_U8);
    Bf16s ms({2}, XLA_FFI_DataType_BF16), mz({2}, XLA_FFI_DataType_BF16);
    Bf16s ws({2}, XLA_FFI_DataType_BF16), wz({2}, XLA_FFI_DataType_BF16);
    e = cpu::DequantizeSumQuantize(
        ffi::Buffer<ffi::U8>(chunked.view()), ffi::Buffer<ffi::BF16>(cs.view()),
        ffi::Buffer<ffi::BF16>(cz.view()), ffi::Buffer<ffi::U8>(mc.view()),
        ffi::Buffer<ffi::BF16>(ms.view()), ffi::Buffer<ffi::BF16>(mz.view()), bits, 8, g, k, ko);
    CHECK(e.success(), Fmt("dequantize_sum_quantize spikes %d -> %d", k, ko));
    e = cpu::Quantize(ffi::AnyBuffer(sum.view()), ffi::Buffer<ffi::U8>(wc.view()),
                      ffi::Buffer<ffi::BF16>(ws.view()), ffi::Buffer<ffi::BF16>(wz.view()), 8, g,
                      kRotationNone, ko);
    CHECK(e.success(), "quantize of the sum");
    CHECK(mc.data == wc.data && ms.data == ws.data && mz.data == wz.data,
          Fmt("spikes %d -> %d: fused == quantize(dequantize_sum)", k, ko));
  }
  {  // out_spikes out of range is an InvalidArgument, not a write past the output
    Codes bc({2, record_bytes(g, 8, 0)}, XLA_FFI_DataType_U8);
    Bf16s bs({2}, XLA_FFI_DataType_BF16), bz({2}, XLA_FFI_DataType_BF16);
    e = cpu::DequantizeSumQuantize(
        ffi::Buffer<ffi::U8>(chunked.view()), ffi::Buffer<ffi::BF16>(cs.view()),
        ffi::Buffer<ffi::BF16>(cz.view()), ffi::Buffer<ffi::U8>(bc.view()),
        ffi::Buffer<ffi::BF16>(bs.view()), ffi::Buffer<ffi::BF16>(bz.view()), bits, 8, g, k, 17);
    CHECK(e.failure(), "dequantize_sum_quantize rejects out_spikes 17");
  }
  // a tampered position past the group is skipped, not written
  uint8_t* pos0 = codes.data.data() + group_bytes(g, bits) + 2 * k;
  pos0[0] = 0xFF;
  if (position_bytes(g) == 2) pos0[1] = 0xFF;
  e = cpu::Dequantize(ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
                      ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y.view()), bits, g,
                      rotation, k);
  CHECK(e.success(), "tampered spike position");
  // invalid spike counts are errors, not reads past the codes
  for (int bad : {-1, kMaxSpikes + 1, int(g)}) {
    e = cpu::Quantize(ffi::AnyBuffer(x.view()), ffi::Buffer<ffi::U8>(codes.view()),
                      ffi::Buffer<ffi::BF16>(scale.view()), ffi::Buffer<ffi::BF16>(zero.view()),
                      bits, g, rotation, bad);
    CHECK(e.failure(), Fmt("spikes=%d rejected", bad));
  }
}

// ---------------------------------------------------------------------------------------------
// Failed scratch allocations (cpu_alloc.h): a test allocator that fails the allocation number
// g_fail_at (0-based) and every later one, and counts the calls.

int g_alloc_calls = 0;
int g_fail_at = -1;  // -1: never fail

void* FailingAlloc(size_t bytes) {
  const int call = g_alloc_calls++;
  if (g_fail_at >= 0 && call >= g_fail_at) return nullptr;
  return std::malloc(bytes);
}

// Runs `op` (returning the handler's ffi::Error) with allocation 0, 1, ... failing until it
// succeeds: every failing run must be ResourceExhausted naming the op and the bytes, the last
// must succeed, and at least `min_allocs` allocations must have been tried (every path under
// test allocates).
template <typename Op>
void CheckAllocFailures(const std::string& what, const char* op_name, int min_allocs, Op&& op) {
  flashcomm_set_scratch_allocator(FailingAlloc);
  g_fail_at = -1;
  g_alloc_calls = 0;
  ffi::Error ok = op();
  const int allocs = g_alloc_calls;
  CHECK(ok.success() && allocs >= min_allocs,
        Fmt("%s: succeeds with %d scratch allocations (>= %d)", what.c_str(), allocs, min_allocs));
  for (int fail_at = 0; fail_at < allocs; ++fail_at) {
    g_fail_at = fail_at;
    g_alloc_calls = 0;
    ffi::Error e = op();
    const std::string msg = e.failure() ? e.message() : std::string();
    CHECK(e.failure() && e.errc() == ffi::ErrorCode::kResourceExhausted &&
              msg.find(op_name) != std::string::npos &&
              msg.find("could not allocate") != std::string::npos &&
              msg.find(" bytes") != std::string::npos,
          Fmt("%s: allocation %d of %d failing is an error (%s)", what.c_str(), fail_at, allocs,
              msg.c_str()));
  }
  g_fail_at = -1;
  flashcomm_set_scratch_allocator(nullptr);
}

void TestAllocFailure() {
  const int64_t g = 64, groups = 3;  // a power of two: rotation 2 allocates its sign masks
  Array<float> x({groups, g}, XLA_FFI_DataType_F32);
  for (size_t i = 0; i < x.data.size(); ++i) x.data[i] = float(int(i % 13) - 6) * 0.37f;
  for (int rotation : {kRotationNone, kRotationSignedHadamard}) {
    for (int k : {0, 3}) {
      if (rotation == kRotationNone && k == 0) continue;  // the one path without scratch
      const int64_t rec = record_bytes(g, 8, k);
      const std::string tag = Fmt("rotation %d spikes %d", rotation, k);
      Codes codes({groups, rec}, XLA_FFI_DataType_U8);
      Bf16s scale({groups}, XLA_FFI_DataType_BF16), zero({groups}, XLA_FFI_DataType_BF16);
      auto quantize = [&] {
        return cpu::Quantize(ffi::AnyBuffer(x.view()), ffi::Buffer<ffi::U8>(codes.view()),
                             ffi::Buffer<ffi::BF16>(scale.view()),
                             ffi::Buffer<ffi::BF16>(zero.view()), 8, g, rotation, k);
      };
      // (spikes: the key scratch and a batch of groups)
      CheckAllocFailures("quantize " + tag, "flashcomm_quantize",
                         (rotation != 0) + (k > 0 ? 2 : 1), quantize);
      CHECK(quantize().success(), "quantize again, allocator restored");
      Array<float> y({groups, g}, XLA_FFI_DataType_F32);
      // (rotated: the sign masks and a group; unrotated: none)
      CheckAllocFailures("dequantize " + tag, "flashcomm_dequantize", 2 * (rotation != 0), [&] {
        return cpu::Dequantize(ffi::Buffer<ffi::U8>(codes.view()),
                               ffi::Buffer<ffi::BF16>(scale.view()),
                               ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y.view()), 8,
                               g, rotation, k);
      });
      // dequantize_into: a cut last group (count not whole groups) allocates its copy too.
      Array<float> out({groups * g}, XLA_FFI_DataType_F32);
      Array<int32_t> offset({}, XLA_FFI_DataType_S32, 0);
      CheckAllocFailures("dequantize_into " + tag, "flashcomm_dequantize_into",
                         1 + 2 * (rotation != 0), [&] {
        return cpu::DequantizeInto(ffi::AnyBuffer(out.view()),
                                   ffi::Buffer<ffi::U8>(codes.view()),
                                   ffi::Buffer<ffi::BF16>(scale.view()),
                                   ffi::Buffer<ffi::BF16>(zero.view()),
                                   ffi::Buffer<ffi::S32>(offset.view()),
                                   ffi::AnyBuffer(out.view()), 8, g, rotation, k,
                                   groups * g - 5);
      });
    }
  }
  // The sums: (batch 1, 2 chunks, 2 groups per chunk); every input/output spike count and
  // rotation (dequantize_sum) and both re-quantize paths (out_spikes 0: the batched sums).
  for (int k : {0, 3}) {
    const int64_t rec = record_bytes(g, 8, k);
    Codes codes({2, 2, rec}, XLA_FFI_DataType_U8);
    Bf16s scale({2, 2}, XLA_FFI_DataType_BF16), zero({2, 2}, XLA_FFI_DataType_BF16);
    Array<float> x4({4, g}, XLA_FFI_DataType_F32);
    for (size_t i = 0; i < x4.data.size(); ++i) x4.data[i] = float(int(i % 7) - 3) * 1.5f;
    CHECK(cpu::Quantize(ffi::AnyBuffer(x4.view()), ffi::Buffer<ffi::U8>(codes.view()),
                        ffi::Buffer<ffi::BF16>(scale.view()), ffi::Buffer<ffi::BF16>(zero.view()),
                        8, g, kRotationNone, k)
              .success(),
          "quantize the chunked payload");
    for (int rotation : {kRotationNone, kRotationSignedHadamard}) {
      Array<float> y({2 * g}, XLA_FFI_DataType_F32);
      CheckAllocFailures(Fmt("dequantize_sum spikes %d rotation %d", k, rotation),
                         "flashcomm_dequantize_sum", 1 + (rotation != 0), [&] {
        return cpu::DequantizeSum(ffi::Buffer<ffi::U8>(codes.view()),
                                  ffi::Buffer<ffi::BF16>(scale.view()),
                                  ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(y.view()),
                                  8, g, rotation, k);
      });
    }
    for (int ko : {0, 2}) {
      Codes oc({2, record_bytes(g, 4, ko)}, XLA_FFI_DataType_U8);
      Bf16s os({2}, XLA_FFI_DataType_BF16), oz({2}, XLA_FFI_DataType_BF16);
      CheckAllocFailures(Fmt("dequantize_sum_quantize spikes %d out_spikes %d", k, ko),
                         "flashcomm_dequantize_sum_quantize", ko > 0 ? 2 : 1, [&] {
        return cpu::DequantizeSumQuantize(
            ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
            ffi::Buffer<ffi::BF16>(zero.view()), ffi::Buffer<ffi::U8>(oc.view()),
            ffi::Buffer<ffi::BF16>(os.view()), ffi::Buffer<ffi::BF16>(oz.view()), 8, 4, g, k, ko);
      });
    }
  }
}

// The limits of ffi_checks.h: group_size <= 2**24; spikes (and out_spikes) > 0 need
// group_size <= 65536 (2-byte spike positions, codec.h kMaxSpikeGroupSize).
void TestGroupSizeLimits() {
  CHECK(CheckCodecAttrs(8, kMaxGroupSize, 0).success(), "group_size 2**24 accepted");
  ffi::Error e = CheckCodecAttrs(8, kMaxGroupSize + 8, 0);
  CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument &&
            e.message().find("2**24") != std::string::npos,
        "group_size 2**24 + 8 rejected");
  CHECK(CheckCodecAttrs(8, kMaxSpikeGroupSize, 4).success(), "spikes at group_size 65536");
  e = CheckCodecAttrs(8, kMaxSpikeGroupSize + 8, 1);
  CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument &&
            e.message().find("65536") != std::string::npos,
        "spikes at group_size 65544 rejected");
  CHECK(CheckCodecAttrs(8, kMaxSpikeGroupSize + 8, 0).success(), "no spikes at 65544 accepted");
  // Through the handlers: quantize with spikes, dequantize_sum_quantize with out_spikes.
  const int64_t g = kMaxSpikeGroupSize + 8;
  Array<float> x({1, g}, XLA_FFI_DataType_F32, 1.0f);
  Codes codes({1, record_bytes(g, 8, 1)}, XLA_FFI_DataType_U8, 0xA5);
  Bf16s scale({1}, XLA_FFI_DataType_BF16, 0xBEEF), zero({1}, XLA_FFI_DataType_BF16, 0xBEEF);
  e = cpu::Quantize(ffi::AnyBuffer(x.view()), ffi::Buffer<ffi::U8>(codes.view()),
                    ffi::Buffer<ffi::BF16>(scale.view()), ffi::Buffer<ffi::BF16>(zero.view()), 8,
                    g, kRotationNone, 1);
  CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument && codes.data[0] == 0xA5 &&
            scale.data[0] == 0xBEEF,
        "quantize rejects spikes at group_size 65544, writes nothing");
  Codes cc({1, 1, record_bytes(g, 8, 0)}, XLA_FFI_DataType_U8);
  Bf16s cs({1, 1}, XLA_FFI_DataType_BF16), cz({1, 1}, XLA_FFI_DataType_BF16);
  Codes oc({1, record_bytes(g, 8, 2)}, XLA_FFI_DataType_U8, 0xA5);
  Bf16s os({1}, XLA_FFI_DataType_BF16, 0xBEEF), oz({1}, XLA_FFI_DataType_BF16, 0xBEEF);
  e = cpu::DequantizeSumQuantize(
      ffi::Buffer<ffi::U8>(cc.view()), ffi::Buffer<ffi::BF16>(cs.view()),
      ffi::Buffer<ffi::BF16>(cz.view()), ffi::Buffer<ffi::U8>(oc.view()),
      ffi::Buffer<ffi::BF16>(os.view()), ffi::Buffer<ffi::BF16>(oz.view()), 8, 8, g, 0, 2);
  CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument &&
            e.message().find("out_spikes") != std::string::npos && oc.data[0] == 0xA5,
        "dequantize_sum_quantize rejects out_spikes at group_size 65544");
}

// Every test, with the kernels of the instruction-set build in use (cpu_dispatch.h).
void RunAll() {
  TestAllocFailure();
  TestGroupSizeLimits();
  Rng rng;
  TestPacking();
  TestHuge();
  TestInvalidArguments();
  for (int bits = kMinBits; bits <= kMaxBits; ++bits) {
    for (int64_t g : {8, 24, 128, 512}) {
      TestRoundTrip<F32>(rng, bits, g);
      TestRoundTrip<BF16>(rng, bits, g);
      TestRoundTrip<F16>(rng, bits, g);
    }
  }
  const int sum_cases[][2] = {{4, 6}, {8, 3}, {2, 8}, {5, 4}};
  for (const auto& bc : sum_cases) {
    for (int64_t g : {8, 24, 128}) {
      for (bool with_nan : {false, true}) {
        TestSum<F32>(rng, bc[0], bc[1], g, with_nan);
        TestSum<BF16>(rng, bc[0], bc[1], g, with_nan);
        TestSum<F16>(rng, bc[0], bc[1], g, with_nan);
      }
    }
  }
  TestConversions(rng);
  TestFlushModes<F32>(rng);
  TestFlushModes<BF16>(rng);
  for (int64_t g : {16, 512}) {
    for (int k : {1, 5}) {
      for (int32_t rotation : {kRotationNone, kRotationSignedHadamard}) {
        TestSpikes(rng, g, k, rotation);
      }
    }
  }
}

int main() {
  // Each instruction-set build this CPU runs (the codes must be the same bits on every one:
  // the tests compare against the scalar codec.h reference).
  for (const std::string& isa : cpu::supported_isas()) {
    CHECK(cpu::set_isa(isa).empty(), "set_isa " + isa);
    const int before = g_passed;
    RunAll();
    std::printf("ISA %s: %d checks\n", cpu::kernels().isa, g_passed - before);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
