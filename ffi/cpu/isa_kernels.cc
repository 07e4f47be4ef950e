// long file: every kernel entry point of one instruction-set build (the translation unit compiled
// once per ISA)
// The CPU codec's work, compiled once per instruction set: the build system compiles this file
// with FLASHCOMM_ISA (isa_<name>: the namespace of every symbol here and in the codec headers),
// FLASHCOMM_LANES (16 / 8 / 4 f32 lanes) and the ISA's -m flags; the
// result is one CodecKernels table per ISA (cpu_dispatch.h). The handlers check shapes and
// attributes first (codec_handlers.cc, gather_handlers.cc), so sizes here are valid.
//
// Nothing here may instantiate a template or inline function outside FLASHCOMM_ISA's
// namespace (no std containers): the linker keeps one copy of such a function for the whole
// library, and an AVX-512 copy called from the baseline build would not run on other CPUs.
// Scratch memory comes from flashcomm_scratch_alloc (cpu_alloc.h: malloc, or a test's
// allocator), and every allocation is checked: a kernel that cannot get its scratch writes
// nothing more and returns the size it asked for (cpu_dispatch.h), which the handler reports as
// an ffi::Error.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "flashcomm/codec.h"
#include "cpu/cpu_alloc.h"
#include "cpu/cpu_codec.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_fp.h"
#include "cpu/cpu_norm.h"
#include "cpu/cpu_rotation.h"
#include "cpu/cpu_spikes.h"
#include "cpu/cpu_sum_lanes.h"

#if !defined(FLASHCOMM_ISA) || !defined(FLASHCOMM_LANES)
#error "compile with -DFLASHCOMM_ISA=isa_<name> -DFLASHCOMM_LANES=<16, 8 or 4>"
#endif
#define FC_STRINGIFY(x) #x
#define FC_STRING(x) FC_STRINGIFY(x)

namespace flashcomm {
inline namespace FLASHCOMM_ISA {
namespace cpu {
namespace {

// Scratch of n values of T (flashcomm_scratch_alloc, freed on scope exit; null when n is 0).
// failed(): the allocation of n > 0 values came back null; bytes: the size asked for.
template <typename T>
struct Scratch {
  explicit Scratch(int64_t n)
      : bytes(n > 0 ? size_t(n) * sizeof(T) : 0),
        data(static_cast<T*>(bytes > 0 ? flashcomm_scratch_alloc(bytes) : nullptr)) {}
  ~Scratch() { std::free(data); }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  bool failed() const { return bytes > 0 && data == nullptr; }
  const size_t bytes;
  T* const data;
};

// The size of the first failed allocation among `scratch`, or 0 when every one succeeded.
template <typename... S>
size_t FailedBytes(const S&... scratch) {
  size_t failed = 0;
  ((failed = failed == 0 && scratch.failed() ? scratch.bytes : failed), ...);
  return failed;
}

// Sign masks of rotation 2 (rotation_sign_masks), or null for rotation 0 and 1 (and when the
// allocation failed: masks.failed()).
struct SignMasks {
  SignMasks(int rotation, int64_t g) : masks(rotation == kRotationSignedHadamard ? g : 0) {
    if (masks.data != nullptr) rotation_sign_masks(g, masks.data);
  }
  const uint32_t* get() const { return masks.data; }
  bool failed() const { return masks.failed(); }
  size_t bytes() const { return masks.bytes; }
  Scratch<uint32_t> masks;
};

template <typename T>
size_t QuantizeAs(const void* x, int64_t n_groups, int64_t g, int bits, int rotation, int spikes,
                  uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  const auto* xs = static_cast<const typename T::Storage*>(x);
  if (spikes == 0 && rotation == kRotationNone) {
    quantize_groups<T>(xs, n_groups, g, bits, codes, scale, zero);
    return 0;
  }
  const SignMasks masks(rotation, g);
  if (masks.failed()) return masks.bytes();
  if (spikes == 0) {
    Scratch<float> buf(g);
    if (buf.failed()) return buf.bytes;
    quantize_groups_rotated<T>(xs, n_groups, g, bits, masks.get(), buf.data, codes, scale, zero);
    return 0;
  }
  // Spikes (any rotation): kQuantizeBatch groups at a time widened (and rotated) into batch,
  // then quantize_spiked_groups writes their records.
  Scratch<int32_t> keys(g);
  Scratch<float> batch(kQuantizeBatch * g);
  if (const size_t failed = FailedBytes(keys, batch)) return failed;
  const int64_t stride = record_bytes(g, bits, spikes);
  const float c = rotation_scale(g);
  for (int64_t k0 = 0; k0 < n_groups; k0 += kQuantizeBatch) {
    const int64_t count = n_groups - k0 < kQuantizeBatch ? n_groups - k0 : kQuantizeBatch;
#ifdef FLASHCOMM_FP_BF16_DIRECT
    if constexpr (std::is_same_v<T, BF16>) {  // one spike, no rotation: not widened
      if (spikes == 1 && rotation == kRotationNone && g % kBf16PerReg == 0 && g < 65536) {
        quantize_bf16_spiked_groups(xs + k0 * g, count, g, bits,
                                    reinterpret_cast<uint16_t*>(batch.data), codes + k0 * stride,
                                    stride, scale + k0, zero + k0);
        continue;
      }
    }
#endif
    for (int64_t j = 0; j < count; ++j) {
      const typename T::Storage* group = xs + (k0 + j) * g;
      float* v = batch.data + j * g;
      if (rotation != kRotationNone && g >= kLanes) {
        rotate_group<T>(group, g, c, masks.get(), nullptr, v);
      } else {
        load_group<T>(group, g, v);
        if (rotation != kRotationNone) rotate_small(v, g, c, masks.get(), nullptr);
      }
    }
    quantize_spiked_groups(batch.data, count, g, bits, spikes, keys.data, codes + k0 * stride,
                           stride, scale + k0, zero + k0);
  }
  return 0;
}

// Dequantize: plain groups straight into T; rotated groups fused per group; with spikes:
// decode, put the spikes back, rotate back, saturate, store.
template <typename T>
size_t DequantizeAs(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                    int64_t n_groups, int64_t g, int bits, int rotation, int spikes, void* y) {
  auto* ys = static_cast<typename T::Storage*>(y);
  const SignMasks masks(rotation, g);
  if (masks.failed()) return masks.bytes();
  const int64_t stride = record_bytes(g, bits, spikes);
  if (rotation == kRotationNone) {  // the plain loops (then any spikes stored over their values)
    dequantize_groups<T>(codes, scale, zero, n_groups, g, bits, nullptr, ys, stride);
    for (int64_t k = 0; spikes > 0 && k < n_groups; ++k) {
      store_spikes_over<T>(codes + k * stride + group_bytes(g, bits), spikes, g, ys + k * g);
    }
    return 0;
  }
  Scratch<float> buf(g);
  if (buf.failed()) return buf.bytes;
  if (spikes == 0) {
    dequantize_groups_rotated<T>(codes, scale, zero, n_groups, g, bits, masks.get(), buf.data,
                                 ys);
    return 0;
  }
  for (int64_t k = 0; k < n_groups; ++k) {
    decode_spiked_group(codes + k * stride, scale[k], zero[k], g, bits, spikes, buf.data);
    unrotate_group(buf.data, g, masks.get());
    store_group<T>(buf.data, g, /*saturating=*/true, ys + k * g);
  }
  return 0;
}

// Sum over the chunk axis in order 0..n-1, in f32, of chunk c's group k, into buf.
// Each chunk after the first is decoded into the sum in one pass (add_spiked with spikes).
void SumGroup(const PayloadView& in, int64_t batch, int64_t k, float* buf) {
  bool chunks_finite = true;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
    const uint8_t* rec = in.codes + group * in.group_bytes;
    if (in.spikes > 0 && c > 0) {  // decoded into the sum in one pass
      add_spiked(rec + group_bytes(in.group_size, in.bits), in.spikes, in.group_size, buf,
                 [&](float* acc) {
                   decode_group(rec, in.scale[group], in.zero[group], in.group_size, in.bits,
                                true, acc);
                 });
    } else if (in.spikes > 0) {
      decode_spiked_group(rec, in.scale[group], in.zero[group], in.group_size, in.bits,
                          in.spikes, buf);
    } else {
      decode_group(rec, in.scale[group], in.zero[group], in.group_size, in.bits, c > 0, buf);
    }
    chunks_finite = chunks_finite && is_finite(bf16_to_float(in.scale[group]));
  }
  if (!chunks_finite) return;
  // The overflow fallback of codec.h (sum_shift): rare, so scalar, and skipped when no partial
  // sum can overflow: the chunks' decoded values are within [zero, top] of their group
  // (decoding is monotonic), and the magnitudes' sum, rounded up, stays below FLT_MAX.
  double bound = 0.0;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
    const GroupParams p = stored_params(in.scale[group], in.zero[group]);
    const double top = double(p.zero) + double(max_code(in.bits)) * double(p.scale);
    const double zero_mag = p.zero < 0.0f ? -double(p.zero) : double(p.zero);
    double mag = top > zero_mag ? top : zero_mag;
    const uint8_t* spikes = in.codes + group * in.group_bytes + group_bytes(in.group_size, in.bits);
    for (int j = 0; j < in.spikes; ++j) {  // spikes replace values: any finite bf16
      const double v = double(spike_value(spikes, j));
      mag = (v < 0.0 ? -v : v) > mag ? (v < 0.0 ? -v : v) : mag;
    }
    bound += mag;
  }
  if (bound * (1.0 + 1e-6) < double(kFltMax) / 2.0) return;
  const int s = sum_shift(in.chunks);
  const float down = pow2f(-s), up = pow2f(s);
  for (int64_t i = 0; i < in.group_size; i += kBlock) {
    bool overflowed = false;
    for (int j = 0; j < kBlock; ++j) overflowed = overflowed || !is_finite(buf[i + j]);
    if (!overflowed) continue;
    float scaled[kBlock] = {};
    for (int64_t c = 0; c < in.chunks; ++c) {
      const int64_t group = (batch * in.chunks + c) * in.groups_per_chunk + k;
      const GroupParams p = stored_params(in.scale[group], in.zero[group]);
      float decoded[kBlock];
      decode_spiked_block(in.codes + group * in.group_bytes, p, in.group_size, in.bits,
                          in.spikes, i / kBlock, decoded);
      for (int j = 0; j < kBlock; ++j) {
        const float d = mul_rn(decoded[j], down);
        scaled[j] = c == 0 ? d : add_rn(scaled[j], d);
      }
    }
    for (int j = 0; j < kBlock; ++j) {
      if (!is_finite(buf[i + j])) buf[i + j] = mul_rn(scaled[j], up);
    }
  }
}

// Sums in the rotated domain; with rotation, the inverse rotation runs once on the sum.
template <typename T>
size_t DequantizeSumAs(const PayloadView& in, int rotation, void* y, int64_t begin,
                       int64_t end) {
  auto* ys = static_cast<typename T::Storage*>(y);
  Scratch<float> buf(in.group_size);
  if (const size_t failed = FailedBytes(buf)) return failed;
  const SignMasks masks(rotation, in.group_size);
  if (masks.failed()) return masks.bytes();
  for (int64_t o = begin; o < end; ++o) {  // o = b * groups_per_chunk + k
    SumGroup(in, o / in.groups_per_chunk, o % in.groups_per_chunk, buf.data);
    typename T::Storage* out = ys + o * in.group_size;
    if (rotation != kRotationNone) {
      unrotate_store_group<T>(buf.data, in.group_size, masks.get(), out);  // the store fused in
    } else {
      store_group<T>(buf.data, in.group_size, /*saturating=*/false, out);
    }
  }
  return 0;
}

size_t DequantizeSumQuantize(const PayloadView& in, int out_bits, int out_spikes,
                             uint8_t* codes, uint16_t* scale, uint16_t* zero, int64_t begin,
                             int64_t end) {
  const int64_t out_nbytes = record_bytes(in.group_size, out_bits, out_spikes);
  const int64_t gpc = in.groups_per_chunk;
  // kQuantizeBatch sums at a time, quantized together (spikes first taken out)
  Scratch<float> sums(kQuantizeBatch * in.group_size);
  Scratch<int32_t> keys(out_spikes > 0 ? in.group_size : 0);
  if (const size_t failed = FailedBytes(sums, keys)) return failed;
  for (int64_t o0 = begin; o0 < end; o0 += kQuantizeBatch) {  // o = b * groups_per_chunk + k
    const int64_t m = end - o0 < kQuantizeBatch ? end - o0 : kQuantizeBatch;
    for (int64_t i = 0; i < m; ++i) {
      SumGroup(in, (o0 + i) / gpc, (o0 + i) % gpc, sums.data + i * in.group_size);
    }
    if (out_spikes > 0) {
      quantize_spiked_groups(sums.data, m, in.group_size, out_bits, out_spikes, keys.data,
                             codes + o0 * out_nbytes, out_nbytes, scale + o0, zero + o0);
    } else {
      quantize_groups<F32>(sums.data, m, in.group_size, out_bits, codes + o0 * out_nbytes,
                           scale + o0, zero + o0);
    }
  }
  return 0;
}

template <typename T>
size_t DequantizeIntoAs(const uint8_t* codes, const uint16_t* scale, const uint16_t* zero,
                        int64_t g, int bits, int rotation, int spikes, int64_t count,
                        void* out) {
  using S = typename T::Storage;
  S* y = static_cast<S*>(out);
  const int64_t full = count / g;
  const int64_t tail = count - full * g;
  const int64_t stride = record_bytes(g, bits, spikes);
  Scratch<S> last(tail > 0 ? g : 0);
  if (last.failed()) return last.bytes;
  if (full > 0) {
    if (const size_t failed =
            DequantizeAs<T>(codes, scale, zero, full, g, bits, rotation, spikes, y)) {
      return failed;
    }
  }
  if (tail > 0) {
    if (const size_t failed = DequantizeAs<T>(codes + full * stride, scale + full, zero + full,
                                              1, g, bits, rotation, spikes, last.data)) {
      return failed;
    }
    std::memcpy(y + full * g, last.data, size_t(tail) * sizeof(S));
  }
  return 0;
}

// dtype dispatch of the templates above.
template <template <typename> class Op, typename... Args>
size_t ByDType(DType dtype, Args... args) {
  switch (dtype) {
    case DType::kF32: return Op<F32>::run(args...);
    case DType::kBF16: return Op<BF16>::run(args...);
    default: return Op<F16>::run(args...);
  }
}
template <typename T> struct QuantizeOp { template <typename... A> static size_t run(A... a) { return QuantizeAs<T>(a...); } };
template <typename T> struct DequantizeOp { template <typename... A> static size_t run(A... a) { return DequantizeAs<T>(a...); } };
template <typename T> struct DequantizeSumOp { template <typename... A> static size_t run(A... a) { return DequantizeSumAs<T>(a...); } };
template <typename T> struct DequantizeIntoOp { template <typename... A> static size_t run(A... a) { return DequantizeIntoAs<T>(a...); } };

size_t Quantize(DType dtype, const void* x, int64_t n_groups, int64_t g, int bits,
                int rotation, int spikes, uint8_t* codes, uint16_t* scale, uint16_t* zero) {
  return ByDType<QuantizeOp>(dtype, x, n_groups, g, bits, rotation, spikes, codes, scale, zero);
}
size_t Dequantize(DType dtype, const uint8_t* codes, const uint16_t* scale,
                  const uint16_t* zero, int64_t n_groups, int64_t g, int bits, int rotation,
                  int spikes, void* y) {
  return ByDType<DequantizeOp>(dtype, codes, scale, zero, n_groups, g, bits, rotation, spikes, y);
}
size_t DequantizeSum(DType dtype, const PayloadView& in, int rotation, void* y,
                     int64_t begin, int64_t end) {
  return ByDType<DequantizeSumOp>(dtype, in, rotation, y, begin, end);
}
size_t DequantizeInto(DType dtype, const uint8_t* codes, const uint16_t* scale,
                      const uint16_t* zero, int64_t g, int bits, int rotation, int spikes,
                      int64_t count, void* y) {
  return ByDType<DequantizeIntoOp>(dtype, codes, scale, zero, g, bits, rotation, spikes, count, y);
}

// The fused residual add + RMSNorm (cpu_dispatch.h NormArgs, docs/fused_norm.md), rows
// [begin, end) in tiles of about kNormTile values: the tile's groups are decoded to f32 (the
// dequantize of a payload as f32, rotation and spikes included), then per row the residual
// add and the sum of squares (one pass), then the scaling by the weight (a second pass over
// the row in L1); with a quantized output the tile's normalised rows are quantized from L1.
// Values per tile: the tile's decoded f32 values (64 KB) stay in L2 between the passes, and each
// tile costs one dequantize call (its setup and scratch).
constexpr int64_t kNormTile = 16384;

template <typename T, typename W>
size_t AddRmsNormAs(const NormArgs& a, int64_t begin, int64_t end) {
  using S = typename T::Storage;
  const int64_t h = a.hidden, g = a.group_size;
  const int64_t tile = h >= kNormTile ? 1 : kNormTile / h;
  Scratch<float> dec(((tile * h + g - 1) / g + 1) * g);
  Scratch<S> normed(a.out == nullptr ? tile * h : 0);
  if (const size_t failed = FailedBytes(dec, normed)) return failed;
  const float inv_h = 1.0f / float(h), eps_h = mul_rn(a.eps, float(h));
  const int64_t stride = record_bytes(g, a.bits, a.spikes);
  const auto* res = static_cast<const S*>(a.residual);
  const auto* w = static_cast<const typename W::Storage*>(a.weight);
  auto* new_res = static_cast<S*>(a.new_residual);
  auto* out = static_cast<S*>(a.out);
  for (int64_t r0 = begin; r0 < end; r0 += tile) {
    const int64_t rows = end - r0 < tile ? end - r0 : tile;
    const int64_t first = r0 * h / g, last = ((r0 + rows) * h + g - 1) / g;
    if (const size_t failed = DequantizeAs<F32>(a.codes + first * stride, a.scale + first,
                                                a.zero + first, last - first, g, a.bits,
                                                a.rotation, a.spikes, dec.data)) {
      return failed;
    }
    for (int64_t k = 0; k < rows; ++k) {
      const int64_t row = r0 + k;
      float* d = dec.data + (row * h - first * g);
      const float inv_rms = add_residual_row<T>(d, res + row * h, h, inv_h, eps_h,
                                                new_res + row * h);
      scale_row<T, W>(d, inv_rms, w, h, out != nullptr ? out + row * h : normed.data + k * h);
    }
    if (out == nullptr) {
      const int64_t og = a.out_group_size, o0 = r0 * h / og;
      if (const size_t failed = QuantizeAs<T>(
              normed.data, rows * h / og, og, a.out_bits, kRotationNone, 0,
              a.out_codes + o0 * record_bytes(og, a.out_bits, 0), a.out_scale + o0,
              a.out_zero + o0)) {
        return failed;
      }
    }
  }
  return 0;
}

template <typename T>
size_t AddRmsNormW(const NormArgs& a, int64_t begin, int64_t end) {
  return a.wtype == DType::kBF16 ? AddRmsNormAs<T, BF16>(a, begin, end)
                                 : AddRmsNormAs<T, F32>(a, begin, end);
}

size_t AddRmsNorm(const NormArgs& a, int64_t begin, int64_t end) {
  switch (a.dtype) {
    case DType::kF32: return AddRmsNormW<F32>(a, begin, end);
    case DType::kBF16: return AddRmsNormW<BF16>(a, begin, end);
    default: return AddRmsNormW<F16>(a, begin, end);
  }
}

// ---- the floating-point formats (cpu_fp.h) ----

// Group k of x widened (and rotated) into buf, as QuantizeAs does.
template <typename T>
void LoadRotated(const typename T::Storage* group, int64_t g, int rotation, const SignMasks& masks,
                 float* buf) {
  if (rotation != kRotationNone && g >= kLanes) {
    rotate_group<T>(group, g, rotation_scale(g), masks.get(), nullptr, buf);
  } else {
    load_group<T>(group, g, buf);
    if (rotation != kRotationNone) rotate_small(buf, g, rotation_scale(g), masks.get(), nullptr);
  }
}

template <typename T>
struct FpQuantizeOp {
  static size_t run(const void* x, int64_t n_groups, int64_t g, int32_t format, int rotation,
                    int spikes, uint8_t* records) {
    const auto* xs = static_cast<const typename T::Storage*>(x);
    const SignMasks masks(rotation, g);
    Scratch<float> buf(g);
    Scratch<int32_t> keys(spikes > 0 ? g : 0);
    if (const size_t failed = FailedBytes(masks.masks, buf, keys)) return failed;
    const int64_t stride = fp_record_bytes(format, g, spikes);
    // Groups `per` at a time through `batch` (`floats` of scratch): `plain` reads them where
    // they lie (no rotation), `loaded` takes them widened and rotated into the batch.
    const auto in_batches = [&](int64_t floats, int64_t per, auto plain, auto loaded) -> size_t {
      Scratch<float> batch(floats);
      if (batch.failed()) return batch.bytes;
      for (int64_t k0 = 0; k0 < n_groups; k0 += per) {
        const int64_t count = n_groups - k0 < per ? n_groups - k0 : per;
        uint8_t* out = records + k0 * stride;
        if (rotation == kRotationNone) {
          plain(xs + k0 * g, count, batch.data, out);
          continue;
        }
        for (int64_t j = 0; j < count; ++j) {
          LoadRotated<T>(xs + (k0 + j) * g, g, rotation, masks, batch.data + j * g);
        }
        loaded(batch.data, count, out);
      }
      return 0;
    };
    // The batch loops where they take g (fp8: kLanes groups, widened with their maxima in one
    // pass; the four-bit formats: kLanes blocks; spikes first taken out of the batch)
    if (const int64_t batch_groups = fp_batch_groups(format, g); batch_groups > 0) {
      const auto loaded = [&](float* batch, int64_t count, uint8_t* out) {
        if (spikes > 0) {
          fp_quantize_spiked_groups(batch, count, g, format, spikes, keys.data, out, stride);
        } else {
          fp_quantize_groups(batch, count, g, format, out, stride);
        }
      };
      return in_batches(
          fp_batch_floats(format, g), batch_groups,
          [&](const auto* x, int64_t count, float* batch, uint8_t* out) {
            if (spikes > 0) {
              fp_quantize_spiked_batch<T>(x, count, g, format, spikes, batch, keys.data, out,
                                          stride);
            } else if (format == kFormatFp8) {
              fp8_quantize_batch<T>(x, count, g, batch, out, stride);
            } else {
              fp4_quantize_batch<T>(x, count, g, format, batch, out, stride);
            }
          },
          loaded);
    }
    for (int64_t k = 0; k < n_groups; ++k) {
      LoadRotated<T>(xs + k * g, g, rotation, masks, buf.data);
      fp_quantize_group(buf.data, g, format, spikes, keys.data, records + k * stride);
    }
    return 0;
  }
};

size_t FpQuantize(DType dtype, const void* x, int64_t n_groups, int64_t g, int32_t format,
                  int rotation, int spikes, uint8_t* records) {
  return ByDType<FpQuantizeOp>(dtype, x, n_groups, g, format, rotation, spikes, records);
}

template <typename T>
struct FpDequantizeOp {
  static size_t run(const uint8_t* records, int64_t n_groups, int64_t g, int32_t format,
                    int rotation, int spikes, void* y) {
    auto* ys = static_cast<typename T::Storage*>(y);
    const SignMasks masks(rotation, g);
    Scratch<float> buf(g);
    if (const size_t failed = FailedBytes(masks.masks, buf)) return failed;
    const FpTables tables;
    const int64_t stride = fp_record_bytes(format, g, spikes);
    // bf16 / f32 in one pass where the records allow it (fp8_decode_store, fp4_decode_store),
    // then the spikes stored over their positions' values, as store_group stores them
    const bool plain = rotation == kRotationNone;
#if defined(FC_FP8_DECODE_STORE)
    const bool direct8 = plain && format == kFormatFp8 && g % 16 == 0;
#endif
    const bool direct4 = plain && format != kFormatFp8;
    const int64_t spikes_at = fp_code_bytes(format, g) + fp_scale_bytes(format, g);
    for (int64_t k = 0; k < n_groups; ++k) {
      const uint8_t* rec = records + k * stride;
      bool direct = false;
#if defined(FC_FP8_DECODE_STORE)
      direct = direct8 && fp8_decode_store<T>(rec, g, ys + k * g);
#endif
      direct = direct || (direct4 && fp4_decode_store<T>(rec, g, format, tables.e4m3, ys + k * g));
      if (direct) {
        store_spikes_over<T>(rec + spikes_at, spikes, g, ys + k * g);
        continue;
      }
      fp_decode_group(rec, g, format, spikes, tables, buf.data);
      if (rotation != kRotationNone) unrotate_group(buf.data, g, masks.get());
      store_group<T>(buf.data, g, /*saturating=*/true, ys + k * g);
    }
    return 0;
  }
};

size_t FpDequantize(DType dtype, const uint8_t* records, int64_t n_groups, int64_t g,
                    int32_t format, int rotation, int spikes, void* y) {
  return ByDType<FpDequantizeOp>(dtype, records, n_groups, g, format, rotation, spikes, y);
}

// Output group o's f32 sum over the chunks, in chunk order, into acc: each chunk after the
// first decoded into the sum in the same pass.
void FpSumGroup(const FpChunks& in, int64_t o, const FpTables& t, float* acc) {
  const int64_t g = in.group_size, stride = fp_record_bytes(in.format, g, in.spikes);
  const int64_t batch = o / in.groups_per_chunk, k = o % in.groups_per_chunk;
  for (int64_t c = 0; c < in.chunks; ++c) {
    const uint8_t* rec = in.codes + ((batch * in.chunks + c) * in.groups_per_chunk + k) * stride;
    if (c == 0) {
      fp_decode_group(rec, g, in.format, in.spikes, t, acc);
      continue;
    }
    // decoded into the sum in one pass
    add_spiked(rec + fp_code_bytes(in.format, g) + fp_scale_bytes(in.format, g), in.spikes, g,
               acc, [&](float* sum) {
                 fp_decode_group</*kAdd=*/true>(rec, g, in.format, 0, t, sum);
               });
  }
}

template <typename T>
struct FpDequantizeSumOp {
  static size_t run(const FpChunks& in, int rotation, void* y, int64_t begin, int64_t end) {
    auto* ys = static_cast<typename T::Storage*>(y);
    const int64_t g = in.group_size;
    const SignMasks masks(rotation, g);
    Scratch<float> acc(g);
    if (const size_t failed = FailedBytes(masks.masks, acc)) return failed;
    const FpTables tables;
    for (int64_t o = begin; o < end; ++o) {
      FpSumGroup(in, o, tables, acc.data);
      if (rotation != kRotationNone) unrotate_group(acc.data, g, masks.get());
      store_group<T>(acc.data, g, /*saturating=*/true, ys + o * g);
    }
    return 0;
  }
};

size_t FpDequantizeSum(DType dtype, const FpChunks& in, int rotation, void* y, int64_t begin,
                       int64_t end) {
  return ByDType<FpDequantizeSumOp>(dtype, in, rotation, y, begin, end);
}

// The sums re-quantized, `per` at a time into a batch that the quantize's batch loops encode
// together, spikes first taken out (the same bytes as one group at a time).
size_t FpDequantizeSumQuantize(const FpChunks& in, int32_t out_format, int out_spikes,
                               uint8_t* records, int64_t begin, int64_t end) {
  const int64_t g = in.group_size, stride = fp_record_bytes(out_format, g, out_spikes);
  const int64_t batch_groups = fp_batch_groups(out_format, g);  // 0: one group at a time
  const int64_t per = batch_groups > 0 ? batch_groups : 1;
  Scratch<float> acc(batch_groups > 0 ? fp_batch_floats(out_format, g) : g);
  Scratch<int32_t> keys(out_spikes > 0 ? g : 0);
  if (const size_t failed = FailedBytes(acc, keys)) return failed;
  const FpTables tables;
  for (int64_t o0 = begin; o0 < end; o0 += per) {
    const int64_t count = end - o0 < per ? end - o0 : per;
    for (int64_t j = 0; j < count; ++j) {
      FpSumGroup(in, o0 + j, tables, acc.data + j * g);
    }
    uint8_t* out = records + o0 * stride;
    if (batch_groups == 0) {
      fp_quantize_group(acc.data, g, out_format, out_spikes, keys.data, out);
    } else if (out_spikes > 0) {
      fp_quantize_spiked_groups(acc.data, count, g, out_format, out_spikes, keys.data, out, stride);
    } else {
      fp_quantize_groups(acc.data, count, g, out_format, out, stride);
    }
  }
  return 0;
}

}  // namespace

// This build's table (declared per ISA in ffi/cpu/dispatch.cc).
const CodecKernels& isa_kernels() {
  // The build's name: FLASHCOMM_ISA without its "isa_" prefix.
  static const CodecKernels table = {FC_STRING(FLASHCOMM_ISA) + 4, Quantize, Dequantize, DequantizeSum,
                                     DequantizeSumQuantize, DequantizeInto,
                                     AddRmsNorm, FpQuantize, FpDequantize,
                                     FpDequantizeSum, FpDequantizeSumQuantize, sum_ranks};
  return table;
}

}  // namespace cpu
}  // inline namespace FLASHCOMM_ISA
}  // namespace flashcomm
