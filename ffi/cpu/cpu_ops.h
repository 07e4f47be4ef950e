// Plain C++ entry points of the CPU codec handlers (defined in ffi/cpu/codec_handlers.cc).
//
// These are the functions the XLA_FFI_DEFINE_HANDLER_SYMBOL handlers (cpu_kernels.h) bind:
// XLA decodes the call frame into these arguments and calls them. Declared here so that the
// C++ tests (ffi/tests/codec_cpu_test.cc) can call the handler bodies, shape checks included,
// on buffers they own, without going through the XLA FFI C API. `runner` splits a call's
// groups over threads (the handlers pass XLA's intra-op pool; the bytes do not depend on it).
#ifndef FLASHCOMM_CPU_OPS_H_
#define FLASHCOMM_CPU_OPS_H_

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>

#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_parallel.h"
#include "flashcomm/ffi_checks.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// A runner on the pool the XLA FFI hands a handler (XLA's intra-op pool); valid while the
// handler runs.
inline Runner PoolRunner(xla::ffi::ThreadPool& pool) {
  return Runner([&pool](Runner::Task task) { pool.Schedule(std::move(task)); },
                pool.num_threads());
}

// A handler body run so that no exception leaves the handler (XLA calls it through a C API):
// std::bad_alloc (a small allocation of the handler itself: a message, the thread pool's
// shared state) becomes ResourceExhausted, any other exception Internal, named by `op`.
template <typename Body>
xla::ffi::Error Guarded(const char* op, Body&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return xla::ffi::Error(xla::ffi::ErrorCode::kResourceExhausted,
                           std::string(op) + ": out of memory");
  } catch (const std::exception& e) {
    return xla::ffi::Error::Internal(std::string(op) + ": " + e.what());
  } catch (...) {
    return xla::ffi::Error::Internal(std::string(op) + ": unknown exception");
  }
}

// Guarded for a handler bound directly by its function: Guard<&F>::Call has F's signature and
// returns F's result, or the error of an exception leaving F (as an ffi::Error, or a future
// completed with it, for the asynchronous handlers).
template <auto F>
struct Guard;
template <typename R, typename... A, R (*F)(A...)>
struct Guard<F> {
  static R Call(A... args) {
    if constexpr (std::is_same_v<R, xla::ffi::Future>) {
      std::optional<R> result;
      xla::ffi::Error error = Guarded("flashcomm handler", [&] {
        result.emplace(F(std::move(args)...));
        return xla::ffi::Error::Success();
      });
      if (result) return std::move(*result);
      xla::ffi::Promise promise;
      promise.SetError(std::move(error));
      return xla::ffi::Future(promise);
    } else {
      return Guarded("flashcomm handler", [&] { return F(std::move(args)...); });
    }
  }
};

// The codec's operand dtypes (f32, bf16, f16); false for any other.
inline bool ToDType(xla::ffi::DataType type, DType* dtype) {
  switch (type) {
    case xla::ffi::DataType::F32: *dtype = DType::kF32; return true;
    case xla::ffi::DataType::BF16: *dtype = DType::kBF16; return true;
    case xla::ffi::DataType::F16: *dtype = DType::kF16; return true;
    default: return false;
  }
}

// rotation: 0 none, 1 Hadamard, 2 signed Hadamard of each group (codec.h; docs/format.md).
// Quantize rotates before quantizing; Dequantize and DequantizeSum rotate back (the sum once,
// in the rotated domain); DequantizeSumQuantize stays in the rotated domain.
// spikes: per group, the k largest-magnitude values kept in bf16 after the codes (codec.h
// select_spikes; docs/format.md "Spike reserving"); the codes arrays hold record_bytes per group.
// x (..., group_size) f32/bf16/f16 -> codes (..., group_size * bits / 8) u8, scale and zero
// (...) bf16.
xla::ffi::Error Quantize(xla::ffi::AnyBuffer x, U8Out codes, Bf16Out scale, Bf16Out zero,
                         int32_t bits, int64_t group_size, int32_t rotation, int32_t spikes,
                         const Runner& runner = Runner::Inline());

// codes, scale, zero -> y (..., group_size) f32/bf16/f16, saturated to y's finite range.
xla::ffi::Error Dequantize(U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y, int32_t bits,
                           int64_t group_size, int32_t rotation, int32_t spikes,
                           const Runner& runner = Runner::Inline());

// codes (..., N, G, bytes), scale and zero (..., N, G) -> y (..., G * group_size): the f32 sum
// over the N chunks in order 0..N-1, stored as y's dtype.
xla::ffi::Error DequantizeSum(U8Buf codes, Bf16Buf scale, Bf16Buf zero, AnyOut y, int32_t bits,
                              int64_t group_size, int32_t rotation, int32_t spikes,
                              const Runner& runner = Runner::Inline());

// As DequantizeSum, then the f32 sum is quantized again with out_bits and out_spikes.
xla::ffi::Error DequantizeSumQuantize(U8Buf codes, Bf16Buf scale, Bf16Buf zero, U8Out out_codes,
                                      Bf16Out out_scale, Bf16Out out_zero, int32_t bits,
                                      int32_t out_bits, int64_t group_size, int32_t spikes,
                                      int32_t out_spikes, const Runner& runner = Runner::Inline());

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_OPS_H_
