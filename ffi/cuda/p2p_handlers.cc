// The peer-to-peer transport on CUDA: one process with several GPUs, one FFI call per rank per
// collective, the same protocol and the same operands, results and attributes as the CPU
// handlers (ffi/cpu/p2p_kernels.cc), over the same host-side rendezvous (p2p_rendezvous.h).
// NOT RUN ON HARDWARE: it compiles and lowers; no GPU has executed it (docs/cuda.md,
// "Peer-to-peer transport (not run on hardware)").
//
// What differs from the CPU: the handler runs on the host thread that enqueues the device's
// work, so it does not touch the data, it enqueues. At each barrier a rank records a CUDA event
// on its stream (everything it enqueued so far: its payload is written, its reads of the peers'
// buffers are done) and publishes it with its device pointers; after the barrier its stream
// waits on every peer's event (cudaStreamWaitEvent across devices), then copies what it needs
// from the peers' buffers into its own memory (cudaMemcpyPeerAsync, direct when peer access is
// enabled) and runs the codec kernels locally. The last barrier's events are the "every peer
// is done reading my buffers" signal: each stream waits on them before the call's later work.
// Events and host barriers stand in for device-side flags: no kernel ever spin-waits on a peer.
//
// Plain C++ (host compiler, CUDA runtime API), like codec_handlers.cc. Not CUDA-graph safe (it
// reads the rank on the host and meets its peers per call): no command-buffer trait.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "flashcomm/codec.h"
#include "flashcomm/cuda_kernels.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "launch.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

using p2p::Meeting;
using p2p::Published;
using p2p::Rendezvous;
using Clock = std::chrono::steady_clock;

// An event one rank records and every peer's stream waits on, shared through the meeting
// (Published slot 3). It starts with one reference per rank; the owner drops its own after the
// barrier, each peer after enqueueing its wait, and the last one destroys the event (a
// cudaStreamWaitEvent already enqueued does not need the event to live on). Peers also read
// the owner's device from it.
class SharedEvent {
 public:
  // A new event on `device` (current), recorded on `stream`, with `users` references.
  static cudaError_t Record(int device, int users, cudaStream_t stream, SharedEvent** out) {
    cudaEvent_t event = nullptr;
    if (cudaError_t e = cudaEventCreateWithFlags(&event, cudaEventDisableTiming);
        e != cudaSuccess) {
      return e;
    }
    if (cudaError_t e = cudaEventRecord(event, stream); e != cudaSuccess) {
      cudaEventDestroy(event);
      return e;
    }
    *out = new SharedEvent(event, device, users);
    return cudaSuccess;
  }
  cudaEvent_t event() const { return event_; }
  int device() const { return device_; }
  // Drop `n` references; the last one destroys the event (on its device).
  void Release(int n = 1) {
    if (users_.fetch_sub(n, std::memory_order_acq_rel) == n) {
      CurrentDevice on;
      on.Set(device_);
      cudaEventDestroy(event_);
      delete this;
    }
  }

 private:
  SharedEvent(cudaEvent_t event, int device, int users)
      : event_(event), device_(device), users_(users) {}
  cudaEvent_t event_;
  int device_;
  std::atomic<int> users_;
};

// One rank's part in one meeting (joins, leaves on destruction on every return path). Record()
// marks the point of this rank's stream its peers will wait for at the next Meet(); Meet()
// publishes the pointers and that event, waits (on the host, until the deadline) for every
// rank, then makes this rank's stream wait on every peer's event.
class Participant {
 public:
  Participant(const char* op, int device, cudaStream_t stream, Clock::time_point deadline)
      : op_(op), device_(device), stream_(stream), deadline_(deadline) {}
  Participant(const Participant&) = delete;
  Participant& operator=(const Participant&) = delete;
  ~Participant() {
    if (pending_) pending_->Release(size_);  // recorded, never published: no peer has it
    if (meeting_) Rendezvous::Global().Leave(meeting_);
  }

  ffi::Error Join(int64_t run_id, int64_t site, int32_t group, int32_t rank, int64_t size,
                  int barriers) {
    rank_ = rank;
    size_ = int(size);
    std::string error;
    meeting_ = Rendezvous::Global().Join({run_id, site, group}, rank, size_, barriers, &error);
    if (!meeting_) return ffi::Error::Internal(std::string(op_) + ": " + error);
    devices_.assign(size_, -1);
    return ffi::Error::Success();
  }

  ffi::Error Record() {
    if (pending_) pending_->Release(size_);
    pending_ = nullptr;
    FLASHCOMM_CUDA_TRY(op_, "recording an event",
                       SharedEvent::Record(device_, size_, stream_, &pending_));
    return ffi::Error::Success();
  }

  ffi::Error Meet(int barrier, const void* codes, const void* scale, const void* zero) {
    if (!pending_) return ffi::Error::Internal(std::string(op_) + ": Meet without Record");
    SharedEvent* mine = pending_;
    pending_ = nullptr;
    std::string error;
    const bool met = meeting_->Arrive(barrier, rank_, Published{codes, scale, zero, mine},
                                      deadline_, &peers_, &error);
    // On failure this leaks `mine` unless every peer saw it: a peer that passed the barrier
    // may still use it, and a leaked event is safer than a destroyed one in use.
    mine->Release();
    if (!met) return ffi::Error::Internal(std::string(op_) + ": " + error);
    cudaError_t first = cudaSuccess;
    for (int j = 0; j < size_; ++j) {
      if (j == rank_) {
        devices_[j] = device_;
        continue;
      }
      auto* peer = static_cast<SharedEvent*>(const_cast<void*>(peers_[j][3]));
      devices_[j] = peer->device();
      if (first == cudaSuccess) first = cudaStreamWaitEvent(stream_, peer->event(), 0);
      peer->Release();
    }
    FLASHCOMM_CUDA_TRY(op_, "waiting for a peer's event", first);
    return ffi::Error::Success();
  }

  const std::vector<Published>& peers() const { return peers_; }
  int device(int j) const { return devices_[j]; }
  int size() const { return size_; }

 private:
  const char* op_;
  int device_;
  cudaStream_t stream_;
  Clock::time_point deadline_;
  int rank_ = 0;
  int size_ = 1;
  std::shared_ptr<Meeting> meeting_;
  SharedEvent* pending_ = nullptr;
  std::vector<Published> peers_;
  std::vector<int> devices_;
};

constexpr size_t kAlign = 256;
size_t AlignUp(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

// `slots` payloads of `groups` records of `nb` bytes, as one chunked payload in scratch memory
// (codes, scale and zero each 256-byte aligned: the kernels read 2-byte scales).
struct ScratchPayload {
  uint8_t* codes = nullptr;
  uint16_t* scale = nullptr;
  uint16_t* zero = nullptr;
};

ffi::Error AllocateScratch(const char* op, ffi::ScratchAllocator& scratch, int64_t slots,
                           int64_t groups, int64_t nb, ScratchPayload* out) {
  const size_t codes = AlignUp(size_t(slots * groups * nb));
  const size_t params = AlignUp(size_t(slots * groups) * 2);
  const size_t bytes = codes + 2 * params;
  if (bytes == 0) return ffi::Error::Success();
  const std::optional<void*> mem = scratch.Allocate(bytes, kAlign);
  if (!mem.has_value() || *mem == nullptr) {
    return ffi::Error::Internal(std::string(op) + ": could not allocate " +
                                std::to_string(bytes) + " bytes of scratch memory");
  }
  auto* base = static_cast<uint8_t*>(*mem);
  out->codes = base;
  out->scale = reinterpret_cast<uint16_t*>(base + codes);
  out->zero = reinterpret_cast<uint16_t*>(base + codes + params);
  return ffi::Error::Success();
}

// `groups` records (codes, scale, zero) from device `src_dev` to `dst_dev`, on `stream`.
cudaError_t CopyRecords(cudaStream_t stream, int dst_dev, uint8_t* dst_codes,
                        uint16_t* dst_scale, uint16_t* dst_zero, int src_dev,
                        const uint8_t* src_codes, const uint16_t* src_scale,
                        const uint16_t* src_zero, int64_t groups, int64_t nb) {
  if (groups == 0) return cudaSuccess;
  if (cudaError_t e = cudaMemcpyPeerAsync(dst_codes, dst_dev, src_codes, src_dev,
                                          size_t(groups * nb), stream);
      e != cudaSuccess) {
    return e;
  }
  if (cudaError_t e = cudaMemcpyPeerAsync(dst_scale, dst_dev, src_scale, src_dev,
                                          size_t(groups) * 2, stream);
      e != cudaSuccess) {
    return e;
  }
  return cudaMemcpyPeerAsync(dst_zero, dst_dev, src_zero, src_dev, size_t(groups) * 2, stream);
}

// Peer access to every peer's device (the copies then go over NVLink/PCIe directly).
ffi::Error EnablePeers(const char* op, const Participant& me, int device) {
  for (int j = 0; j < me.size(); ++j) {
    FLASHCOMM_CUDA_TRY(op, "enabling peer access", EnablePeerAccess(device, me.device(j)));
  }
  return ffi::Error::Success();
}

// Records [first, first + groups) of every rank's payload published at the last barrier, one
// slot per rank in rank order, into `dst` (slots of `slot_groups` records): the chunked input
// of the fused sum kernels (first = rank * gpc), or every payload for the all-gather (first 0).
ffi::Error GatherFromPeers(const char* op, cudaStream_t stream, const Participant& me,
                           int device, int64_t first, int64_t groups, int64_t nb,
                           const ScratchPayload& dst, int skip) {
  const std::vector<Published>& peers = me.peers();
  for (int j = 0; j < me.size(); ++j) {
    if (j == skip) continue;
    FLASHCOMM_CUDA_TRY(op, "copying from a peer",
                       CopyRecords(stream, device, dst.codes + j * groups * nb,
                                   dst.scale + j * groups, dst.zero + j * groups, me.device(j),
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
cudaError_t ForType(ffi::DataType dtype, Launch launch) {
  switch (dtype) {
    case ffi::F32:
      return launch(Tag<F32>{});
    case ffi::BF16:
      return launch(Tag<BF16>{});
    default:  // F16: checked by CheckCommon
      return launch(Tag<F16>{});
  }
}

cudaError_t Quantize(ffi::DataType dtype, cudaStream_t stream, const void* x, int64_t n_groups,
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

cudaError_t Dequantize(ffi::DataType dtype, cudaStream_t stream, const uint8_t* c,
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

cudaError_t DequantizeSum(ffi::DataType dtype, cudaStream_t stream, const PayloadView& in,
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

cudaError_t DequantizeSumQuantize(cudaStream_t stream, const PayloadView& in, int out_bits,
                                  int out_spikes, uint8_t* c, uint16_t* s, uint16_t* z) {
  const auto launch = in.spikes > 0
                          ? (out_spikes > 0 ? LaunchDequantizeSumQuantize<true, true>
                                            : LaunchDequantizeSumQuantize<true, false>)
                          : (out_spikes > 0 ? LaunchDequantizeSumQuantize<false, true>
                                            : LaunchDequantizeSumQuantize<false, false>);
  return launch(stream, in, in.batch * in.groups_per_chunk, out_bits, out_spikes, c, s, z);
}

PayloadView View(const ScratchPayload& p, int64_t chunks, int64_t gpc, int64_t group_size,
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
ffi::Error CheckCommon(const char* op, ffi::DataType dtype, int64_t size, int64_t timeout_ms,
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
ffi::Error Start(const char* op, cudaStream_t stream, ffi::Buffer<ffi::S32> rank_buf,
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

}  // namespace

ffi::Error P2pAllReduce(ffi::RunId run, cudaStream_t stream, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero,
                        ffi::Result<ffi::Buffer<ffi::U8>> p2_codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p2_scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> p2_zero, int32_t bits,
                        int32_t out_bits, int64_t group_size, int32_t rotation, int32_t spikes,
                        int32_t out_spikes, int64_t size, int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_reduce";
  const ffi::DataType dtype = x.element_type();
  if (ffi::Error e = CheckCommon(kOp, dtype, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return e;
  }
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, *p1_codes, *p1_scale, *p1_zero, bits, group_size,
                                         spikes, &n_groups);
      e.failure()) {
    return e;
  }
  int64_t n_out = 0;
  // An empty y: the caller decodes the gathered phase-2 payload itself (the fused epilogue,
  // docs/fused_norm.md), so step 3 stops after the gather.
  const bool decode = y->element_count() != 0;
  if (ffi::Error e = CheckQuantizeShapes(decode ? *y : x, *p2_codes, *p2_scale, *p2_zero,
                                         out_bits, group_size, out_spikes, &n_out);
      e.failure()) {
    return e;
  }
  if (n_out != n_groups || n_groups % size != 0 || (decode && y->element_type() != dtype)) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": y or the group count do not "
                                       "match x and the group size");
  }
  const auto deadline = p2p::DeadlineAfter(timeout_ms);  // saturated: no overflow
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  if (ffi::Error e = Start(kOp, stream, rank_buf, group_buf, size, deadline, &on, &device, &rank,
                           &group);
      e.failure()) {
    return e;
  }
  const int64_t gpc = n_groups / size;
  const int64_t nb1 = record_bytes(group_size, bits, spikes);
  const int64_t nb2 = record_bytes(group_size, out_bits, out_spikes);
  uint8_t* c1 = p1_codes->typed_data();
  uint16_t* s1 = p1_scale->typed_data();
  uint16_t* z1 = p1_zero->typed_data();
  uint8_t* c2 = p2_codes->typed_data();
  uint16_t* s2 = p2_scale->typed_data();
  uint16_t* z2 = p2_zero->typed_data();
  ScratchPayload gathered;  // chunk `rank` of every peer's phase-1 payload
  if (ffi::Error e = AllocateScratch(kOp, scratch, size, gpc, nb1, &gathered); e.failure()) {
    return e;
  }

  // 1. Quantize the operand (N chunks) into this rank's phase-1 payload; meet.
  FLASHCOMM_CUDA_TRY(kOp, "quantize launch",
                     Quantize(dtype, stream, x.untyped_data(), n_groups, group_size, bits,
                              rotation, spikes, c1, s1, z1));
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 3); e.failure()) return e;
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(0, c1, s1, z1); e.failure()) return e;
  if (ffi::Error e = EnablePeers(kOp, me, device); e.failure()) return e;
  // 2. This rank's chunk of every peer's payload into scratch, summed in f32 in rank order and
  //    re-quantized into its slot of the gathered phase-2 payload.
  if (ffi::Error e = GatherFromPeers(kOp, stream, me, device, rank * gpc, gpc, nb1, gathered, -1);
      e.failure()) {
    return e;
  }
  FLASHCOMM_CUDA_TRY(kOp, "dequantize_sum_quantize launch",
                     DequantizeSumQuantize(stream, View(gathered, size, gpc, group_size, bits,
                                                        spikes),
                                           out_bits, out_spikes, c2 + rank * gpc * nb2,
                                           s2 + rank * gpc, z2 + rank * gpc));
  // The event of barrier 1 covers the slot written and this rank's reads of the peers' p1.
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(1, c2, s2, z2); e.failure()) return e;
  // 3. Every peer's reduced chunk into its slot, then decode the whole gathered payload.
  const std::vector<Published>& peers = me.peers();
  for (int j = 0; j < int(size); ++j) {
    if (j == rank) continue;
    FLASHCOMM_CUDA_TRY(kOp, "copying a peer's reduced chunk",
                       CopyRecords(stream, device, c2 + j * gpc * nb2, s2 + j * gpc,
                                   z2 + j * gpc, me.device(j),
                                   static_cast<const uint8_t*>(peers[j][0]) + j * gpc * nb2,
                                   static_cast<const uint16_t*>(peers[j][1]) + j * gpc,
                                   static_cast<const uint16_t*>(peers[j][2]) + j * gpc, gpc,
                                   nb2));
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' p2
  if (decode) {
    FLASHCOMM_CUDA_TRY(kOp, "dequantize launch",
                       Dequantize(dtype, stream, c2, s2, z2, n_groups, group_size, out_bits,
                                  rotation, out_spikes, y->untyped_data()));
  }
  // 4. This stream's later work waits until every peer has read this rank's buffers.
  return me.Meet(2, nullptr, nullptr, nullptr);
}

ffi::Error P2pReduceScatter(ffi::RunId run, cudaStream_t stream, ffi::ScratchAllocator scratch,
                            ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                            ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                            ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                            ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero, int32_t bits,
                            int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                            int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_reduce_scatter";
  const ffi::DataType dtype = x.element_type();
  if (ffi::Error e = CheckCommon(kOp, dtype, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return e;
  }
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, *p1_codes, *p1_scale, *p1_zero, bits, group_size,
                                         spikes, &n_groups);
      e.failure()) {
    return e;
  }
  if (n_groups % size != 0 || int64_t(y->element_count()) * size != n_groups * group_size ||
      y->element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": y must hold one chunk of x");
  }
  const auto deadline = p2p::DeadlineAfter(timeout_ms);  // saturated: no overflow
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  if (ffi::Error e = Start(kOp, stream, rank_buf, group_buf, size, deadline, &on, &device, &rank,
                           &group);
      e.failure()) {
    return e;
  }
  const int64_t gpc = n_groups / size;
  const int64_t nb = record_bytes(group_size, bits, spikes);
  uint8_t* c1 = p1_codes->typed_data();
  uint16_t* s1 = p1_scale->typed_data();
  uint16_t* z1 = p1_zero->typed_data();
  ScratchPayload gathered;
  if (ffi::Error e = AllocateScratch(kOp, scratch, size, gpc, nb, &gathered); e.failure()) {
    return e;
  }
  FLASHCOMM_CUDA_TRY(kOp, "quantize launch",
                     Quantize(dtype, stream, x.untyped_data(), n_groups, group_size, bits,
                              rotation, spikes, c1, s1, z1));
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 2); e.failure()) return e;
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(0, c1, s1, z1); e.failure()) return e;
  if (ffi::Error e = EnablePeers(kOp, me, device); e.failure()) return e;
  if (ffi::Error e = GatherFromPeers(kOp, stream, me, device, rank * gpc, gpc, nb, gathered, -1);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' payloads
  FLASHCOMM_CUDA_TRY(kOp, "dequantize_sum launch",
                     DequantizeSum(dtype, stream, View(gathered, size, gpc, group_size, bits,
                                                       spikes),
                                   rotation, y->untyped_data()));
  return me.Meet(1, nullptr, nullptr, nullptr);
}

ffi::Error P2pAllGather(ffi::RunId run, cudaStream_t stream, ffi::ScratchAllocator scratch,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                        int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                        int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_gather";
  const ffi::DataType dtype = x.element_type();
  if (ffi::Error e = CheckCommon(kOp, dtype, size, timeout_ms, rotation, group_size);
      e.failure()) {
    return e;
  }
  int64_t n_groups = 0;
  if (ffi::Error e = CheckQuantizeShapes(x, *codes, *scale, *zero, bits, group_size, spikes,
                                         &n_groups);
      e.failure()) {
    return e;
  }
  if (y->element_count() != x.element_count() * size || y->element_type() != dtype) {
    return ffi::Error::InvalidArgument(std::string(kOp) + ": y must hold N copies of x");
  }
  const auto deadline = p2p::DeadlineAfter(timeout_ms);  // saturated: no overflow
  CurrentDevice on;
  int device = 0;
  int32_t rank = 0, group = 0;
  if (ffi::Error e = Start(kOp, stream, rank_buf, group_buf, size, deadline, &on, &device, &rank,
                           &group);
      e.failure()) {
    return e;
  }
  const int64_t nb = record_bytes(group_size, bits, spikes);
  uint8_t* c = codes->typed_data();
  uint16_t* s = scale->typed_data();
  uint16_t* z = zero->typed_data();
  ScratchPayload gathered;  // every peer's payload (this rank's slot unused)
  if (ffi::Error e = AllocateScratch(kOp, scratch, size, n_groups, nb, &gathered);
      e.failure()) {
    return e;
  }
  FLASHCOMM_CUDA_TRY(kOp, "quantize launch",
                     Quantize(dtype, stream, x.untyped_data(), n_groups, group_size, bits,
                              rotation, spikes, c, s, z));
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 2); e.failure()) return e;
  if (ffi::Error e = me.Record(); e.failure()) return e;
  if (ffi::Error e = me.Meet(0, c, s, z); e.failure()) return e;
  if (ffi::Error e = EnablePeers(kOp, me, device); e.failure()) return e;
  if (ffi::Error e = GatherFromPeers(kOp, stream, me, device, 0, n_groups, nb, gathered, rank);
      e.failure()) {
    return e;
  }
  if (ffi::Error e = me.Record(); e.failure()) return e;  // done reading the peers' payloads
  // Every rank's payload decoded into its slot: this rank's from its own buffers.
  const size_t slot_bytes = x.size_bytes();
  auto* out = static_cast<uint8_t*>(y->untyped_data());
  for (int64_t j = 0; j < size; ++j) {
    const bool own = j == rank;
    FLASHCOMM_CUDA_TRY(
        kOp, "dequantize launch",
        Dequantize(dtype, stream, own ? c : gathered.codes + j * n_groups * nb,
                   own ? s : gathered.scale + j * n_groups, own ? z : gathered.zero + j * n_groups,
                   n_groups, group_size, bits, rotation, spikes, out + j * slot_bytes));
  }
  return me.Meet(1, nullptr, nullptr, nullptr);
}

size_t P2pMeetingsInProgress() { return Rendezvous::Global().InProgress(); }

}  // namespace cuda
}  // namespace flashcomm

// The same operands, results and attributes as the CPU handlers (ffi/cpu/p2p_kernels.cc), in
// the same order; the contexts add the stream and XLA's scratch allocator.
//
// No traits: these handlers are NOT command-buffer compatible and must never declare XLA's
// command-buffer trait. Each call reads the rank and group from device memory on the host
// (polling the stream with cudaStreamQuery), meets its peers on the host, records and waits on
// events published by other devices' calls and allocates scratch memory: a CUDA graph would
// freeze the rank of its capture, the peers' pointers and events of one run (silently stale
// data afterwards), and capture forbids the stream query. XLA runs them as plain custom calls
// outside command buffers (tests/gpu/test_cuda_traits.py checks both ways).
#define FLASHCOMM_P2P_COMMON_ATTRS                                                         \
  .Attr<int64_t>("size")          /* ranks in the replica group */                         \
      .Attr<int64_t>("site")      /* the call site: peers of one call share it */          \
      .Attr<int64_t>("timeout_ms") /* every host wait gives up after this, with an error */

#define FLASHCOMM_P2P_CUDA_CONTEXT                                                         \
  .Ctx<ffi::RunId>()                             /* the execution: peers of one run meet */ \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  /* this device's stream */                 \
      .Ctx<ffi::ScratchAllocator>()              /* the chunks copied from the peers */

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pAllReduceCuda, flashcomm::cuda::P2pAllReduce,
    ffi::Ffi::Bind() FLASHCOMM_P2P_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1, device memory
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: x's shape and dtype, the decoded sum
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-1 codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-1 zero
        .Ret<ffi::Buffer<ffi::U8>>()       // phase-2 codes, gathered: (N * gpc, bytes')
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 scale: (N * gpc)
        .Ret<ffi::Buffer<ffi::BF16>>()     // phase-2 zero
        .Attr<int32_t>("bits")             // phase-1 code width, 2..8
        .Attr<int32_t>("out_bits")         // phase-2 code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2 (both phases)
        .Attr<int32_t>("spikes")           // phase-1 spikes per group, 0..16
        .Attr<int32_t>("out_spikes")       // phase-2 spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pReduceScatterCuda, flashcomm::cuda::P2pReduceScatter,
    ffi::Ffi::Bind() FLASHCOMM_P2P_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (N * groups_per_chunk, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1, device memory
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (groups_per_chunk, group_size), chunk `rank`
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (N, groups_per_chunk, bytes)
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (N, groups_per_chunk)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    FlashcommP2pAllGatherCuda, flashcomm::cuda::P2pAllGather,
    ffi::Ffi::Bind() FLASHCOMM_P2P_CUDA_CONTEXT
        .Arg<ffi::AnyBuffer>()             // x: (groups, group_size)
        .Arg<ffi::Buffer<ffi::S32>>()      // rank: () in 0..N-1, device memory
        .Arg<ffi::Buffer<ffi::S32>>()      // group: () the replica group's index
        .Ret<ffi::AnyBuffer>()             // y: (N, groups, group_size), rank j's in slot j
        .Ret<ffi::Buffer<ffi::U8>>()       // codes: (groups, bytes), this rank's payload
        .Ret<ffi::Buffer<ffi::BF16>>()     // scale: (groups)
        .Ret<ffi::Buffer<ffi::BF16>>()     // zero
        .Attr<int32_t>("bits")             // code width, 2..8
        .Attr<int64_t>("group_size")       // multiple of 8
        .Attr<int32_t>("rotation")         // 0, 1 or 2
        .Attr<int32_t>("spikes")           // spikes per group, 0..16
        FLASHCOMM_P2P_COMMON_ATTRS);
