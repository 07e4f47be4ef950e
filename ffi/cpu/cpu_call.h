// One rank's part in one collective call of the peer-to-peer transport on CPU, over the Gang its
// transport makes (the devices of one process: p2p_handlers.cc; processes of one host:
// shm_handlers.cc); the protocols (cpu_p2p_protocol.h, cpu_exact_sum.h) are written over it.
#ifndef FLASHCOMM_CPU_CALL_H_
#define FLASHCOMM_CPU_CALL_H_

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "flashcomm/p2p_rendezvous.h"
#include "cpu/shm_rendezvous.h"
#include "xla/ffi/api/ffi.h"

namespace flashcomm {
namespace cpu {

namespace ffi = xla::ffi;
using p2p::Published;
using shm::Span;
using shm::Spans;

// One rank's part in one call, as its transport carries it.
class Gang {
 public:
  virtual ~Gang() = default;
  // Publish `mine` at `barrier` (`failed`: this rank's own work failed; `wire_bytes`: the bytes
  // of it the peers will read, which an emulated link paces); `then` gets every rank's
  // pointers (a failed rank's [3] is &p2p::kRankFailed) or the error that ended the call.
  // `inline_then`: every rank's `then` is cheap and may run in the thread that opens the
  // barrier (a gang with threads of its own may ignore it).
  virtual void Arrive(int barrier, const Spans& mine, bool failed, p2p::Continuation then,
                      int64_t wire_bytes, bool inline_then) = 0;
  // End the call for every rank now.
  virtual void Abort(const std::string& why) = 0;
  // Done with the call (after its last barrier, or an error); called once.
  virtual void Leave() = 0;
};

// Makes the gang of this call: `barriers` of the protocol, `descriptor` of its shapes and
// options (ranks that disagree fail); nullptr and `error` when it cannot.
using GangFactory =
    std::function<std::unique_ptr<Gang>(int barriers, uint64_t descriptor, std::string* error)>;

using shm::Describe;  // the descriptor of a call (JoinArgs::descriptor)

// One rank's part in one call: joined on creation, left when the call completes (success or
// error), which completes the call's future.
//
// A failure of this rank's codec work (Fail) does not leave the protocol: the rank skips the
// work that is left, passes its remaining barriers marked failed (peers may still read the
// buffers it published), and completes with the error; a peer that sees the mark completes with
// an error naming the rank. Continuations of one call run one after another, so the failure
// state needs no lock.
class Call : public std::enable_shared_from_this<Call> {
 public:
  static std::shared_ptr<Call> Join(const char* op, int32_t rank, const GangFactory& join,
                                    int barriers, uint64_t descriptor, std::string* error) {
    auto call = std::shared_ptr<Call>(new Call(op, rank));
    call->gang_ = join(barriers, descriptor, error);
    return call->gang_ ? call : nullptr;
  }
  ~Call() {
    if (gang_) gang_->Leave();
  }
  ffi::Future future() const { return ffi::Future(promise_); }
  // Publish `mine` at `barrier` (`wire_bytes` of it read by the peers); `next` gets every
  // rank's pointers once all have arrived (`inline_next`: Gang::Arrive's inline_then). On a
  // failed meeting the call completes with the error instead.
  void Arrive(int barrier, const Spans& mine,
              std::function<void(const std::vector<Published>&)> next, int64_t wire_bytes = 0,
              bool inline_next = false) {
    auto self = shared_from_this();
    gang_->Arrive(barrier, mine, failed(),
                  [self, next = std::move(next)](const std::vector<Published>& peers,
                                                 const std::string& error) {
                    if (!error.empty()) return self->Finish(error);
                    for (size_t j = 0; j < peers.size() && !self->failed(); ++j) {
                      if (peers[j][3] == &p2p::kRankFailed) {
                        self->Fail(ffi::ErrorCode::kInternal,
                                   "rank " + std::to_string(j) +
                                       " failed (its own error says why)");
                      }
                    }
                    try {
                      next(peers);
                    } catch (const std::exception& e) {
                      // A small allocation of the protocol itself: fail the meeting, so that
                      // the peers do not wait for the deadline.
                      self->Abort(std::string("rank ") + std::to_string(self->rank_) + ": " +
                                  e.what());
                    }
                  },
                  wire_bytes, inline_next);
  }
  // This rank's codec work failed: remember the first failure (Finish reports it).
  void Fail(ffi::ErrorCode code, const std::string& why) {
    if (failure_.empty()) {
      failure_ = why;
      failure_code_ = code;
    }
  }
  bool failed() const { return !failure_.empty(); }
  // Fail the whole meeting now (nothing of this rank's is published, or the protocol cannot go
  // on), then complete this call with `why`.
  void Abort(const std::string& why) {
    if (gang_) gang_->Abort("peer-to-peer collective: " + why);
    Fail(ffi::ErrorCode::kInternal, why);
    Finish();
  }
  // Complete the call (after its last barrier): leave the meeting, then set the future, with
  // `error` (a failed meeting) or this rank's failure (Fail) if any.
  void Finish(const std::string& error = std::string()) {
    if (gang_) {
      gang_->Leave();
      gang_ = nullptr;
    }
    ffi::Promise promise = promise_;
    const std::string& why = error.empty() ? failure_ : error;
    const ffi::ErrorCode code = error.empty() ? failure_code_ : ffi::ErrorCode::kInternal;
    std::string message = why.empty() ? why : std::string(op_) + ": " + why;
    auto complete = [promise, message, code]() mutable {
      if (message.empty()) {
        promise.SetAvailable();
      } else {
        promise.SetError(ffi::Error(code, message));
      }
    };
    {
      // The handler still waits for it (AwaitInHandler): complete here, before XLA holds the
      // future, so that nothing of the program runs on this thread.
      std::lock_guard<std::mutex> lock(await_mu_);
      if (await_ == kAwaiting) {
        complete();
        await_ = kCompleted;
        await_cv_.notify_all();
        return;
      }
    }
    // Never on a worker: XLA continues the program on the completing thread.
    p2p::ThreadPool::Completions().Schedule(std::move(complete));
  }
  // Let the handler wait for this call (AwaitInHandler); before its first Arrive.
  void ExpectAwait() {
    std::lock_guard<std::mutex> lock(await_mu_);
    await_ = kAwaiting;
  }
  // In the handler's thread, before it returns the future: wait up to `limit` for the call to
  // complete, so that a call whose peers are in step returns a completed future and XLA goes on
  // in this thread, as after its own collectives (no hand-over to a completion thread). A call
  // still open then completes later on the completion threads: the wait is bounded, so
  // collectives that devices reach in different orders cannot deadlock.
  // Meanwhile it runs the work offered to it (Offer).
  void AwaitInHandler(std::chrono::microseconds limit) {
    const auto until = std::chrono::steady_clock::now() + limit;
    std::unique_lock<std::mutex> lock(await_mu_);
    while (await_cv_.wait_until(lock, until, [&] { return await_ == kCompleted || offered_; }) &&
           offered_) {
      std::function<void()> work = std::move(offered_);
      offered_ = nullptr;
      lock.unlock();
      work();
      lock.lock();
    }
    if (await_ == kAwaiting) await_ = kNotAwaited;
  }
  // Hand `work` to the handler's thread while it awaits the call (it runs it there, then goes
  // on waiting); false when it no longer waits.
  bool Offer(std::function<void()> work) {
    std::lock_guard<std::mutex> lock(await_mu_);
    if (await_ != kAwaiting || offered_) return false;
    offered_ = std::move(work);
    await_cv_.notify_all();
    return true;
  }

 private:
  Call(const char* op, int rank) : op_(op), rank_(rank) {}

  const char* op_;
  int rank_;
  std::unique_ptr<Gang> gang_;
  ffi::Promise promise_;
  std::string failure_;
  ffi::ErrorCode failure_code_ = ffi::ErrorCode::kOk;
  enum Await { kNotAwaited, kAwaiting, kCompleted };
  std::mutex await_mu_;
  std::condition_variable await_cv_;
  Await await_ = kNotAwaited;
  std::function<void()> offered_;
};

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_CALL_H_
