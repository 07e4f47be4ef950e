// The choice of the CPU codec's instruction-set build (cpu_dispatch.h): the best build the CPU
// can run, or the one FLASHCOMM_CPU_ISA names, decided once on first use; set_isa switches
// (the Python module and the C++ tests use it to run every build).
#include "cpu/cpu_dispatch.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/cpu_alloc.h"

// One declaration per build compiled in (ffi/cpu/isa_kernels.cc; CMake defines the
// FLASHCOMM_HAVE_ISA_* macros for the builds it compiles). The builds' namespaces are inline
// namespaces of flashcomm there; declared here as plain ones (same symbols), so that
// flashcomm::cpu stays unambiguous in this file.
#if defined(FLASHCOMM_HAVE_ISA_AVX512)
FLASHCOMM_DECLARE_ISA_KERNELS(isa_avx512);
#endif
#if defined(FLASHCOMM_HAVE_ISA_AVX2)
FLASHCOMM_DECLARE_ISA_KERNELS(isa_avx2);
#endif
#if defined(FLASHCOMM_HAVE_ISA_NEON)
FLASHCOMM_DECLARE_ISA_KERNELS(isa_neon);
#endif
FLASHCOMM_DECLARE_ISA_KERNELS(isa_baseline);

namespace flashcomm {
namespace cpu {
namespace {

struct Build {
  const char* name;
  const CodecKernels& (*table)();
  bool (*runs_here)();
};

[[maybe_unused]] bool Always() { return true; }

#if defined(__x86_64__) || defined(__i386__)
// x86-64-v4 (AVX-512 F/BW/CD/DQ/VL) and x86-64-v3 (AVX2, FMA, BMI1/2, F16C, LZCNT, MOVBE): the
// levels the builds are compiled for (-march=x86-64-v4 / v3). libgcc checks that the OS saves
// the vector registers too.
[[maybe_unused]] bool HasV4() { return __builtin_cpu_supports("x86-64-v4"); }
[[maybe_unused]] bool HasV3() { return __builtin_cpu_supports("x86-64-v3"); }
#endif

// Best first.
const std::vector<Build>& Builds() {
  static const std::vector<Build> builds = {
#if defined(FLASHCOMM_HAVE_ISA_AVX512)
      {"avx512", isa_avx512::cpu::isa_kernels, HasV4},
#endif
#if defined(FLASHCOMM_HAVE_ISA_AVX2)
      {"avx2", isa_avx2::cpu::isa_kernels, HasV3},
#endif
#if defined(FLASHCOMM_HAVE_ISA_NEON)
      {"neon", isa_neon::cpu::isa_kernels, Always},
#endif
      {"baseline", isa_baseline::cpu::isa_kernels, Always},
  };
  return builds;
}

const CodecKernels* Best() {
  for (const Build& b : Builds()) {
    if (b.runs_here()) return &b.table();
  }
  return &isa_baseline::cpu::isa_kernels();
}

// The table in use: FLASHCOMM_CPU_ISA's build when it names one this CPU runs, else the best.
// (A bad FLASHCOMM_CPU_ISA is reported by the Python module when it loads, through set_isa.)
const CodecKernels* Initial() {
  const char* env = std::getenv("FLASHCOMM_CPU_ISA");
  if (env != nullptr && *env != '\0') {
    const std::string name(env);
    for (const Build& b : Builds()) {
      if (name == b.name && b.runs_here()) return &b.table();
    }
  }
  return Best();
}

std::atomic<const CodecKernels*>& Active() {
  static std::atomic<const CodecKernels*> active{Initial()};
  return active;
}

}  // namespace

const CodecKernels& kernels() { return *Active().load(std::memory_order_acquire); }

std::vector<std::string> supported_isas() {
  std::vector<std::string> names;
  for (const Build& b : Builds()) {
    if (b.runs_here()) names.emplace_back(b.name);
  }
  return names;
}

std::string cpu_features() {
#if defined(__x86_64__) || defined(__i386__)
#define FC_FEATURE(f) {f, static_cast<bool>(__builtin_cpu_supports(f))}
  const struct {
    const char* name;
    bool present;
  } features[] = {FC_FEATURE("avx512f"), FC_FEATURE("avx512bw"), FC_FEATURE("avx512dq"),
                  FC_FEATURE("avx512vl"), FC_FEATURE("avx2"), FC_FEATURE("fma"),
                  FC_FEATURE("bmi2"), FC_FEATURE("f16c"), FC_FEATURE("sse4.2")};
#undef FC_FEATURE
  std::string have, lack;
  for (const auto& f : features) {
    std::string& list = f.present ? have : lack;
    list += list.empty() ? f.name : std::string(" ") + f.name;
  }
  return "x86-64 with sse2" + (have.empty() ? std::string() : " " + have) +
         (lack.empty() ? std::string() : " (no " + lack + ")");
#elif defined(__aarch64__)
  return "aarch64 (Advanced SIMD / NEON is part of the architecture)";
#else
  return "an architecture without vector builds (baseline only)";
#endif
}

std::string set_isa(const std::string& name) {
  if (name == "auto" || name.empty()) {
    Active().store(Best(), std::memory_order_release);
    return "";
  }
  std::string known;
  for (const Build& b : Builds()) {
    if (name == b.name) {
      if (!b.runs_here()) {
        return "FLASHCOMM_CPU_ISA=" + name + ": this CPU cannot run the " + name +
               " build; it is " + cpu_features();
      }
      Active().store(&b.table(), std::memory_order_release);
      return "";
    }
    known += known.empty() ? b.name : std::string(", ") + b.name;
  }
  return "FLASHCOMM_CPU_ISA=" + name + " is not one of this library's builds (" + known +
         ", or auto)";
}

double pass_seconds(const std::string& name, int64_t groups, int reps) {
  const CodecKernels* table = nullptr;
  for (const Build& b : Builds()) {
    if (name == b.name && b.runs_here()) table = &b.table();
  }
  if (table == nullptr || groups < 1 || reps < 1) return -1.0;
  constexpr int64_t kGroup = 128, kChunks = 4;
  constexpr int kBits = 8, kRotation = 1;
  const int64_t record = kGroup * kBits / 8;
  std::vector<uint16_t> x(static_cast<size_t>(groups * kGroup));
  for (size_t i = 0; i < x.size(); ++i) {  // bf16 values in [-2, 2): a fixed pattern
    const float v = float(int64_t(i * 2654435761u % 4096) - 2048) / 1024.0f;
    uint32_t bits;
    std::memcpy(&bits, &v, 4);
    x[i] = uint16_t(bits >> 16);
  }
  const size_t n = static_cast<size_t>(groups), out_n = static_cast<size_t>(groups / kChunks);
  std::vector<uint8_t> codes(n * record), out_codes(out_n * record);
  std::vector<uint16_t> scale(n), zero(n), y(x.size()), out_scale(out_n), out_zero(out_n);
  const PayloadView chunked{codes.data(), scale.data(), zero.data(), 1, kChunks,
                            groups / kChunks, kGroup, record, kBits, 0};
  std::vector<double> times;
  for (int r = 0; r < reps; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    const size_t failed =  // scratch bytes a pass could not allocate (0: none)
        table->quantize(DType::kBF16, x.data(), groups, kGroup, kBits, kRotation, 0,
                        codes.data(), scale.data(), zero.data()) +
        table->dequantize_sum_quantize(chunked, kBits, 0, out_codes.data(), out_scale.data(),
                                       out_zero.data(), 0, groups / kChunks) +
        table->dequantize(DType::kBF16, codes.data(), scale.data(), zero.data(), groups, kGroup,
                          kBits, kRotation, 0, y.data());
    if (failed != 0) return -1.0;
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

}  // namespace cpu
}  // namespace flashcomm

// The scratch allocator of cpu_alloc.h (nullptr: std::malloc).
namespace {
std::atomic<flashcomm_scratch_alloc_fn> g_scratch_allocator{nullptr};
}  // namespace

extern "C" void* flashcomm_scratch_alloc(size_t bytes) {
  const flashcomm_scratch_alloc_fn fn = g_scratch_allocator.load(std::memory_order_relaxed);
  return fn != nullptr ? fn(bytes) : std::malloc(bytes);
}

extern "C" flashcomm_scratch_alloc_fn flashcomm_set_scratch_allocator(
    flashcomm_scratch_alloc_fn fn) {
  return g_scratch_allocator.exchange(fn);
}
