// long file: the ring step's start and done on CUDA and the CUDA state they share (events, pending
// dones)
// Ring steps of the peer-to-peer transport on CUDA: one process with several GPUs, the same
// start / done pair with the same operands, results and attributes as the CPU handlers
// (ffi/cpu/p2p_ring_handlers.cc), over the same host-side protocol (p2p_ring.h).
// NOT RUN ON HARDWARE: it compiles and lowers; no GPU has executed it (docs/cuda.md,
// "Peer-to-peer transport (not run on hardware)").
//
// start: passes `send` through to `send_out`, zeroes `order` (as on the CPU: the step's dot
// adds it to its offsets, so it depends on the start by data), reads the rank and group (a
// host sync, as in p2p_handlers.cc), records a "started" event on its stream (send_out is
// written, nothing before it still reads recv) and publishes (send_out, recv, bytes, this
// rank's RingEnd) through the RingTable. When both ends of a move have started, the move callback (on the host
// thread of whichever end started last) enqueues the copy on a link stream of the *receiver's*
// device: wait on both ends' started events, cudaMemcpyPeerAsync, record an "arrived" event.
// It reports the move finished as soon as that is enqueued. So on CUDA a chunk has "arrived"
// when its copy is enqueued and ordered by its arrived event; no host thread waits for a copy.
// done: waits on the host (a condition variable, with a deadline) until the step reports both
// moves touching this rank enqueued, makes its stream wait on their arrived events (the chunk
// into this rank, and this rank's chunk read by rank + shift) and passes recv and after
// through. Synchronous: XLA:GPU calls each device's handlers on that device's own thread, so a
// done that waits does not keep another device from starting.
//
// Plain C++ (host compiler, CUDA runtime API), like p2p_handlers.cc. Not CUDA-graph safe (host
// reads and waits on every call): no command-buffer trait.
#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>

#include "handlers.h"
#include "flashcomm/bindings.h"
#include "flashcomm/p2p_ring.h"
#include "p2p_host.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cuda {
namespace {

using p2p::Clock;
using p2p::Move;
using p2p::RingTable;
using p2p::Timeline;

// A done that hears nothing from its step gives up this long after the step's own deadline
// (the RingTable's watchdog normally fails the step first, with the missing ranks' names).
constexpr std::chrono::milliseconds kDoneGrace(1000);

std::string Prefix(const char* op) { return std::string(op) + ": "; }

std::string CudaErrorText(const std::string& what, cudaError_t err) {
  return what + " failed: " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
}

// --- the ring step's CUDA state ---

// One rank's CUDA side of one step, published as its Endpoint::event. `started`: recorded on
// its stream by the start. `incoming` / `outgoing`: the arrived events of the move into this
// rank and of the move out of it, set by those moves (each event has one reference for each of
// its two ranks' ends). Owned by the start until published, then by PendingDones, then by the
// done (and by the step's done callback if the done gives up first). No move touches it once
// the step has reported this rank done: a move sets these before it reports itself finished.
struct RingEnd {
  int device = 0;
  cudaEvent_t started = nullptr;
  std::atomic<SharedEvent*> incoming{nullptr};
  std::atomic<SharedEvent*> outgoing{nullptr};
  std::atomic<cudaError_t> incoming_error{cudaSuccess};  // why the move into it failed
  std::atomic<cudaError_t> outgoing_error{cudaSuccess};  // why the move out of it failed

  RingEnd() = default;
  RingEnd(const RingEnd&) = delete;
  RingEnd& operator=(const RingEnd&) = delete;
  ~RingEnd() {
    for (auto* slot : {&incoming, &outgoing}) {
      if (SharedEvent* e = slot->exchange(nullptr)) e->Release();
    }
    if (started) {
      CurrentDevice on;
      on.Set(device);
      cudaEventDestroy(started);  // the moves' waits on it are enqueued (or never will be)
    }
  }
};

// The link stream from `sender`'s device into `receiver`'s (current): one non-blocking stream on
// the receiver's device per sender device, created on first use, never destroyed. Moves from
// different peers (the two directions of a bidirectional ring) copy concurrently.
cudaError_t LinkStream(int receiver, int sender, cudaStream_t* out) {
  static std::mutex mu;
  static auto* streams = new std::map<std::pair<int, int>, cudaStream_t>();
  std::lock_guard<std::mutex> lock(mu);
  auto it = streams->find({receiver, sender});
  if (it == streams->end()) {
    cudaStream_t s = nullptr;
    if (cudaError_t e = cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking); e != cudaSuccess) {
      return e;
    }
    it = streams->emplace(std::make_pair(receiver, sender), s).first;
  }
  *out = it->second;
  return cudaSuccess;
}

// Enqueues a move's copy on its link stream, behind both ends' started events, and records its
// arrived event (two references: the receiver's done and the sender's).
cudaError_t EnqueueCopy(const RingEnd& from, const RingEnd& to, const void* send, void* recv,
                        size_t bytes, SharedEvent** arrived) {
  CurrentDevice on;
  if (cudaError_t e = on.Set(to.device); e != cudaSuccess) return e;
  if (cudaError_t e = EnablePeerAccess(to.device, from.device); e != cudaSuccess) return e;
  cudaStream_t link = nullptr;
  if (cudaError_t e = LinkStream(to.device, from.device, &link); e != cudaSuccess) return e;
  if (cudaError_t e = cudaStreamWaitEvent(link, from.started, 0); e != cudaSuccess) return e;
  if (cudaError_t e = cudaStreamWaitEvent(link, to.started, 0); e != cudaSuccess) return e;
  if (bytes) {
    if (cudaError_t e = cudaMemcpyPeerAsync(recv, to.device, send, from.device, bytes, link);
        e != cudaSuccess) {
      return e;
    }
  }
  return SharedEvent::Record(to.device, 2, link, arrived);
}

// The move callback handed to Step::Start: runs on the host thread of the start that made the
// move possible. Enqueues, hands the arrived event to both ends, then reports the move (last:
// after finished() the step may report either rank done and its RingEnd be freed).
void EnqueueMove(Move m, int64_t site) {
  const int64_t begin_us = Timeline::NowMicros();
  auto* from = static_cast<RingEnd*>(const_cast<void*>(m.from.event));
  auto* to = static_cast<RingEnd*>(const_cast<void*>(m.to.event));
  if (m.failed()) {
    m.finished(false);
    return;
  }
  SharedEvent* arrived = nullptr;
  const cudaError_t err = EnqueueCopy(*from, *to, m.from.send, m.to.recv, m.to.bytes, &arrived);
  if (err != cudaSuccess) {
    to->incoming_error.store(err);
    from->outgoing_error.store(err);
    m.finished(false);
    return;
  }
  to->incoming.store(arrived, std::memory_order_release);
  from->outgoing.store(arrived, std::memory_order_release);
  // On CUDA a move's times are its enqueueing on the host, not the copy.
  Timeline::Global().Add({Timeline::kMove, site, m.receiver, m.sender, int64_t(m.to.bytes),
                          begin_us, Timeline::NowMicros()});
  m.finished(true);
}

// What a start leaves for its done: XLA:GPU runs a device's calls in program order on that
// device's thread, so the k-th done of (run, site) on a device pairs with the k-th start there
// (the CPU's per-rank sequence numbers, as a queue). The done takes the rank and group from
// here instead of reading its own operands, which would drain its stream behind the step's dot.
struct Pending {
  int32_t rank = 0;
  int32_t group = 0;
  int64_t size = 0;
  int64_t shift = 0;
  Clock::time_point deadline;  // the done's host wait gives up then
  std::unique_ptr<RingEnd> end;
};

class PendingDones {
 public:
  using Key = std::tuple<int64_t, int64_t, int>;  // run id, site, device
  static PendingDones& Global() {
    static PendingDones* instance = new PendingDones();  // never destroyed, like RingTable
    return *instance;
  }
  void Push(const Key& key, Pending p) {
    std::lock_guard<std::mutex> lock(mu_);
    queues_[key].push_back(std::move(p));
  }
  bool Pop(const Key& key, Pending* out) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = queues_.find(key);
    if (it == queues_.end()) return false;
    *out = std::move(it->second.front());
    it->second.pop_front();
    if (it->second.empty()) queues_.erase(it);
    return true;
  }

 private:
  std::mutex mu_;
  std::map<Key, std::deque<Pending>> queues_;
};

// A done's host wait, shared with the step's done callback: whichever lets go last frees the
// RingEnd (the callback runs only once no move touches it).
struct DoneWait {
  std::mutex mu;
  std::condition_variable cv;
  bool reported = false;
  std::string error;
  std::unique_ptr<RingEnd> end;
};

// The CPU handlers' checks of size and shift (the rank is checked once read).
ffi::Error CheckRing(const char* op, int64_t size, int64_t shift) {
  if (size < 1) return ffi::Error::InvalidArgument(Prefix(op) + "size must be positive");
  if (shift % size == 0 && size > 1) {
    return ffi::Error::InvalidArgument(Prefix(op) + "shift " + std::to_string(shift) +
                                       " sends every chunk to itself");
  }
  return ffi::Error::Success();
}

// XLA aliases a result to its operand as asked; if it ever gives a distinct buffer, copy (on
// the stream, after what is already there).
cudaError_t PassThrough(cudaStream_t stream, const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (in.untyped_data() == out.untyped_data() || in.size_bytes() == 0) return cudaSuccess;
  return cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), in.size_bytes(),
                         cudaMemcpyDeviceToDevice, stream);
}

int Wrap(int64_t r, int64_t size) { return int(((r % size) + size) % size); }

}  // namespace

ffi::Error P2pRingStart(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer send,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> send_out, ffi::Result<ffi::AnyBuffer> recv,
                        ffi::Result<ffi::Buffer<ffi::S32>> order, int64_t size, int64_t shift,
                        int64_t site, int64_t timeout_ms, int64_t link_bytes_per_s) {
  constexpr const char* kOp = "flashcomm_p2p_ring_start";
  const int64_t begin_us = Timeline::NowMicros();
  if (ffi::Error e = CheckRing(kOp, size, shift); e.failure()) return e;
  if (timeout_ms <= 0) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "timeout_ms must be positive");
  }
  if (link_bytes_per_s != 0) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "link emulation (link_bytes_per_s) is "
                                       "for the CPU transport only; it must be 0 on CUDA");
  }
  if (send_out->size_bytes() != send.size_bytes() || recv->size_bytes() != send.size_bytes() ||
      recv->element_type() != send.element_type()) {
    return ffi::Error::InvalidArgument(Prefix(kOp) +
                                       "recv and send_out must have send's size and dtype");
  }
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1 ||
      order->element_count() != 1) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "rank, group and order must be scalars");
  }
  const auto deadline = p2p::DeadlineAfter(timeout_ms);  // saturated: no overflow
  CurrentDevice on;
  int device = 0;
  FLASHCOMM_CUDA_TRY(kOp, "cudaStreamGetDevice", cudaStreamGetDevice(stream, &device));
  FLASHCOMM_CUDA_TRY(kOp, "cudaSetDevice", on.Set(device));
  FLASHCOMM_CUDA_TRY(kOp, "passing send through", PassThrough(stream, send, *send_out));
  FLASHCOMM_CUDA_TRY(kOp, "zeroing order",
                     cudaMemsetAsync(order->untyped_data(), 0, sizeof(int32_t), stream));
  int32_t rank = 0, group = 0;
  if (ffi::Error e = ReadRankAndGroup(kOp, stream, rank_buf.typed_data(), group_buf.typed_data(),
                                      deadline, &rank, &group);
      e.failure()) {
    return e;
  }
  if (rank < 0 || rank >= size) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "rank " + std::to_string(rank) +
                                       " is not in 0.." + std::to_string(size - 1));
  }
  // The point of this stream the moves wait for: send_out is written, recv no longer read.
  auto end = std::make_unique<RingEnd>();
  end->device = device;
  FLASHCOMM_CUDA_TRY(kOp, "creating the start event",
                     cudaEventCreateWithFlags(&end->started, cudaEventDisableTiming));
  FLASHCOMM_CUDA_TRY(kOp, "recording the start event", cudaEventRecord(end->started, stream));
  std::string error;
  auto step = RingTable::Global().Start({run.run_id, site, group}, rank, int(size), int(shift),
                                        timeout_ms, &error);
  if (!step) return ffi::Error::Internal(Prefix(kOp) + error);
  p2p::Endpoint mine;
  mine.send = send_out->untyped_data();
  mine.recv = recv->untyped_data();
  mine.bytes = send.size_bytes();
  mine.event = end.get();
  // On an error no move was handed out with this end, so `end` may go.
  error = step->Start(rank, mine, [site](Move m) { EnqueueMove(std::move(m), site); });
  if (!error.empty()) return ffi::Error::Internal(Prefix(kOp) + error);
  Pending pending;
  pending.rank = rank;
  pending.group = group;
  pending.size = size;
  pending.shift = shift;
  pending.deadline = deadline + kDoneGrace;
  pending.end = std::move(end);
  PendingDones::Global().Push({run.run_id, site, device}, std::move(pending));
  Timeline::Global().Add({Timeline::kStart, site, rank, -1, int64_t(mine.bytes), begin_us,
                          Timeline::NowMicros()});
  return ffi::Error::Success();
}

ffi::Error P2pRingDone(ffi::RunId run, cudaStream_t stream, ffi::AnyBuffer recv,
                       ffi::AnyBuffer send, ffi::AnyBuffer after, ffi::Buffer<ffi::S32> rank_buf,
                       ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> recv_out,
                       ffi::Result<ffi::AnyBuffer> after_out, int64_t size, int64_t shift,
                       int64_t site) {
  constexpr const char* kOp = "flashcomm_p2p_ring_done";
  // long function: the done's protocol: both moves, then their events, each with its failure path
  const int64_t begin_us = Timeline::NowMicros();
  if (ffi::Error e = CheckRing(kOp, size, shift); e.failure()) return e;
  if (recv_out->size_bytes() != recv.size_bytes() ||
      after_out->size_bytes() != after.size_bytes() || send.size_bytes() != recv.size_bytes()) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "results must match recv and after");
  }
  if (rank_buf.element_count() != 1 || group_buf.element_count() != 1) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "rank and group must be scalars");
  }
  CurrentDevice on;
  int device = 0;
  FLASHCOMM_CUDA_TRY(kOp, "cudaStreamGetDevice", cudaStreamGetDevice(stream, &device));
  FLASHCOMM_CUDA_TRY(kOp, "cudaSetDevice", on.Set(device));
  Pending p;
  if (!PendingDones::Global().Pop({run.run_id, site, device}, &p)) {
    return ffi::Error::Internal(Prefix(kOp) + "device " + std::to_string(device) +
                                " has no step in progress at this call site");
  }
  if (p.size != size || p.shift != shift) {
    (void)p.end.release();  // its step may still hand it to a move: leaked, not freed
    return ffi::Error::InvalidArgument(Prefix(kOp) + "size and shift differ from the start's");
  }
  auto step = RingTable::Global().Done({run.run_id, site, p.group}, p.rank);
  if (!step) {
    (void)p.end.release();  // as above
    return ffi::Error::Internal(Prefix(kOp) + "rank " + std::to_string(p.rank) +
                                " has no step in progress at this call site");
  }
  auto wait = std::make_shared<DoneWait>();
  wait->end = std::move(p.end);
  RingEnd* end = wait->end.get();
  step->Done(p.rank, recv.untyped_data(), [wait](const std::string& error) {
    {
      std::lock_guard<std::mutex> lock(wait->mu);
      wait->reported = true;
      wait->error = error;
    }
    wait->cv.notify_all();
  });
  const int sender = Wrap(p.rank - shift, size), receiver = Wrap(p.rank + shift, size);
  std::string error;
  {
    std::unique_lock<std::mutex> lock(wait->mu);
    if (!wait->cv.wait_until(lock, p.deadline, [&] { return wait->reported; })) {
      // The step never answered. The callback, when it comes, frees the end.
      std::string missing;
      if (!end->incoming.load(std::memory_order_acquire)) {
        missing = "the chunk of rank " + std::to_string(sender) + " was never moved here";
      }
      if (!end->outgoing.load(std::memory_order_acquire)) {
        missing += (missing.empty() ? "" : "; ") + std::string("rank ") +
                   std::to_string(receiver) + " never took this rank's chunk";
      }
      return ffi::Error::Internal(Prefix(kOp) + "rank " + std::to_string(p.rank) +
                                  " timed out waiting for its step (" +
                                  (missing.empty() ? "no answer from the step" : missing) + ")");
    }
    error = wait->error;
  }
  // This stream's later work (the chunk's readers, the reuse of send and recv) comes after the
  // moves enqueued, on failure too: a copy enqueued before the step failed may still run.
  cudaError_t waited = cudaSuccess;
  for (SharedEvent* arrived : {end->incoming.load(std::memory_order_acquire),
                               end->outgoing.load(std::memory_order_acquire)}) {
    if (arrived && waited == cudaSuccess) {
      waited = cudaStreamWaitEvent(stream, arrived->event(), 0);
    }
  }
  Timeline::Global().Add({Timeline::kWait, site, p.rank, -1, int64_t(recv.size_bytes()),
                          begin_us, Timeline::NowMicros()});
  RingTable::Global().Prune();
  if (!error.empty()) {
    if (cudaError_t e = end->incoming_error.load(); e != cudaSuccess) {
      error += "; " + CudaErrorText("moving the chunk of rank " + std::to_string(sender), e);
    }
    if (cudaError_t e = end->outgoing_error.load(); e != cudaSuccess) {
      error += "; " + CudaErrorText("moving this rank's chunk to rank " +
                                    std::to_string(receiver), e);
    }
    return ffi::Error::Internal(Prefix(kOp) + error);
  }
  FLASHCOMM_CUDA_TRY(kOp, "waiting for the moves' arrived events", waited);
  FLASHCOMM_CUDA_TRY(kOp, "passing recv through", PassThrough(stream, recv, *recv_out));
  FLASHCOMM_CUDA_TRY(kOp, "passing after through", PassThrough(stream, after, *after_out));
  return ffi::Error::Success();
}

size_t P2pRingStepsInProgress() { return RingTable::Global().InProgress(); }

}  // namespace cuda
}  // namespace flashcomm

// The bindings of the CPU handlers (flashcomm/bindings.h); the contexts add the stream.
//
// No traits: not command-buffer compatible (see p2p_handlers.cc). The start reads the rank on
// the host and publishes this call's pointers and events to the peers; the done waits on the
// host until both moves of its rank are enqueued. A captured graph would replay one run's
// peers, pointers and events.
FLASHCOMM_DEFINE_CUDA_RING(
    P2p, flashcomm::bind::Peers::kInProcess,
    ffi::Ffi::Bind().Ctx<ffi::RunId>().Ctx<ffi::PlatformStream<cudaStream_t>>());

