// Tests of the p2p transport's rendezvous (ffi/include/flashcomm/p2p_rendezvous.h) with real
// threads: continuations see every rank's pointers, a site in a loop meets once per call, a
// missing rank fails every waiting rank within the deadline with its number in the error, the
// blocking Arrive agrees, a rank out of range and disagreeing sizes are errors, and no meeting
// is left behind; a staged ring step (p2p_ring.h) moves a chunk whose receiver starts late
// through its staging buffer, in every order of the ranks' calls. Run under ASan + UBSan by ffi/tests/run_sanitizers.sh (and TSan-clean by
// design: every shared field is under a mutex).
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "flashcomm/p2p_rendezvous.h"
#include "flashcomm/p2p_ring.h"
#include "check.h"

namespace p2p = flashcomm::p2p;
using Clock = std::chrono::steady_clock;


// Waits until `count` reaches `want` (or 10 s pass).
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int count = 0;
  void Add() {
    std::lock_guard<std::mutex> lock(mu);
    ++count;
    cv.notify_all();
  }
  bool Wait(int want) {
    std::unique_lock<std::mutex> lock(mu);
    return cv.wait_for(lock, std::chrono::seconds(10), [&] { return count >= want; });
  }
};

static const void* Tag(int rank, int barrier, int call) {
  return reinterpret_cast<const void*>(uintptr_t(1 + rank + 16 * barrier + 256 * call));
}

// `size` threads make `calls` calls of one site; each call passes 3 barriers through
// continuations; every continuation checks that it sees every rank's tag of its barrier.
static void TestContinuationsInALoop(int64_t site, int size, int calls) {
  auto& rv = p2p::Rendezvous::Global();
  std::atomic<int> wrong{0};
  Latch done;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      for (int call = 0; call < calls; ++call) {
        std::string error;
        auto m = rv.Join({7, site, 0}, rank, size, 3, &error, 10000);
        if (!m) {
          ++wrong;
          continue;
        }
        auto check = [&, call](int barrier, const std::vector<p2p::Published>& peers) {
          if (int(peers.size()) != size) return ++wrong, void();
          for (int r = 0; r < size; ++r) {
            if (peers[r][0] != Tag(r, barrier, call)) ++wrong;
          }
        };
        // Shared with the continuations: they may run on after this thread stops waiting.
        auto call_done = std::make_shared<Latch>();
        m->Arrive(0, rank, {Tag(rank, 0, call)}, [&, m, rank, call, call_done](auto& peers,
                                                                               auto& err) {
          if (!err.empty()) ++wrong;
          check(0, peers);
          m->Arrive(1, rank, {Tag(rank, 1, call)}, [&, m, rank, call, call_done](auto& peers,
                                                                                 auto& err) {
            if (!err.empty()) ++wrong;
            check(1, peers);
            m->Arrive(2, rank, {Tag(rank, 2, call)}, [&, rank, call, call_done](auto& peers,
                                                                              auto& err) {
              if (!err.empty()) ++wrong;
              check(2, peers);
              call_done->Add();
            });
          });
        });
        if (!call_done->Wait(1)) ++wrong;
        rv.Leave(m);
      }
      done.Add();
    });
  }
  CHECK(done.Wait(size));
  for (auto& t : threads) t.join();
  CHECK(wrong.load() == 0);
  CHECK(rv.InProgress() == 0);
}

// Ranks 0..size-2 come, the last never does: every waiting rank gets the error, naming it.
static void TestMissingRank(int size) {
  auto& rv = p2p::Rendezvous::Global();
  struct Seen {
    Latch failed;
    std::mutex mu;
    std::vector<std::string> errors;
  };
  auto seen = std::make_shared<Seen>();  // outlives this function if a continuation is late
  std::vector<std::shared_ptr<p2p::Meeting>> meetings;
  const auto start = Clock::now();
  for (int rank = 0; rank + 1 < size; ++rank) {
    std::string error;
    auto m = rv.Join({8, 1, 0}, rank, size, 2, &error, 300);
    CHECK(m != nullptr);
    meetings.push_back(m);
    m->Arrive(0, rank, {Tag(rank, 0, 0)}, [seen](auto& peers, const std::string& err) {
      {
        std::lock_guard<std::mutex> lock(seen->mu);
        seen->errors.push_back(peers.empty() ? err : std::string());
      }
      seen->failed.Add();
    });
  }
  CHECK(seen->failed.Wait(size - 1));
  const double waited = std::chrono::duration<double>(Clock::now() - start).count();
  CHECK(waited >= 0.25 && waited < 3.0);
  const std::string missing = "missing: rank " + std::to_string(size - 1) + ")";
  std::lock_guard<std::mutex> lock(seen->mu);
  CHECK(int(seen->errors.size()) == size - 1);
  for (auto& e : seen->errors) CHECK(e.find(missing) != std::string::npos);
  for (auto& m : meetings) rv.Leave(m);
  CHECK(rv.InProgress() == 0);
  // The missing rank comes after its peers have left: it fails at once with their error, not
  // after a whole timeout of its own.
  std::string error;
  const auto late_start = Clock::now();
  auto late = rv.Join({8, 1, 0}, size - 1, size, 2, &error, 60000);
  CHECK(late != nullptr);
  std::string late_error;
  late->Arrive(0, size - 1, {Tag(size - 1, 0, 0)},
               [&](auto& peers, const std::string& err) { late_error = peers.empty() ? err : ""; });
  CHECK(late_error.find(missing) != std::string::npos);
  CHECK(late_error.find("arrived after its peers had left") != std::string::npos);
  CHECK(Clock::now() - late_start < std::chrono::seconds(1));
  rv.Leave(late);
  CHECK(rv.InProgress() == 0);
}

// The blocking Arrive: every rank sees every pointer; and a missing rank times out.
static void TestBlockingArrive(int size) {
  auto& rv = p2p::Rendezvous::Global();
  std::atomic<int> wrong{0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      std::string error;
      auto m = rv.Join({9, 1, 0}, rank, size, 1, &error, 10000);
      std::vector<p2p::Published> peers;
      if (!m || !m->Arrive(0, rank, {Tag(rank, 0, 0)}, Clock::now() + std::chrono::seconds(10),
                           &peers, &error)) {
        ++wrong;
      } else {
        for (int r = 0; r < size; ++r) wrong += peers[r][0] != Tag(r, 0, 0);
      }
      if (m) rv.Leave(m);
    });
  }
  for (auto& t : threads) t.join();
  CHECK(wrong.load() == 0);
  std::string error;
  auto m = rv.Join({9, 2, 0}, 0, 2, 1, &error, 10000);
  std::vector<p2p::Published> peers;
  CHECK(!m->Arrive(0, 0, {nullptr}, Clock::now() + std::chrono::milliseconds(100), &peers,
                   &error));
  CHECK(error.find("missing: rank 1)") != std::string::npos);
  rv.Leave(m);
  CHECK(rv.InProgress() == 0);
}

// A rank out of range, and a group size the ranks disagree on.
static void TestBadJoins() {
  auto& rv = p2p::Rendezvous::Global();
  std::string error;
  CHECK(rv.Join({10, 1, 0}, 5, 4, 1, &error) == nullptr);
  CHECK(error.find("out of range") != std::string::npos);
  auto b = rv.Join({10, 3, 0}, 0, 2, 1, &error, 1000);
  auto c = rv.Join({10, 3, 0}, 1, 3, 1, &error, 1000);
  CHECK(b != nullptr && c == nullptr);
  CHECK(error.find("disagree on the group size") != std::string::npos);
  rv.Leave(b);
  CHECK(rv.InProgress() == 0);
}

// A staged ring step of 2 ranks (shift 1), the moves run inline: the rank that starts first
// sends at once into the staging buffer, its done completes once its chunk is read (before
// the peer starts), and the late rank's chunk is copied out of the staging buffer when it
// starts. Then every valid order of the four calls, chunks checked byte by byte.
static void TestStagedRingStep() {
  // Call c: rank c % 2, a start if c < 2 else a done; a rank's start comes before its done.
  const int kOrders[][4] = {{0, 1, 2, 3}, {0, 1, 3, 2}, {0, 2, 1, 3},
                            {1, 0, 2, 3}, {1, 0, 3, 2}, {1, 3, 0, 2}};
  for (const auto& order : kOrders) {
    auto step = std::make_shared<p2p::Step>(2, 1, Clock::now() + std::chrono::seconds(10),
                                            /*staged=*/true);
    std::vector<char> send[2] = {std::vector<char>(1000, 'a'), std::vector<char>(1000, 'b')};
    std::vector<char> recv[2] = {std::vector<char>(1000, 0), std::vector<char>(1000, 0)};
    int moves = 0, local = 0, completed = 0, errors = 0;
    std::function<void(p2p::Move)> run = [&](p2p::Move m) {
      ++moves;
      local += m.local;
      std::memcpy(m.to.recv, m.from.send, m.to.bytes);
      m.finished(true);
    };
    std::string error;
    for (int c : order) {
      const int rank = c % 2;
      if (c < 2) {
        p2p::Endpoint ep;
        ep.send = send[rank].data();
        ep.recv = recv[rank].data();
        ep.bytes = 1000;
        error += step->Start(rank, ep, run);
      } else {
        step->Done(rank, recv[rank].data(), [&](const std::string& e) {
          ++completed;
          errors += !e.empty();
        });
      }
    }
    CHECK(error.empty());
    CHECK(completed == 2 && errors == 0);
    CHECK(recv[0] == send[1] && recv[1] == send[0]);
    CHECK(step->Finished());
    CHECK(moves == 2 + local);  // one link move per rank, plus one local copy per staged chunk
  }
  // Rank 0 alone, staged: its done completes (its chunk was read into staging) only when its own
  // chunk arrives, i.e. not before rank 1 starts; rank 0's send is in rank 1's staging buffer.
  auto step = std::make_shared<p2p::Step>(2, 1, Clock::now() + std::chrono::seconds(10), true);
  std::vector<char> a(64, 'x'), got(64, 0), b(64, 'y'), got_b(64, 0);
  int links = 0;
  auto run = [&](p2p::Move m) {
    links += !m.local;
    std::memcpy(m.to.recv, m.from.send, m.to.bytes);
    m.finished(true);
  };
  p2p::Endpoint e0{a.data(), got.data(), 64, nullptr};
  CHECK(step->Start(0, e0, run).empty());
  CHECK(links == 1 && got_b[0] == 0);  // sent into staging at once
  bool done0 = false;
  step->Done(0, got.data(), [&](const std::string& e) { done0 = e.empty(); });
  CHECK(!done0);  // its own chunk has not arrived
  p2p::Endpoint e1{b.data(), got_b.data(), 64, nullptr};
  CHECK(step->Start(1, e1, run).empty());
  CHECK(done0 && got == b && got_b == a && links == 2);
  // Disagreeing sizes with a staged chunk: an error at the late rank's start.
  auto bad = std::make_shared<p2p::Step>(2, 1, Clock::now() + std::chrono::seconds(10), true);
  p2p::Endpoint short0{a.data(), got.data(), 32, nullptr};
  CHECK(bad->Start(0, short0, run).empty());
  CHECK(bad->Start(1, e1, run).find("disagree on the chunk size") != std::string::npos);
}

// Huge timeouts: INT64_MAX, 2**62 and 9e15 ms must not overflow now + timeout into a
// deadline in the past (a healthy collective would "time out" at once). Deadlines saturate at
// kMaxTimeoutMs: a two-thread rendezvous completes normally, and the watchdog's check does not
// expire it. A timeout <= 0 is an error.
static void TestHugeTimeouts() {
  auto& rv = p2p::Rendezvous::Global();
  const int64_t huge[] = {INT64_MAX, int64_t(1) << 62, int64_t(9e15), p2p::kMaxTimeoutMs};
  int64_t site = 1;
  for (int64_t timeout : huge) {
    const auto now = Clock::now();
    const auto deadline = p2p::DeadlineAfter(timeout, now);
    CHECK(deadline > now + std::chrono::hours(24 * 24));
    CHECK(deadline <= now + std::chrono::milliseconds(p2p::kMaxTimeoutMs));
    std::atomic<int> wrong{0};
    std::vector<std::thread> threads;
    for (int rank = 0; rank < 2; ++rank) {
      threads.emplace_back([&, rank] {
        std::string error;
        auto m = rv.Join({11, site, 0}, rank, 2, 1, &error, timeout);
        std::vector<p2p::Published> peers;
        if (m) m->ExpireIfLate(Clock::now());  // the watchdog's check: not late
        if (!m || !m->Arrive(0, rank, {Tag(rank, 0, 0)}, Clock::now() + std::chrono::seconds(10),
                             &peers, &error)) {
          ++wrong;
          std::fprintf(stderr, "timeout %lld: %s\n", static_cast<long long>(timeout),
                       error.c_str());
        } else {
          wrong += peers[1 - rank][0] != Tag(1 - rank, 0, 0);
        }
        if (m) rv.Leave(m);
      });
    }
    for (auto& t : threads) t.join();
    CHECK(wrong.load() == 0);
    // A ring step with the same timeout is not late either.
    std::string error;
    auto step = p2p::RingTable::Global().Start({11, 100 + site, 0}, 0, 1, 1, timeout, &error);
    CHECK(step != nullptr);
    if (step) {
      step->ExpireIfLate(Clock::now());
      CHECK(!step->failed());
      p2p::Endpoint ep;
      char in = 'z', out = 0;
      ep.send = &in;
      ep.recv = &out;
      ep.bytes = 1;
      CHECK(step->Start(0, ep, [](p2p::Move m) {
        std::memcpy(m.to.recv, m.from.send, m.to.bytes);
        m.finished(true);
      }).empty());
      bool ok = false;
      step->Done(0, &out, [&](const std::string& e) { ok = e.empty(); });
      CHECK(ok && out == 'z');
      p2p::RingTable::Global().Done({11, 100 + site, 0}, 0);
    }
    ++site;
  }
  for (int64_t bad : {int64_t(0), int64_t(-1), INT64_MIN}) {
    std::string error;
    CHECK(rv.Join({12, 1, 0}, 0, 2, 1, &error, bad) == nullptr);
    CHECK(error.find("timeout_ms must be positive") != std::string::npos);
    error.clear();
    CHECK(p2p::RingTable::Global().Start({12, 2, 0}, 0, 2, 1, bad, &error) == nullptr);
    CHECK(error.find("timeout_ms must be positive") != std::string::npos);
  }
  CHECK(rv.InProgress() == 0);
  CHECK(p2p::RingTable::Global().InProgress() == 0);
}

// Abort (a rank whose codec work failed before it published anything): the waiting ranks get
// the reason at once, a rank arriving later too, long before the deadline.
static void TestAbort() {
  auto& rv = p2p::Rendezvous::Global();
  std::string error;
  auto a = rv.Join({13, 1, 0}, 0, 2, 2, &error, 60000);
  std::string seen;
  Latch got;
  a->Arrive(0, 0, {nullptr}, [&](const std::vector<p2p::Published>&, const std::string& e) {
    seen = e;
    got.Add();
  });
  auto b = rv.Join({13, 1, 0}, 1, 2, 2, &error, 60000);
  const auto t0 = Clock::now();
  b->Abort("rank 1: could not allocate 64 bytes");
  CHECK(got.Wait(1));
  CHECK(Clock::now() - t0 < std::chrono::seconds(5));
  CHECK(seen.find("could not allocate 64 bytes") != std::string::npos);
  std::string late;
  b->Arrive(0, 1, {nullptr}, [&](const std::vector<p2p::Published>&, const std::string& e) {
    late = e;
  });
  CHECK(late.find("could not allocate") != std::string::npos);
  rv.Leave(a);
  rv.Leave(b);
  CHECK(rv.InProgress() == 0);
}

int main() {
  TestHugeTimeouts();
  TestAbort();
  TestContinuationsInALoop(1, 4, 200);
  TestContinuationsInALoop(2, 8, 50);
  TestMissingRank(4);
  TestBlockingArrive(4);
  TestBadJoins();
  TestStagedRingStep();
  return ReportChecks("p2p_rendezvous_test");
}
