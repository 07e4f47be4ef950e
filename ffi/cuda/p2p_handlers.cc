// The peer-to-peer transport on CUDA: one process with several GPUs, one FFI call per rank per
// collective, the same protocol and the same operands, results and attributes as the CPU
// handlers (ffi/cpu/p2p_handlers.cc), over the same host-side rendezvous (p2p_rendezvous.h).
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

#include "flashcomm/bindings.h"
#include "flashcomm/codec.h"
#include "handlers.h"
#include "flashcomm/ffi_checks.h"
#include "flashcomm/p2p_rendezvous.h"
#include "collective_handlers.h"
#include "exact_sum.h"
#include "exchange.h"
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


// The GPUs of this process: they meet in the in-process rendezvous (p2p_rendezvous.h) and read
// each other's buffers by peer copies; the descriptor is for the shared-memory meeting point.
struct InProcessPeers {
  using Participant = cuda::Participant;
  static constexpr const char* kAllReduce = "flashcomm_p2p_all_reduce";
  static constexpr const char* kReduceScatter = "flashcomm_p2p_reduce_scatter";
  static constexpr const char* kAllGather = "flashcomm_p2p_all_gather";
  static ffi::Error Begin(const char* op, const ffi::RunId& run, cudaStream_t stream,
                          ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                          int64_t size, int64_t site, int64_t timeout_ms, int barriers,
                          uint64_t /*descriptor*/, int64_t slots, int64_t slot_groups,
                          int64_t nb, Begun<Participant>* b) {
    const auto deadline = p2p::DeadlineAfter(timeout_ms);  // saturated: no overflow
    if (ffi::Error e = b->Start(op, stream, rank_buf, group_buf, size, site, deadline, slots,
                                slot_groups, nb);
        e.failure()) {
      return e;
    }
    b->me = std::make_unique<Participant>(op, b->device, stream, deadline);
    return b->me->Join(run.run_id, site, b->group, b->rank, size, barriers);
  }
};

}  // namespace

size_t P2pMeetingsInProgress() { return Rendezvous::Global().InProgress(); }

// The exact all-reduce among the GPUs of this process (exact_sum.h): one region per barrier,
// published with this stream's event.
ffi::Error P2pPsum(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer x,
                   ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                   ffi::Result<ffi::AnyBuffer> y, int64_t size, int64_t site,
                   int64_t timeout_ms, int32_t two_shot, int64_t two_shot_bytes) {
  constexpr const char* kOp = "flashcomm_p2p_psum";
  protocol::ExactStart s;
  if (ffi::Error e = protocol::BeginExactSum(kOp, stream, x, *y, rank_buf, group_buf, size,
                                             timeout_ms, two_shot, two_shot_bytes, &s);
      e.failure()) {
    return e;
  }
  Participant me(kOp, s.device, stream, s.deadline);
  if (ffi::Error e = me.Join(run.run_id, site, s.group, s.rank, size, s.two ? 3 : 2);
      e.failure()) {
    return e;
  }
  auto meet = [&me](int barrier, const void* data, size_t /*bytes*/) {
    if (ffi::Error e = me.Record(); e.failure()) return e;
    return me.Meet(barrier, data, nullptr, nullptr, 0, 0);
  };
  return protocol::ExactSum(kOp, me, meet, stream, s.device, site, s.group, s.rank, size, x, *y,
                            s.two);
}

// The ragged exchange among the GPUs of this process (exchange.h).
ffi::Error P2pExchange(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer operand,
                       ffi::AnyBuffer output, ffi::Buffer<ffi::S32> input_offsets,
                       ffi::Buffer<ffi::S32> send_sizes, ffi::Buffer<ffi::S32> output_offsets,
                       ffi::Buffer<ffi::S32> recv_sizes, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> out,
                       int64_t size, int64_t site, int64_t timeout_ms) {
  constexpr const char* kOp = "flashcomm_p2p_exchange";
  protocol::ExchangeStart s;
  if (ffi::Error e = protocol::BeginExchange(kOp, stream, rank_buf, group_buf, size, timeout_ms,
                                             &s);
      e.failure()) {
    return e;
  }
  Participant me(kOp, s.device, stream, s.deadline);
  if (ffi::Error e = me.Join(run.run_id, site, s.group, s.rank, size, 3); e.failure()) return e;
  auto meet = [&me](int barrier, const void* data, size_t /*bytes*/) {
    if (ffi::Error e = me.Record(); e.failure()) return e;
    return me.Meet(barrier, data, nullptr, nullptr, 0, 0);
  };
  return protocol::Exchange(kOp, me, meet, stream, s.device, site, s.group, s.rank, size,
                            operand, output, input_offsets, send_sizes, output_offsets,
                            recv_sizes, *out);
}

}  // namespace cuda
}  // namespace flashcomm

// The bindings of the CPU handlers (flashcomm/bindings.h); the contexts add the stream.
//
// No traits: these handlers are NOT command-buffer compatible and must never declare XLA's
// command-buffer trait. Each call reads the rank and group from device memory on the host
// (polling the stream with cudaStreamQuery), meets its peers on the host, records and waits on
// events published by other devices' calls and allocates working memory: a CUDA graph would
// freeze the rank of its capture, the peers' pointers and events of one run (silently stale
// data afterwards), and capture forbids the stream query. XLA runs them as plain custom calls
// outside command buffers (tests/gpu/test_gpu_traits.py checks both ways).
FLASHCOMM_DEFINE_CUDA_COLLECTIVES(P2p, flashcomm::bind::Peers::kInProcess,
                                  flashcomm::cuda::InProcessPeers);

// The exact all-reduce's binding; no traits either (it meets its peers on the host per call).
XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommP2pPsumCuda, flashcomm::cuda::P2pPsum,
                              flashcomm::bind::Psum<flashcomm::bind::Peers::kInProcess>(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::RunId>()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()));

XLA_FFI_DEFINE_HANDLER_SYMBOL(FlashcommP2pExchangeCuda, flashcomm::cuda::P2pExchange,
                              flashcomm::bind::Exchange<flashcomm::bind::Peers::kInProcess>(
                                  ffi::Ffi::Bind()
                                      .Ctx<ffi::RunId>()
                                      .Ctx<ffi::PlatformStream<cudaStream_t>>()));
