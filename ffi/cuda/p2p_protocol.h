// long file: the three collectives' protocols on CUDA and the steps they share (checks, peer
// copies, codec launches)
// The CUDA collectives' protocols, shared by the two ways ranks meet (docs/cuda.md):
//   - in one process with several GPUs (p2p_handlers.cc: the host-side rendezvous of
//     p2p_rendezvous.h, device pointers and CUDA events shared in memory);
//   - across processes on one host, one GPU each (shm_handlers.cc: the CPU module's
//     shared-memory meeting point, CUDA IPC memory and event handles).
// The protocols are the CPU ones (cpu_p2p_protocol.h): the same barriers, codec calls and rank
// order, so the codes are the CPU transport's. A protocol is written once against a
// Participant P, which provides
//   ffi::Error Record();                     // mark what this rank's stream did so far
//   ffi::Error Meet(int barrier, const void* codes, const void* scale, const void* zero,
//                   int64_t groups, int64_t nb);  // publish a payload of `groups` records of
//                                                 // nb bytes (or nothing), wait for every rank,
//                                                 // then order this stream after their Record
//   const std::vector<p2p::Published>& peers() const;  // their payloads, readable from here
//   cudaError_t Copy(cudaStream_t, void* dst, int j, const void* src, size_t bytes);
//   ffi::Error Prepare();                    // after the first Meet: peer access
//   int size() const;
// Plain C++ with the CUDA runtime API (host compiler).
#ifndef FLASHCOMM_CUDA_P2P_PROTOCOL_H_
#define FLASHCOMM_CUDA_P2P_PROTOCOL_H_

#include <cuda_runtime_api.h>

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "flashcomm/codec.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "launch.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cuda {
namespace protocol {

namespace ffi = xla::ffi;
using Clock = std::chrono::steady_clock;
using p2p::Published;

inline constexpr size_t kAlign = 256;
inline size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// `slots` payloads of `groups` records of `nb` bytes, as one chunked payload in working memory
// (codes, scale and zero each 256-byte aligned: the kernels read 2-byte scales).
struct ScratchPayload {
  uint8_t* codes = nullptr;
  uint16_t* scale = nullptr;
  uint16_t* zero = nullptr;
};

inline ffi::Error AllocateWork(const char* op, int device, int64_t site, int64_t group,
                               int64_t slots, int64_t groups, int64_t nb, ScratchPayload* out) {
  const size_t codes = AlignUp(size_t(slots * groups * nb));
  const size_t params = AlignUp(size_t(slots * groups) * 2);
  const size_t bytes = codes + 2 * params;
  if (bytes == 0) return ffi::Error::Success();
  void* mem = nullptr;
  FLASHCOMM_CUDA_TRY(op, "allocating " + std::to_string(bytes) + " bytes of working memory",
                     Workspace(device, site, group, bytes, &mem));
  auto* base = static_cast<uint8_t*>(mem);
  out->codes = base;
  out->scale = reinterpret_cast<uint16_t*>(base + codes);
  out->zero = reinterpret_cast<uint16_t*>(base + codes + params);
  return ffi::Error::Success();
}

// `groups` records (codes, scale, zero) of rank j's payload into this rank's memory, on `stream`.
template <class P>
cudaError_t CopyRecords(P& me, cudaStream_t stream, uint8_t* dst_codes, uint16_t* dst_scale,
                        uint16_t* dst_zero, int j, const uint8_t* src_codes,
                        const uint16_t* src_scale, const uint16_t* src_zero, int64_t groups,
                        int64_t nb) {
  if (groups == 0) return cudaSuccess;
  if (cudaError_t e = me.Copy(stream, dst_codes, j, src_codes, size_t(groups * nb));
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = me.Copy(stream, dst_scale, j, src_scale, size_t(groups) * 2);
      e != cudaSuccess) {
    return e;
  }
  return me.Copy(stream, dst_zero, j, src_zero, size_t(groups) * 2);
}

// Records [first, first + groups) of every rank's payload published at the last barrier, one
// slot per rank in rank order, into `dst` (slots of `groups` records): the chunked input of
// the fused sum kernels (first = rank * gpc), or every payload for the all-gather (first 0).
template <class P>
ffi::Error GatherFromPeers(const char* op, cudaStream_t stream, P& me, int64_t first,
                           int64_t groups, int64_t nb, const ScratchPayload& dst, int skip) {
  const std::vector<Published>& peers = me.peers();
  for (int j = 0; j < me.size(); ++j) {
    if (j == skip) continue;
    FLASHCOMM_CUDA_TRY(op, "copying from a peer",
                       CopyRecords(me, stream, dst.codes + j * groups * nb,
                                   dst.scale + j * groups, dst.zero + j * groups, j,
                                   static_cast<const uint8_t*>(peers[j][0]) + first * nb,
                                   static_cast<const uint16_t*>(peers[j][1]) + first,
                                   static_cast<const uint16_t*>(peers[j][2]) + first, groups,
                                   nb));
  }
  return ffi::Error::Success();
}

// --- the codec launchers, the instance picked on the host as in codec_handlers.cc ---

template <typename T>
struct Tag {
  using type = T;
};

template <typename Launch>
inline cudaError_t ForType(ffi::DataType dtype, Launch launch) {
  switch (dtype) {
    case ffi::F32:
      return launch(Tag<F32>{});
    case ffi::BF16:
      return launch(Tag<BF16>{});
    default:  // F16: checked by CheckCommon
      return launch(Tag<F16>{});
  }
}

inline cudaError_t Quantize(ffi::DataType dtype, cudaStream_t stream, const void* x, int64_t n_groups,
                     int64_t g, int bits, int rotation, int spikes, uint8_t* c, uint16_t* s,
                     uint16_t* z) {
  return ForType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchQuantizeRotated<T, true>(stream, x, n_groups, g, bits, rotation,
                                                         spikes, c, s, z)
                        : LaunchQuantizeRotated<T, false>(stream, x, n_groups, g, bits,
                                                          rotation, 0, c, s, z);
    }
    return spikes > 0 ? LaunchQuantize<T, true>(stream, x, n_groups, g, bits, spikes, c, s, z)
                      : LaunchQuantize<T, false>(stream, x, n_groups, g, bits, 0, c, s, z);
  });
}

inline cudaError_t Dequantize(ffi::DataType dtype, cudaStream_t stream, const uint8_t* c,
                       const uint16_t* s, const uint16_t* z, int64_t n_groups, int64_t g,
                       int bits, int rotation, int spikes, void* y) {
  return ForType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return spikes > 0 ? LaunchDequantizeRotated<T, true>(stream, c, s, z, n_groups, g, bits,
                                                           rotation, spikes, y)
                        : LaunchDequantizeRotated<T, false>(stream, c, s, z, n_groups, g, bits,
                                                            rotation, 0, y);
    }
    return spikes > 0 ? LaunchDequantize<T, true>(stream, c, s, z, n_groups, g, bits, spikes, y)
                      : LaunchDequantize<T, false>(stream, c, s, z, n_groups, g, bits, 0, y);
  });
}

inline cudaError_t DequantizeSum(ffi::DataType dtype, cudaStream_t stream, const PayloadView& in,
                          int rotation, void* y) {
  return ForType(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (rotation != kRotationNone) {
      return in.spikes > 0 ? LaunchDequantizeSumRotated<T, true>(stream, in, rotation, y)
                           : LaunchDequantizeSumRotated<T, false>(stream, in, rotation, y);
    }
    return in.spikes > 0 ? LaunchDequantizeSum<T, true>(stream, in, y)
                         : LaunchDequantizeSum<T, false>(stream, in, y);
  });
}

inline cudaError_t DequantizeSumQuantize(cudaStream_t stream, const PayloadView& in, int out_bits,
                                  int out_spikes, uint8_t* c, uint16_t* s, uint16_t* z) {
  const auto launch = in.spikes > 0
                          ? (out_spikes > 0 ? LaunchDequantizeSumQuantize<true, true>
                                            : LaunchDequantizeSumQuantize<true, false>)
                          : (out_spikes > 0 ? LaunchDequantizeSumQuantize<false, true>
                                            : LaunchDequantizeSumQuantize<false, false>);
  return launch(stream, in, in.batch * in.groups_per_chunk, out_bits, out_spikes, c, s, z);
}

inline PayloadView View(const ScratchPayload& p, int64_t chunks, int64_t gpc, int64_t group_size,
                 int bits, int spikes) {
  PayloadView view;
  view.codes = p.codes;
  view.scale = p.scale;
  view.zero = p.zero;
  view.batch = 1;
  view.chunks = chunks;
  view.groups_per_chunk = gpc;
  view.group_size = group_size;
  view.group_bytes = record_bytes(group_size, bits, spikes);
  view.bits = bits;
  view.spikes = spikes;
  return view;
}

// Attribute checks shared by the three handlers (host only, before any CUDA call).
inline ffi::Error CheckCommon(const char* op, ffi::DataType dtype, int64_t size, int64_t timeout_ms,
                       int32_t rotation, int64_t group_size) {
  if (size < 1 || size > 1024) {
    return ffi::Error::InvalidArgument(std::string(op) + ": size must be in 1..1024");
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": timeout_ms must be positive");
  }
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard ||
      (rotation != kRotationNone &&
       ((group_size & (group_size - 1)) != 0 || group_size > kMaxRotatedGroup))) {
    return ffi::Error::InvalidArgument(
        std::string(op) + ": rotation must be 0, 1 or 2, and needs a power-of-two group_size "
        "of at most 1024 on CUDA");
  }
  if (dtype != ffi::F32 && dtype != ffi::BF16 && dtype != ffi::F16) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32, bf16 or f16");
  }
  return ffi::Error::Success();
}

// What every handler does first, after its shape checks: the device of `stream` made current,
// the rank and group read, the rank checked.
inline ffi::Error Start(const char* op, cudaStream_t stream, ffi::Buffer<ffi::S32> rank_buf,
                 ffi::Buffer<ffi::S32> group_buf, int64_t size, Clock::time_point deadline,
                 CurrentDevice* on, int* device, int32_t* rank, int32_t* group) {
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank and group must be scalars");
  }
  FLASHCOMM_CUDA_TRY(op, "cudaStreamGetDevice", cudaStreamGetDevice(stream, device));
  FLASHCOMM_CUDA_TRY(op, "cudaSetDevice", on->Set(*device));
  if (ffi::Error e = ReadRankAndGroup(op, stream, rank_buf.typed_data(), group_buf.typed_data(),
                                      deadline, rank, group);
      e.failure()) {
    return e;
  }
  if (*rank < 0 || *rank >= size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(*rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  return ffi::Error::Success();
}


// The operands and options of one quantized collective, checked by the handler.
struct Codec {
  ffi::DataType dtype = ffi::F32;
  int64_t n_groups = 0, group_size = 0;
  int bits = 0, out_bits = 0, rotation = 0, spikes = 0, out_spikes = 0;
};

// The shape and attribute checks of each collective (host only, before any CUDA call); they
// fill `k`.
inline ffi::Error CheckAllReduce(const char* op, const ffi::AnyBuffer& x, const ffi::AnyBuffer& y,
                                 const ffi::Buffer<ffi::U8>& p1_codes,
                                 const ffi::Buffer<ffi::BF16>& p1_scale,
                                 const ffi::Buffer<ffi::BF16>& p1_zero,
                                 const ffi::Buffer<ffi::U8>& p2_codes,
                                 const ffi::Buffer<ffi::BF16>& p2_scale,
                                 const ffi::Buffer<ffi::BF16>& p2_zero, int32_t bits,
                                 int32_t out_bits, int64_t group_size, int32_t rotation,
                                 int32_t spikes, int32_t out_spikes, int64_t size,
                                 int64_t timeout_ms, Codec* k, bool* decode) {
  const ffi::DataType dtype = x.element_type();
  if (ffi::Error e = CheckCommon(op, dtype, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return e;
  }
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, p1_codes, p1_scale, p1_zero, bits, group_size,
                                         spikes, &n_groups);
      e.failure()) {
    return e;
  }
  int64_t n_out = 0;
  // An empty y: the caller decodes the gathered phase-2 payload itself (the fused epilogue,
  // docs/fused_norm.md), so step 3 stops after the gather.
  *decode = y.element_count() != 0;
  if (ffi::Error e = CheckQuantizeShapes(*decode ? y : x, p2_codes, p2_scale, p2_zero, out_bits,
                                         group_size, out_spikes, &n_out);
      e.failure()) {
    return e;
  }
  if (n_out != n_groups || n_groups % size != 0 || (*decode && y.element_type() != dtype)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": y or the group count do not "
                                       "match x and the group size");
  }
  *k = Codec{dtype, n_groups, group_size, bits, out_bits, rotation, spikes, out_spikes};
  return ffi::Error::Success();
}

// x and its one payload (codes, scale, zero) of a reduce-scatter or all-gather; fills `k`.
inline ffi::Error CheckOnePayload(const char* op, const ffi::AnyBuffer& x,
                                  const ffi::Buffer<ffi::U8>& codes,
                                  const ffi::Buffer<ffi::BF16>& scale,
                                  const ffi::Buffer<ffi::BF16>& zero, int32_t bits,
                                  int64_t group_size, int32_t rotation, int32_t spikes,
                                  int64_t size, int64_t timeout_ms, Codec* k) {
  const ffi::DataType dtype = x.element_type();
  if (ffi::Error e = CheckCommon(op, dtype, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return e;
  }
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, codes, scale, zero, bits, group_size, spikes,
                                         &n_groups);
      e.failure()) {
    return e;
  }
  *k = Codec{dtype, n_groups, group_size, bits, bits, rotation, spikes, spikes};
  return ffi::Error::Success();
}

// reduce_scatter's operands (y: chunk `rank` of the sum) or all_gather's (y: N copies of x).
inline ffi::Error CheckPayloadCollective(const char* op, bool all_gather, const ffi::AnyBuffer& x,
                                         const ffi::AnyBuffer& y,
                                         const ffi::Buffer<ffi::U8>& codes,
                                         const ffi::Buffer<ffi::BF16>& scale,
                                         const ffi::Buffer<ffi::BF16>& zero, int32_t bits,
                                         int64_t group_size, int32_t rotation, int32_t spikes,
                                         int64_t size, int64_t timeout_ms, Codec* k) {
  if (ffi::Error e = CheckOnePayload(op, x, codes, scale, zero, bits, group_size, rotation,
                                     spikes, size, timeout_ms, k);
      e.failure()) {
    return e;
  }
  if (all_gather) {
    if (y.element_count() != x.element_count() * size || y.element_type() != k->dtype) {
      return ffi::Error::InvalidArgument(std::string(op) + ": y must hold N copies of x");
    }
  } else if (k->n_groups % size != 0 ||
             int64_t(y.element_count()) * size != k->n_groups * group_size ||
             y.element_type() != k->dtype) {
    return ffi::Error::InvalidArgument(std::string(op) + ": y must hold one chunk of x");
  }
  return ffi::Error::Success();
}

// Step 1 of every protocol: quantize the operand into this rank's payload, publish it at
// barrier 0 and wait for every rank's.
template <class P>
ffi::Error QuantizeAndMeet(const char* op, P& me, cudaStream_t stream, const Codec& k,
                           const void* x, uint8_t* c, uint16_t* s, uint16_t* z) {
  FLASHCOMM_CUDA_TRY(op, "quantize launch",
                     Quantize(k.dtype, stream, x, k.n_groups, k.group_size, k.bits, k.rotation,
                              k.spikes, c, s, z));
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(0, c, s, z, k.n_groups, record_bytes(k.group_size, k.bits, k.spikes));
      e.failure()) {
    return e;
  }
  return me.Prepare();
}

// The fused all-reduce (3 barriers): quantize, every rank's chunk `rank` summed and
// re-quantized, the reduced chunks gathered and decoded (decode false: y is the caller's).
template <class P>
ffi::Error AllReduce(const char* op, P& me, cudaStream_t stream, const ScratchPayload& gathered,
                     const Codec& k, int32_t rank, const void* x, void* y, bool decode,
                     uint8_t* c1, uint16_t* s1, uint16_t* z1, uint8_t* c2, uint16_t* s2,
                     uint16_t* z2) {
  const int size = me.size();
  const int64_t gpc = k.n_groups / size;
  const int64_t nb1 = record_bytes(k.group_size, k.bits, k.spikes);
  const int64_t nb2 = record_bytes(k.group_size, k.out_bits, k.out_spikes);
  // 1. Quantize the operand (N chunks) into this rank's phase-1 payload; meet.
  if (ffi::Error e = QuantizeAndMeet(op, me, stream, k, x, c1, s1, z1); e.failure()) return e;
  // 2. This rank's chunk of every peer's payload into scratch, summed in f32 in rank order and
  //    re-quantized into its slot of the gathered phase-2 payload.
  if (ffi::Error e = GatherFromPeers(op, stream, me, rank * gpc, gpc, nb1, gathered, -1);
      e.failure()) {
    return e;
  }
  FLASHCOMM_CUDA_TRY(op, "dequantize_sum_quantize launch",
                     DequantizeSumQuantize(stream, View(gathered, size, gpc, k.group_size,
                                                        k.bits, k.spikes),
                                           k.out_bits, k.out_spikes, c2 + rank * gpc * nb2,
                                           s2 + rank * gpc, z2 + rank * gpc));
  // The event of barrier 1 covers the slot written and this rank's reads of the peers' p1.
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(1, c2, s2, z2, k.n_groups, nb2); e.failure()) return e;
  // 3. Every peer's reduced chunk into its slot, then decode the whole gathered payload.
  const std::vector<Published>& peers = me.peers();
  for (int j = 0; j < size; ++j) {
    if (j == rank) continue;
    FLASHCOMM_CUDA_TRY(op, "copying a peer's reduced chunk",
                       CopyRecords(me, stream, c2 + j * gpc * nb2, s2 + j * gpc, z2 + j * gpc, j,
                                   static_cast<const uint8_t*>(peers[j][0]) + j * gpc * nb2,
                                   static_cast<const uint16_t*>(peers[j][1]) + j * gpc,
                                   static_cast<const uint16_t*>(peers[j][2]) + j * gpc, gpc,
                                   nb2));
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' p2
  if (decode) {
    FLASHCOMM_CUDA_TRY(op, "dequantize launch",
                       Dequantize(k.dtype, stream, c2, s2, z2, k.n_groups, k.group_size,
                                  k.out_bits, k.rotation, k.out_spikes, y));
  }
  // 4. This stream's later work waits until every peer has read this rank's buffers.
  return me.Meet(2, nullptr, nullptr, nullptr, 0, 0);
}

// The reduce-scatter (2 barriers): quantize, every rank's chunk `rank` decoded and summed.
template <class P>
ffi::Error ReduceScatter(const char* op, P& me, cudaStream_t stream,
                         const ScratchPayload& gathered, const Codec& k, int32_t rank,
                         const void* x, void* y, uint8_t* c1, uint16_t* s1, uint16_t* z1) {
  const int size = me.size();
  const int64_t gpc = k.n_groups / size;
  const int64_t nb = record_bytes(k.group_size, k.bits, k.spikes);
  if (ffi::Error e = QuantizeAndMeet(op, me, stream, k, x, c1, s1, z1); e.failure()) return e;
  if (ffi::Error e = GatherFromPeers(op, stream, me, rank * gpc, gpc, nb, gathered, -1);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' payloads
  FLASHCOMM_CUDA_TRY(op, "dequantize_sum launch",
                     DequantizeSum(k.dtype, stream, View(gathered, size, gpc, k.group_size,
                                                         k.bits, k.spikes),
                                   k.rotation, y));
  return me.Meet(1, nullptr, nullptr, nullptr, 0, 0);
}

// The all-gather (2 barriers): quantize, every rank's payload decoded into its slot of y.
template <class P>
ffi::Error AllGather(const char* op, P& me, cudaStream_t stream, const ScratchPayload& gathered,
                     const Codec& k, int32_t rank, const void* x, size_t slot_bytes, void* y,
                     uint8_t* c, uint16_t* s, uint16_t* z) {
  const int size = me.size();
  const int64_t nb = record_bytes(k.group_size, k.bits, k.spikes);
  if (ffi::Error e = QuantizeAndMeet(op, me, stream, k, x, c, s, z); e.failure()) return e;
  if (ffi::Error e = GatherFromPeers(op, stream, me, 0, k.n_groups, nb, gathered, rank);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' payloads
  // Every rank's payload decoded into its slot: this rank's from its own buffers.
  auto* out = static_cast<uint8_t*>(y);
  for (int64_t j = 0; j < size; ++j) {
    const bool own = j == rank;
    FLASHCOMM_CUDA_TRY(
        op, "dequantize launch",
        Dequantize(k.dtype, stream, own ? c : gathered.codes + j * k.n_groups * nb,
                   own ? s : gathered.scale + j * k.n_groups,
                   own ? z : gathered.zero + j * k.n_groups, k.n_groups, k.group_size, k.bits,
                   k.rotation, k.spikes, out + j * slot_bytes));
  }
  return me.Meet(1, nullptr, nullptr, nullptr, 0, 0);
}

}  // namespace protocol
}  // namespace cuda
}  // namespace flashcomm

#endif  // FLASHCOMM_CUDA_P2P_PROTOCOL_H_
