// Host-side checks of the floating-point formats' handlers (fp8, mxfp4, nvfp4), shared by the
// CPU handlers (ffi/cpu/fp_handlers.cc) and the CUDA ones (ffi/cuda/fp_handlers.cc). The Python
// wrappers validate everything at trace time; these make a handler called directly return an
// ffi::Error instead of reading or writing out of bounds.
#ifndef FLASHCOMM_FP_CHECKS_H_
#define FLASHCOMM_FP_CHECKS_H_

#include <cstdint>
#include <string>

#include "flashcomm/codec.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/fp_codec.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {

inline ffi::Error FpInvalid(const char* op, const std::string& what) {
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what);
}

// format 1..3; group_size a multiple of 8 and of the format's block, at most max_group_size;
// rotation 0..2 (a power-of-two group_size); spikes 0..16 below group_size.
inline ffi::Error CheckFpAttrs(const char* op, int32_t format, int64_t group_size,
                               int32_t rotation, int32_t spikes,
                               int64_t max_group_size = kMaxGroupSize) {
  if (format < kFormatFp8 || format > kFormatNvfp4) {
    return FpInvalid(op, "format must be 1 (fp8), 2 (mxfp4) or 3 (nvfp4)");
  }
  if (ffi::Error e = CheckCodecAttrs(8, group_size, spikes); e.failure()) return e;
  if (group_size % fp_block(format, group_size) != 0) {
    return FpInvalid(op, "group_size must be a multiple of the format's block (32 for mxfp4, "
                         "16 for nvfp4)");
  }
  if (group_size > max_group_size) {
    return FpInvalid(op, "group_size must be at most " + std::to_string(max_group_size) +
                             " here");
  }
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard ||
      (rotation != kRotationNone && (group_size & (group_size - 1)) != 0)) {
    return FpInvalid(op, "rotation must be 0, 1 or 2 (a rotation needs a power-of-two "
                         "group_size)");
  }
  return ffi::Error::Success();
}

// Records (..., record bytes) decoded into y (group_size values per record): the record
// count in *n_groups.
inline ffi::Error CheckFpDecode(const char* op, const ffi::Buffer<ffi::U8>& records,
                                const ffi::AnyBuffer& y, int32_t format, int64_t group_size,
                                int32_t spikes, int64_t* n_groups) {
  const int64_t stride = fp_record_bytes(format, group_size, spikes);
  const auto dims = records.dimensions();
  if (dims.size() == 0 || dims.back() != stride) {
    return FpInvalid(op, "the records' last axis must be " + std::to_string(stride) + " bytes");
  }
  *n_groups = int64_t(records.element_count()) / stride;
  if (int64_t(y.element_count()) != *n_groups * group_size) {
    return FpInvalid(op, "y must hold group_size values per record");
  }
  return ffi::Error::Success();
}

// The chunk layout of records (..., chunks, groups, record bytes).
struct FpChunkShape {
  int64_t batch = 0, chunks = 0, groups_per_chunk = 0;
};

inline ffi::Error ViewFpChunks(const char* op, const ffi::Buffer<ffi::U8>& records,
                               int32_t format, int64_t group_size, int32_t spikes,
                               FpChunkShape* shape) {
  const auto dims = records.dimensions();
  if (dims.size() < 3) return FpInvalid(op, "records must be (..., chunks, groups, bytes)");
  const int64_t stride = fp_record_bytes(format, group_size, spikes);
  if (dims.back() != stride) {
    return FpInvalid(op, "the records' last axis must be " + std::to_string(stride) + " bytes");
  }
  shape->chunks = dims[dims.size() - 3];
  shape->groups_per_chunk = dims[dims.size() - 2];
  shape->batch = 1;
  for (size_t i = 0; i + 3 < dims.size(); ++i) shape->batch *= dims[i];
  if (shape->chunks < 1) return FpInvalid(op, "records need at least one chunk");
  return ffi::Error::Success();
}

}  // namespace flashcomm

#endif  // FLASHCOMM_FP_CHECKS_H_
