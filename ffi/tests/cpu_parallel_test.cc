// C++ tests of the split of codec calls over threads (cpu/cpu_parallel.h): every range
// once, on an inline runner, on real threads and on a pool that starts its tasks only after the
// call returned (they must find nothing to do); and the kernels' output-group ranges
// (dequantize_sum, dequantize_sum_quantize) giving the bytes of one whole call.
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "flashcomm/codec.h"
#include "cpu/cpu_dispatch.h"
#include "cpu/cpu_parallel.h"
#include "check.h"

using namespace flashcomm;  // NOLINT
using flashcomm::cpu::Runner;

namespace {


// Runs body over [0, n) and checks that every item was visited exactly once.
void CheckCovers(const Runner& runner, int64_t n, int64_t item_bytes) {
  std::vector<std::atomic<int>> seen(static_cast<size_t>(n));
  std::atomic<int64_t> calls{0};
  runner.ForRanges(n, item_bytes, [&](int64_t b, int64_t e) {
    CHECK(0 <= b && b < e && e <= n);
    for (int64_t i = b; i < e; ++i) seen[size_t(i)].fetch_add(1);
    calls.fetch_add(1);
  });
  int64_t wrong = 0;
  for (auto& s : seen) wrong += s.load() != 1;
  CHECK(wrong == 0);
  CHECK(n == 0 ? calls.load() == 0 : calls.load() >= 1);
}

void TestRunners() {
  CheckCovers(Runner::Inline(), 1000, 1 << 20);
  CheckCovers(Runner::Inline(), 0, 1 << 20);

  // Real threads, each task on a thread of its own, joined after the call.
  std::vector<std::thread> threads;
  Runner threaded([&](Runner::Task t) { threads.emplace_back(std::move(t)); }, 4);
  for (int64_t n : {1, 7, 16, 1000, 4099}) {
    CheckCovers(threaded, n, 1 << 20);
  }
  CHECK(!threads.empty());  // large calls were split
  for (auto& t : threads) t.join();
  threads.clear();
  CheckCovers(threaded, 100, 64);  // 6.4 KB: below the piece size, on the caller alone
  CHECK(threads.empty());

  // A pool that runs nothing until the call has returned: the caller does every piece, and
  // the late tasks claim none (ASan would flag a call to the dead body).
  std::vector<Runner::Task> deferred;
  Runner late([&](Runner::Task t) { deferred.push_back(std::move(t)); }, 8);
  CheckCovers(late, 4096, 1 << 20);
  CHECK(!deferred.empty());
  for (auto& t : deferred) t();

  // The cap (jax_flashcomm.codec.use_cpu_threads): 1 means the caller alone.
  cpu::max_codec_threads().store(1);
  Runner capped([&](Runner::Task t) { deferred.push_back(std::move(t)); }, 8);
  CHECK(capped.threads() == 1);
  deferred.clear();
  CheckCovers(capped, 4096, 1 << 20);
  CHECK(deferred.empty());
  cpu::max_codec_threads().store(0);
}

// A thread started now that runs the tasks given to it, in order, until destroyed: it keeps
// the floating-point control it started with (a new thread inherits its creator's).
class Worker {
 public:
  Worker() : thread_([this] { Loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Run(Runner::Task task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      tasks_.push_back(std::move(task));
    }
    cv_.notify_all();
  }

 private:
  void Loop() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      Runner::Task task = std::move(tasks_.front());
      tasks_.pop_front();
      lock.unlock();
      task();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Runner::Task> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

// Pieces on helper threads run under the caller's floating-point control, whatever the
// helper's own: here the caller flushes (FTZ and DAZ, as XLA's threads do) and the helper, a
// thread started before, does not.
void TestCallersFpControl() {
#if defined(__x86_64__) || defined(__i386__)
  constexpr uint64_t kControl = 0xFFC0;  // MXCSR's control bits; bits 0-5 are sticky flags
#else
  constexpr uint64_t kControl = ~uint64_t(0);
#endif
  const uint64_t own = cpu::fp_control();
  std::vector<uint64_t> seen(64, ~uint64_t(0));
  uint64_t caller = own;
#if defined(__x86_64__) || defined(__i386__)
  caller = own | 0x8040u;  // MXCSR FTZ (bit 15) and DAZ (bit 6)
#endif
  std::atomic<int> helper_pieces{0};
  {
    Worker worker;  // started under the thread's own control
    Runner pooled([&](Runner::Task t) { worker.Run(std::move(t)); }, 2);
    const cpu::ScopedFpControl mode(caller);
    const auto me = std::this_thread::get_id();
    pooled.ForRanges(64, 1 << 20, [&](int64_t b, int64_t e) {
      if (std::this_thread::get_id() != me) helper_pieces.fetch_add(1);
      // Long enough that the worker claims pieces too.
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
      for (int64_t i = b; i < e; ++i) seen[size_t(i)] = cpu::fp_control() & kControl;
    });
  }
  CHECK(helper_pieces.load() >= 1);  // the worker ran some
  int64_t other = 0;
  for (uint64_t v : seen) other += v != (caller & kControl);
  CHECK(other == 0);
  CHECK((cpu::fp_control() & kControl) == (own & kControl));  // restored on the caller
#if defined(__x86_64__) || defined(__i386__)
  CHECK((own & kControl) != (caller & kControl));  // so the check above means something
#endif
}

// The fused sums over output groups [b, e) in pieces == one call over all of them.
void TestKernelRanges() {
  const cpu::CodecKernels& k = cpu::kernels();
  std::mt19937 rng(7);
  std::normal_distribution<float> normal;
  for (int spikes : {0, 2}) {
    const int64_t g = 128, chunks = 4, gpc = 37, batch = 2, bits = 6, out_bits = 4;
    const int64_t ng = batch * chunks * gpc, rec = record_bytes(g, bits, spikes);
    std::vector<float> x(static_cast<size_t>(ng * g));
    for (auto& v : x) v = normal(rng);
    std::vector<uint8_t> codes(static_cast<size_t>(ng * rec));
    std::vector<uint16_t> scale(static_cast<size_t>(ng)), zero(scale.size());
    k.quantize(cpu::DType::kF32, x.data(), ng, g, bits, 0, spikes, codes.data(), scale.data(),
               zero.data());
    const PayloadView view{codes.data(), scale.data(), zero.data(), batch, chunks, gpc,
                           g, rec, bits, spikes};
    const int64_t n_out = batch * gpc, out_rec = record_bytes(g, out_bits, spikes);
    std::vector<float> whole(static_cast<size_t>(n_out * g)), parts(whole.size(), -1.0f);
    k.dequantize_sum(cpu::DType::kF32, view, 0, whole.data(), 0, n_out);
    std::vector<uint8_t> c1(static_cast<size_t>(n_out * out_rec)), c2(c1.size(), 0xA5);
    std::vector<uint16_t> s1(static_cast<size_t>(n_out)), z1(s1.size()), s2(s1.size(), 1), z2(s1.size(), 1);
    k.dequantize_sum_quantize(view, out_bits, spikes, c1.data(), s1.data(), z1.data(), 0, n_out);
    const int64_t cuts[] = {0, 5, 36, 37, 60, n_out};  // pieces across the batch boundary
    for (size_t i = 0; i + 1 < sizeof cuts / sizeof cuts[0]; ++i) {
      k.dequantize_sum(cpu::DType::kF32, view, 0, parts.data(), cuts[i], cuts[i + 1]);
      k.dequantize_sum_quantize(view, out_bits, spikes, c2.data(), s2.data(), z2.data(),
                                cuts[i], cuts[i + 1]);
    }
    CHECK(std::memcmp(whole.data(), parts.data(), whole.size() * sizeof(float)) == 0);
    CHECK(c1 == c2);
    CHECK(s1 == s2);
    CHECK(z1 == z2);
  }
}

}  // namespace

int main() {
  TestRunners();
  TestCallersFpControl();
  TestKernelRanges();
  return ReportChecks("cpu_parallel_test");
}
