// Tests of the shared-memory meeting point (ffi/cpu/shm_rendezvous.h) with real
// processes: the parent forks N ranks, passes every block's (pid, fd) to every rank through
// pipes (as jax.distributed's key-value store does), and checks each rank's exit status. In the
// ranks: continuations see every rank's published bytes at every barrier of 200 calls on two
// channels at once; a rank that never joins fails its peers within the timeout; a rank that
// exits fails them at once; ranks whose descriptors differ all fail; no call is left in
// progress. Run under ASan + UBSan by ffi/tests/run_sanitizers.sh.
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "cpu/shm_rendezvous.h"

namespace shm = flashcomm::shm;
namespace p2p = flashcomm::p2p;
using Clock = std::chrono::steady_clock;

namespace {

struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  std::string error;
  void Add(const std::string& e = std::string()) {
    std::lock_guard<std::mutex> lock(mu);
    ++count;
    if (!e.empty()) error = e;
    cv.notify_all();
  }
  bool Wait(int want, int seconds = 20) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(seconds), [&] { return count >= want; });
  }
};

// All `bytes` through `io` (write or read), however many calls it takes.
template <typename Ptr, typename Io>
bool TransferAll(int fd, Ptr p, size_t bytes, Io io) {
  while (bytes > 0) {
    const ssize_t n = io(fd, p, bytes);
    if (n <= 0) return false;
    p += n;
    bytes -= size_t(n);
  }
  return true;
}

bool WriteAll(int fd, const void* data, size_t bytes) {
  return TransferAll(fd, static_cast<const char*>(data), bytes, write);
}

bool ReadAll(int fd, void* data, size_t bytes) {
  return TransferAll(fd, static_cast<char*>(data), bytes, read);
}

// One call of `site`: 3 barriers; at each, rank r publishes 4 KiB of the byte r + 7 * call +
// barrier and checks every peer's. Returns the call's error ("" on success).
void Call(int rank, int size, int64_t site, int call, uint64_t descriptor, int64_t timeout_ms,
          Latch* done, std::vector<std::vector<char>>* buffers) {
  std::string error;
  auto m = shm::Join({1, site, 0, rank, size, 3, descriptor, timeout_ms}, &error);
  if (!m) return done->Add("join: " + error);
  auto fill = [buffers, rank, call](int barrier) {
    auto& buf = (*buffers)[size_t(barrier)];
    std::memset(buf.data(), (rank + 7 * call + barrier) & 0xff, buf.size());
    return shm::Spans{shm::Span{buf.data(), buf.size()}, shm::Span{}, shm::Span{}, shm::Span{}};
  };
  auto check = [size, call](int barrier, const std::vector<p2p::Published>& peers) {
    std::string bad;
    for (int j = 0; j < size; ++j) {
      const auto* p = static_cast<const unsigned char*>(peers[size_t(j)][0]);
      const unsigned char want = (j + 7 * call + barrier) & 0xff;
      if (p == nullptr || p[0] != want || p[4095] != want) {
        bad = "barrier " + std::to_string(barrier) + ": wrong bytes of rank " + std::to_string(j);
      }
    }
    return bad;
  };
  shm::Arrive(m, 0, fill(0), false, [=](const std::vector<p2p::Published>& peers,
                                        const std::string& e) {
    if (!e.empty()) return shm::Leave(m), done->Add(e);
    const std::string bad0 = check(0, peers);
    shm::Arrive(m, 1, fill(1), false, [=](const std::vector<p2p::Published>& peers,
                                          const std::string& e) {
      if (!e.empty()) return shm::Leave(m), done->Add(e);
      const std::string bad = bad0.empty() ? check(1, peers) : bad0;
      shm::Arrive(m, 2, shm::Spans{}, false,
                  [=](const std::vector<p2p::Published>&, const std::string& e) {
                    shm::Leave(m);
                    done->Add(e.empty() ? bad : e);
                  });
    });
  });
}

// A rank's part of a scenario; its exit status is 0 when every check held.
int Rank(const char* scenario, int rank, int size) {
  std::string error;
  if (std::strcmp(scenario, "loop") == 0) {
    constexpr int kCalls = 200;
    std::vector<std::vector<std::vector<char>>> buffers(
        2 * kCalls, std::vector<std::vector<char>>(2, std::vector<char>(4096)));
    Latch done;
    for (int call = 0; call < kCalls; ++call) {  // two channels, calls queued on each
      Call(rank, size, 11, call, 42, 10000, &done, &buffers[2 * call]);
      Call(rank, size, 12, call, 42, 10000, &done, &buffers[2 * call + 1]);
    }
    CHECK(done.Wait(2 * kCalls));
    CHECK(done.error.empty());
    if (!done.error.empty()) std::fprintf(stderr, "rank %d: %s\n", rank, done.error.c_str());
    for (int i = 0; i < 100 && shm::InProgress() != 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    CHECK(shm::InProgress() == 0);
    CHECK(shm::SegmentsMapped() > 0);
  } else if (std::strcmp(scenario, "missing") == 0 || std::strcmp(scenario, "exited") == 0) {
    const bool exited = scenario[0] == 'e';
    if (rank == size - 1) {  // never calls: waits, or exits at once
      if (exited) _exit(0);
      std::this_thread::sleep_for(std::chrono::seconds(4));
      return 0;
    }
    std::vector<std::vector<char>> buffers(2, std::vector<char>(4096));
    Latch done;
    const auto t0 = Clock::now();
    Call(rank, size, 21, 0, 42, exited ? 60000 : 500, &done, &buffers);
    CHECK(done.Wait(1, 10));
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    CHECK(seconds < 3.0);
    CHECK(done.error.find(exited ? "exited" : "timed out") != std::string::npos);
    if (done.error.empty()) std::fprintf(stderr, "rank %d: no error\n", rank);
  } else if (std::strcmp(scenario, "mismatch") == 0) {
    std::vector<std::vector<char>> buffers(2, std::vector<char>(4096));
    Latch done;
    Call(rank, size, 31, 0, rank == 0 ? 1 : 2, 10000, &done, &buffers);
    CHECK(done.Wait(1, 10));
    CHECK(done.error.find("different shapes or options") != std::string::npos);
    std::vector<std::vector<char>> again(2, std::vector<char>(4096));  // the channel recovers
    Latch next;
    Call(rank, size, 31, 1, 2, 10000, &next, &again);
    CHECK(next.Wait(1, 10));
    CHECK(next.error.empty());
  }
  return g_failed.load() == 0 ? 0 : 1;
}

// Forks `size` ranks, hands out the blocks, returns whether every rank exited 0.
bool RunScenario(const char* scenario, int size) {
  std::vector<int> up(static_cast<size_t>(size)), down(static_cast<size_t>(size));
  std::vector<pid_t> pids;
  for (int r = 0; r < size; ++r) {
    int u[2], d[2];
    if (pipe(u) != 0 || pipe(d) != 0) return false;
    const pid_t pid = fork();
    if (pid == 0) {
      close(u[0]);
      close(d[1]);
      shm::BlockId mine;
      std::string error;
      if (!shm::CreateBlock(r, &mine, &error) || !WriteAll(u[1], &mine, sizeof(mine))) _exit(2);
      std::vector<shm::BlockId> all(static_cast<size_t>(size));
      if (!ReadAll(d[0], all.data(), sizeof(shm::BlockId) * all.size())) _exit(3);
      if (!shm::AttachBlocks(all, &error)) {
        std::fprintf(stderr, "rank %d: %s\n", r, error.c_str());
        _exit(4);
      }
      // Every rank has mapped every block before any goes on (Python's setup agrees so too).
      char go = 1;
      if (!WriteAll(u[1], &go, 1) || !ReadAll(d[0], &go, 1)) _exit(5);
      const int status = Rank(scenario, r, size);
      std::fflush(nullptr);
      _exit(status);  // the ranks' threads are detached and may be waiting: no static dtors
    }
    close(u[1]);
    close(d[0]);
    up[size_t(r)] = u[0];
    down[size_t(r)] = d[1];
    pids.push_back(pid);
  }
  std::vector<shm::BlockId> all(static_cast<size_t>(size));
  bool ok = true;
  for (int r = 0; r < size; ++r) ok = ok && ReadAll(up[size_t(r)], &all[size_t(r)], sizeof(all[0]));
  for (int r = 0; r < size && ok; ++r) {
    ok = WriteAll(down[size_t(r)], all.data(), sizeof(all[0]) * all.size());
  }
  char attached = 0;
  for (int r = 0; r < size && ok; ++r) ok = ReadAll(up[size_t(r)], &attached, 1);
  for (int r = 0; r < size && ok; ++r) ok = WriteAll(down[size_t(r)], &attached, 1);
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  for (pid_t pid : pids) {
    int status = -1;
    while (waitpid(pid, &status, WNOHANG) == 0) {
      if (Clock::now() > deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, &status, 0);
        ok = false;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  for (int r = 0; r < size; ++r) {
    close(up[size_t(r)]);
    close(down[size_t(r)]);
  }
  if (!ok) std::fprintf(stderr, "scenario %s with %d ranks failed\n", scenario, size);
  return ok;
}

}  // namespace

int main() {
  CHECK(RunScenario("loop", 2));
  CHECK(RunScenario("loop", 3));
  CHECK(RunScenario("missing", 3));
  CHECK(RunScenario("exited", 2));
  CHECK(RunScenario("mismatch", 2));
  return ReportChecks("shm_rendezvous_test");
}
