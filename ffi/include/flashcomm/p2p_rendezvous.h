// long file: the in-process rendezvous: meetings, barriers, deadlines and continuation threads are
// one state machine
// The peer-to-peer transport's meeting point: the devices of one process find each other's
// buffers here (docs/transport.md). Host-side and platform-neutral: the CPU handlers
// (ffi/cpu/p2p_handlers.cc) and the CUDA handlers (ffi/cuda/p2p_handlers.cc) run the same
// protocol over it.
//
// One collective call of one call site by the `size` ranks of one replica group is a Meeting.
// Its key is (run id of the XLA execution, call site, replica group, sequence number), the
// sequence number counting this rank's earlier calls of the same site in the same run (a site
// inside a loop meets once per iteration). Each rank passes a series of barriers in order,
// publishing a set of pointers at each; a barrier opens when every rank has arrived, and then
// every rank sees every rank's pointers of that barrier. A buffer published at barrier k may
// be read by peers until they arrive at barrier k + 1: the protocols end with a barrier after
// the last read, so that no rank returns (and lets XLA reuse its buffers) while a peer still
// reads them. Arriving never blocks a thread: a rank hands over a continuation, which runs
// once every rank has arrived (on the transport's workers, the last rank's own inline), so a
// gang of peers never needs a thread each to wait in (XLA:CPU's thread pools are shared by
// every device and its executor may reach independent collectives in different orders on
// different devices). A watchdog gives up at the meeting's deadline: it is marked failed, every
// waiting continuation gets the error, and the error names the ranks that never came.
// A blocking Arrive (a condition variable, no spinning) serves callers that have a thread to
// wait in (the CUDA handlers).
#ifndef FLASHCOMM_P2P_RENDEZVOUS_H_
#define FLASHCOMM_P2P_RENDEZVOUS_H_

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

namespace flashcomm {
namespace p2p {

// The pointers a rank publishes at one barrier (codes, scale, zero of a payload, or an event).
using Published = std::array<const void*, 4>;

// Published[3] of a rank whose own work failed (a scratch allocation): it still passes every
// barrier, so that no peer loses a buffer it reads, and every rank's call ends with an error.
inline const char kRankFailed = 0;

// The longest wait a deadline allows: 2**31 - 1 ms (about 24.8 days; the Python side rejects
// longer timeouts). Longer timeouts are clamped to it, so that now + timeout never overflows
// the clock (a timeout of 2**62 ms or INT64_MAX used to give a deadline in the past: a healthy
// collective failed at once with "timed out").
constexpr int64_t kMaxTimeoutMs = (int64_t(1) << 31) - 1;

// now + timeout_ms, the timeout clamped to [0, kMaxTimeoutMs] (callers reject timeout_ms <= 0).
inline std::chrono::steady_clock::time_point DeadlineAfter(
    int64_t timeout_ms,
    std::chrono::steady_clock::time_point now = std::chrono::steady_clock::now()) {
  const int64_t ms = std::min<int64_t>(std::max<int64_t>(timeout_ms, 0), kMaxTimeoutMs);
  return now + std::chrono::milliseconds(ms);
}

// The error of a timeout that is not positive (nullptr-free: the message), for the handlers.
inline std::string TimeoutError(int64_t timeout_ms) {
  return "timeout_ms must be positive (got " + std::to_string(timeout_ms) + ")";
}

struct SiteKey {
  int64_t run_id;
  int64_t site;   // the call site (a trace-time id, an FFI attribute)
  int64_t group;  // the replica group (index over the mesh axes not reduced)
  bool operator<(const SiteKey& o) const {
    return std::tie(run_id, site, group) < std::tie(o.run_id, o.site, o.group);
  }
};

// How many times each rank has called each call site in each run: the sequence number that
// pairs the k-th calls of the ranks (a site inside a loop meets once per iteration). The
// counters of long-finished runs are forgotten (the last kRunsKept runs are kept).
class SequenceCounter {
 public:
  int64_t Next(const SiteKey& key, int rank) {
    if (runs_seen_.insert(key.run_id).second) {
      runs_.push_back(key.run_id);
      if (runs_.size() > kRunsKept) {
        const int64_t old = runs_.front();
        runs_.pop_front();
        runs_seen_.erase(old);
        seq_.erase(seq_.lower_bound({SiteKey{old, INT64_MIN, INT64_MIN}, INT32_MIN}),
                   seq_.lower_bound({SiteKey{old, INT64_MAX, INT64_MAX}, INT32_MAX}));
      }
    }
    return seq_[{key, rank}]++;
  }

 private:
  static constexpr size_t kRunsKept = 1024;
  std::map<std::pair<SiteKey, int>, int64_t> seq_;
  std::deque<int64_t> runs_;
  std::set<int64_t> runs_seen_;
};

// The transport's threads. Workers() run the continuations of meetings (codec work): one per
// core, at least two. Completions() complete the calls' futures: XLA continues a program on
// the thread that completes a future it waits for, and that may be an XLA collective that
// blocks until its peers arrive; so completions get a thread pool of their own that grows
// whenever every thread is busy (up to kMaxThreads), and the workers are never lent out.
// Created on first use, never destroyed (tasks may be pending at exit).
class ThreadPool {
 public:
  static ThreadPool& Workers() {
    static ThreadPool* instance =
        new ThreadPool(std::max(2u, std::thread::hardware_concurrency()), false);
    return *instance;
  }
  static ThreadPool& Completions() {
    static ThreadPool* instance = new ThreadPool(1, true);
    return *instance;
  }
  void Schedule(std::function<void()> task) {
    bool spawn = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
      if (elastic_ && idle_ < int(tasks_.size()) && threads_ < kMaxThreads) {
        ++threads_;
        spawn = true;
      }
    }
    if (spawn) std::thread([this] { Run(); }).detach();
    cv_.notify_one();
  }

 private:
  static constexpr int kMaxThreads = 1024;
  ThreadPool(unsigned threads, bool elastic) : elastic_(elastic), threads_(int(threads)) {
    for (unsigned i = 0; i < threads; ++i) std::thread([this] { Run(); }).detach();
  }
  void Run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        ++idle_;
        cv_.wait(lock, [&] { return !tasks_.empty(); });
        --idle_;
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }
  const bool elastic_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  int threads_;
  int idle_ = 0;
};

// Called once a barrier opens with every rank's pointers (error empty), or with the reason it
// never will (peers empty).
using Continuation =
    std::function<void(const std::vector<Published>& peers, const std::string& error)>;

class Meeting {
 public:
  Meeting(int size, int barriers, std::chrono::steady_clock::time_point deadline)
      : size_(size), deadline_(deadline), arrived_(barriers, 0),
        published_(barriers, std::vector<Published>(size)),
        came_(barriers, std::vector<bool>(size, false)), waiting_(barriers) {}

  // Arrive at `barrier` with `mine`; `then` runs once every rank has arrived: inline when this
  // rank is the last, else on a worker (at the last barrier, or when `inline_then`, inline in
  // the last rank's thread: continuations that only hand work out or complete their calls,
  // which a worker's wake-up would only delay). Never blocks.
  void Arrive(int barrier, int rank, const Published& mine, Continuation then,
              bool inline_then = false) {
    std::vector<Continuation> ready;
    std::vector<Published> peers;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) {
        error = failure_;
      } else {
        published_[barrier][rank] = mine;
        came_[barrier][rank] = true;
        if (++arrived_[barrier] < size_) {
          waiting_[barrier].push_back(std::move(then));
          cv_.notify_all();
          return;
        }
        ready.swap(waiting_[barrier]);
        peers = published_[barrier];
      }
    }
    cv_.notify_all();
    // The last barrier's continuations only complete their calls (every protocol ends with a
    // barrier whose continuation is Finish): they run here, in the last rank's thread, rather
    // than waking a worker each first.
    const bool here = inline_then || barrier + 1 == int(arrived_.size());
    for (auto& cont : ready) {
      if (here) {
        cont(peers, std::string());
      } else {
        ThreadPool::Workers().Schedule(
            [cont = std::move(cont), peers] { cont(peers, std::string()); });
      }
    }
    then(error.empty() ? peers : std::vector<Published>(), error);
  }

  // Arrive and wait in this thread (until the meeting's deadline) for every rank. On success
  // `peers` holds every rank's pointers of this barrier, indexed by rank.
  bool Arrive(int barrier, int rank, const Published& mine,
              std::chrono::steady_clock::time_point deadline, std::vector<Published>* peers,
              std::string* error) {
    std::unique_lock<std::mutex> lock(mu_);
    if (failed_) {
      *error = failure_;
      return false;
    }
    published_[barrier][rank] = mine;
    came_[barrier][rank] = true;
    if (++arrived_[barrier] == size_) {
      auto ready = std::move(waiting_[barrier]);
      waiting_[barrier].clear();
      const auto snapshot = published_[barrier];
      cv_.notify_all();
      for (auto& cont : ready) {
        ThreadPool::Workers().Schedule(
            [cont = std::move(cont), snapshot] { cont(snapshot, std::string()); });
      }
    } else if (!cv_.wait_until(lock, std::min(deadline, deadline_),
                               [&] { return failed_ || arrived_[barrier] == size_; })) {
      std::vector<Continuation> pending = FailLocked(Missing(barrier));
      lock.unlock();
      Notify(std::move(pending));
      lock.lock();
    }
    if (failed_) {
      *error = failure_;
      return false;
    }
    *peers = published_[barrier];
    return true;
  }

  // Fail the meeting now with `why` (a rank that cannot take part, e.g. its scratch allocation
  // failed before it published anything): every waiting rank gets the error at once, and every
  // later arrival too, instead of waiting for the deadline.
  void Abort(const std::string& why) {
    std::vector<Continuation> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_) return;
      pending = FailLocked(why);
    }
    Notify(std::move(pending));
  }

  // Whether the meeting failed, and why.
  bool Failed(std::string* why) {
    std::lock_guard<std::mutex> lock(mu_);
    if (failed_) *why = failure_;
    return failed_;
  }

  // The watchdog's check: past the deadline with a barrier still closed, fail the meeting.
  void ExpireIfLate(std::chrono::steady_clock::time_point now) {
    std::vector<Continuation> pending;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (failed_ || now < deadline_) return;
      int barrier = 0;
      while (barrier + 1 < int(arrived_.size()) && arrived_[barrier] == size_) ++barrier;
      pending = FailLocked(Missing(barrier));
    }
    Notify(std::move(pending));
  }

 private:
  std::vector<Continuation> FailLocked(const std::string& why) {
    failed_ = true;
    failure_ = why;
    cv_.notify_all();
    std::vector<Continuation> pending;
    for (auto& w : waiting_) {
      for (auto& cont : w) pending.push_back(std::move(cont));
      w.clear();
    }
    return pending;
  }

  void Notify(std::vector<Continuation> pending) {
    const std::string why = failure_;  // set once, never changed after failed_
    for (auto& cont : pending) {
      ThreadPool::Workers().Schedule([cont = std::move(cont), why] { cont({}, why); });
    }
  }

  std::string Missing(int barrier) const {
    std::string who;
    for (int r = 0; r < size_; ++r) {
      if (!came_[barrier][r]) who += (who.empty() ? "" : ", ") + std::to_string(r);
    }
    return "peer-to-peer collective: timed out at barrier " + std::to_string(barrier) + ": " +
           std::to_string(arrived_[barrier]) + " of " + std::to_string(size_) +
           " ranks arrived (missing: rank " + who + ")";
  }

  std::mutex mu_;
  std::condition_variable cv_;
  const int size_;
  const std::chrono::steady_clock::time_point deadline_;
  std::vector<int> arrived_;
  std::vector<std::vector<Published>> published_;
  std::vector<std::vector<bool>> came_;
  std::vector<std::vector<Continuation>> waiting_;
  bool failed_ = false;
  std::string failure_;
};

// The process-wide table of meetings in progress.
class Rendezvous {
 public:
  static Rendezvous& Global() {
    static Rendezvous* instance = new Rendezvous();  // never destroyed: handlers may outlive
    return *instance;                                // static destruction at exit
  }

  // Join this rank's next call of `key`; nullptr (and `error`) on a bad rank or size.
  std::shared_ptr<Meeting> Join(const SiteKey& key, int rank, int size, int barriers,
                                std::string* error, int64_t timeout_ms = 60000) {
    if (size < 1 || rank < 0 || rank >= size) {
      *error = "peer-to-peer collective: rank " + std::to_string(rank) + " of " +
               std::to_string(size) + " is out of range";
      return nullptr;
    }
    if (timeout_ms <= 0) {
      *error = "peer-to-peer collective: " + TimeoutError(timeout_ms);
      return nullptr;
    }
    std::shared_ptr<Meeting> meeting;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t seq = seq_.Next(key, rank);
      const MeetingKey mk{key, seq};
      auto it = meetings_.find(mk);
      if (it == meetings_.end()) {
        const auto deadline = DeadlineAfter(timeout_ms);
        Entry entry{std::make_shared<Meeting>(size, barriers, deadline), size, 0};
        auto late = failed_.find(mk);
        if (late != failed_.end()) {
          // Its peers met without it, failed and left (XLA started this rank's execution
          // late): fail at once rather than wait a whole timeout alone.
          entry.meeting->Abort(late->second + " (this rank arrived after its peers had left)");
        }
        StartWatchdog();
        watchdog_cv_.notify_one();
        it = meetings_.emplace(mk, std::move(entry)).first;
      } else if (it->second.size != size) {
        *error = "peer-to-peer collective: ranks disagree on the group size (" +
                 std::to_string(size) + " vs " + std::to_string(it->second.size) + ")";
        return nullptr;
      }
      ++it->second.joined;
      meeting = it->second.meeting;
      joined_[meeting.get()] = mk;
    }
    return meeting;
  }

  // Done with `meeting` (after the protocol's last barrier, or after an error): the last rank
  // to leave removes it.
  void Leave(const std::shared_ptr<Meeting>& meeting) {
    std::lock_guard<std::mutex> lock(mu_);
    auto j = joined_.find(meeting.get());
    if (j == joined_.end()) return;
    auto it = meetings_.find(j->second);
    if (it != meetings_.end() && ++it->second.left == it->second.joined) {
      std::string why;
      if (it->second.joined < it->second.size && it->second.meeting->Failed(&why)) {
        RememberFailedLocked(it->first, why);  // a rank that never came may still come
      }
      joined_.erase(j);
      meetings_.erase(it);
    }
  }

  // Meetings in progress (for tests: zero once every call has returned).
  size_t InProgress() {
    std::lock_guard<std::mutex> lock(mu_);
    return meetings_.size();
  }

 private:
  // Fails the meetings that are past their deadline (a continuation never waits on its own).
  void StartWatchdog() {
    if (watchdog_started_) return;
    watchdog_started_ = true;
    std::thread([this] {
      for (;;) {
        std::vector<std::shared_ptr<Meeting>> live;
        {
          std::unique_lock<std::mutex> lock(mu_);
          watchdog_cv_.wait(lock, [&] { return !meetings_.empty(); });
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        {
          std::lock_guard<std::mutex> lock(mu_);
          for (auto& kv : meetings_) live.push_back(kv.second.meeting);
        }
        const auto now = std::chrono::steady_clock::now();
        for (auto& m : live) m->ExpireIfLate(now);
      }
    }).detach();
  }

  struct MeetingKey {
    SiteKey site;
    int64_t seq;
    bool operator<(const MeetingKey& o) const {
      return std::tie(site, seq) < std::tie(o.site, o.seq);
    }
  };

  // The failures of the last kFailedKept meetings that ended without every rank.
  void RememberFailedLocked(const MeetingKey& key, const std::string& why) {
    if (failed_.emplace(key, why).second) failed_order_.push_back(key);
    if (failed_order_.size() > kFailedKept) {
      failed_.erase(failed_order_.front());
      failed_order_.pop_front();
    }
  }
  static constexpr size_t kFailedKept = 1024;
  std::map<MeetingKey, std::string> failed_;
  std::deque<MeetingKey> failed_order_;
  struct Entry {
    std::shared_ptr<Meeting> meeting;
    int size;
    int joined;
    int left = 0;
  };
  std::mutex mu_;
  bool watchdog_started_ = false;
  std::condition_variable watchdog_cv_;  // meetings_ became non-empty
  std::map<MeetingKey, Entry> meetings_;
  std::map<const Meeting*, MeetingKey> joined_;
  SequenceCounter seq_;
};

}  // namespace p2p
}  // namespace flashcomm

#endif  // FLASHCOMM_P2P_RENDEZVOUS_H_
