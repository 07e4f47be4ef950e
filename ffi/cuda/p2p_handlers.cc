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
#include "p2p_host.h"
#include "p2p_protocol.h"
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

  // Publishes the payload's pointers (the byte counts are for other participants).
  ffi::Error Meet(int barrier, const void* codes, const void* scale, const void* zero,
                  int64_t /*groups*/, int64_t /*nb*/) {
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
  int size() const { return size_; }
  // Rank j's device memory into this device's, direct where peer access is enabled.
  cudaError_t Copy(cudaStream_t stream, void* dst, int j, const void* src, size_t bytes) {
    return cudaMemcpyPeerAsync(dst, device_, src, devices_[j], bytes, stream);
  }
  // Peer access to every peer's device (the copies then go over NVLink/PCIe directly).
  ffi::Error Prepare() {
    for (int j = 0; j < size_; ++j) {
      FLASHCOMM_CUDA_TRY(op_, "enabling peer access", EnablePeerAccess(device_, devices_[j]));
    }
    return ffi::Error::Success();
  }

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


using protocol::AllocateWork;
using protocol::CheckCommon;
using protocol::Codec;
using protocol::ScratchPayload;
using protocol::Start;

}  // namespace

ffi::Error P2pAllReduce(ffi::RunId run, cudaStream_t stream,
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
  Codec k;
  bool decode = false;
  if (ffi::Error e = protocol::CheckAllReduce(kOp, x, *y, *p1_codes, *p1_scale, *p1_zero,
                                              *p2_codes, *p2_scale, *p2_zero, bits, out_bits,
                                              group_size, rotation, spikes, out_spikes, size,
                                              timeout_ms, &k, &decode);
      e.failure()) {
    return e;
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
  ScratchPayload gathered;  // chunk `rank` of every peer's phase-1 payload
  if (ffi::Error e = AllocateWork(kOp, device, site, group, size, k.n_groups / size,
                                     record_bytes(group_size, bits, spikes), &gathered);
      e.failure()) {
    return e;
  }
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 3); e.failure()) return e;
  return protocol::AllReduce(kOp, me, stream, gathered, k, rank, x.untyped_data(),
                             y->untyped_data(), decode, p1_codes->typed_data(),
                             p1_scale->typed_data(), p1_zero->typed_data(),
                             p2_codes->typed_data(), p2_scale->typed_data(),
                             p2_zero->typed_data());
}

ffi::Error P2pReduceScatter(ffi::RunId run, cudaStream_t stream,
                            ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                            ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                            ffi::Result<ffi::Buffer<ffi::U8>> p1_codes,
                            ffi::Result<ffi::Buffer<ffi::BF16>> p1_scale,
                            ffi::Result<ffi::Buffer<ffi::BF16>> p1_zero, int32_t bits,
                            int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                            int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_reduce_scatter";
  Codec k;
  if (ffi::Error e = protocol::CheckReduceScatter(kOp, x, *y, *p1_codes, *p1_scale, *p1_zero,
                                                  bits, group_size, rotation, spikes, size,
                                                  timeout_ms, &k);
      e.failure()) {
    return e;
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
  ScratchPayload gathered;
  if (ffi::Error e = AllocateWork(kOp, device, site, group, size, k.n_groups / size,
                                     record_bytes(group_size, bits, spikes), &gathered);
      e.failure()) {
    return e;
  }
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 2); e.failure()) return e;
  return protocol::ReduceScatter(kOp, me, stream, gathered, k, rank, x.untyped_data(),
                                 y->untyped_data(), p1_codes->typed_data(),
                                 p1_scale->typed_data(), p1_zero->typed_data());
}

ffi::Error P2pAllGather(ffi::RunId run, cudaStream_t stream,
                        ffi::AnyBuffer x, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> y,
                        ffi::Result<ffi::Buffer<ffi::U8>> codes,
                        ffi::Result<ffi::Buffer<ffi::BF16>> scale,
                        ffi::Result<ffi::Buffer<ffi::BF16>> zero, int32_t bits,
                        int64_t group_size, int32_t rotation, int32_t spikes, int64_t size,
                        int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_all_gather";
  Codec k;
  if (ffi::Error e = protocol::CheckAllGather(kOp, x, *y, *codes, *scale, *zero, bits,
                                              group_size, rotation, spikes, size, timeout_ms,
                                              &k);
      e.failure()) {
    return e;
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
  ScratchPayload gathered;  // every peer's payload (this rank's slot unused)
  if (ffi::Error e = AllocateWork(kOp, device, site, group, size, k.n_groups,
                                     record_bytes(group_size, bits, spikes), &gathered);
      e.failure()) {
    return e;
  }
  Participant me(kOp, device, stream, deadline);
  if (ffi::Error e = me.Join(run.run_id, site, group, rank, size, 2); e.failure()) return e;
  return protocol::AllGather(kOp, me, stream, gathered, k, rank, x.untyped_data(), x.size_bytes(),
                             y->untyped_data(), codes->typed_data(), scale->typed_data(),
                             zero->typed_data());
}

size_t P2pMeetingsInProgress() { return Rendezvous::Global().InProgress(); }

}  // namespace cuda
}  // namespace flashcomm

// The same operands, results and attributes as the CPU handlers (ffi/cpu/p2p_kernels.cc), in
// the same order; the contexts add the run id and the stream.
//
// No traits: these handlers are NOT command-buffer compatible and must never declare XLA's
// command-buffer trait. Each call reads the rank and group from device memory on the host
// (polling the stream with cudaStreamQuery), meets its peers on the host, records and waits on
// events published by other devices' calls and allocates working memory: a CUDA graph would
// freeze the rank of its capture, the peers' pointers and events of one run (silently stale
// data afterwards), and capture forbids the stream query. XLA runs them as plain custom calls
// outside command buffers (tests/gpu/test_cuda_traits.py checks both ways).
#define FLASHCOMM_P2P_COMMON_ATTRS                                                         \
  .Attr<int64_t>("size")          /* ranks in the replica group */                         \
      .Attr<int64_t>("site")      /* the call site: peers of one call share it */          \
      .Attr<int64_t>("timeout_ms") /* every host wait gives up after this, with an error */

#define FLASHCOMM_P2P_CUDA_CONTEXT                                                         \
  .Ctx<ffi::RunId>()                             /* the execution: peers of one run meet */ \
      .Ctx<ffi::PlatformStream<cudaStream_t>>()  /* this device's stream */

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
