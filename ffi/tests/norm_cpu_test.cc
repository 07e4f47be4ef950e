// C++ test of the fused all-reduce epilogue on CPU (docs/fused_norm.md): kernels().add_rms_norm
// of every instruction-set build against a scalar model of the five steps built from codec.h,
// on heap buffers of exact sizes (AddressSanitizer catches any access past a row, a tile or the
// payload), rows split in two ranges as the thread pool splits them; and the quantized output
// against the kernels' own quantize of the normalised rows. Prints failures, then "N passed,
// M failed"; exits nonzero on any failure (ffi/tests/run_sanitizers.sh runs it).
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"

using namespace flashcomm;  // NOLINT

namespace {

int g_passed = 0;
int g_failed = 0;

void Check(bool ok, const std::string& what) {
  if (ok) {
    ++g_passed;
  } else {
    ++g_failed;
    std::printf("FAILED: %s\n", what.c_str());
  }
}

template <typename T>
void RunCase(int64_t rows, int64_t hidden, int64_t g, int rotation, int spikes, bool bf16_weight,
             uint32_t seed) {
  // long function: one case end to end: operands, both handlers, the reference, the comparison
  using S = typename T::Storage;
  const int bits = 8;
  const cpu::DType dtype = sizeof(S) == 4 ? cpu::DType::kF32 : cpu::DType::kBF16;
  const int64_t n = rows * hidden, groups = (n + g - 1) / g, record = record_bytes(g, bits, spikes);
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 2.0f);
  std::vector<S> x(static_cast<size_t>(groups * g), T::store(0.0f)), res(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) x[size_t(i)] = T::store(normal(rng));
  for (auto& v : res) v = T::store(normal(rng));
  std::vector<float> wf(static_cast<size_t>(hidden));
  std::vector<uint16_t> wb(static_cast<size_t>(hidden));
  for (int64_t i = 0; i < hidden; ++i) {
    wb[size_t(i)] = bf16_from_float(1.0f + 0.1f * normal(rng));
    wf[size_t(i)] = bf16_to_float(wb[size_t(i)]) + 1e-3f * normal(rng);
  }
  std::vector<uint8_t> codes(static_cast<size_t>(groups * record));
  std::vector<uint16_t> scale(static_cast<size_t>(groups)), zero(static_cast<size_t>(groups));
  const auto& k = cpu::kernels();
  k.quantize(dtype, x.data(), groups, g, bits, rotation, spikes, codes.data(), scale.data(),
             zero.data());
  std::vector<float> d(static_cast<size_t>(groups * g));
  k.dequantize(cpu::DType::kF32, codes.data(), scale.data(), zero.data(), groups, g, bits,
               rotation, spikes, d.data());
  // the scalar model (docs/fused_norm.md)
  const float inv_h = 1.0f / float(hidden), eps = 1e-5f, eps_h = mul_rn(eps, float(hidden));
  std::vector<S> want_h(static_cast<size_t>(n)), want_out(static_cast<size_t>(n));
  for (int64_t r = 0; r < rows; ++r) {
    float sums[kNormLanes] = {};
    std::vector<float> hf(static_cast<size_t>(hidden));
    for (int64_t i = 0; i < hidden; ++i) {
      const S hs = T::store(add_rn(d[size_t(r * hidden + i)], T::load(res[size_t(r * hidden + i)])));
      want_h[size_t(r * hidden + i)] = hs;
      hf[size_t(i)] = T::load(hs);
      sums[i % kNormLanes] = add_rn(sums[i % kNormLanes], mul_rn(hf[size_t(i)], hf[size_t(i)]));
    }
    const float inv = norm_inverse_rms(norm_reduce(sums), inv_h, eps_h);
    for (int64_t i = 0; i < hidden; ++i) {
      const float w = bf16_weight ? bf16_to_float(wb[size_t(i)]) : wf[size_t(i)];
      want_out[size_t(r * hidden + i)] = T::store(mul_rn(mul_rn(hf[size_t(i)], inv), w));
    }
  }
  const std::string tag = std::string(sizeof(S) == 4 ? "f32" : "bf16") + " rows " +
                          std::to_string(rows) + " hidden " + std::to_string(hidden) + " G " +
                          std::to_string(g) + " rot " + std::to_string(rotation) + " spikes " +
                          std::to_string(spikes) + (bf16_weight ? " w bf16" : " w f32") +
                          " on " + k.isa;
  std::vector<S> got_h(static_cast<size_t>(n)), got_out(static_cast<size_t>(n));
  cpu::NormArgs a{};
  a.dtype = dtype;
  a.wtype = bf16_weight ? cpu::DType::kBF16 : cpu::DType::kF32;
  a.codes = codes.data();
  a.scale = scale.data();
  a.zero = zero.data();
  a.group_size = g;
  a.bits = bits;
  a.rotation = rotation;
  a.spikes = spikes;
  a.residual = res.data();
  a.weight = bf16_weight ? static_cast<const void*>(wb.data()) : wf.data();
  a.hidden = hidden;
  a.eps = eps;
  a.new_residual = got_h.data();
  a.out = got_out.data();
  const int64_t split = rows / 2;
  Check(k.add_rms_norm(a, 0, split) == 0 && k.add_rms_norm(a, split, rows) == 0, tag + " runs");
  Check(std::memcmp(got_h.data(), want_h.data(), got_h.size() * sizeof(S)) == 0,
        tag + ": new residual bits");
  Check(std::memcmp(got_out.data(), want_out.data(), got_out.size() * sizeof(S)) == 0,
        tag + ": output bits");
  if (hidden % 64 != 0) return;
  // the quantized output: the kernels' quantize of the output rows, at 4 bits, G = 64
  const int64_t og = 64, ogroups = n / og, orec = record_bytes(og, 4, 0);
  std::vector<uint8_t> qc(static_cast<size_t>(ogroups * orec)), wc(qc.size());
  std::vector<uint16_t> qs(static_cast<size_t>(ogroups)), qz(static_cast<size_t>(ogroups)), ws(qs.size()), wz(qz.size());
  k.quantize(dtype, want_out.data(), ogroups, og, 4, kRotationNone, 0, wc.data(), ws.data(),
             wz.data());
  a.out = nullptr;
  a.out_bits = 4;
  a.out_group_size = og;
  a.out_codes = qc.data();
  a.out_scale = qs.data();
  a.out_zero = qz.data();
  Check(k.add_rms_norm(a, 0, split) == 0 && k.add_rms_norm(a, split, rows) == 0,
        tag + " quantized runs");
  Check(qc == wc && qs == ws && qz == wz, tag + ": quantized output bits");
}

void RunAll() {
  uint32_t seed = 1;
  for (int64_t hidden : {8, 24, 200, 576, 4100, 8192}) {
    for (int64_t rows : {1, 3, 9}) {
      for (int rotation : {0, 1}) {
        for (int spikes : {0, 1}) {
          RunCase<F32>(rows, hidden, 128, rotation, spikes, false, seed++);
          RunCase<BF16>(rows, hidden, 128, rotation, spikes, true, seed++);
        }
      }
      RunCase<BF16>(rows, hidden, 32, 2, 0, false, seed++);
    }
  }
}

}  // namespace

int main() {
  for (const std::string& isa : cpu::supported_isas()) {
    if (!cpu::set_isa(isa).empty()) {
      Check(false, "set_isa " + isa);
      continue;
    }
    const int before = g_passed;
    RunAll();
    std::printf("ISA %s: %d checks\n", cpu::kernels().isa, g_passed - before);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
