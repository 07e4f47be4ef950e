// Ring steps of the peer-to-peer transport between processes on one host (docs/transport.md,
// "Across processes"): the start / done pair of p2p_ring_handlers.cc over shared memory.
//
// start: copies this rank's send chunk into its shared segment and arrives at the step's first
// barrier; when every rank has, the copy engine of p2p_ring.h copies the chunk of rank - shift
// out of that rank's segment into `recv` (paced at the step's link rate, if any), while XLA runs
// the step's dot. On the emulated bus (shm::SetLinkRate) a chunk holds the bus from its sender's
// start, as the all-reduces' publications do from their arrival: the sender reserves it
// (shm::ReserveBus) and publishes the reservation's end beside the chunk, and the receiver's
// move completes no earlier (nor later than the step's timeout from now).
// done: completes once the chunk has arrived and every rank has read what it needed (the
// step's second barrier), so the sender's segment may be reused.
#include "cpu/handlers.h"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>

#include "cpu/cpu_ops.h"
#include "cpu/cpu_p2p_protocol.h"
#include "flashcomm/bindings.h"
#include "flashcomm/p2p_ring.h"
#include "cpu/shm_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace flashcomm {
namespace cpu {
namespace {

using p2p::CopyEngine;
using p2p::Move;

using p2p::Prefix;

// One rank's ring step: started by start, finished by done.
class Step : public std::enable_shared_from_this<Step> {
 public:
  using Complete = std::function<void(const std::string& error)>;
  explicit Step(std::shared_ptr<shm::Meeting> meeting) : meeting_(std::move(meeting)) {}

  // The chunk has arrived in recv (or the step failed with `error`).
  void Moved(const std::string& error) {
    Complete then;
    {
      std::lock_guard<std::mutex> lock(mu_);
      moved_ = true;
      error_ = error;
      if (!done_) return;
      then = std::move(done_);
    }
    Finish(std::move(then));
  }
  // done's call: `then` runs once the chunk has arrived and every rank has read its chunk.
  void Done(Complete then) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!moved_) {
        done_ = std::move(then);
        return;
      }
    }
    Finish(std::move(then));
  }

 private:
  void Finish(Complete then) {
    auto self = shared_from_this();
    if (!error_.empty()) {
      shm::Leave(meeting_);
      return then(error_);
    }
    shm::Arrive(meeting_, 1, Spans{}, false,
                [self, then](const std::vector<Published>&, const std::string& error) {
                  shm::Leave(self->meeting_);
                  then(error);
                });
  }

 public:
  // On the emulated bus: when this rank's chunk will have crossed it (steady-clock ns), read
  // by the receiver out of this rank's segment.
  int64_t bus_end = 0;

 private:
  std::shared_ptr<shm::Meeting> meeting_;
  std::mutex mu_;
  bool moved_ = false;
  std::string error_;
  Complete done_;
};

// The steps this process started and not yet finished, per (site, group), in start order.
class StepTable {
 public:
  static StepTable& Global() {
    static StepTable* table = new StepTable();
    return *table;
  }
  void Push(int64_t site, int64_t group, std::shared_ptr<Step> step) {
    std::lock_guard<std::mutex> lock(mu_);
    steps_[{site, group}].push_back(std::move(step));
    ++count_;
  }
  std::shared_ptr<Step> Pop(int64_t site, int64_t group) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = steps_.find({site, group});
    if (it == steps_.end() || it->second.empty()) return nullptr;
    auto step = it->second.front();
    it->second.pop_front();
    if (it->second.empty()) steps_.erase(it);
    --count_;
    return step;
  }
  size_t Count() {
    std::lock_guard<std::mutex> lock(mu_);
    return count_;
  }

 private:
  std::mutex mu_;
  std::map<std::pair<int64_t, int64_t>, std::deque<std::shared_ptr<Step>>> steps_;
  size_t count_ = 0;
};

}  // namespace

ffi::Error ShmRingStart(ffi::AnyBuffer send, ffi::Buffer<ffi::S32> rank_buf,
                        ffi::Buffer<ffi::S32> group_buf, ffi::Result<ffi::AnyBuffer> send_out,
                        ffi::Result<ffi::AnyBuffer> recv, ffi::Result<ffi::Buffer<ffi::S32>> order,
                        int64_t size, int64_t shift, int64_t site, int64_t timeout_ms,
                        int64_t link_bytes_per_s, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_ring_start";
  const int32_t rank = rank_buf.typed_data()[0];
  const int32_t group = group_buf.typed_data()[0];
  if (size < 1 || rank < 0 || rank >= size || (shift % size == 0 && size > 1)) {
    return ffi::Error::InvalidArgument(Prefix(kOp) + "rank " + std::to_string(rank) +
                                       " not in 0.." + std::to_string(size - 1) +
                                       ", or a shift that sends every chunk to itself");
  }
  if (ffi::Error e =
          CheckRingStartArgs(kOp, send, *send_out, *recv, timeout_ms, link_bytes_per_s);
      e.failure()) {
    return e;
  }
  PassThrough(send, *send_out);
  order->typed_data()[0] = 0;
  std::string error;
  auto meeting = shm::Join({axes_key, site, group, rank, int(size), 2,
                            Describe({5, int64_t(send.size_bytes()), shift, size}), timeout_ms},
                           &error);
  if (!meeting) return ffi::Error::Internal(Prefix(kOp) + error);
  auto step = std::make_shared<Step>(meeting);
  StepTable::Global().Push(site, group, step);
  const int sender = int(((rank - shift) % size + size) % size);
  void* to = recv->untyped_data();
  const size_t bytes = send.size_bytes();
  const double rate = double(link_bytes_per_s);
  const bool bus = rate <= 0 && shm::LinkRate() > 0;
  if (bus) step->bus_end = shm::ReserveBus(int64_t(bytes));
  const Span bus_end = bus ? Span{&step->bus_end, sizeof(step->bus_end)} : Span{};
  shm::Arrive(meeting, 0, Spans{Span{send_out->untyped_data(), bytes}, bus_end, Span{}, Span{}},
              false, [step, sender, rank, to, bytes, rate, site, timeout_ms, bus](
                         const std::vector<Published>& peers, const std::string& error) {
                if (!error.empty()) return step->Moved(Prefix(kOp) + error);
                if (peers[sender][3] == &p2p::kRankFailed || (bytes && !peers[sender][0])) {
                  return step->Moved(Prefix(kOp) + "rank " + std::to_string(sender) + " failed");
                }
                const void* from = peers[sender][0];
                if (bus) {
                  // The emulated bus: the chunk has crossed it when the sender's reservation
                  // ends (a sleep, on a thread of its own; a sender that reserved nothing, its
                  // bus set later than this rank's: the bus held from now).
                  int64_t end = 0;
                  if (peers[sender][1] != nullptr) std::memcpy(&end, peers[sender][1], sizeof(end));
                  std::thread([step, to, from, bytes, end, timeout_ms] {
                    std::memcpy(to, from, bytes);
                    if (end > 0) {  // a peer's word: the wait is bounded by the step's timeout
                      std::this_thread::sleep_until(std::min(
                          p2p::Clock::time_point(std::chrono::nanoseconds(end)),
                          p2p::Clock::now() + std::chrono::milliseconds(timeout_ms)));
                    } else {
                      shm::Pace(int64_t(bytes));
                    }
                    step->Moved("");
                  }).detach();
                  return;
                }
                // The step's own link (or none): the in-process ring steps' copy engine, off
                // the transport's workers, paced in slices at `rate`.
                Move m{};
                m.sender = sender;
                m.receiver = rank;
                m.from.send = from;
                m.from.bytes = bytes;
                m.to.recv = to;
                m.to.bytes = bytes;
                m.failed = [] { return false; };
                m.finished = [step](bool ok) {
                  step->Moved(ok ? "" : Prefix(kOp) + "the chunk's move stopped");
                };
                CopyEngine::Global().Submit(std::move(m), rate, site);
              });
  return ffi::Error::Success();
}

ffi::Future ShmRingDone(ffi::AnyBuffer recv, ffi::AnyBuffer send, ffi::AnyBuffer after,
                        ffi::Buffer<ffi::S32> rank_buf, ffi::Buffer<ffi::S32> group_buf,
                        ffi::Result<ffi::AnyBuffer> recv_out, ffi::Result<ffi::AnyBuffer> after_out,
                        int64_t size, int64_t shift, int64_t site, int64_t axes_key) {
  constexpr const char* kOp = "flashcomm_shm_ring_done";
  (void)shift;
  (void)axes_key;
  (void)size;
  if (ffi::Error e = CheckRingDoneSizes(kOp, recv, send, after, *recv_out, *after_out);
      e.failure()) {
    return Failed(std::move(e));
  }
  PassThrough(after, *after_out);
  const int32_t rank = rank_buf.typed_data()[0];
  auto step = StepTable::Global().Pop(site, group_buf.typed_data()[0]);
  if (!step) return Failed(NoRingStep(kOp, rank));
  ffi::Promise promise;
  ffi::Future future(promise);
  const RecvCopy copy = CopyRecv(recv, *recv_out);
  step->Done([promise, copy](const std::string& error) mutable {
    if (error.empty()) copy();
    CompleteLater(promise, error);
  });
  return future;
}

size_t ShmRingStepsInProgress() { return StepTable::Global().Count(); }

}  // namespace cpu
}  // namespace flashcomm

FLASHCOMM_DEFINE_CPU_RING(Shm, flashcomm::bind::Peers::kShared, ffi::Ffi::Bind());
