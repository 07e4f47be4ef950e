// The codec's C++ tests' harness (codec_cpu_test.cc, gather_cpu_test.cc): CHECK(cond, what)
// counts and prints each failure with its place; the operands are XLA_FFI_Buffer views of
// std::vector storage of exact size (so that AddressSanitizer flags the first byte past the end);
// the codec dtypes' FFI types and names.
#ifndef FLASHCOMM_TESTS_HARNESS_H_
#define FLASHCOMM_TESTS_HARNESS_H_

#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <string>
#include <utility>
#include <vector>

#include "flashcomm/codec.h"
#include "xla/ffi/api/c_api.h"

namespace flashcomm {
namespace test {

inline int g_passed = 0;
inline int g_failed = 0;

inline void Check(bool ok, const char* expr, const char* file, int line, const std::string& what) {
  if (ok) {
    ++g_passed;
    return;
  }
  ++g_failed;
  std::printf("FAIL %s:%d: %s  [%s]\n", file, line, expr, what.c_str());
}

#define CHECK(cond, what) \
  ::flashcomm::test::Check(static_cast<bool>(cond), #cond, __FILE__, __LINE__, (what))

inline std::string Fmt(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
inline std::string Fmt(const char* fmt, ...) {
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  std::vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  return buf;
}

template <typename S>
struct Array {
  std::vector<S> data;
  std::vector<int64_t> dims;
  XLA_FFI_Buffer buf;

  Array(std::vector<int64_t> shape, XLA_FFI_DataType dtype, S fill = S()) : dims(std::move(shape)) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    data.assign(size_t(n), fill);  // exactly n elements
    buf.struct_size = XLA_FFI_Buffer_STRUCT_SIZE;
    buf.extension_start = nullptr;
    buf.dtype = dtype;
    buf.data = data.data();
    buf.rank = int64_t(dims.size());
    buf.dims = dims.data();
  }
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  const XLA_FFI_Buffer* view() const { return &buf; }
};

using Codes = Array<uint8_t>;
using Bf16s = Array<uint16_t>;

template <typename T>
constexpr XLA_FFI_DataType DtypeOf();
template <>
constexpr XLA_FFI_DataType DtypeOf<F32>() { return XLA_FFI_DataType_F32; }
template <>
constexpr XLA_FFI_DataType DtypeOf<BF16>() { return XLA_FFI_DataType_BF16; }
template <>
constexpr XLA_FFI_DataType DtypeOf<F16>() { return XLA_FFI_DataType_F16; }

template <typename T>
const char* NameOf();
template <>
inline const char* NameOf<F32>() { return "f32"; }
template <>
inline const char* NameOf<BF16>() { return "bf16"; }
template <>
inline const char* NameOf<F16>() { return "f16"; }

}  // namespace test
}  // namespace flashcomm

#endif  // FLASHCOMM_TESTS_HARNESS_H_
