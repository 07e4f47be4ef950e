// long file: the shared-memory meeting point: blocks, segments, meetings, the emulated bus and the
// C API the CUDA module binds share one state and its lock
// The shared-memory meeting point (cpu/shm_rendezvous.h has the design).
#include "cpu/shm_rendezvous.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <atomic>
#include <chrono>
#include <climits>
#include <cstring>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>
#include <utility>

namespace flashcomm {
namespace shm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic = 0x326d63687361666cULL;  // "lfashcm2"
constexpr int kChannels = 1024;
constexpr int kActive = 64;   // calls of a process named in its block at once (errors only)
constexpr int kNames = 1024;  // call sites whose description a process publishes
constexpr int kNameProbe = 16;
constexpr int kBarriers = 4;
constexpr int kRegions = 4;
constexpr int kMembers = 256;

// Everything a peer reads from another process's block is plain data written before the owner
// publishes it with a release store of its ticket (or member count) and read after an acquire
// load of it.
struct Region {
  int64_t offset;
  int64_t bytes;
};
struct Record {
  int64_t site, group, seq;
  uint64_t descriptor;
  int64_t failed;
  int64_t seg_fd, seg_gen, seg_bytes;
  Region regions[kRegions];
};
struct alignas(64) ChannelRec {
  int64_t ticket;
  Record records[kBarriers];
};
struct Member {
  int64_t axes_key, group, rank, size;
};
// A call this process has joined and not left (site 0: a free slot), for peers' errors.
struct Active {
  int64_t site, seq;
};
// What a call site is, as Python described it at trace time (SiteName: site 0 is free).
struct SiteName {
  int64_t site;
  char text[120];
};
struct Block {
  uint64_t magic;
  int64_t pid;
  int64_t process_index;
  alignas(64) uint32_t doorbell;
  alignas(64) int64_t bus_free_ns;  // the emulated bus is reserved until then (CLOCK_MONOTONIC)
  alignas(64) int64_t members;
  Member member[kMembers];
  ChannelRec channels[kChannels];
  Active active[kActive];
  SiteName names[kNames];
};

int64_t LoadAcquire(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_ACQUIRE); }
void StoreRelease(int64_t* p, int64_t v) { __atomic_store_n(p, v, __ATOMIC_RELEASE); }

void Ring(Block* block) {
  __atomic_fetch_add(&block->doorbell, 1u, __ATOMIC_RELEASE);
  syscall(SYS_futex, &block->doorbell, FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
}

std::string Errno(const std::string& what) { return what + ": " + std::strerror(errno); }

// A memfd of `bytes` mapped read-write; base null (and `error`) on failure.
struct Segment {
  int fd = -1;
  uint8_t* base = nullptr;
  size_t bytes = 0;
  int64_t gen = 0;
};
bool NewSegment(const char* name, size_t bytes, Segment* seg, std::string* error) {
  const int fd = int(syscall(SYS_memfd_create, name, MFD_CLOEXEC));
  if (fd < 0) return *error = Errno("memfd_create"), false;
  if (ftruncate(fd, off_t(bytes)) != 0) {
    *error = Errno("ftruncate of a " + std::to_string(bytes) + "-byte segment");
    close(fd);
    return false;
  }
  void* base = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    *error = Errno("mmap of a " + std::to_string(bytes) + "-byte segment");
    close(fd);
    return false;
  }
  seg->fd = fd;
  seg->base = static_cast<uint8_t*>(base);
  seg->bytes = bytes;
  return true;
}

// Maps another process's memfd (pid, fd) of at least `bytes`.
void* MapPeer(int64_t pid, int64_t fd, size_t bytes, int prot, std::string* error) {
  const std::string path = "/proc/" + std::to_string(pid) + "/fd/" + std::to_string(fd);
  const int local = open(path.c_str(), ((prot & PROT_WRITE) ? O_RDWR : O_RDONLY) | O_CLOEXEC);
  if (local < 0) return *error = Errno("open " + path), nullptr;
  struct stat st {};
  if (fstat(local, &st) != 0 || size_t(st.st_size) < bytes) {
    *error = path + " is smaller than its owner says (" + std::to_string(bytes) + " bytes)";
    close(local);
    return nullptr;
  }
  void* base = mmap(nullptr, bytes, prot, MAP_SHARED, local, 0);
  close(local);
  if (base == MAP_FAILED) return *error = Errno("mmap " + path), nullptr;
  return base;
}

// Whether process `pid` has exited (gone, or a zombie nobody has reaped yet).
bool Exited(int64_t pid) {
  if (kill(pid_t(pid), 0) != 0 && errno == ESRCH) return true;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  return paren != std::string::npos && paren + 2 < text.size() &&
         (text[paren + 2] == 'Z' || text[paren + 2] == 'X');
}

}  // namespace

struct Meeting {
  JoinArgs args;
  int64_t seq = 0;
  int channel = 0;
  bool started = false;  // owns its channel
  bool left = false;
  int64_t start_ticket = 0;
  Clock::time_point deadline;
  std::vector<int> procs;  // rank -> process index (resolved at the first barrier)
  // The barrier waited on (-1: none) and what runs when it opens.
  int waiting = -1;
  p2p::Continuation then;
  // The first arrival of a call still queued behind its channel's previous call.
  bool deferred = false;
  Spans deferred_spans;
  bool deferred_failed = false;
  int64_t deferred_wire = 0;
  bool failed = false;
  std::string failure;
  int active_slot = -1;  // its entry in this process's Block::active
};

namespace {

class Engine {
 public:
  static Engine& Global() {
    static Engine* engine = new Engine();  // never destroyed: continuations may be pending
    return *engine;
  }

  bool CreateBlock(int64_t process_index, BlockId* id, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mine_ == nullptr) {
      Segment seg;
      if (!NewSegment("flashcomm-block", sizeof(Block), &seg, error)) return false;
      mine_ = reinterpret_cast<Block*>(seg.base);
      mine_fd_ = seg.fd;
      mine_->magic = kMagic;
      mine_->pid = getpid();
      mine_->process_index = process_index;
      process_index_ = process_index;
    }
    *id = BlockId{process_index_, mine_->pid, mine_fd_};
    return true;
  }

  bool AttachBlocks(const std::vector<BlockId>& blocks, std::string* error) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mine_ == nullptr) return *error = "this process has no block yet", false;
    for (const BlockId& b : blocks) {
      if (b.process_index == process_index_) {
        blocks_[b.process_index] = mine_;
        pids_[b.process_index] = mine_->pid;
        continue;
      }
      auto it = pids_.find(b.process_index);
      if (it != pids_.end() && it->second == b.pid) continue;
      void* base = MapPeer(b.pid, b.fd, sizeof(Block), PROT_READ | PROT_WRITE, error);
      if (base == nullptr) return false;
      auto* block = static_cast<Block*>(base);
      if (block->magic != kMagic || block->pid != b.pid ||
          block->process_index != b.process_index) {
        munmap(base, sizeof(Block));
        *error = "the block of process " + std::to_string(b.process_index) +
                 " is not a flashcomm block of this version";
        return false;
      }
      blocks_[b.process_index] = block;
      pids_[b.process_index] = b.pid;
    }
    StartProgress();
    return true;
  }

  int Attached() {
    std::lock_guard<std::mutex> lock(mu_);
    return int(blocks_.size());
  }

  std::shared_ptr<Meeting> Join(const JoinArgs& args, std::string* error) {
    if (args.size < 1 || args.rank < 0 || args.rank >= args.size) {
      *error = "rank " + std::to_string(args.rank) + " of " + std::to_string(args.size) +
               " is out of range";
      return nullptr;
    }
    if (args.timeout_ms <= 0) return *error = p2p::TimeoutError(args.timeout_ms), nullptr;
    if (args.barriers < 1 || args.barriers > kBarriers) {
      return *error = "at most " + std::to_string(kBarriers) + " barriers", nullptr;
    }
    std::lock_guard<std::mutex> lock(mu_);
    if (mine_ == nullptr || blocks_.empty()) {
      *error = "the shared-memory transport is not set up in this process "
               "(jax_flashcomm.transport.shm.setup)";
      return nullptr;
    }
    if (!AddMemberLocked(args, error)) return nullptr;
    auto m = std::make_shared<Meeting>();
    m->args = args;
    m->seq = seqs_[{args.site, args.group}]++;
    m->channel = int((uint64_t(args.site) * 1000003u + uint64_t(args.group)) % kChannels);
    for (int i = 0; i < kActive; ++i) {
      Active& slot = mine_->active[i];
      if (LoadAcquire(&slot.site) != 0) continue;
      slot.seq = m->seq;
      StoreRelease(&slot.site, args.site);
      m->active_slot = i;
      break;
    }
    in_progress_.push_back(m);
    auto& queue = queues_[m->channel];
    queue.push_back(m);
    if (queue.size() == 1 && !drains_.count(m->channel)) StartLocked(m);
    return m;
  }

  void Arrive(const std::shared_ptr<Meeting>& m, int barrier, const Spans& spans, bool failed,
              p2p::Continuation then, int64_t wire_bytes) {
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!m->failed && !m->started) {  // queued: arrives when its channel is free
        m->deferred = true;
        m->deferred_spans = spans;
        m->deferred_wire = wire_bytes;
        m->deferred_failed = failed;
        m->then = std::move(then);
        return;
      }
      if (m->failed) error = m->failure;
    }
    if (!error.empty()) return then({}, error);
    Publish(m, barrier, spans, failed, std::move(then), wire_bytes);
  }

  void Abort(const std::shared_ptr<Meeting>& m, const std::string& why) {
    std::lock_guard<std::mutex> lock(mu_);
    FailLocked(m, why);
  }

  void Leave(const std::shared_ptr<Meeting>& m) {
    std::vector<std::shared_ptr<Meeting>> runnable;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (m->left) return;
      m->left = true;
      if (m->active_slot >= 0) StoreRelease(&mine_->active[m->active_slot].site, 0);
      for (auto it = in_progress_.begin(); it != in_progress_.end(); ++it) {
        if (*it == m) {
          in_progress_.erase(it);
          break;
        }
      }
      auto& queue = queues_[m->channel];
      for (auto it = queue.begin(); it != queue.end(); ++it) {
        if (*it == m) {
          queue.erase(it);
          break;
        }
      }
      if (m->started) {
        // Pass any barrier left (a failed call): the channel's tickets stay aligned.
        ChannelRec& ch = mine_->channels[m->channel];
        const int64_t end = m->start_ticket + m->args.barriers;
        if (LoadAcquire(&ch.ticket) < end) StoreRelease(&ch.ticket, end);
        if (m->failed && !m->procs.empty()) {
          // The channel's next call waits until every peer is past this one too (or a short
          // while): its records must not change under a peer still reading why it failed.
          const auto wait = std::min<int64_t>(m->args.timeout_ms, 5000);
          drains_[m->channel] = Drain{end, m->procs, p2p::DeadlineAfter(wait)};
          Ring(mine_);
        } else {
          StartNextLocked(m->channel, &runnable);
        }
      }
    }
    ScheduleDeferred(runnable);
  }

  // Publishes what `site` is (its description at trace time) for the errors of peers.
  void NameSite(int64_t site, const std::string& text) {
    std::lock_guard<std::mutex> lock(mu_);
    if (mine_ == nullptr || site == 0) return;
    for (int i = 0; i < kNameProbe; ++i) {
      SiteName& e = mine_->names[(uint64_t(site) + uint64_t(i)) % kNames];
      const int64_t at = LoadAcquire(&e.site);
      if (at == site) return;
      if (at != 0) continue;
      const size_t n = std::min(text.size(), sizeof(e.text) - 1);
      std::memcpy(e.text, text.data(), n);
      e.text[n] = '\0';
      StoreRelease(&e.site, site);
      return;
    }
  }

  size_t InProgress() {
    std::lock_guard<std::mutex> lock(mu_);
    return in_progress_.size();
  }

  void SetLinkRate(double bytes_per_s) { rate_.store(bytes_per_s > 0 ? bytes_per_s : 0.0); }
  double LinkRate() const { return rate_.load(); }

  void Pace(int64_t bytes) {
    if (const int64_t end = ReserveBus(bytes)) {
      std::this_thread::sleep_until(Clock::time_point(std::chrono::nanoseconds(end)));
    }
  }

  int64_t ReserveBus(int64_t bytes) {
    const double rate = rate_.load();
    if (rate <= 0 || bytes <= 0) return 0;
    Block* bus = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (blocks_.empty()) return 0;
      bus = blocks_.begin()->second;
    }
    const int64_t duration = int64_t(double(bytes) * 1e9 / rate);
    int64_t end = 0;
    for (;;) {
      const int64_t now = std::chrono::duration_cast<std::chrono::nanoseconds>(
                              Clock::now().time_since_epoch()).count();
      int64_t free_at = LoadAcquire(&bus->bus_free_ns);
      end = std::max(now, free_at) + duration;
      if (__atomic_compare_exchange_n(&bus->bus_free_ns, &free_at, end, false, __ATOMIC_ACQ_REL,
                                      __ATOMIC_ACQUIRE)) {
        break;
      }
    }
    return end;
  }

  size_t Segments() {
    std::lock_guard<std::mutex> lock(mu_);
    return own_.size() + peer_.size();
  }

 private:
  Engine() = default;

  bool AddMemberLocked(const JoinArgs& a, std::string* error) {
    const auto key = std::make_tuple(a.axes_key, a.group, int64_t(a.size));
    auto it = my_rank_.find(key);
    if (it != my_rank_.end()) {
      if (it->second == a.rank) return true;
      *error = "this process is rank " + std::to_string(it->second) + " and " +
               std::to_string(a.rank) + " of one group (one device per process)";
      return false;
    }
    const int64_t n = mine_->members;
    if (n >= kMembers) return *error = "too many replica groups in this process", false;
    mine_->member[n] = Member{a.axes_key, a.group, a.rank, a.size};
    StoreRelease(&mine_->members, n + 1);
    my_rank_[key] = a.rank;
    return true;
  }

  struct Drain {
    int64_t end;             // the failed call's last ticket
    std::vector<int> procs;  // its ranks' processes
    Clock::time_point deadline;
  };

  // Starts the channel's next queued call, if any (and no failed call is draining).
  void StartNextLocked(int channel, std::vector<std::shared_ptr<Meeting>>* runnable) {
    auto& queue = queues_[channel];
    if (queue.empty() || queue.front()->started || drains_.count(channel)) return;
    StartLocked(queue.front());
    if (queue.front()->deferred) runnable->push_back(queue.front());
  }

  // Publishes the first arrival of calls that were queued behind their channel.
  void ScheduleDeferred(const std::vector<std::shared_ptr<Meeting>>& runnable) {
    for (auto& next : runnable) {
      p2p::ThreadPool::Workers().Schedule([this, next] {
        p2p::Continuation then;
        {
          std::lock_guard<std::mutex> lock(mu_);
          if (!next->deferred) return;  // failed meanwhile: FailLocked handed `then` the error
          next->deferred = false;
          then = std::move(next->then);
        }
        Publish(next, 0, next->deferred_spans, next->deferred_failed, std::move(then),
                next->deferred_wire);
      });
    }
  }

  // Ends the drains whose peers are all past the failed call (or whose time is up).
  void DrainLocked(Clock::time_point now, std::vector<std::shared_ptr<Meeting>>* runnable) {
    for (auto it = drains_.begin(); it != drains_.end();) {
      bool past = true;
      for (int proc : it->second.procs) {
        past = past && LoadAcquire(&blocks_.at(proc)->channels[it->first].ticket) >=
                           it->second.end;
      }
      if (past || now >= it->second.deadline) {
        const int channel = it->first;
        it = drains_.erase(it);
        StartNextLocked(channel, runnable);
      } else {
        ++it;
      }
    }
  }

  void StartLocked(const std::shared_ptr<Meeting>& m) {
    m->started = true;
    m->start_ticket = LoadAcquire(&mine_->channels[m->channel].ticket);
    m->deadline = p2p::DeadlineAfter(m->args.timeout_ms);
  }

  // Copies `spans` into this rank's segment of (channel, barrier), publishes the record and
  // the ticket, rings the peers and leaves the wait to the progress thread.
  void Publish(const std::shared_ptr<Meeting>& m, int barrier, const Spans& spans, bool failed,
               p2p::Continuation then, int64_t wire_bytes) {
    size_t total = 0;
    for (const Span& s : spans) total += (s.bytes + 63) & ~size_t(63);
    Segment* seg = nullptr;
    std::string error;
    {
      std::lock_guard<std::mutex> lock(mu_);
      seg = &own_[{m->channel, barrier}];
      if (seg->bytes < total) {
        Segment grown;
        size_t bytes = 4096;
        while (bytes < total) bytes *= 2;
        if (NewSegment("flashcomm-segment", bytes, &grown, &error)) {
          if (seg->base != nullptr) {
            munmap(seg->base, seg->bytes);
            close(seg->fd);
          }
          grown.gen = ++generation_;
          *seg = grown;
        }
      }
    }
    if (!error.empty()) failed = true;
    Region regions[kRegions];
    int64_t offset = 0;
    for (int i = 0; i < kRegions; ++i) {
      const Span& s = spans[i];
      const bool copy = !failed && s.data != nullptr && s.bytes > 0;
      regions[i] = Region{offset, copy ? int64_t(s.bytes) : 0};
      if (copy) std::memcpy(seg->base + offset, s.data, s.bytes);
      offset += int64_t((s.bytes + 63) & ~size_t(63));
    }
    if (!failed) Pace(wire_bytes);
    std::vector<Block*> ring;
    {
      // The record is written under the lock, so that a failure (FailLocked) cannot interleave.
      std::lock_guard<std::mutex> lock(mu_);
      if (m->failed) {
        error = m->failure;
      } else {
        ChannelRec& ch = mine_->channels[m->channel];
        Record& rec = ch.records[barrier];
        rec.site = m->args.site;
        rec.group = m->args.group;
        rec.seq = m->seq;
        rec.descriptor = m->args.descriptor;
        rec.failed = failed ? 1 : 0;
        rec.seg_fd = seg->fd;
        rec.seg_gen = seg->gen;
        rec.seg_bytes = int64_t(seg->bytes);
        for (int i = 0; i < kRegions; ++i) rec.regions[i] = regions[i];
        StoreRelease(&ch.ticket, m->start_ticket + barrier + 1);
        m->waiting = barrier;
        m->then = std::move(then);
        pending_.push_back(m);
        for (auto& kv : blocks_) ring.push_back(kv.second);
      }
    }
    if (!error.empty()) return then({}, error);
    for (Block* b : ring) Ring(b);
  }

  // Resolves rank -> process from the blocks' member tables; false while a rank is missing.
  bool ResolveLocked(Meeting& m, std::string* error) {
    if (!m.procs.empty()) return true;
    std::vector<int> procs(m.args.size, -1);
    for (auto& kv : blocks_) {
      const Block* b = kv.second;
      const int64_t n = std::min<int64_t>(LoadAcquire(&b->members), kMembers);
      for (int64_t i = 0; i < n; ++i) {
        const Member& mem = b->member[i];
        if (mem.axes_key != m.args.axes_key || mem.group != m.args.group ||
            mem.size != m.args.size || mem.rank < 0 || mem.rank >= m.args.size) {
          continue;
        }
        if (procs[mem.rank] >= 0 && procs[mem.rank] != kv.first) {
          *error = "processes " + std::to_string(procs[mem.rank]) + " and " +
                   std::to_string(kv.first) + " both claim rank " + std::to_string(mem.rank) +
                   " of one group";
          return false;
        }
        procs[mem.rank] = int(kv.first);
      }
    }
    for (int p : procs) {
      if (p < 0) return false;
    }
    m.procs = procs;
    return true;
  }

  // Marks `m` failed, passes its remaining barriers (peers see the failure) and hands the
  // error to its waiting continuation, if any.
  void FailLocked(const std::shared_ptr<Meeting>& m, const std::string& why) {
    if (m->failed || m->left) return;
    m->failed = true;
    m->failure = why;
    if (m->started) {
      ChannelRec& ch = mine_->channels[m->channel];
      const int64_t done = LoadAcquire(&ch.ticket) - m->start_ticket;
      for (int64_t b = std::max<int64_t>(done, 0); b < m->args.barriers; ++b) {
        Record& rec = ch.records[b];
        rec.site = m->args.site;
        rec.group = m->args.group;
        rec.seq = m->seq;
        rec.descriptor = m->args.descriptor;
        rec.failed = 1;
        for (Region& r : rec.regions) r = Region{0, 0};
      }
      StoreRelease(&ch.ticket, m->start_ticket + m->args.barriers);
      for (auto& kv : blocks_) Ring(kv.second);
    }
    if (m->waiting >= 0 || m->deferred) {
      m->waiting = -1;
      m->deferred = false;
      auto then = std::move(m->then);
      p2p::ThreadPool::Workers().Schedule([then, why] { then({}, why); });
    }
  }

  // One look at a waiting call: opens its barrier, fails it, or leaves it waiting.
  void CheckLocked(const std::shared_ptr<Meeting>& m, Clock::time_point now, bool check_exits) {
    // long function: every way a meeting's peers can disagree, exit or time out, checked in one
    // pass under the lock
    const JoinArgs& a = m->args;
    const int b = m->waiting;
    std::string error;
    if (!ResolveLocked(*m, &error)) {
      if (!error.empty()) return FailLocked(m, "shared-memory collective: " + error);
      for (auto& kv : pids_) {  // a peer that exits before its first call of this group
        if (check_exits && kv.first != process_index_ && Exited(kv.second)) {
          return FailLocked(m, "shared-memory collective: process " + std::to_string(kv.first) +
                                   " (pid " + std::to_string(kv.second) +
                                   ") exited before it joined this group");
        }
      }
      if (now >= m->deadline) {
        std::string others;
        for (auto& kv : blocks_) {
          if (kv.first == process_index_) continue;
          others += "; process " + std::to_string(kv.first) + " is in " + ActivityLocked(kv.first);
        }
        return FailLocked(m, "shared-memory collective: timed out at barrier 0 of " +
                                 DescribeLocked(process_index_, a.site) + " call " +
                                 std::to_string(m->seq) + " (rank " + std::to_string(a.rank) +
                                 "): rank " + UnjoinedLocked(a) +
                                 " of the group never joined this group's calls" + others);
      }
      return;
    }
    const int64_t target = m->start_ticket + b + 1;
    std::string missing;
    int arrived = 0;
    for (int r = 0; r < a.size; ++r) {
      const Block* blk = blocks_.at(m->procs[r]);
      if (LoadAcquire(&blk->channels[m->channel].ticket) >= target) {
        ++arrived;
      } else {
        missing += (missing.empty() ? "" : ", ") + std::to_string(r);
        if (check_exits && Exited(pids_.at(m->procs[r]))) {
          return FailLocked(m, "shared-memory collective: rank " + std::to_string(r) +
                                   " (process " + std::to_string(m->procs[r]) + ", pid " +
                                   std::to_string(pids_.at(m->procs[r])) + ") exited");
        }
      }
    }
    if (arrived < a.size) {
      if (now >= m->deadline) {
        std::string where;
        for (int r = 0; r < a.size; ++r) {
          const int proc = m->procs[r];
          if (proc == process_index_ ||
              LoadAcquire(&blocks_.at(proc)->channels[m->channel].ticket) >= target) {
            continue;
          }
          where += "; rank " + std::to_string(r) + " (process " + std::to_string(proc) +
                   ") is in " + ActivityLocked(proc);
        }
        FailLocked(m, "shared-memory collective: timed out at barrier " + std::to_string(b) +
                          " of " + DescribeLocked(process_index_, a.site) + " call " +
                          std::to_string(m->seq) + ": " + std::to_string(arrived) + " of " +
                          std::to_string(a.size) + " ranks arrived (missing: rank " + missing +
                          ")" + where);
      }
      return;
    }
    std::vector<p2p::Published> peers(a.size);
    const bool last = b + 1 == a.barriers;
    std::string differ, theirs;
    for (int r = 0; r < a.size; ++r) {
      const int proc = m->procs[r];
      const Record& rec = blocks_.at(proc)->channels[m->channel].records[b];
      if (last) {  // no data; a peer may have moved on to its next call (then it succeeded)
        if (rec.site == a.site && rec.group == a.group && rec.seq == m->seq && rec.failed) {
          peers[r][3] = &p2p::kRankFailed;
        }
        continue;
      }
      if (rec.site != a.site || rec.group != a.group || rec.seq != m->seq) {
        return FailLocked(m, "shared-memory collective: rank " + std::to_string(r) +
                                 " is at another call on this channel (" +
                                 DescribeLocked(proc, rec.site) + " call " +
                                 std::to_string(rec.seq) + "; rank " + std::to_string(a.rank) +
                                 ": " + DescribeLocked(process_index_, a.site) + " call " +
                                 std::to_string(m->seq) + "): the processes ran different "
                                 "programs, or the same ones in different orders");
      }
      if (rec.descriptor != a.descriptor) {
        if (differ.empty()) theirs = "; rank " + std::to_string(r) + ": " + DescribeLocked(proc, a.site);
        differ += (differ.empty() ? "" : ", ") + std::to_string(r);
      }
      if (rec.failed) {
        peers[r][3] = &p2p::kRankFailed;
        continue;
      }
      uint8_t* base = nullptr;
      if (proc == process_index_) {
        base = own_[{m->channel, b}].base;
      } else if (!MapLocked(proc, m->channel, b, rec, &base, &error)) {
        if (Exited(pids_.at(proc))) {  // its fds went with it
          return FailLocked(m, "shared-memory collective: rank " + std::to_string(r) +
                                   " (process " + std::to_string(proc) + ", pid " +
                                   std::to_string(pids_.at(proc)) + ") exited");
        }
        return FailLocked(m, "shared-memory collective: rank " + std::to_string(r) + ": " + error);
      }
      for (int i = 0; i < kRegions; ++i) {
        peers[r][i] = rec.regions[i].bytes > 0 ? base + rec.regions[i].offset : nullptr;
      }
    }
    if (!differ.empty() && b == 0) {
      return FailLocked(m, "shared-memory collective: ranks passed different shapes or options "
                           "at " + DescribeLocked(process_index_, a.site) + " (ranks " + differ +
                           " differ from rank " + std::to_string(a.rank) + theirs + ")");
    }
    m->waiting = -1;
    auto then = std::move(m->then);
    p2p::ThreadPool::Workers().Schedule([then, peers] { then(peers, std::string()); });
  }

  // "<description> [site 0x...]" from process `proc`'s names ("site 0x..." when unnamed).
  std::string DescribeLocked(int64_t proc, int64_t site) {
    char hex[24];
    std::snprintf(hex, sizeof(hex), "%llx", static_cast<unsigned long long>(site));
    const std::string id = std::string("site 0x") + hex;
    auto it = blocks_.find(proc);
    if (it == blocks_.end()) return id;
    const Block* b = it->second;
    for (int i = 0; i < kNameProbe; ++i) {
      const SiteName& e = b->names[(uint64_t(site) + uint64_t(i)) % kNames];
      const int64_t at = LoadAcquire(&e.site);
      if (at == 0) break;
      if (at != site) continue;
      char text[sizeof(e.text)];
      std::memcpy(text, e.text, sizeof(text));
      text[sizeof(text) - 1] = '\0';
      return std::string(text) + " [" + id + "]";
    }
    return id;
  }

  // The ranks of `a`'s group that no process has claimed yet ("1, 3").
  std::string UnjoinedLocked(const JoinArgs& a) {
    std::vector<bool> claimed(a.size, false);
    for (auto& kv : blocks_) {
      const Block* b = kv.second;
      const int64_t n = std::min<int64_t>(LoadAcquire(&b->members), kMembers);
      for (int64_t i = 0; i < n; ++i) {
        const Member& mem = b->member[i];
        if (mem.axes_key == a.axes_key && mem.group == a.group && mem.size == a.size &&
            mem.rank >= 0 && mem.rank < a.size) {
          claimed[mem.rank] = true;
        }
      }
    }
    std::string out;
    for (int r = 0; r < a.size; ++r) {
      if (!claimed[r]) out += (out.empty() ? "" : ", ") + std::to_string(r);
    }
    return out;
  }

  // The calls process `proc` has joined and not left, described.
  std::string ActivityLocked(int64_t proc) {
    const Block* b = blocks_.at(proc);
    std::string out;
    for (int i = 0; i < kActive; ++i) {
      const int64_t site = LoadAcquire(&b->active[i].site);
      if (site == 0) continue;
      out += (out.empty() ? "" : ", ") + DescribeLocked(proc, site) + " call " +
             std::to_string(b->active[i].seq);
    }
    return out.empty() ? std::string("no call (it may have given this one up already)") : out;
  }

  bool MapLocked(int proc, int channel, int barrier, const Record& rec, uint8_t** base,
                 std::string* error) {
    Segment& seg = peer_[{proc, channel, barrier}];
    if (seg.gen != rec.seg_gen || seg.base == nullptr) {
      void* mapped = MapPeer(pids_.at(proc), rec.seg_fd, size_t(rec.seg_bytes), PROT_READ, error);
      if (mapped == nullptr) return false;
      if (seg.base != nullptr) munmap(seg.base, seg.bytes);
      seg.base = static_cast<uint8_t*>(mapped);
      seg.bytes = size_t(rec.seg_bytes);
      seg.gen = rec.seg_gen;
    }
    *base = seg.base;
    return true;
  }

  void StartProgress() {
    if (progress_started_) return;
    progress_started_ = true;
    std::thread([this] { Progress(); }).detach();
  }

  void Progress() {
    auto last_exit_check = Clock::now();
    for (;;) {
      const uint32_t seen = __atomic_load_n(&mine_->doorbell, __ATOMIC_ACQUIRE);
      bool idle = true;
      std::vector<std::shared_ptr<Meeting>> runnable;
      {
        std::lock_guard<std::mutex> lock(mu_);
        const auto now = Clock::now();
        DrainLocked(now, &runnable);
        const bool check_exits = now - last_exit_check > std::chrono::milliseconds(100);
        if (check_exits) last_exit_check = now;
        std::vector<std::shared_ptr<Meeting>> waiting;
        waiting.swap(pending_);
        for (auto& m : waiting) {
          if (m->waiting < 0) continue;
          CheckLocked(m, now, check_exits);
          if (m->waiting >= 0) pending_.push_back(m);
        }
        idle = pending_.empty() && drains_.empty();
      }
      ScheduleDeferred(runnable);
      struct timespec ts {0, (idle ? 50 : 10) * 1000 * 1000};
      syscall(SYS_futex, &mine_->doorbell, FUTEX_WAIT, seen, &ts, nullptr, 0);
    }
  }

  std::mutex mu_;
  std::atomic<double> rate_{0.0};
  Block* mine_ = nullptr;
  int mine_fd_ = -1;
  int64_t process_index_ = -1;
  int64_t generation_ = 0;
  bool progress_started_ = false;
  std::map<int64_t, Block*> blocks_;  // process index -> block (this one's included)
  std::map<int64_t, int64_t> pids_;
  std::map<std::tuple<int64_t, int64_t, int64_t>, int> my_rank_;
  std::map<std::pair<int64_t, int64_t>, int64_t> seqs_;  // (site, group) -> next call
  std::map<int, std::deque<std::shared_ptr<Meeting>>> queues_;
  std::map<int, Drain> drains_;  // channels whose failed call some peer may still be in
  std::vector<std::shared_ptr<Meeting>> in_progress_;
  std::vector<std::shared_ptr<Meeting>> pending_;
  std::map<std::pair<int, int>, Segment> own_;
  std::map<std::tuple<int, int, int>, Segment> peer_;
};

}  // namespace

bool CreateBlock(int64_t process_index, BlockId* id, std::string* error) {
  return Engine::Global().CreateBlock(process_index, id, error);
}
bool AttachBlocks(const std::vector<BlockId>& blocks, std::string* error) {
  return Engine::Global().AttachBlocks(blocks, error);
}
int AttachedProcesses() { return Engine::Global().Attached(); }
std::shared_ptr<Meeting> Join(const JoinArgs& args, std::string* error) {
  return Engine::Global().Join(args, error);
}
void Arrive(const std::shared_ptr<Meeting>& m, int barrier, const Spans& mine, bool failed,
            p2p::Continuation then, int64_t wire_bytes) {
  Engine::Global().Arrive(m, barrier, mine, failed, std::move(then), wire_bytes);
}
void SetLinkRate(double bytes_per_s) { Engine::Global().SetLinkRate(bytes_per_s); }
double LinkRate() { return Engine::Global().LinkRate(); }
void Pace(int64_t bytes) { Engine::Global().Pace(bytes); }
int64_t ReserveBus(int64_t bytes) { return Engine::Global().ReserveBus(bytes); }
void Abort(const std::shared_ptr<Meeting>& m, const std::string& why) {
  Engine::Global().Abort(m, why);
}
void Leave(const std::shared_ptr<Meeting>& m) { Engine::Global().Leave(m); }
size_t InProgress() { return Engine::Global().InProgress(); }
void NameSite(int64_t site, const std::string& text) { Engine::Global().NameSite(site, text); }
size_t SegmentsMapped() { return Engine::Global().Segments(); }

const Api* GetApi() {
  static const Api api{kApiVersion,
                       [](const JoinArgs& args, std::string* error) { return Join(args, error); },
                       [](const std::shared_ptr<Meeting>& m, int barrier, const Spans& mine,
                          bool failed, p2p::Continuation then, int64_t wire_bytes) {
                         Arrive(m, barrier, mine, failed, std::move(then), wire_bytes);
                       },
                       [](const std::shared_ptr<Meeting>& m, const std::string& why) {
                         Abort(m, why);
                       },
                       [](const std::shared_ptr<Meeting>& m) { Leave(m); },
                       []() { return AttachedProcesses(); }, &p2p::kRankFailed};
  return &api;
}

}  // namespace shm
}  // namespace flashcomm
