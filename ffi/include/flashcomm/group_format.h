// A phase's group format as the handlers receive it: one FFI dictionary attribute built by
// jax_flashcomm.codec.group_format.GroupFormat.ffi_attribute() (docs/format.md). Host-only:
// the kernels take its fields as plain arguments.
#ifndef FLASHCOMM_GROUP_FORMAT_H_
#define FLASHCOMM_GROUP_FORMAT_H_

#include <cstdint>

#include "xla/ffi/api/api.h"

namespace flashcomm {

struct GroupFormat {
  int32_t format;      // FpFormat (fp_codec.h): kFormatInt, or a floating-point format
  int32_t bits;        // bits per code, 2..8 (the floating-point formats: their own width)
  int64_t group_size;  // values per group, a positive multiple of 8
  int32_t rotation;    // 0 none, 1 Hadamard, 2 signed Hadamard
  int32_t spikes;      // values per group kept in bf16 beside the codes, 0..16
};

}  // namespace flashcomm

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(::flashcomm::GroupFormat, StructMember<int32_t>("format"),
                                      StructMember<int32_t>("bits"),
                                      StructMember<int64_t>("group_size"),
                                      StructMember<int32_t>("rotation"),
                                      StructMember<int32_t>("spikes"));

#endif  // FLASHCOMM_GROUP_FORMAT_H_
