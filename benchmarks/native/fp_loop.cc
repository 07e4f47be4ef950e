// The FP formats' quantize loop without XLA: where a kernel's time goes, per group.
//
//     bash benchmarks/native/fp_loop.sh
//
// Compiled once per instruction set (fp_loop.sh: the flags of CMakeLists.txt's ISA builds), it
// runs the loop of ffi/cpu/isa_kernels.cc FpQuantizeOp (fp8_quantize_batch on kLanes groups at a
// time for fp8, fp4_quantize_batch on kLanes blocks at a time for the four-bit formats) over
// a bf16 operand of G = 128 groups, one thread, and prints for each format ns per group and
// GB/s of the operand beside single-core memcpy of the same bytes:
//   - "L2": a 1 MiB operand, so the time is the arithmetic's;
//   - "memory": 16 MiB, with the buffers on transparent huge pages and without them;
//   - "widen+max": only the bf16 widening and the group maximum (the first two passes).
// Best of the repetitions (the machine's noise only ever adds time).
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "benchmarks/native/bench_memory.h"
#include "cpu/cpu_fp.h"

using namespace flashcomm;
using namespace flashcomm::cpu;

namespace {

using bench::Buffer;
using bench::Now;

struct Result {
  double ns_per_group, gbps, memcpy_gbps;
};

// kMode 0: the whole quantize; 1: widen + group maximum only.
template <int kMode>
Result Run(int32_t format, int64_t mib, bool huge) {
  static volatile int64_t group_size = 128;  // a runtime size, as the kernels see it
  const int64_t g = group_size;
  const int64_t n = mib * (int64_t(1) << 20) / 2, groups = n / g;
  const int64_t stride = fp_record_bytes(format, g, 0);
  auto* x = static_cast<uint16_t*>(Buffer(size_t(n) * 2, huge));
  auto* records = static_cast<uint8_t*>(Buffer(size_t(groups * stride), huge));
  auto* copy = static_cast<uint16_t*>(Buffer(size_t(n) * 2, huge));
  uint32_t state = 1;
  for (int64_t i = 0; i < n; ++i) {  // bf16 of uniform values in [-2, 2)
    state = state * 1664525u + 1013904223u;
    const float f = (float(state >> 8) / float(1 << 24) - 0.5f) * 4.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x[i] = uint16_t(bits >> 16);
  }
  auto* buf = static_cast<float*>(std::aligned_alloc(64, kLanes * g * sizeof(float)));
  auto* keys = static_cast<int32_t*>(std::aligned_alloc(64, g * sizeof(int32_t)));
  const int reps = mib < 4 ? 400 : 20;
  double best = 1e30, best_copy = 1e30;
  volatile float sink = 0;
  for (int r = 0; r < reps; ++r) {
    const double t0 = Now();
    if (kMode == 0 && format == kFormatFp8 && g % kLanes == 0 && g <= kFp8BatchMaxGroup) {
      for (int64_t k0 = 0; k0 < groups; k0 += kLanes) {  // FpQuantizeOp's fp8 batches
        const int64_t count = groups - k0 < kLanes ? groups - k0 : kLanes;
        fp8_quantize_batch<BF16>(x + k0 * g, count, g, buf, records + k0 * stride, stride);
      }
    } else if (kMode == 0 && fp4_batch_takes(format, g)) {  // FpQuantizeOp's four-bit batches
      const int64_t per = fp4_batch_groups(format, g);
      for (int64_t k0 = 0; k0 < groups; k0 += per) {
        const int64_t count = groups - k0 < per ? groups - k0 : per;
        fp4_quantize_batch<BF16>(x + k0 * g, count, g, format, buf, records + k0 * stride, stride);
      }
    } else {
      for (int64_t k = 0; k < groups; ++k) {
        load_group<BF16>(x + k * g, g, buf);
        if constexpr (kMode == 0) {
          fp_quantize_group(buf, g, format, 0, keys, records + k * stride);
        } else {
          sink = sink + max_abs(buf, g);
        }
      }
    }
    const double t = Now() - t0;
    best = t < best ? t : best;
    const double c0 = Now();
    std::memcpy(copy, x, size_t(n) * 2);
    const double c = Now() - c0;
    best_copy = c < best_copy ? c : best_copy;
  }
  std::free(x);
  std::free(records);
  std::free(copy);
  std::free(buf);
  std::free(keys);
  return {best / double(groups) * 1e9, double(n) * 2 / best / 1e9, double(n) * 2 / best_copy / 1e9};
}

void Print(const char* what, const char* format, Result r) {
  std::printf("%-10s %-6s %-28s %6.1f ns/group  %5.2f GB/s  (memcpy %5.2f GB/s: %.2f of it)\n",
              FC_ISA_NAME, format, what, r.ns_per_group, r.gbps, r.memcpy_gbps,
              r.gbps / r.memcpy_gbps);
}

}  // namespace

int main(int argc, char** argv) {
  const struct {
    const char* name;
    int32_t format;
  } formats[] = {{"fp8", kFormatFp8},
                 {"mxfp4", kFormatMxfp4},
                 {"nvfp4", kFormatNvfp4}};
  for (const auto& f : formats) {
    bool wanted = argc == 1;  // arguments: the formats to run (default: all)
    for (int a = 1; a < argc; ++a) wanted = wanted || std::strcmp(argv[a], f.name) == 0;
    if (!wanted) continue;
    Print("quantize, L2 (1 MiB)", f.name, Run<0>(f.format, 1, true));
    Print("quantize, memory, huge pages", f.name, Run<0>(f.format, 16, true));
    Print("quantize, memory, 4 KiB pages", f.name, Run<0>(f.format, 16, false));
  }
  if (argc > 1) return 0;
  Print("widen+max, L2 (1 MiB)", "any", Run<1>(kFormatFp8, 1, true));
  return 0;
}
