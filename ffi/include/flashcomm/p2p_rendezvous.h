// The peer-to-peer transport's meeting point: the devices of one process find each other's
// buffers here (docs/transport.md). Host-side and platform-neutral: the CPU handlers
// (ffi/cpu/p2p_kernels.cc) and the CUDA handlers (ffi/cuda/p2p_handlers.cc) run the same
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
// reads them. Waits block on a condition variable (no spinning) and give up at a deadline:
// the meeting is then marked failed, every waiting rank returns the error, and the error names
// the ranks that never came.
#ifndef FLASHCOMM_P2P_RENDEZVOUS_H_
#define FLASHCOMM_P2P_RENDEZVOUS_H_

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

namespace flashcomm {
namespace p2p {

// The pointers a rank publishes at one barrier (codes, scale, zero of a payload, or an event).
using Published = std::array<const void*, 4>;

struct SiteKey {
  int64_t run_id;
  int64_t site;   // the call site (a trace-time id, an FFI attribute)
  int64_t group;  // the replica group (index over the mesh axes not reduced)
  bool operator<(const SiteKey& o) const {
    return std::tie(run_id, site, group) < std::tie(o.run_id, o.site, o.group);
  }
};

class Meeting {
 public:
  Meeting(int size, int barriers)
      : size_(size), arrived_(barriers, 0), published_(barriers, std::vector<Published>(size)),
        came_(barriers, std::vector<bool>(size, false)), ranks_(size, false) {}

  // Arrive at barrier `barrier` with `mine`; wait (until `deadline`) for every rank. On
  // success `peers` holds every rank's pointers of this barrier, indexed by rank.
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
      cv_.notify_all();
    } else if (!cv_.wait_until(lock, deadline,
                               [&] { return failed_ || arrived_[barrier] == size_; })) {
      failed_ = true;
      failure_ = Missing(barrier);
      cv_.notify_all();
    }
    if (failed_) {
      *error = failure_;
      return false;
    }
    *peers = published_[barrier];
    return true;
  }

  // Claim `rank` (a second claim means two devices think they are the same rank).
  bool Claim(int rank, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ranks_[rank]) {
      *error = "rank " + std::to_string(rank) + " joined the same call twice (are there mesh "
               "axes outside the shard_map that are not reduced over?)";
      failed_ = true;
      failure_ = *error;
      cv_.notify_all();
      return false;
    }
    ranks_[rank] = true;
    return true;
  }

 private:
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
  std::vector<int> arrived_;
  std::vector<std::vector<Published>> published_;
  std::vector<std::vector<bool>> came_;
  std::vector<bool> ranks_;
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
                                std::string* error) {
    if (size < 1 || rank < 0 || rank >= size) {
      *error = "peer-to-peer collective: rank " + std::to_string(rank) + " of " +
               std::to_string(size) + " is out of range";
      return nullptr;
    }
    std::shared_ptr<Meeting> meeting;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const int64_t seq = NextSeq(key, rank);
      const MeetingKey mk{key, seq};
      auto it = meetings_.find(mk);
      if (it == meetings_.end()) {
        Entry entry{std::make_shared<Meeting>(size, barriers), size, 0};
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
    if (!meeting->Claim(rank, error)) {
      Leave(meeting);
      return nullptr;
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
  struct MeetingKey {
    SiteKey site;
    int64_t seq;
    bool operator<(const MeetingKey& o) const {
      return std::tie(site, seq) < std::tie(o.site, o.seq);
    }
  };
  struct Entry {
    std::shared_ptr<Meeting> meeting;
    int size;
    int joined;
    int left = 0;
  };
  static constexpr size_t kRunsKept = 1024;

  int64_t NextSeq(const SiteKey& key, int rank) {
    if (runs_seen_.insert(key.run_id).second) {
      runs_.push_back(key.run_id);
      if (runs_.size() > kRunsKept) {  // forget the sequence counters of long-finished runs
        const int64_t old = runs_.front();
        runs_.pop_front();
        runs_seen_.erase(old);
        seq_.erase(seq_.lower_bound({SiteKey{old, INT64_MIN, INT64_MIN}, INT32_MIN}),
                   seq_.lower_bound({SiteKey{old, INT64_MAX, INT64_MAX}, INT32_MAX}));
      }
    }
    return seq_[{key, rank}]++;
  }

  std::mutex mu_;
  std::map<MeetingKey, Entry> meetings_;
  std::map<const Meeting*, MeetingKey> joined_;
  std::map<std::pair<SiteKey, int>, int64_t> seq_;
  std::deque<int64_t> runs_;
  std::set<int64_t> runs_seen_;
};

}  // namespace p2p
}  // namespace flashcomm

#endif  // FLASHCOMM_P2P_RENDEZVOUS_H_
