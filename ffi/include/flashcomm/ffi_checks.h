// Host-side argument checks shared by the CPU and CUDA handlers. The Python wrappers validate
// everything at trace time; these checks make a handler called directly return an
// ffi::Error instead of reading or writing out of bounds.
#ifndef FLASHCOMM_FFI_CHECKS_H_
#define FLASHCOMM_FFI_CHECKS_H_

#include <cstddef>
#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "flashcomm/payload_view.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {

namespace ffi = xla::ffi;

// The payload buffers as the handlers' signatures name them (codes u8, scale and zero bf16).
using U8Buf = ffi::Buffer<ffi::U8>;
using Bf16Buf = ffi::Buffer<ffi::BF16>;
using U8Out = ffi::Result<U8Buf>;
using Bf16Out = ffi::Result<Bf16Buf>;
using AnyOut = ffi::Result<ffi::AnyBuffer>;

// Returns from the calling handler with the error `expr` gives, if it is a failure.
#define FLASHCOMM_RETURN_IF_FAILED(expr)                                       \
  do {                                                                         \
    if (::xla::ffi::Error flashcomm_e_ = (expr); flashcomm_e_.failure()) {     \
      return flashcomm_e_;                                                     \
    }                                                                          \
  } while (0)

// InvalidArgument, the message after the op's name.
inline ffi::Error InvalidFor(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// Spike positions are 2 bytes (codec.h position_bytes): spikes > 0 needs group_size <= 65536.
inline ffi::Error CheckSpikeGroupSize(int32_t spikes, int64_t group_size, const char* what) {
  if (spikes > 0 && group_size > kMaxSpikeGroupSize) {
    return ffi::Error::InvalidArgument(
        std::string("flashcomm: ") + what + " > 0 needs group_size <= 65536 (spike positions are " +
        "2 bytes), got group_size " + std::to_string(group_size));
  }
  return ffi::Error::Success();
}

// A kernel's failed scratch allocation (cpu_dispatch.h: the bytes it asked for) as the
// handler's error.
inline ffi::Error ScratchError(const char* op, size_t bytes) {
  return ffi::Error(ffi::ErrorCode::kResourceExhausted,
                    std::string(op) + ": could not allocate " + std::to_string(bytes) +
                        " bytes of scratch memory");
}

// The rotation attribute: 0 (none), 1 (Hadamard) or 2 (signed Hadamard), with a power-of-two
// group_size (and at most max_rotated_group where it is > 0: the platform's limit, which
// `limit_note` names in the message). Messages are prefixed by `op`.
inline ffi::Error CheckRotation(int32_t rotation, int64_t group_size, const char* op,
                                int64_t max_rotated_group = 0, const char* limit_note = "") {
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rotation must be 0, 1 or 2");
  }
  if (rotation != kRotationNone &&
      ((group_size & (group_size - 1)) != 0 ||
       (max_rotated_group > 0 && group_size > max_rotated_group))) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": rotation needs a power-of-two group_size" + limit_note);
  }
  return ffi::Error::Success();
}

inline ffi::Error CheckCodecAttrs(int32_t bits, int64_t group_size, int32_t spikes) {
  if (bits < kMinBits || bits > kMaxBits) {
    return ffi::Error::InvalidArgument("flashcomm: bits must be in 2..8");
  }
  if (group_size <= 0 || group_size % kBlock != 0) {
    return ffi::Error::InvalidArgument("flashcomm: group_size must be a positive multiple of 8");
  }
  if (group_size > kMaxGroupSize) {
    return ffi::Error::InvalidArgument("flashcomm: group_size " + std::to_string(group_size) +
                                       " is above the limit of 2**24 (16777216)");
  }
  if (spikes < 0 || spikes > kMaxSpikes || spikes >= group_size) {
    return ffi::Error::InvalidArgument("flashcomm: spikes must be in 0..16 and below group_size");
  }
  if (ffi::Error e = CheckSpikeGroupSize(spikes, group_size, "spikes"); e.failure()) return e;
  return ffi::Error::Success();
}

template <typename X, typename C, typename S>
ffi::Error CheckQuantizeShapes(const X& x, const C& codes, const S& scale, const S& zero,
                               int32_t bits, int64_t group_size, int32_t spikes,
                               int64_t* n_groups) {
  if (ffi::Error e = CheckCodecAttrs(bits, group_size, spikes); e.failure()) return e;
  const int64_t n = int64_t(x.element_count());
  if (n % group_size != 0) {
    return ffi::Error::InvalidArgument("flashcomm: operand size is not a multiple of group_size");
  }
  *n_groups = n / group_size;
  if (int64_t(scale.element_count()) != *n_groups || int64_t(zero.element_count()) != *n_groups ||
      int64_t(codes.element_count()) != *n_groups * record_bytes(group_size, bits, spikes)) {
    return ffi::Error::InvalidArgument("flashcomm: payload shapes do not match the operand");
  }
  return ffi::Error::Success();
}

// The operands and rotation of quantize (`values`: x) and dequantize (`values`: y), with the
// platform's limit on rotated groups (CheckRotation); `n_groups`: the payload's groups.
template <typename V, typename C, typename S>
ffi::Error CheckCodecOperands(const char* op, const V& values, const C& codes, const S& scale,
                              const S& zero, int32_t bits, int64_t group_size, int32_t rotation,
                              int32_t spikes, int64_t max_rotated_group, const char* limit_note,
                              int64_t* n_groups) {
  if (ffi::Error e = CheckQuantizeShapes(values, codes, scale, zero, bits, group_size, spikes,
                                         n_groups);
      e.failure()) {
    return e;
  }
  return CheckRotation(rotation, group_size, op, max_rotated_group, limit_note);
}

template <typename C, typename S, typename Y>
ffi::Error CheckDequantizeShapes(const C& codes, const S& scale, const S& zero, const Y& y,
                                 int32_t bits, int64_t group_size, int32_t spikes,
                                 int64_t* n_groups) {
  return CheckQuantizeShapes(y, codes, scale, zero, bits, group_size, spikes, n_groups);
}

template <typename C, typename S>
ffi::Error ViewChunkedPayload(const C& codes, const S& scale, const S& zero, int32_t bits,
                              int64_t group_size, int32_t spikes, PayloadView* view) {
  if (ffi::Error e = CheckCodecAttrs(bits, group_size, spikes); e.failure()) return e;
  const auto dims = scale.dimensions();
  if (dims.size() < 2) {
    return ffi::Error::InvalidArgument("flashcomm: chunked scale must have rank >= 2");
  }
  view->chunks = dims[dims.size() - 2];
  view->groups_per_chunk = dims[dims.size() - 1];
  const int64_t n = int64_t(scale.element_count());
  const int64_t per_batch = view->chunks * view->groups_per_chunk;
  view->batch = per_batch == 0 ? 0 : n / per_batch;
  view->group_size = group_size;
  view->group_bytes = record_bytes(group_size, bits, spikes);
  view->bits = bits;
  view->spikes = spikes;
  if (int64_t(zero.element_count()) != n ||
      int64_t(codes.element_count()) != n * view->group_bytes) {
    return ffi::Error::InvalidArgument("flashcomm: payload codes/scale/zero do not match");
  }
  view->codes = codes.typed_data();
  view->scale = scale.typed_data();
  view->zero = zero.typed_data();
  return ffi::Error::Success();
}

// The output payload of dequantize_sum_quantize: out_bits and out_spikes in range and
// (batch..., groups) groups of out_bits codes with out_spikes spikes each.
template <typename C, typename S>
ffi::Error CheckSumQuantizeOutputs(const PayloadView& in, const C& out_codes, const S& out_scale,
                                   const S& out_zero, int32_t out_bits, int32_t out_spikes,
                                   int64_t* n_out) {
  if (out_bits < kMinBits || out_bits > kMaxBits) {
    return ffi::Error::InvalidArgument("flashcomm_dequantize_sum_quantize: out_bits not in 2..8");
  }
  if (out_spikes < 0 || out_spikes > kMaxSpikes || out_spikes >= in.group_size) {
    return ffi::Error::InvalidArgument(
        "flashcomm_dequantize_sum_quantize: out_spikes not in 0..16 and below group_size");
  }
  if (ffi::Error e = CheckSpikeGroupSize(out_spikes, in.group_size, "out_spikes"); e.failure()) {
    return e;
  }
  *n_out = in.batch * in.groups_per_chunk;
  const int64_t out_nbytes = record_bytes(in.group_size, out_bits, out_spikes);
  if (int64_t(out_scale.element_count()) != *n_out ||
      int64_t(out_zero.element_count()) != *n_out ||
      int64_t(out_codes.element_count()) != *n_out * out_nbytes) {
    return ffi::Error::InvalidArgument(
        "flashcomm_dequantize_sum_quantize: output payload has the wrong size");
  }
  return ffi::Error::Success();
}

// Every operand of flashcomm_dequantize_sum_quantize: the chunked input payload (viewed as
// `in`) and the output payload, of `n_out` groups.
template <typename C, typename S, typename OC, typename OS>
ffi::Error CheckSumQuantizeOperands(const C& codes, const S& scale, const S& zero,
                                    const OC& out_codes, const OS& out_scale, const OS& out_zero,
                                    int32_t bits, int32_t out_bits, int64_t group_size,
                                    int32_t spikes, int32_t out_spikes, PayloadView* in,
                                    int64_t* n_out) {
  if (ffi::Error e = ViewChunkedPayload(codes, scale, zero, bits, group_size, spikes, in);
      e.failure()) {
    return e;
  }
  return CheckSumQuantizeOutputs(*in, out_codes, out_scale, out_zero, out_bits, out_spikes,
                                 n_out);
}

// The operands of flashcomm_dequantize_into, shared by the CPU and CUDA handlers: attributes,
// payload shapes, count, out's dtype and size, the aliased operand, the offset scalar.
// rotated_group_note: the platform's limit on rotated group sizes, for the message ("" for none;
// max_rotated_group <= 0 means no limit). Messages are prefixed by the op name.
template <typename A, typename C, typename S, typename O, typename R>
ffi::Error CheckDequantizeIntoArgs(const A& out_in, const C& codes, const S& scale, const S& zero,
                                   const O& offset, const R& out, int32_t bits,
                                   int64_t group_size, int32_t rotation, int32_t spikes,
                                   int64_t count, int64_t max_rotated_group,
                                   const char* rotated_group_note) {
  auto invalid = [](const char* what) {
    return ffi::Error::InvalidArgument(std::string("flashcomm_dequantize_into: ") + what);
  };
  if (ffi::Error e = CheckCodecAttrs(bits, group_size, spikes); e.failure()) return e;
  if (ffi::Error e = CheckRotation(rotation, group_size, "flashcomm_dequantize_into",
                                   max_rotated_group, rotated_group_note);
      e.failure()) {
    return e;
  }
  const int64_t n_groups = int64_t(scale.element_count());
  if (int64_t(zero.element_count()) != n_groups ||
      int64_t(codes.element_count()) != n_groups * record_bytes(group_size, bits, spikes)) {
    return invalid("payload codes/scale/zero do not match");
  }
  if (count < 0 || count > n_groups * group_size) {
    return invalid("count is negative or more than the payload's groups hold");
  }
  const ffi::DataType type = out.element_type();
  if (type != ffi::F32 && type != ffi::BF16 && type != ffi::F16) {
    return invalid("out must be f32, bf16 or f16");
  }
  const int64_t size = int64_t(out.element_count());
  if (out_in.element_type() != type || int64_t(out_in.element_count()) != size) {
    return invalid("the result does not match operand 0 (out)");
  }
  if (offset.element_count() != 1) return invalid("offset must be an int32 scalar");
  return ffi::Error::Success();
}

}  // namespace flashcomm

#endif  // FLASHCOMM_FFI_CHECKS_H_
