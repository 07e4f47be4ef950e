// Host-side checks of the fused residual add + RMSNorm (docs/fused_norm.md), shared by the CPU
// and CUDA handlers of flashcomm_add_rms_norm(_quantize). The Python wrapper validates at trace
// time; these make a handler called directly return an ffi::Error instead of reading or
// writing out of bounds.
#ifndef FLASHCOMM_NORM_CHECKS_H_
#define FLASHCOMM_NORM_CHECKS_H_

#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/group_format.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {

// The shape of one call: rows of `hidden` values, and the payload's group count.
struct NormShape {
  int64_t rows = 0, hidden = 0, groups = 0;
};

// codes/scale/zero: the gathered payload of at least rows * hidden values (its padding is
// ignored); residual (rows * hidden, f32/bf16/f16); weight (hidden, f32 or bf16); new_residual
// of the residual's type and size; out (when given) too.
template <typename C, typename S, typename A>
ffi::Error CheckNormArgs(const C& codes, const S& scale, const S& zero, const A& residual,
                         const A& weight, const A& new_residual, const A* out,
                         const GroupFormat& fmt, float eps, const char* op, NormShape* shape) {
  const int32_t bits = fmt.bits, rotation = fmt.rotation, spikes = fmt.spikes;
  const int64_t group_size = fmt.group_size;
  const std::string name(op);
  if (ffi::Error e = CheckCodecAttrs(bits, group_size, spikes); e.failure()) return e;
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard ||
      (rotation != kRotationNone && (group_size & (group_size - 1)) != 0)) {
    return ffi::Error::InvalidArgument(name + ": rotation must be 0, 1 or 2 (1 and 2 with a "
                                       "power-of-two group_size)");
  }
  if (!(eps >= 0.0f) || !is_finite(eps)) {
    return ffi::Error::InvalidArgument(name + ": eps must be finite and >= 0");
  }
  shape->hidden = int64_t(weight.element_count());
  shape->groups = int64_t(scale.element_count());
  if (shape->hidden <= 0 || int64_t(residual.element_count()) % shape->hidden != 0) {
    return ffi::Error::InvalidArgument(name + ": residual is not whole rows of weight's size");
  }
  shape->rows = int64_t(residual.element_count()) / shape->hidden;
  if (int64_t(zero.element_count()) != shape->groups ||
      int64_t(codes.element_count()) != shape->groups * record_bytes(group_size, bits, spikes) ||
      shape->groups * group_size < shape->rows * shape->hidden) {
    return ffi::Error::InvalidArgument(name + ": the payload does not cover the residual");
  }
  const auto t = residual.element_type();
  if (t != ffi::DataType::F32 && t != ffi::DataType::BF16 && t != ffi::DataType::F16) {
    return ffi::Error::InvalidArgument(name + ": residual must be f32, bf16 or f16");
  }
  if (weight.element_type() != ffi::DataType::F32 &&
      weight.element_type() != ffi::DataType::BF16) {
    return ffi::Error::InvalidArgument(name + ": weight must be f32 or bf16");
  }
  if (new_residual.element_type() != t ||
      new_residual.element_count() != residual.element_count() ||
      (out != nullptr &&
       (out->element_type() != t || out->element_count() != residual.element_count()))) {
    return ffi::Error::InvalidArgument(name + ": outputs must have the residual's type and size");
  }
  return ffi::Error::Success();
}

// The quantized output of flashcomm_add_rms_norm_quantize: hidden a multiple of out_group_size,
// rows * hidden / out_group_size groups of out_bits codes (no spikes).
template <typename C, typename S>
ffi::Error CheckNormQuantOut(const NormShape& shape, const C& codes, const S& scale,
                             const S& zero, const GroupFormat& out_fmt, const char* op) {
  const int32_t out_bits = out_fmt.bits;
  const int64_t out_group_size = out_fmt.group_size;
  if (ffi::Error e = CheckCodecAttrs(out_bits, out_group_size, 0); e.failure()) return e;
  if (shape.hidden % out_group_size != 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": hidden must be a multiple of out_group_size");
  }
  const int64_t groups = shape.rows * shape.hidden / out_group_size;
  if (int64_t(scale.element_count()) != groups || int64_t(zero.element_count()) != groups ||
      int64_t(codes.element_count()) != groups * record_bytes(out_group_size, out_bits, 0)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": output payload shapes are wrong");
  }
  return ffi::Error::Success();
}

// The gathered payload and its format into a kernel's arguments (the CPU's NormArgs, CUDA's
// NormLaunch).
template <typename Args>
void SetNormPayload(const U8Buf& codes, const Bf16Buf& scale, const Bf16Buf& zero,
                    const GroupFormat& fmt, Args* a) {
  a->codes = codes.typed_data();
  a->scale = reinterpret_cast<const uint16_t*>(scale.typed_data());
  a->zero = reinterpret_cast<const uint16_t*>(zero.typed_data());
  a->group_size = fmt.group_size;
  a->bits = fmt.bits;
  a->rotation = fmt.rotation;
  a->spikes = fmt.spikes;
}

}  // namespace flashcomm

#endif  // FLASHCOMM_NORM_CHECKS_H_
