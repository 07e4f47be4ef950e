// The CPU codec's instruction-set builds and the choice between them.
//
// ffi/cpu/isa_kernels.cc is compiled once per instruction set (its vector width fitting the
// ISA's registers: 16 f32 lanes on AVX-512, 8 on AVX2, 4 on SSE2 and NEON), each build in its
// own namespace, and each fills one CodecKernels table. The FFI handlers (compiled for the
// baseline ISA) call through the table chosen once, when the library loads: the best the CPU
// supports, or the one FLASHCOMM_CPU_ISA names (avx512 | avx2 | baseline; on aarch64 neon |
// baseline). Every build runs the same codec.h arithmetic, so every build gives the same bits.
#ifndef FLASHCOMM_CPU_DISPATCH_H_
#define FLASHCOMM_CPU_DISPATCH_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "flashcomm/payload_view.h"

namespace flashcomm {
namespace cpu {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// What the exact all-reduce sums (cpu_sum_lanes.h): the signed integers as the unsigned ones
// of their width (two's complement wraps alike), complex as its components.
enum class SumType : int32_t { kF32, kBF16, kF16, kF64, kU8, kU16, kU32, kU64 };

// The fused epilogue of the all-reduce (docs/fused_norm.md): a decoded payload of rows * hidden
// values (plus padding) + residual -> new residual; RMSNorm with weight -> out, or (out null)
// the normalised rows quantized to out_bits in groups of out_group_size (no rotation, no
// spikes; hidden a multiple of out_group_size).
struct NormArgs {
  DType dtype;    // residual, new residual and out
  DType wtype;    // weight: kF32 or kBF16
  const uint8_t* codes;
  const uint16_t* scale;
  const uint16_t* zero;
  int64_t group_size;
  int bits, rotation, spikes;
  const void* residual;
  const void* weight;
  int64_t hidden;
  float eps;
  void* new_residual;
  void* out;
  int out_bits;
  int64_t out_group_size;
  uint8_t* out_codes;
  uint16_t* out_scale;
  uint16_t* out_zero;
};

// The handler bodies, after the shape and attribute checks (ffi/cpu/codec_handlers.cc,
// ffi/cpu/gather_handlers.cc): plain pointers, validated sizes. Each returns 0 on success, else
// the size in bytes of the scratch allocation that failed (cpu_alloc.h): it then stopped, its
// outputs partly written, and the handler returns an ffi::Error (ScratchError, ffi_checks.h).
// Chunked records of a floating-point format (fp_codec.h): codes (batch, chunks,
// groups_per_chunk, fp_record_bytes(format, group_size, spikes)).
struct FpChunks {
  const uint8_t* codes;
  int64_t batch, chunks, groups_per_chunk, group_size;
  int32_t format;
  int spikes;
};

struct CodecKernels {
  const char* isa;  // "avx512", "avx2", "baseline" or "neon"
  // x (n_groups * g of dtype) -> codes (n_groups * record_bytes), scale, zero.
  size_t (*quantize)(DType dtype, const void* x, int64_t n_groups, int64_t g, int bits,
                     int rotation, int spikes, uint8_t* codes, uint16_t* scale, uint16_t* zero);
  // codes, scale, zero -> y (n_groups * g of dtype), saturated to dtype's finite range.
  size_t (*dequantize)(DType dtype, const uint8_t* codes, const uint16_t* scale,
                       const uint16_t* zero, int64_t n_groups, int64_t g, int bits, int rotation,
                       int spikes, void* y);
  // Chunked payload -> y (batch * groups_per_chunk * group_size of dtype): the f32 sum over the
  // chunks in order, rotated back once when rotation != 0. Only output groups [begin, end) of
  // the batch * groups_per_chunk (y, codes, scale and zero stay the whole arrays), so that a
  // call can be split over threads.
  size_t (*dequantize_sum)(DType dtype, const PayloadView& in, int rotation, void* y,
                           int64_t begin, int64_t end);
  // Chunked payload -> the f32 sum re-quantized at out_bits with out_spikes spikes per group
  // (no rotation: a rotated payload stays in the rotated domain); output groups [begin, end).
  size_t (*dequantize_sum_quantize)(const PayloadView& in, int out_bits, int out_spikes,
                                    uint8_t* codes, uint16_t* scale, uint16_t* zero,
                                    int64_t begin, int64_t end);
  // The first `count` decoded values of a payload into y (dtype), saturated.
  size_t (*dequantize_into)(DType dtype, const uint8_t* codes, const uint16_t* scale,
                            const uint16_t* zero, int64_t g, int bits, int rotation, int spikes,
                            int64_t count, void* y);
  // Rows [begin, end) of the fused residual add + RMSNorm (NormArgs).
  size_t (*add_rms_norm)(const NormArgs& args, int64_t begin, int64_t end);
  // The floating-point formats (fp_codec.h, cpu_fp.h): x (n_groups * g of dtype) -> records
  // (n_groups * fp_record_bytes).
  size_t (*fp_quantize)(DType dtype, const void* x, int64_t n_groups, int64_t g, int32_t format,
                        int rotation, int spikes, uint8_t* records);
  // Records -> y (n_groups * g of dtype), rotated back, saturated to dtype's finite range.
  size_t (*fp_dequantize)(DType dtype, const uint8_t* records, int64_t n_groups, int64_t g,
                          int32_t format, int rotation, int spikes, void* y);
  // Output groups [begin, end) of batch * groups_per_chunk: the f32 sum over the chunks in
  // order, rotated back, saturated, as dtype.
  size_t (*fp_dequantize_sum)(DType dtype, const FpChunks& in, int rotation, void* y,
                              int64_t begin, int64_t end);
  // The same sums (no rotation back) re-quantized in out_format with out_spikes.
  size_t (*fp_dequantize_sum_quantize)(const FpChunks& in, int32_t out_format, int out_spikes,
                                       uint8_t* records, int64_t begin, int64_t end);
  // The exact all-reduce's sum: values [begin, end) of the n_xs ranks' x (xs, rank order)
  // summed in rank order (16-bit floats in f32, rounded once) into every one of the n_ys ys
  // (which may be the xs: each block is read from every x before any y is written). Allocates
  // nothing.
  void (*sum_ranks)(SumType type, const void* const* xs, int64_t n_xs, int64_t begin,
                    int64_t end, void* const* ys, int64_t n_ys);
};

// The table in use (chosen on first use; see set_isa).
const CodecKernels& kernels();

// The ISA builds this CPU can run, best first (compiled in and supported by the CPU).
std::vector<std::string> supported_isas();

// What the CPU reports, for error messages: e.g. "x86-64 with avx2 fma (no avx512f)".
std::string cpu_features();

// Use the named build from now on ("auto": the best supported). Returns an empty string on
// success, else the reason (unknown name, or a build the CPU cannot run).
std::string set_isa(const std::string& name);

// Median seconds of `reps` runs of the all-reduce's three codec passes (quantize,
// dequantize_sum_quantize over 4 chunks, dequantize; bf16, 8 bits, G = 128, Hadamard) on
// `groups` groups with build `name` (not the one in use: set_isa is untouched); -1 for a
// build this CPU cannot run. What the loader measures on a CPU kind it has no rule for.
double pass_seconds(const std::string& name, int64_t groups, int reps);

}  // namespace cpu
}  // namespace flashcomm

// The table of build `ns` (ffi/cpu/isa_kernels.cc compiled with FLASHCOMM_ISA=ns), declared in
// a plain namespace (the same symbol as the build's inline one) where several builds meet:
// ffi/cpu/dispatch.cc, benchmarks/native/isa_ab.cc.
#define FLASHCOMM_DECLARE_ISA_KERNELS(ns)                \
  namespace flashcomm {                                  \
  namespace ns {                                         \
  namespace cpu {                                        \
  const ::flashcomm::cpu::CodecKernels& isa_kernels();   \
  }                                                      \
  }                                                      \
  }                                                      \
  static_assert(true, "a declaration: ends with ;")

#endif  // FLASHCOMM_CPU_DISPATCH_H_
