// A fingerprint of the CPU codec's output: one fixed, deterministic set of operands (every bit
// width and floating-point format, f32/bf16/f16, group sizes 8..512, rotation 0/1/2, spikes
// 0/1/3, special values) through quantize, dequantize and the two fused sums, hashed (FNV-1a
// 64) over every output byte. Printed once per instruction-set build this CPU runs:
// "fingerprint <isa> <hash>". The codec is bit-exact by design, so the hash must be the same on
// every build and every architecture;
// ffi/tests/run_aarch64.sh compares the x86-64 builds with the aarch64 ones (under qemu).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"
#include "flashcomm/fp_codec.h"

using flashcomm::PayloadView;
using flashcomm::cpu::DType;

namespace {

struct Fnv {
  uint64_t h = 1469598103934665603ull;
  void add(const void* data, size_t n) {
    const auto* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; i < n; ++i) h = (h ^ p[i]) * 1099511628211ull;
  }
};

// Deterministic operand values (xorshift), with specials sprinkled in, as f32.
std::vector<float> Values(int64_t n, uint32_t seed) {
  std::vector<float> v(static_cast<size_t>(n));
  uint32_t s = seed * 2654435761u + 1;
  for (int64_t i = 0; i < n; ++i) {
    s ^= s << 13;
    s ^= s >> 17;
    s ^= s << 5;
    const float u = float(s >> 8) * (1.0f / 16777216.0f);  // [0, 1)
    float x = (u - 0.3f) * 8.0f;
    if (i % 97 == 5) x *= 300.0f;      // outliers
    if (i % 211 == 7) x = 1e-39f;      // a denormal
    if (i % 401 == 9) x = -0.0f;
    v[static_cast<size_t>(i)] = x;
  }
  return v;
}

// The operand as dtype's storage bytes (bf16 / f16 rounded to nearest even).
std::vector<uint8_t> AsDType(const std::vector<float>& v, DType dtype) {
  std::vector<uint8_t> out;
  if (dtype == DType::kF32) {
    out.resize(v.size() * 4);
    std::memcpy(out.data(), v.data(), out.size());
    return out;
  }
  out.resize(v.size() * 2);
  for (size_t i = 0; i < v.size(); ++i) {
    const uint16_t h = dtype == DType::kBF16 ? flashcomm::bf16_from_float(v[i])
                                             : flashcomm::f16_from_float(v[i]);
    std::memcpy(out.data() + 2 * i, &h, 2);
  }
  return out;
}

// The floating-point formats (fp_codec.h) through the same four passes: every format, group
// sizes with a scalar tail (40, fp8 only) and several blocks, rotation where the size allows it,
// spikes 0/1/3, each fused sum re-quantized in the next format. Buffers are sized exactly, so
// that the sanitizer build catches a read or write past a record.
void FpFingerprint(Fnv* fnv, uint32_t* seed) {
  const auto& k = flashcomm::cpu::kernels();
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    const size_t item = dtype == DType::kF32 ? 4 : 2;
    for (int32_t format = 1; format <= 3; ++format) {
      for (int64_t g : {16, 32, 40, 128, 512}) {
        if (g % flashcomm::fp_block(format, g) != 0) continue;
        for (int rotation : {0, 1, 2}) {
          if (rotation != 0 && (g & (g - 1)) != 0) continue;
          for (int spikes : {0, 1, 3}) {
            const int64_t chunks = 3, groups = 5, n = chunks * groups * g, ng = n / g;
            std::vector<float> v = Values(n, ++*seed);
            if (spikes == 1) v[static_cast<size_t>(g + 3)] = INFINITY;  // poisons group 1 only
            const std::vector<uint8_t> x = AsDType(v, dtype);
            const int64_t rec = flashcomm::fp_record_bytes(format, g, spikes);
            std::vector<uint8_t> records(static_cast<size_t>(ng * rec));
            std::vector<uint8_t> y(static_cast<size_t>(n) * item);
            std::vector<uint8_t> sum(static_cast<size_t>(groups * g) * item);
            const int32_t out_format = format % 3 + 1;
            std::vector<uint8_t> requantized(
                static_cast<size_t>(groups * flashcomm::fp_record_bytes(out_format, g, spikes)));
            k.fp_quantize(dtype, x.data(), ng, g, format, rotation, spikes, records.data());
            k.fp_dequantize(dtype, records.data(), ng, g, format, rotation, spikes, y.data());
            const flashcomm::cpu::FpChunks in{records.data(), 1, chunks, groups, g, format, spikes};
            k.fp_dequantize_sum(dtype, in, rotation, sum.data(), 0, groups);
            k.fp_dequantize_sum_quantize(in, out_format, spikes, requantized.data(), 0, groups);
            for (const auto* v : {&records, &y, &sum, &requantized}) fnv->add(v->data(), v->size());
          }
        }
      }
    }
  }
}

uint64_t Fingerprint() {
  const auto& k = flashcomm::cpu::kernels();
  Fnv fnv;
  uint32_t seed = 0;
  for (DType dtype : {DType::kF32, DType::kBF16, DType::kF16}) {
    const size_t item = dtype == DType::kF32 ? 4 : 2;
    for (int bits = 2; bits <= 8; ++bits) {
      for (int64_t g : {8, 32, 128, 512}) {
        for (int rotation : {0, 1, 2}) {
          for (int spikes : {0, 1, 3}) {
            if (spikes >= g) continue;
            const int64_t chunks = 4, groups = 6, n = chunks * groups * g;
            const std::vector<uint8_t> x = AsDType(Values(n, ++seed), dtype);
            const int64_t rec = flashcomm::record_bytes(g, bits, spikes);
            const int64_t ng = n / g;
            std::vector<uint8_t> codes(static_cast<size_t>(ng * rec));
            std::vector<uint16_t> scale(static_cast<size_t>(ng)), zero(scale.size());
            k.quantize(dtype, x.data(), ng, g, bits, rotation, spikes, codes.data(),
                       scale.data(), zero.data());
            std::vector<uint8_t> y(static_cast<size_t>(n) * item);
            k.dequantize(dtype, codes.data(), scale.data(), zero.data(), ng, g, bits, rotation,
                         spikes, y.data());
            // The payload as `chunks` chunks of `groups` groups: the fused sums.
            const PayloadView view{codes.data(), scale.data(), zero.data(), 1, chunks, groups,
                                   g, rec, bits, spikes};
            std::vector<uint8_t> sum(static_cast<size_t>(groups * g) * item);
            k.dequantize_sum(dtype, view, rotation, sum.data(), 0, groups);
            const int out_bits = 10 - bits < 2 ? 2 : 10 - bits;
            const int64_t out_rec = flashcomm::record_bytes(g, out_bits, spikes);
            std::vector<uint8_t> codes2(static_cast<size_t>(groups * out_rec));
            std::vector<uint16_t> scale2(static_cast<size_t>(groups)), zero2(scale2.size());
            k.dequantize_sum_quantize(view, out_bits, spikes, codes2.data(), scale2.data(), zero2.data(),
                                      0, groups);
            fnv.add(codes.data(), codes.size());
            fnv.add(scale.data(), scale.size() * 2);
            fnv.add(zero.data(), zero.size() * 2);
            fnv.add(y.data(), y.size());
            fnv.add(sum.data(), sum.size());
            fnv.add(codes2.data(), codes2.size());
            fnv.add(scale2.data(), scale2.size() * 2);
            fnv.add(zero2.data(), zero2.size() * 2);
          }
        }
      }
    }
  }
  FpFingerprint(&fnv, &seed);
  return fnv.h;
}

}  // namespace

int main() {
  int passed = 0, failed = 0;
  uint64_t first = 0;
  for (const std::string& isa : flashcomm::cpu::supported_isas()) {
    if (!flashcomm::cpu::set_isa(isa).empty()) return 1;
    const uint64_t h = Fingerprint();
    std::printf("fingerprint %s %016llx\n", isa.c_str(), static_cast<unsigned long long>(h));
    if (passed + failed == 0) first = h;
    (h == first ? passed : failed) += 1;  // every build gives the same bytes
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed == 0 ? 0 : 1;
}
