// long file: the ring steps' table, copy engine and timeline, shared by both platforms' ring
// handlers
// One ring step of the peer-to-peer transport, split in two calls so that a matmul runs while
// the chunk moves (docs/transport.md, "Ring steps"): every rank r *starts* (publishes the
// buffer it sends and the buffer it receives into), the chunk of rank r - shift is moved into
// rank r's receive buffer as soon as both have started, and *done* completes once this rank's
// chunk has arrived and its own send buffer has been read by rank r + shift. Host-side and
// platform-neutral: the CPU handlers (ffi/cpu/p2p_ring_handlers.cc) move chunks with the
// CopyEngine below, the CUDA handlers (ffi/cuda/p2p_ring_handlers.cc) with peer copies on a
// stream.
//
// A Step is keyed like a Meeting of p2p_rendezvous.h: (run id, call site, replica group,
// sequence number), the sequence numbers of starts and dones counted separately per rank, so
// the k-th done of a site pairs with the k-th start. Nothing ever blocks a thread: a move is
// handed to the platform when its two ends have started, and a done hands over a callback that
// runs when its two moves have finished. A watchdog fails the steps that are late; a move in
// progress is never abandoned (it stops at its next slice), so no rank is told "done" while a
// peer's copy still touches its buffers.
#ifndef FLASHCOMM_P2P_RING_H_
#define FLASHCOMM_P2P_RING_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <queue>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "flashcomm/p2p_rendezvous.h"

namespace flashcomm {
namespace p2p {

using Clock = std::chrono::steady_clock;

// "op: ", the start of a ring handler's error messages.
inline std::string Prefix(const char* op) { return std::string(op) + ": "; }

// What one rank publishes when it starts a step.
struct Endpoint {
  const void* send = nullptr;  // the chunk it sends to rank + shift
  void* recv = nullptr;        // where the chunk of rank - shift goes
  size_t bytes = 0;            // of each (the ranks of a step agree on it)
  const void* event = nullptr; // platform data (the CUDA event recorded at start)
};

// A move the platform must perform: `to.bytes` from `from.send` to `to.recv`. It calls
// `finished(ok)` exactly once when the move is over (ok false: it stopped early because the
// step failed; `failed()` tells it to stop). A staged step's move may go from the sender to a
// staging buffer (to.recv) before the receiver has started, then `local`ly from there to the
// receiver's buffer: a copy within the receiver's memory, not over the link.
struct Move {
  int sender;
  int receiver;
  Endpoint from;
  Endpoint to;
  bool local = false;
  std::function<bool()> failed;
  std::function<void(bool ok)> finished;
};

// Called when a rank's done completes: error empty on success.
using DoneCallback = std::function<void(const std::string& error)>;

// `staged`: a sender that starts before its receiver sends at once, into a staging buffer of
// the step (the link's receive buffer of a real transport), and the chunk is copied locally
// into the receiver's buffer when it starts; otherwise a move waits for both ends. The CPU
// transport stages: a rank that starts late does not delay its peer's move.
class Step : public std::enable_shared_from_this<Step> {
 public:
  Step(int size, int shift, Clock::time_point deadline, bool staged = false)
      : size_(size),
        shift_(((shift % size) + size) % size),
        deadline_(deadline),
        staged_(staged),
        ranks_(size) {}

  int sender_of(int rank) const { return (rank - shift_ + size_) % size_; }
  int receiver_of(int rank) const { return (rank + shift_) % size_; }

  // Rank `rank` starts with `mine`; `move` is called (outside the lock, possibly twice) for the
  // moves this arrival makes possible. Returns an error if the step has failed or the ranks
  // disagree on the chunk size.
  std::string Start(int rank, const Endpoint& mine, const std::function<void(Move)>& move) {
    std::vector<Move> ready;
    std::vector<std::pair<DoneCallback, std::string>> complete;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) return failure_;
      Rank& me = ranks_[rank];
      if (me.started) return "rank " + std::to_string(rank) + " started the same step twice";
      me.started = true;
      me.ep = mine;
      ++started_;
      if (!submit_) submit_ = move;
      for (int receiver : {rank, receiver_of(rank)}) {
        const int sender = sender_of(receiver);
        Rank& to = ranks_[receiver];
        const Rank& from = ranks_[sender];
        if (to.recv == kStaged && receiver == rank) {  // it arrived before this rank started
          error = UnstageLocked(receiver, &ready);
          if (!error.empty()) {
            complete = FailLocked(error);
            break;
          }
        } else if (to.recv == kPending && from.started && !to.started && staged_) {
          // This rank sends first: into the staging buffer (null: it could not be allocated).
          Move m{};
          if (!MakeStagingMove(sender, receiver, &m)) {
            error = "could not allocate " + std::to_string(from.ep.bytes) +
                    " bytes of staging buffer for rank " + std::to_string(receiver);
            complete = FailLocked(error);
            break;
          }
          to.recv = kMoving;
          ready.push_back(std::move(m));
        } else if (to.recv == kPending && from.started && to.started) {
          error = SizeErrorLocked(sender, receiver, from.ep.bytes);
          if (!error.empty()) {
            complete = FailLocked(error);
            break;
          }
          to.recv = kMoving;
          ready.push_back(MakeMove(sender, receiver));
        }
        if (size_ == 1 || sender == receiver) break;  // one rank: it moves to itself once
      }
    }
    Run(std::move(complete));
    // Moves handed out after a failure see failed() and finish at once: every move marked
    // moving must reach the platform, or the ranks waiting on it would never complete.
    for (auto& m : ready) move(std::move(m));
    return error;
  }

  // Rank `rank` waits for its step: `then` runs once its chunk has arrived and its own send
  // buffer has been read (or with the error that ended the step). `recv` must be the buffer
  // it started with: anything else means the caller moved the buffer while it was in flight.
  void Done(int rank, const void* recv, DoneCallback then) {
    std::vector<std::pair<DoneCallback, std::string>> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Rank& me = ranks_[rank];
      if (!me.started || me.done_called) {
        complete.emplace_back(std::move(then), std::string("rank ") + std::to_string(rank) +
                                                   (me.started ? " finished a step twice"
                                                               : " finished a step it never "
                                                                 "started"));
      } else {
        me.done_called = true;
        me.then = std::move(then);
        if (recv != me.ep.recv && !failed_) {
          complete = FailLocked("rank " + std::to_string(rank) + "'s receive buffer moved "
                                "between start and done (the runtime copied it in flight)");
        }
        TryCompleteLocked(rank, &complete);
      }
    }
    Run(std::move(complete));
  }

  // The watchdog's check: past the deadline and not every rank done, fail the step.
  void ExpireIfLate(Clock::time_point now) {
    std::vector<std::pair<DoneCallback, std::string>> complete;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_ || now < deadline_ || completed_ == size_) return;
      std::string missing, moving;
      for (int r = 0; r < size_; ++r) {
        if (!ranks_[r].started) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        if (ranks_[r].recv == kMoving) moving += (moving.empty() ? "" : ", ") + std::to_string(r);
      }
      std::string why = "timed out: " + std::to_string(started_) + " of " +
                        std::to_string(size_) + " ranks started the step";
      if (!missing.empty()) why += " (missing: rank " + missing + ")";
      if (!moving.empty()) why += "; chunks still moving to rank " + moving;
      complete = FailLocked(why);
    }
    Run(std::move(complete));
  }

  // Every rank that started has completed its done (or the step failed and nothing moves).
  bool Finished() {
    std::lock_guard<std::mutex> lock(mu_);
    if (completed_ == size_) return true;
    if (!failed_) return false;
    for (const Rank& r : ranks_) {
      if (r.recv == kMoving || (r.started && !r.completed)) return false;
    }
    return true;
  }

  bool failed() const { return failed_flag_.load(std::memory_order_relaxed); }

 private:
  // The chunk of a rank: not moving yet, moving (over the link, or locally out of the staging
  // buffer), in the staging buffer waiting for its receiver to start, arrived, or stopped.
  enum RecvState { kPending, kMoving, kStaged, kArrived, kStopped };
  struct Rank {
    bool started = false;
    bool done_called = false;
    bool completed = false;
    Endpoint ep;
    RecvState recv = kPending;
    bool sender_read = false;          // the link move out of the sender's buffer has finished
    std::unique_ptr<char[]> staging;   // the chunk sent before this rank started
    size_t staged_bytes = 0;
    DoneCallback then;
  };

  std::string SizeErrorLocked(int sender, int receiver, size_t sent_bytes) const {
    const size_t expected = ranks_[receiver].ep.bytes;
    if (sent_bytes == expected) return std::string();
    return "ranks disagree on the chunk size (" + std::to_string(sent_bytes) +
           " bytes from rank " + std::to_string(sender) + ", " + std::to_string(expected) +
           " expected by rank " + std::to_string(receiver) + ")";
  }

  Move MakeMove(int sender, int receiver, Endpoint to, bool local = false) {
    auto self = shared_from_this();
    Move m{sender, receiver, ranks_[sender].ep, to, local, nullptr, nullptr};
    m.failed = [self] { return self->failed(); };
    m.finished = [self, receiver, local](bool ok) { self->Moved(receiver, ok, local); };
    return m;
  }
  Move MakeMove(int sender, int receiver) {
    return MakeMove(sender, receiver, ranks_[receiver].ep);
  }
  // Sender -> the receiver's staging buffer (the receiver has not started); false when the
  // buffer cannot be allocated (nothing changed then).
  bool MakeStagingMove(int sender, int receiver, Move* out) {
    Rank& to = ranks_[receiver];
    const size_t bytes = ranks_[sender].ep.bytes;
    to.staging.reset(new (std::nothrow) char[std::max<size_t>(bytes, 1)]);
    if (!to.staging) return false;
    to.staged_bytes = bytes;
    Endpoint buffer;
    buffer.recv = to.staging.get();
    buffer.bytes = to.staged_bytes;
    *out = MakeMove(sender, receiver, buffer);
    return true;
  }
  // The staged chunk of a started receiver: the local move from the staging buffer into its
  // buffer (appended to `out`, the chunk marked moving), or the error if the sizes disagree.
  std::string UnstageLocked(int receiver, std::vector<Move>* out) {
    const int sender = sender_of(receiver);
    Rank& to = ranks_[receiver];
    std::string error = SizeErrorLocked(sender, receiver, to.staged_bytes);
    if (!error.empty()) return error;
    to.recv = kMoving;
    Move m = MakeMove(sender, receiver, to.ep, true);
    m.from.send = to.staging.get();
    out->push_back(std::move(m));
    return error;
  }

  void Moved(int receiver, bool ok, bool local) {
    std::vector<std::pair<DoneCallback, std::string>> complete;
    std::vector<Move> next;
    {
      std::lock_guard<std::mutex> lock(mu_);
      Rank& to = ranks_[receiver];
      if (!local) to.sender_read = ok;
      if (!ok) {
        to.recv = kStopped;
        if (!failed_) complete = FailLocked("a chunk move failed");
      } else if (local || !to.staging) {
        to.recv = kArrived;
      } else if (!to.started || failed_) {  // staged: the receiver copies it when it starts
        to.recv = kStaged;
      } else {
        const std::string error = UnstageLocked(receiver, &next);
        if (!error.empty()) {
          to.recv = kStopped;
          complete = FailLocked(error);
        }
      }
      TryCompleteLocked(receiver, &complete);
      TryCompleteLocked(sender_of(receiver), &complete);
    }
    Run(std::move(complete));
    for (auto& m : next) submit_(std::move(m));
  }

  // Completes `rank`'s done when its chunk has arrived and its send buffer has been read, or,
  // after a failure, when no move touches its buffers any more.
  void TryCompleteLocked(int rank, std::vector<std::pair<DoneCallback, std::string>>* out) {
    Rank& me = ranks_[rank];
    if (!me.done_called || me.completed) return;
    const Rank& peer = ranks_[receiver_of(rank)];
    const RecvState in = me.recv, sent = peer.recv;
    if (failed_) {
      if (in == kMoving || (sent == kMoving && !peer.sender_read)) return;
    } else if (in != kArrived || !peer.sender_read) {
      return;
    }
    me.completed = true;
    ++completed_;
    out->emplace_back(std::move(me.then), failed_ ? failure_ : std::string());
  }

  std::vector<std::pair<DoneCallback, std::string>> FailLocked(const std::string& why) {
    std::vector<std::pair<DoneCallback, std::string>> out;
    if (failed_) return out;
    failed_ = true;
    failed_flag_.store(true, std::memory_order_relaxed);
    failure_ = why;
    for (int r = 0; r < size_; ++r) TryCompleteLocked(r, &out);
    return out;
  }

  static void Run(std::vector<std::pair<DoneCallback, std::string>> complete) {
    for (auto& [cb, error] : complete) cb(error);
  }

  std::mutex mu_;
  const int size_;
  const int shift_;
  const Clock::time_point deadline_;
  const bool staged_;
  std::function<void(Move)> submit_;  // the platform's move callback (local moves of Moved)
  std::vector<Rank> ranks_;
  int started_ = 0;
  int completed_ = 0;
  bool failed_ = false;
  std::atomic<bool> failed_flag_{false};
  std::string failure_;
};

// The process-wide table of ring steps in progress.
class RingTable {
 public:
  static RingTable& Global() {
    static RingTable* instance = new RingTable();  // never destroyed (see Rendezvous)
    return *instance;
  }

  // This rank's next start of `key`; nullptr (and `error`) on a bad rank, size or shift.
  std::shared_ptr<Step> Start(const SiteKey& key, int rank, int size, int shift,
                              int64_t timeout_ms, std::string* error, bool staged = false) {
    if (size < 1 || rank < 0 || rank >= size) {
      *error = "rank " + std::to_string(rank) + " of " + std::to_string(size) +
               " is out of range";
      return nullptr;
    }
    if (timeout_ms <= 0) {
      *error = TimeoutError(timeout_ms);
      return nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    const StepKey sk{key, starts_.Next(key, rank)};
    auto it = steps_.find(sk);
    if (it == steps_.end()) {
      auto step = std::make_shared<Step>(size, shift, DeadlineAfter(timeout_ms), staged);
      it = steps_.emplace(sk, Entry{step, size, shift}).first;
      StartWatchdog();
      watchdog_cv_.notify_one();
    } else if (it->second.size != size || it->second.shift != shift) {
      *error = "ranks disagree on the ring (size " + std::to_string(size) + ", shift " +
               std::to_string(shift) + " vs " + std::to_string(it->second.size) + ", " +
               std::to_string(it->second.shift) + ")";
      return nullptr;
    }
    return it->second.step;
  }

  // The step this rank's next done of `key` finishes; nullptr if it never started one.
  std::shared_ptr<Step> Done(const SiteKey& key, int rank) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = steps_.find(StepKey{key, dones_.Next(key, rank)});
    return it == steps_.end() ? nullptr : it->second.step;
  }

  // Forgets the finished steps (called after every done completes, and by the watchdog).
  void Prune() {
    std::lock_guard<std::mutex> lock(mu_);
    PruneLocked();
  }

  size_t InProgress() {
    std::lock_guard<std::mutex> lock(mu_);
    PruneLocked();
    return steps_.size();
  }

 private:
  struct StepKey {
    SiteKey site;
    int64_t seq;
    bool operator<(const StepKey& o) const { return std::tie(site, seq) < std::tie(o.site, o.seq); }
  };
  struct Entry {
    std::shared_ptr<Step> step;
    int size;
    int shift;
  };
  void PruneLocked() {
    for (auto it = steps_.begin(); it != steps_.end();) {
      it = it->second.step->Finished() ? steps_.erase(it) : std::next(it);
    }
  }

  void StartWatchdog() {
    if (watchdog_started_) return;
    watchdog_started_ = true;
    std::thread([this] {
      for (;;) {
        std::vector<std::shared_ptr<Step>> live;
        {
          std::unique_lock<std::mutex> lock(mu_);
          watchdog_cv_.wait(lock, [&] { return !steps_.empty(); });
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto& kv : steps_) live.push_back(kv.second.step);
        }
        const auto now = Clock::now();
        for (auto& s : live) s->ExpireIfLate(now);
        Prune();
      }
    }).detach();
  }

  std::mutex mu_;
  bool watchdog_started_ = false;
  std::condition_variable watchdog_cv_;
  std::map<StepKey, Entry> steps_;
  SequenceCounter starts_, dones_;  // counted apart: the k-th done pairs with the k-th start
};

// The transport's own timeline (off unless a benchmark or test asks): what each rank did when,
// in system-clock microseconds (the clock jax.profiler's traces use), so copies can be laid
// beside the dots of a profiler trace.
class Timeline {
 public:
  enum Kind { kMove = 0, kStart = 1, kWait = 2 };
  struct Event {
    int kind;        // kMove: a chunk moving; kStart: a start call; kWait: done called -> done
    int64_t site;
    int rank;        // the receiver of a move, the caller of a start or done
    int peer;        // the sender of a move, else -1
    int64_t bytes;
    int64_t begin_us, end_us;
  };
  static Timeline& Global() {
    static Timeline* instance = new Timeline();
    return *instance;
  }
  static int64_t NowMicros() {
    return std::chrono::duration_cast<std::chrono::microseconds>(
               std::chrono::system_clock::now().time_since_epoch())
        .count();
  }
  bool recording() const { return recording_.load(std::memory_order_relaxed); }
  void Add(const Event& e) {
    if (!recording()) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (events_.size() < kMax) events_.push_back(e);
  }
  // Starts (true) or stops (false) recording; returns and clears what was recorded.
  std::vector<Event> Take(bool record) {
    std::lock_guard<std::mutex> lock(mu_);
    recording_.store(record, std::memory_order_relaxed);
    std::vector<Event> out;
    out.swap(events_);
    return out;
  }

 private:
  static constexpr size_t kMax = size_t(1) << 20;
  std::mutex mu_;
  std::atomic<bool> recording_{false};
  std::vector<Event> events_;
};

// The CPU's "link": a bounded pool of copy threads. A move is copied in slices; paced at
// `bytes_per_s` (> 0, link emulation for benchmarks) a slice is not started before the time the
// bytes before it would have taken on that link, and a waiting move holds no thread, so every
// link of a ring moves at the set rate at the same time. Unpaced (0), a move is one memcpy.
class CopyEngine {
 public:
  static CopyEngine& Global() {
    static CopyEngine* instance = new CopyEngine(kThreads);
    return *instance;
  }

  void Submit(Move move, double bytes_per_s, int64_t site) {
    auto job = std::make_shared<Job>();
    job->move = std::move(move);
    job->rate = bytes_per_s;
    job->site = site;
    job->begin = Clock::now();
    job->begin_us = Timeline::NowMicros();
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push({job->begin, serial_++, job});
    }
    cv_.notify_one();
  }

 private:
  static constexpr int kThreads = 4;
  static constexpr size_t kUnpacedSlice = size_t(1) << 30;
  struct Job {
    Move move;
    double rate;
    int64_t site;
    Clock::time_point begin;
    int64_t begin_us;
    size_t done = 0;
  };
  struct Queued {
    Clock::time_point when;
    uint64_t serial;
    std::shared_ptr<Job> job;
    bool operator>(const Queued& o) const {
      return std::tie(when, serial) > std::tie(o.when, o.serial);
    }
  };

  explicit CopyEngine(int threads) {
    for (int i = 0; i < threads; ++i) std::thread([this] { Run(); }).detach();
  }

  void Run() {
    for (;;) {
      std::shared_ptr<Job> job;
      {
        std::unique_lock<std::mutex> lock(mu_);
        for (;;) {
          if (queue_.empty()) {
            cv_.wait(lock);
            continue;
          }
          const auto when = queue_.top().when;
          if (when <= Clock::now()) break;
          cv_.wait_until(lock, when);
        }
        job = queue_.top().job;
        queue_.pop();
      }
      Slice(job);
    }
  }

  // Copies the job's next slice, then requeues it at the time its bytes would have taken.
  void Slice(const std::shared_ptr<Job>& job) {
    Move& m = job->move;
    const size_t total = m.to.bytes;
    if (m.failed()) return Finish(job, false);
    // About a millisecond of link time per slice (at least 64 KiB): the pace is smooth at the
    // timescale of a ring step and a failure stops a move within a slice.
    const size_t slice =
        job->rate > 0 ? std::max<size_t>(size_t(job->rate * 1e-3), size_t(64) << 10)
                      : kUnpacedSlice;
    const size_t n = std::min(slice, total - job->done);
    if (n) {
      std::memcpy(static_cast<char*>(m.to.recv) + job->done,
                  static_cast<const char*>(m.from.send) + job->done, n);
    }
    job->done += n;
    if (job->done >= total) return Finish(job, true);
    Clock::time_point when = Clock::now();
    if (job->rate > 0) {
      when = job->begin + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(double(job->done) / job->rate));
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push({when, serial_++, job});
    }
    cv_.notify_one();
  }

  void Finish(const std::shared_ptr<Job>& job, bool ok) {
    Move& m = job->move;
    if (ok && job->rate > 0) {  // the last slice's link time too
      const auto when = job->begin + std::chrono::duration_cast<Clock::duration>(
                                         std::chrono::duration<double>(double(m.to.bytes) /
                                                                       job->rate));
      if (when > Clock::now()) {
        std::lock_guard<std::mutex> lock(mu_);
        job->done = m.to.bytes;
        queue_.push({when, serial_++, FinishJob(job)});
        cv_.notify_one();
        return;
      }
    }
    if (!m.local) Record(job);  // the timeline shows the link's moves
    m.finished(ok);
  }

  // A job whose bytes are all copied and that only waits for its link time: requeued as a
  // zero-byte job that finishes when it comes up.
  std::shared_ptr<Job> FinishJob(const std::shared_ptr<Job>& job) {
    auto last = std::make_shared<Job>(*job);
    last->rate = 0;
    last->done = last->move.to.bytes;
    return last;
  }

  static void Record(const std::shared_ptr<Job>& job) {
    const Move& m = job->move;
    Timeline::Global().Add({Timeline::kMove, job->site, m.receiver, m.sender,
                            int64_t(m.to.bytes), job->begin_us, Timeline::NowMicros()});
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Queued, std::vector<Queued>, std::greater<Queued>> queue_;
  uint64_t serial_ = 0;
};

}  // namespace p2p
}  // namespace flashcomm

#endif  // FLASHCOMM_P2P_RING_H_
