// C++ tests of flashcomm_dequantize_into on CPU (ffi/cpu/gather_handlers.cc), called through
// cpu/cpu_gather.h on XLA_FFI_Buffer views of heap buffers of exact sizes, so that
// AddressSanitizer catches any out-of-bounds access:
// - the chunk written is bit-identical to flashcomm_dequantize of the same payload (f32, bf16,
//   f16; plain, rotation, spikes; chunks that end inside a group), and nothing else is touched;
// - out-of-range offsets, counts and malformed operands are InvalidArgument, nothing written.
// Prints failures, then "N passed, M failed"; exits nonzero on any failure. Built and run by
// ctest with -DFLASHCOMM_CPU_TESTS=ON (ffi/tests/run_sanitizers.sh: under ASan and UBSan).
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/cpu_gather.h"
#include "cpu/cpu_ops.h"
#include "harness.h"
#include "xla/ffi/api/c_api.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
using namespace flashcomm;  // NOLINT

namespace {

using namespace test;  // NOLINT

template <typename S>
ffi::Error CallInto(Array<S>& out, const Codes& codes, const Bf16s& scale, const Bf16s& zero,
                    int32_t offset, int bits, int64_t g, int32_t rotation, int32_t spikes,
                    int64_t count) {
  Array<int32_t> off({}, XLA_FFI_DataType_S32, offset);
  return cpu::DequantizeInto(ffi::AnyBuffer(out.view()), ffi::Buffer<ffi::U8>(codes.view()),
                             ffi::Buffer<ffi::BF16>(scale.view()),
                             ffi::Buffer<ffi::BF16>(zero.view()),
                             ffi::Buffer<ffi::S32>(off.view()), ffi::AnyBuffer(out.view()), bits,
                             g, rotation, spikes, count);
}

// A payload of `groups` groups (values with an outlier per group and a NaN group when asked),
// and its flashcomm_dequantize as T.
template <typename T>
struct Case {
  using S = typename T::Storage;
  int bits;
  int64_t g, groups;
  int32_t rotation, spikes;
  Codes codes;
  Bf16s scale, zero;
  Array<S> ref;

  Case(std::mt19937& rng, int bits_, int64_t g_, int64_t groups_, int32_t rotation_,
       int32_t spikes_, bool with_nan)
      : bits(bits_), g(g_), groups(groups_), rotation(rotation_), spikes(spikes_),
        codes({groups_, record_bytes(g_, bits_, spikes_)}, XLA_FFI_DataType_U8),
        scale({groups_}, XLA_FFI_DataType_BF16), zero({groups_}, XLA_FFI_DataType_BF16),
        ref({groups_, g_}, DtypeOf<T>()) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    Array<S> x({groups, g}, DtypeOf<T>());
    for (int64_t i = 0; i < groups * g; ++i) {
      float v = normal(rng) * (i % g == (i / g) % g ? 40.0f : 1.0f);
      x.data[size_t(i)] = T::store(v);
    }
    if (with_nan) x.data[size_t(g + 1)] = T::store(bits_to_float(0x7FC00000u));
    ffi::Error e = cpu::Quantize(ffi::AnyBuffer(x.view()), ffi::Buffer<ffi::U8>(codes.view()),
                                 ffi::Buffer<ffi::BF16>(scale.view()),
                                 ffi::Buffer<ffi::BF16>(zero.view()), bits, g, rotation, spikes);
    CHECK(e.success(), "quantize: " + e.message());
    e = cpu::Dequantize(ffi::Buffer<ffi::U8>(codes.view()), ffi::Buffer<ffi::BF16>(scale.view()),
                        ffi::Buffer<ffi::BF16>(zero.view()), ffi::AnyBuffer(ref.view()), bits, g,
                        rotation, spikes);
    CHECK(e.success(), "dequantize: " + e.message());
  }
};

template <typename T>
void TestMatchesDequantize(std::mt19937& rng, int bits, int64_t g, int32_t rotation,
                           int32_t spikes) {
  using S = typename T::Storage;
  const int64_t groups = 5;
  Case<T> c(rng, bits, g, groups, rotation, spikes, /*with_nan=*/true);
  const S sentinel = S(0x5A5A);
  // counts: whole groups, ending inside the last group, a single value, nothing
  for (int64_t count : {groups * g, groups * g - 3, (groups - 1) * g + 1, int64_t(1),
                        int64_t(0)}) {
    for (int64_t offset : {int64_t(0), int64_t(7), int64_t(3 * g + 1)}) {
      const int64_t size = offset + count + 5;
      Array<S> out({size}, DtypeOf<T>(), sentinel);
      ffi::Error e = CallInto(out, c.codes, c.scale, c.zero, int32_t(offset), bits, g, rotation,
                              spikes, count);
      const std::string tag = Fmt("%s bits=%d g=%lld rot=%d spikes=%d count=%lld offset=%lld",
                                  NameOf<T>(), bits, (long long)g, rotation, spikes,
                                  (long long)count, (long long)offset);
      CHECK(e.success(), tag + ": " + e.message());
      const bool chunk = std::memcmp(out.data.data() + offset, c.ref.data.data(),
                                     size_t(count) * sizeof(S)) == 0;
      CHECK(chunk, tag + ": chunk bit-identical to dequantize");
      bool rest = true;
      for (int64_t i = 0; i < size; ++i) {
        if (i < offset || i >= offset + count) rest = rest && out.data[size_t(i)] == sentinel;
      }
      CHECK(rest, tag + ": nothing outside the chunk written");
    }
  }
}

void TestBounds() {
  // long function: a test table of out-of-range offsets, counts and malformed operands
  std::mt19937 rng(7);
  const int bits = 4;
  const int64_t g = 16, groups = 3, count = 40;  // the payload holds 48 values
  Case<F32> c(rng, bits, g, groups, kRotationNone, 0, false);
  const float sentinel = -7.25f;
  struct Bad {
    int64_t size;
    int32_t offset;
    int64_t count;
    const char* what;
  };
  const Bad bads[] = {
      {100, -1, count, "negative offset"},
      {100, 61, count, "offset + count one past the end"},
      {100, 100, count, "offset at the end"},
      {100, 2147483647, count, "huge offset"},
      {39, 0, count, "out smaller than the chunk"},
      {100, 0, 49, "count beyond the payload's groups"},
      {100, 0, -1, "negative count"},
  };
  for (const Bad& b : bads) {
    Array<float> out({b.size}, XLA_FFI_DataType_F32, sentinel);
    ffi::Error e = CallInto(out, c.codes, c.scale, c.zero, b.offset, bits, g, kRotationNone, 0,
                            b.count);
    bool untouched = true;
    for (float v : out.data) untouched = untouched && v == sentinel;
    CHECK(e.failure() && e.errc() == ffi::ErrorCode::kInvalidArgument && untouched,
          std::string("rejects ") + b.what);
  }
  {  // the last valid offset is fine
    Array<float> out({100}, XLA_FFI_DataType_F32, sentinel);
    CHECK(CallInto(out, c.codes, c.scale, c.zero, 60, bits, g, kRotationNone, 0, count)
              .success(),
          "offset + count == size accepted");
    CHECK(std::memcmp(out.data.data() + 60, c.ref.data.data(), size_t(count) * 4) == 0,
          "last slot written");
  }
  Array<float> out({100}, XLA_FFI_DataType_F32, sentinel);
  // malformed payloads and attributes
  Bf16s short_zero({groups - 1}, XLA_FFI_DataType_BF16);
  CHECK(CallInto(out, c.codes, c.scale, short_zero, 0, bits, g, kRotationNone, 0, count)
            .failure(),
        "rejects zero one short");
  CHECK(CallInto(out, c.codes, c.scale, c.zero, 0, bits + 1, g, kRotationNone, 0, count)
            .failure(),
        "rejects codes of the wrong size for bits");
  CHECK(CallInto(out, c.codes, c.scale, c.zero, 0, bits, g, 3, 0, count).failure(),
        "rejects rotation 3");
  CHECK(CallInto(out, c.codes, c.scale, c.zero, 0, bits, 24, kRotationNone, 0, count).failure(),
        "rejects group_size / codes mismatch");
  CHECK(CallInto(out, c.codes, c.scale, c.zero, 0, bits, g, kRotationNone, 17, count).failure(),
        "rejects spikes 17");
  bool untouched = true;
  for (float v : out.data) untouched = untouched && v == sentinel;
  CHECK(untouched, "nothing written by rejected calls");
  // an int32 out, an offset of two elements, a result that does not match operand 0
  Array<int32_t> outi({100}, XLA_FFI_DataType_S32, 3);
  CHECK(CallInto(outi, c.codes, c.scale, c.zero, 0, bits, g, kRotationNone, 0, count).failure(),
        "rejects an s32 out");
  // out into `result` with the offset operand `off`
  auto into = [&](Array<int32_t>& off, Array<float>& result) {
    return cpu::DequantizeInto(
        ffi::AnyBuffer(out.view()), ffi::Buffer<ffi::U8>(c.codes.view()),
        ffi::Buffer<ffi::BF16>(c.scale.view()), ffi::Buffer<ffi::BF16>(c.zero.view()),
        ffi::Buffer<ffi::S32>(off.view()), ffi::AnyBuffer(result.view()), bits, g, kRotationNone,
        0, count);
  };
  Array<int32_t> off2({2}, XLA_FFI_DataType_S32, 0);
  ffi::Error e = into(off2, out);
  CHECK(e.failure(), "rejects an offset of two elements");
  Array<float> other({99}, XLA_FFI_DataType_F32, 0.0f);
  Array<int32_t> off0({}, XLA_FFI_DataType_S32, 0);
  e = into(off0, other);
  CHECK(e.failure(), "rejects a result of another size than operand 0");
  // an unaliased result gets operand 0's contents, then the chunk
  Array<float> res({100}, XLA_FFI_DataType_F32, 0.0f);
  Array<int32_t> off10({}, XLA_FFI_DataType_S32, 10);
  e = into(off10, res);
  CHECK(e.success() && res.data[0] == sentinel && res.data[99] == sentinel &&
            std::memcmp(res.data.data() + 10, c.ref.data.data(), size_t(count) * 4) == 0,
        "unaliased result: operand 0 copied, chunk written");
}

}  // namespace

// Every test, with the kernels of the instruction-set build in use (cpu_dispatch.h).
void RunAll() {
  std::mt19937 rng(1234);
  for (int bits : {2, 4, 5, 8}) {
    for (int64_t g : {16, 128, 512}) {
      for (int32_t rotation : {kRotationNone, kRotationHadamard, kRotationSignedHadamard}) {
        for (int32_t spikes : {0, 3}) {
          TestMatchesDequantize<F32>(rng, bits, g, rotation, spikes);
          TestMatchesDequantize<BF16>(rng, bits, g, rotation, spikes);
          TestMatchesDequantize<F16>(rng, bits, g, rotation, spikes);
        }
      }
    }
  }
  TestBounds();
}

int main() {
  for (const std::string& isa : cpu::supported_isas()) {
    if (!cpu::set_isa(isa).empty()) {
      std::printf("FAIL set_isa(%s)\n", isa.c_str());
      return 1;
    }
    const int before = g_passed;
    RunAll();
    std::printf("ISA %s: %d checks\n", cpu::kernels().isa, g_passed - before);
  }
  std::printf("%d passed, %d failed\n", g_passed, g_failed);
  return g_failed == 0 ? 0 : 1;
}
