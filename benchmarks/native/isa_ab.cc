// A/B of two compilations of the CPU kernels (ffi/cpu/isa_kernels.cc), in one process.
//
//     bash benchmarks/native/isa_ab.sh "-O3" "-O2"
//
// isa_ab.sh compiles isa_kernels.cc twice for each x86-64 kernel build this CPU runs, under the
// two optimization flag sets given, each in its own namespace (FLASHCOMM_ISA ..._before and
// ..._after), and links both kernel tables (cpu_dispatch.h CodecKernels) into this driver. The
// driver runs each operation below on a bf16 operand of 16 MiB (G = 128, one thread) with the
// two tables alternately, call by call, keeps the best time of each, and checks that the two
// wrote the same bytes: the integer codec's quantize (8 and 4 bits, 4 bits with a spike),
// dequantize, sum of 8 chunks and fused sum-requantize (8 bits, and 4 bits with a spike); the
// floating-point formats' quantize and dequantize (fp8, mxfp4, nvfp4), sum of 8 chunks and
// fused sum-requantize (mxfp4, nvfp4), and nvfp4's four with a spike per group.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <vector>

#include "benchmarks/native/bench_memory.h"
#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"
#include "flashcomm/fp_codec.h"

FLASHCOMM_DECLARE_ISA_KERNELS(ISA_AB_BEFORE);
FLASHCOMM_DECLARE_ISA_KERNELS(ISA_AB_AFTER);

// The scratch allocator of cpu_alloc.h, as ffi/cpu/dispatch.cc defines it (malloc).
extern "C" void* flashcomm_scratch_alloc(size_t bytes) { return std::malloc(bytes); }

namespace {

using flashcomm::cpu::CodecKernels;
using flashcomm::cpu::DType;

using bench::Now;

// n bytes on huge pages (bench::Buffer), as bytes.
uint8_t* Buffer(size_t n) { return static_cast<uint8_t*>(bench::Buffer(n)); }

constexpr int64_t kGroup = 128, kValues = int64_t(8) << 20, kGroups = kValues / kGroup;
constexpr int64_t kChunks = 8;

struct Out {
  uint8_t* bytes;
  size_t size;
};

// One operation: run(kernels, out) writes out.size bytes to out.bytes.
struct Op {
  const char* name;
  size_t out_size;
  std::function<size_t(const CodecKernels&, uint8_t*)> run;
};

}  // namespace

int main() {
  // long function: the A/B table: one row per kernel and operand, timed and compared in order
  const CodecKernels& before = flashcomm::ISA_AB_BEFORE::cpu::isa_kernels();
  const CodecKernels& after = flashcomm::ISA_AB_AFTER::cpu::isa_kernels();
  auto* x = reinterpret_cast<uint16_t*>(Buffer(size_t(kValues) * 2));
  uint32_t state = 1;
  for (int64_t i = 0; i < kValues; ++i) {  // bf16 of normal-ish values with a few outliers
    state = state * 1664525u + 1013904223u;
    float f = (float(state >> 8) / float(1 << 24) - 0.5f) * 4.0f;
    if ((state & 0x3FF) == 5) f *= 50.0f;
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    x[i] = uint16_t(bits >> 16);
  }
  // Inputs of the decoding operations, from the "before" kernels: int8 and every FP format.
  const int64_t rec8 = flashcomm::record_bytes(kGroup, 8, 0);
  uint8_t* codes8 = Buffer(size_t(kGroups * rec8));
  auto* scale8 = reinterpret_cast<uint16_t*>(Buffer(size_t(kGroups) * 2));
  auto* zero8 = reinterpret_cast<uint16_t*>(Buffer(size_t(kGroups) * 2));
  before.quantize(DType::kBF16, x, kGroups, kGroup, 8, 0, 0, codes8, scale8, zero8);
  uint8_t* fp_records[4] = {};
  for (int32_t f = 1; f <= 3; ++f) {
    fp_records[f] = Buffer(size_t(kGroups * flashcomm::fp_record_bytes(f, kGroup, 0)));
    before.fp_quantize(DType::kBF16, x, kGroups, kGroup, f, 0, 0, fp_records[f]);
  }
  // nvfp4 with a spike per group
  uint8_t* spiked_records = Buffer(size_t(kGroups * flashcomm::fp_record_bytes(3, kGroup, 1)));
  before.fp_quantize(DType::kBF16, x, kGroups, kGroup, 3, 0, 1, spiked_records);
  const flashcomm::PayloadView payload8{codes8, scale8, zero8, 1, kChunks, kGroups / kChunks,
                                        kGroup, rec8, 8, 0};
  const int64_t out_groups = kGroups / kChunks;

  std::vector<Op> ops;
  for (const int bits : {8, 4}) {
    for (const int spikes : {0, 1}) {
      if (bits == 8 && spikes == 1) continue;
      const int64_t rec = flashcomm::record_bytes(kGroup, bits, spikes);
      static char names[4][32];
      char* name = names[ops.size()];
      std::snprintf(name, 32, "quantize int%d%s", bits, spikes ? " +spike" : "");
      ops.push_back({name, size_t(kGroups * (rec + 4)),
                     [=](const CodecKernels& k, uint8_t* out) {
                       auto* scale = reinterpret_cast<uint16_t*>(out + kGroups * rec);
                       return k.quantize(DType::kBF16, x, kGroups, kGroup, bits, 0, spikes, out,
                                         scale, scale + kGroups);
                     }});
    }
  }
  // dequantize, the sum of 8 chunks, and the int8 chunks' sum quantized to this format
  auto add_int_decodes = [&](const char* dequantize, const char* sum, const char* fused, int bits,
                             int spikes, const uint8_t* codes, const uint16_t* scale,
                             const uint16_t* zero, const flashcomm::PayloadView& payload) {
    const int64_t rec = flashcomm::record_bytes(kGroup, bits, spikes);
    ops.push_back({dequantize, size_t(kValues * 2), [=](const CodecKernels& k, uint8_t* o) {
                     return k.dequantize(DType::kBF16, codes, scale, zero, kGroups, kGroup, bits,
                                         0, spikes, o);
                   }});
    ops.push_back({sum, size_t(out_groups * kGroup * 2), [=](const CodecKernels& k, uint8_t* o) {
                     return k.dequantize_sum(DType::kBF16, payload, 0, o, 0, out_groups);
                   }});
    ops.push_back({fused, size_t(out_groups * (rec + 4)), [=](const CodecKernels& k, uint8_t* o) {
                     auto* s = reinterpret_cast<uint16_t*>(o + out_groups * rec);
                     return k.dequantize_sum_quantize(payload8, bits, spikes, o, s, s + out_groups,
                                                      0, out_groups);
                   }});
  };
  add_int_decodes("dequantize int8", "sum of 8 chunks int8", "fused sum-quantize int8", 8, 0,
                  codes8, scale8, zero8, payload8);
  const int64_t rec4s = flashcomm::record_bytes(kGroup, 4, 1);
  uint8_t* codes4s = Buffer(size_t(kGroups * rec4s));
  auto* scale4s = reinterpret_cast<uint16_t*>(Buffer(size_t(kGroups) * 2));
  auto* zero4s = reinterpret_cast<uint16_t*>(Buffer(size_t(kGroups) * 2));
  before.quantize(DType::kBF16, x, kGroups, kGroup, 4, 0, 1, codes4s, scale4s, zero4s);
  const flashcomm::PayloadView payload4s{codes4s, scale4s, zero4s, 1, kChunks, kGroups / kChunks,
                                         kGroup, rec4s, 4, 1};
  add_int_decodes("dequantize int4 +spike", "sum of 8 int4 +spike", "fused int8 to int4 +spike",
                  4, 1, codes4s, scale4s, zero4s, payload4s);
  const char* fp_names[4][4] = {
      {}, {"quantize fp8", "dequantize fp8", "", ""},
      {"quantize mxfp4", "dequantize mxfp4", "sum of 8 chunks mxfp4", "fused sum-quantize mxfp4"},
      {"quantize nvfp4", "dequantize nvfp4", "sum of 8 chunks nvfp4", "fused sum-quantize nvfp4"}};
  for (int32_t f = 1; f <= 3; ++f) {
    const int64_t rec = flashcomm::fp_record_bytes(f, kGroup, 0);
    const uint8_t* records = fp_records[f];
    ops.push_back({fp_names[f][0], size_t(kGroups * rec), [=](const CodecKernels& k, uint8_t* o) {
                     return k.fp_quantize(DType::kBF16, x, kGroups, kGroup, f, 0, 0, o);
                   }});
    ops.push_back({fp_names[f][1], size_t(kValues * 2), [=](const CodecKernels& k, uint8_t* o) {
                     return k.fp_dequantize(DType::kBF16, records, kGroups, kGroup, f, 0, 0, o);
                   }});
    if (f == 3) {  // the four-bit formats' best setting (docs/fp_formats.md): a spike per group
      const int64_t spiked = flashcomm::fp_record_bytes(f, kGroup, 1);
      ops.push_back({"quantize nvfp4 +spike", size_t(kGroups * spiked),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_quantize(DType::kBF16, x, kGroups, kGroup, f, 0, 1, o);
                     }});
      ops.push_back({"dequantize nvfp4 +spike", size_t(kValues * 2),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_dequantize(DType::kBF16, spiked_records, kGroups, kGroup, f, 0,
                                              1, o);
                     }});
      const flashcomm::cpu::FpChunks in{spiked_records, 1, kChunks, kGroups / kChunks, kGroup, f,
                                        1};
      ops.push_back({"sum of 8 nvfp4 +spike", size_t(out_groups * kGroup * 2),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_dequantize_sum(DType::kBF16, in, 0, o, 0, out_groups);
                     }});
      ops.push_back({"fused nvfp4 +spike", size_t(out_groups * spiked),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_dequantize_sum_quantize(in, f, 1, o, 0, out_groups);
                     }});
    }
    if (f >= 2) {
      const flashcomm::cpu::FpChunks chunks{records, 1, kChunks, kGroups / kChunks, kGroup, f, 0};
      ops.push_back({fp_names[f][2], size_t(out_groups * kGroup * 2),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_dequantize_sum(DType::kBF16, chunks, 0, o, 0, out_groups);
                     }});
      ops.push_back({fp_names[f][3], size_t(out_groups * rec),
                     [=](const CodecKernels& k, uint8_t* o) {
                       return k.fp_dequantize_sum_quantize(chunks, f, 0, o, 0, out_groups);
                     }});
    }
  }

  std::printf("%s: bf16 16 MiB, G = %lld, one thread, best of 15 alternating calls\n",
              before.isa, static_cast<long long>(kGroup));
  int failed = 0;
  for (const Op& op : ops) {
    uint8_t* out_before = Buffer(op.out_size);
    uint8_t* out_after = Buffer(op.out_size);
    double best_before = 1e30, best_after = 1e30;
    for (int r = 0; r < 15; ++r) {
      const double t0 = Now();
      failed |= op.run(before, out_before) != 0;
      const double t1 = Now();
      failed |= op.run(after, out_after) != 0;
      const double t2 = Now();
      best_before = t1 - t0 < best_before ? t1 - t0 : best_before;
      best_after = t2 - t1 < best_after ? t2 - t1 : best_after;
    }
    const bool same = std::memcmp(out_before, out_after, op.out_size) == 0;
    failed |= !same;
    std::printf("  %-26s before %6.2f ms  after %6.2f ms  after/before %.2f  %s\n", op.name,
                best_before * 1e3, best_after * 1e3, best_after / best_before,
                same ? "same bytes" : "BYTES DIFFER");
    std::free(out_before);
    std::free(out_after);
  }
  return failed;
}
