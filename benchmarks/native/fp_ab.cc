// A/B of the FP formats' quantize loop between two versions of the headers, in one process.
//
//     bash benchmarks/native/fp_ab.sh [REV] [G]
//
// On a VM whose speed drifts by tens of percent within minutes, two runs of benchmarks/native/fp_loop.sh
// cannot tell a 10% change. fp_ab.sh compiles this file three times for each x86-64 kernel build
// the CPU runs: the loop of ffi/cpu/isa_kernels.cc FpQuantizeOp against git revision REV's
// headers (FP_AB_PART=1, its own inline namespace), the same loop against the working tree's
// (FP_AB_PART=2), and the driver (FP_AB_PART=0). The driver calls the two loops alternately,
// repetition by repetition, on the same bf16 operand of G-value groups (1 MiB: in L2, and 16
// MiB), keeps the best time of each, and checks that both wrote the same bytes.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#if FP_AB_PART != 0
// The CPU-only headers are in ffi/cpu; older revisions (the "before" side) kept them in
// ffi/include/flashcomm.
#if __has_include("cpu/cpu_fp.h")
#include "cpu/cpu_fp.h"
#else
#include "flashcomm/cpu_fp.h"
#endif

using namespace flashcomm;
using namespace flashcomm::cpu;

// FpQuantizeOp's loop without rotation or spikes, for bf16: fp8 kLanes groups at a time, the
// four-bit formats kLanes blocks at a time where the headers have that batch
// (FLASHCOMM_FP4_BATCH), else one group at a time.
extern "C" void FP_AB_NAME(const uint16_t* x, int64_t groups, int64_t g, int32_t format,
                           float* buf, int32_t* keys, uint8_t* records) {
  const int64_t stride = fp_record_bytes(format, g, 0);
  if (format == kFormatFp8 && g % kLanes == 0 && g <= kFp8BatchMaxGroup) {
    for (int64_t k0 = 0; k0 < groups; k0 += kLanes) {
      const int64_t count = groups - k0 < kLanes ? groups - k0 : kLanes;
      fp8_quantize_batch<BF16>(x + k0 * g, count, g, buf, records + k0 * stride, stride);
    }
    return;
  }
#ifdef FLASHCOMM_FP4_BATCH
  if (fp4_batch_takes(format, g)) {
    const int64_t per = fp4_batch_groups(format, g);
    for (int64_t k0 = 0; k0 < groups; k0 += per) {
      const int64_t count = groups - k0 < per ? groups - k0 : per;
      fp4_quantize_batch<BF16>(x + k0 * g, count, g, format, buf, records + k0 * stride, stride);
    }
    return;
  }
#endif
  for (int64_t k = 0; k < groups; ++k) {
    load_group<BF16>(x + k * g, g, buf);
    fp_quantize_group(buf, g, format, 0, keys, records + k * stride);
  }
}

#else
#include <initializer_list>

#include "benchmarks/native/bench_memory.h"

extern "C" void fp_ab_before(const uint16_t*, int64_t, int64_t, int32_t, float*, int32_t*,
                             uint8_t*);
extern "C" void fp_ab_after(const uint16_t*, int64_t, int64_t, int32_t, float*, int32_t*,
                            uint8_t*);

using bench::Buffer;
using bench::Now;

int main(int argc, char** argv) {
  const int64_t g = argc > 1 ? std::atoll(argv[1]) : 128;
  const char* names[] = {"", "fp8", "mxfp4", "nvfp4"};
  for (int32_t format = 1; format <= 3; ++format) {
    for (const int64_t mib : {int64_t(1), int64_t(16)}) {
      const int64_t n = mib << 19, groups = n / g, out = groups * (g + 64);
      auto* x = static_cast<uint16_t*>(Buffer(size_t(n) * 2));
      uint32_t state = 1;
      for (int64_t i = 0; i < n; ++i) {  // bf16 of uniform values in [-2, 2), a few tiny ones
        state = state * 1664525u + 1013904223u;
        float f = (float(state >> 8) / float(1 << 24) - 0.5f) * 4.0f;
        if ((state & 0xFFFF) == 7) f *= 1e-30f;
        uint32_t bits;
        std::memcpy(&bits, &f, 4);
        x[i] = uint16_t(bits >> 16);
      }
      auto* before = static_cast<uint8_t*>(Buffer(size_t(out)));
      auto* after = static_cast<uint8_t*>(Buffer(size_t(out)));
      auto* buf = static_cast<float*>(std::aligned_alloc(64, (16 * g + 4096) * sizeof(float)));
      auto* keys = static_cast<int32_t*>(std::aligned_alloc(64, g * sizeof(int32_t)));
      const int reps = mib == 1 ? 600 : 40;
      double best_before = 1e30, best_after = 1e30;
      for (int r = 0; r < reps; ++r) {
        const double t0 = Now();
        fp_ab_before(x, groups, g, format, buf, keys, before);
        const double t1 = Now();
        fp_ab_after(x, groups, g, format, buf, keys, after);
        const double t2 = Now();
        best_before = t1 - t0 < best_before ? t1 - t0 : best_before;
        best_after = t2 - t1 < best_after ? t2 - t1 : best_after;
      }
      const bool same = std::memcmp(before, after, size_t(out)) == 0;
      std::printf("%-8s %-6s %2lld MiB  before %6.1f  after %6.1f ns/group  after/before %.2f  %s\n",
                  FC_ISA_NAME, names[format], static_cast<long long>(mib),
                  best_before / double(groups) * 1e9, best_after / double(groups) * 1e9,
                  best_after / best_before, same ? "same bytes" : "BYTES DIFFER");
      std::free(x);
      std::free(before);
      std::free(after);
      std::free(buf);
      std::free(keys);
      if (!same) return 1;
    }
  }
  return 0;
}
#endif
