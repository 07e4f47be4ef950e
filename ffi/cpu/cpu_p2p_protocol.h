// The peer-to-peer transport's protocols on CPU (docs/transport.md): fused quantized collectives
// in one FFI call per rank, over a Gang, the rank's part in one call of its group. Two gangs run
// them: the devices of one process (p2p_rendezvous.h, ffi/cpu/p2p_handlers.cc) and processes on
// one host (shm_rendezvous.h, ffi/cpu/shm_handlers.cc). The codec work is the same kernels,
// inputs and order as the `xla` transport's (jax_flashcomm/allreduce.py two_step), so the results
// are bit-identical to it whichever gang carries them.
//
// The protocols are asynchronous (they return an ffi::Future): a call quantizes on XLA's thread,
// arrives at the first barrier and returns; each later step is a continuation that runs when
// every peer has arrived, and the last one completes the future. No thread waits for a peer
// (one bounded exception: the in-process exact sum's handler, Call::AwaitInHandler).
#ifndef FLASHCOMM_CPU_P2P_PROTOCOL_H_
#define FLASHCOMM_CPU_P2P_PROTOCOL_H_

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/cpu_alloc.h"
#include "cpu/cpu_call.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_ops.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "cpu/shm_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

// ffi, Published, Span and Spans: cpu_call.h

// Completes `promise` from the completion threads (XLA continues the program on the thread
// that completes the future: never a copy thread): with Internal(`error`), or available when
// `error` is empty; `first` runs there before.
inline void CompleteLater(ffi::Promise promise, std::string error,
                          std::function<void()> first = nullptr) {
  p2p::ThreadPool::Completions().Schedule([promise, error, first]() mutable {
    if (first) first();
    if (error.empty()) {
      promise.SetAvailable();
    } else {
      promise.SetError(ffi::Error::Internal(error));
    }
  });
}

// The message of a kernel's failed scratch allocation (cpu_dispatch.h).
inline std::string ScratchMessage(size_t bytes, int rank) {
  return "could not allocate " + std::to_string(bytes) + " bytes of scratch memory (rank " +
         std::to_string(rank) + ")";
}

inline ffi::Future Failed(ffi::Error error) {
  ffi::Promise promise;
  promise.SetError(std::move(error));
  return ffi::Future(promise);
}

// ring_start's attributes and results: a positive timeout, a link rate >= 0, and recv and
// send_out of send's size and dtype.
inline ffi::Error CheckRingStartArgs(const char* op, const ffi::AnyBuffer& send,
                                     const ffi::AnyBuffer& send_out, const ffi::AnyBuffer& recv,
                                     int64_t timeout_ms, int64_t link_bytes_per_s) {
  if (timeout_ms <= 0 || link_bytes_per_s < 0) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": timeout_ms must be positive, link_bytes_per_s >= 0");
  }
  if (send_out.size_bytes() != send.size_bytes() || recv.size_bytes() != send.size_bytes() ||
      recv.element_type() != send.element_type()) {
    return ffi::Error::InvalidArgument(std::string(op) +
                                       ": recv and send_out must have send's size and dtype");
  }
  return ffi::Error::Success();
}

// ring_done's operands and results: recv_out and after_out the sizes of recv and after, send
// the size of recv.
inline ffi::Error CheckRingDoneSizes(const char* op, const ffi::AnyBuffer& recv,
                                     const ffi::AnyBuffer& send, const ffi::AnyBuffer& after,
                                     const ffi::AnyBuffer& recv_out,
                                     const ffi::AnyBuffer& after_out) {
  if (recv_out.size_bytes() != recv.size_bytes() || after_out.size_bytes() != after.size_bytes() ||
      send.size_bytes() != recv.size_bytes()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": results must match recv and after");
  }
  return ffi::Error::Success();
}

// A ring_done at a call site where `rank` started no step.
inline ffi::Error NoRingStep(const char* op, int32_t rank) {
  return ffi::Error::Internal(std::string(op) + ": rank " + std::to_string(rank) +
                              " has no step in progress at this call site");
}

// XLA aliases a result to its operand as asked; if it ever gives a distinct buffer, copy.
inline void PassThrough(const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (in.untyped_data() != out.untyped_data()) {
    std::memcpy(out.untyped_data(), in.untyped_data(), in.size_bytes());
  }
}

// ring_done's recv_out once the chunk has arrived in recv: the same buffer, or a copy of it.
struct RecvCopy {
  const void* in;
  void* out;
  size_t bytes;
  void operator()() const {
    if (in != out) std::memcpy(out, in, bytes);
  }
};

inline RecvCopy CopyRecv(const ffi::AnyBuffer& recv, ffi::AnyBuffer& recv_out) {
  return RecvCopy{recv.untyped_data(), recv_out.untyped_data(), recv.size_bytes()};
}

inline ffi::Error CheckCommon(const char* op, const ffi::AnyBuffer& x, int32_t rank, int64_t size,
                              int64_t timeout_ms, int32_t rotation, int64_t group_size) {
  if (size < 1 || rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument(std::string(op) + ": rank " + std::to_string(rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(std::string(op) + ": timeout_ms must be positive");
  }
  if (rotation < kRotationNone || rotation > kRotationSignedHadamard ||
      (rotation != kRotationNone && (group_size & (group_size - 1)) != 0)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": bad rotation for group_size");
  }
  DType dtype = DType::kF32;
  if (!ToDType(x.element_type(), &dtype)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be f32, bf16 or f16");
  }
  return ffi::Error::Success();
}

// A reusable per-thread buffer (grows, never shrinks; flashcomm_scratch_alloc, cpu_alloc.h).
// Null when it cannot grow to `bytes` (the old one is kept).
inline uint8_t* Scratch(size_t bytes) {
  struct Buffer {
    ~Buffer() { std::free(data); }
    uint8_t* data = nullptr;
    size_t size = 0;
  };
  thread_local Buffer buffer;
  if (buffer.size < bytes) {
    auto* grown = static_cast<uint8_t*>(flashcomm_scratch_alloc(bytes));
    if (grown == nullptr) return nullptr;
    std::free(buffer.data);
    buffer.data = grown;
    buffer.size = bytes;
  }
  return buffer.data;
}

// Copies chunk `chunk` (gpc groups) of every peer's payload published at a barrier into one
// chunked payload (peers in rank order): the input of the fused sum kernels. False (and
// *failed_bytes, the size asked for) when the scratch buffer cannot be allocated.
inline bool GatherChunk(const std::vector<Published>& peers, int64_t chunk, int64_t gpc,
                        int64_t group_size, int bits, int spikes, PayloadView* out,
                        size_t* failed_bytes) {
  const int64_t n = int64_t(peers.size());
  const int64_t nb = record_bytes(group_size, bits, spikes);
  const size_t bytes = size_t(n * gpc * (nb + 4));
  uint8_t* buf = Scratch(bytes);
  if (buf == nullptr && bytes > 0) {
    *failed_bytes = bytes;
    return false;
  }
  uint8_t* codes = buf;
  auto* scale = reinterpret_cast<uint16_t*>(buf + n * gpc * nb);
  uint16_t* zero = scale + n * gpc;
  for (int64_t j = 0; j < n; ++j) {
    const auto* pc = static_cast<const uint8_t*>(peers[j][0]);
    const auto* ps = static_cast<const uint16_t*>(peers[j][1]);
    const auto* pz = static_cast<const uint16_t*>(peers[j][2]);
    std::memcpy(codes + j * gpc * nb, pc + chunk * gpc * nb, size_t(gpc * nb));
    std::memcpy(scale + j * gpc, ps + chunk * gpc, size_t(gpc) * 2);
    std::memcpy(zero + j * gpc, pz + chunk * gpc, size_t(gpc) * 2);
  }
  PayloadView view;
  view.codes = codes;
  view.scale = scale;
  view.zero = zero;
  view.batch = 1;
  view.chunks = n;
  view.groups_per_chunk = gpc;
  view.group_size = group_size;
  view.group_bytes = nb;
  view.bits = bits;
  view.spikes = spikes;
  *out = view;
  return true;
}

// A payload of `groups` groups of `nb`-byte records as three regions (codes, scale, zero).
inline Spans PayloadSpans(const void* codes, const void* scale, const void* zero, int64_t groups,
                          int64_t nb) {
  return Spans{Span{codes, size_t(groups * nb)}, Span{scale, size_t(groups) * 2},
               Span{zero, size_t(groups) * 2}, Span{}};
}

// The fused two-step all-reduce (docs/transport.md). `y` empty: stop after the gather.
ffi::Future AllReduceProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                              ffi::AnyBuffer& y, U8Buf& p1_codes, Bf16Buf& p1_scale,
                              Bf16Buf& p1_zero, U8Buf& p2_codes, Bf16Buf& p2_scale,
                              Bf16Buf& p2_zero, int32_t bits, int32_t out_bits, int64_t group_size,
                              int32_t rotation, int32_t spikes, int32_t out_spikes, int64_t size,
                              int64_t timeout_ms);
// Quantized reduce-scatter: this rank's chunk of the f32 sum.
ffi::Future ReduceScatterProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                                  ffi::AnyBuffer& y, U8Buf& codes, Bf16Buf& scale, Bf16Buf& zero,
                                  int32_t bits, int64_t group_size, int32_t rotation,
                                  int32_t spikes, int64_t size, int64_t timeout_ms);
// Quantized all-gather: every rank's decoded payload in its slot.
ffi::Future AllGatherProtocol(const GangFactory& join, int32_t rank, const ffi::AnyBuffer& x,
                              ffi::AnyBuffer& y, U8Buf& codes, Bf16Buf& scale, Bf16Buf& zero,
                              int32_t bits, int64_t group_size, int32_t rotation, int32_t spikes,
                              int64_t size, int64_t timeout_ms);

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_P2P_PROTOCOL_H_
