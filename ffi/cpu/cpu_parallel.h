// Splitting a codec call's groups over XLA's intra-op thread pool.
//
// XLA:CPU runs its own ops (fusions, dots) on the intra-op pool of every core; an FFI kernel
// that ran on one thread would lose to the pure-jnp twin it exists to beat on any machine
// with more than one core. The CPU handlers therefore cut their groups into pieces and run
// them on the pool the XLA FFI hands them (ffi::ThreadPool), the calling thread included.
// Groups are independent, so the bytes do not depend on the split.
//
// The caller never waits for a piece nobody has started: pieces are claimed from a shared
// counter by the caller and by the helper tasks alike, and the caller, once no piece is left
// to claim, waits only for pieces already running. A helper the pool starts late (or never)
// finds nothing to claim, so a busy or one-thread pool cannot deadlock a call, and a helper
// that outlives the call touches only the shared state it co-owns, never the call's buffers.
// A helper runs its pieces under the caller's floating-point control (flush-to-zero,
// denormals-are-zero, rounding), whatever its own thread's: a denormal gives the same bytes
// on every thread (docs/format.md, "Flush to zero").
#ifndef FLASHCOMM_CPU_PARALLEL_H_
#define FLASHCOMM_CPU_PARALLEL_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <utility>

#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
#include <xmmintrin.h>
#endif

namespace flashcomm {
namespace cpu {

// The calling thread's floating-point control register (x86 MXCSR, aarch64 FPCR; 0 where
// neither), and setting it.
inline uint64_t fp_control() {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  return _mm_getcsr();
#elif defined(__aarch64__)
  uint64_t v;
  asm volatile("mrs %0, fpcr" : "=r"(v));
  return v;
#else
  return 0;
#endif
}
inline void set_fp_control(uint64_t v) {
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
  _mm_setcsr(static_cast<unsigned>(v));
#elif defined(__aarch64__)
  asm volatile("msr fpcr, %0" : : "r"(v));
#else
  (void)v;
#endif
}

// Sets the floating-point control to `v` for its lifetime, then restores the thread's own.
class ScopedFpControl {
 public:
  explicit ScopedFpControl(uint64_t v) : saved_(fp_control()) { set_fp_control(v); }
  ~ScopedFpControl() { set_fp_control(saved_); }
  ScopedFpControl(const ScopedFpControl&) = delete;
  ScopedFpControl& operator=(const ScopedFpControl&) = delete;

 private:
  uint64_t saved_;
};

// At most this many threads per codec call (0: as many as the pool has). Set from
// FLASHCOMM_CPU_THREADS when the library loads and by jax_flashcomm.codec.use_cpu_threads.
inline std::atomic<int>& max_codec_threads() {
  static std::atomic<int> value{0};
  return value;
}

// Calls split into more than one piece so far (tests check that a split happened).
inline std::atomic<int64_t>& split_calls() {
  static std::atomic<int64_t> value{0};
  return value;
}

// Pieces of at least this many bytes of operand: below it, scheduling costs more than it saves.
constexpr int64_t kMinPieceBytes = int64_t(256) << 10;
// Pieces per thread: the dynamic claiming evens out threads that start late or run slow.
constexpr int64_t kPiecesPerThread = 4;

class Runner {
 public:
  using Task = std::function<void()>;
  using Schedule = std::function<void(Task)>;

  // Everything on the calling thread (the C++ tests, and pools of one thread).
  static Runner Inline() { return Runner(nullptr, 1); }
  // `schedule` runs a task on one of the pool's `threads` threads (or on the caller).
  Runner(Schedule schedule, int64_t threads) : schedule_(std::move(schedule)), threads_(threads) {
    const int cap = max_codec_threads().load(std::memory_order_relaxed);
    if (cap > 0) threads_ = std::min<int64_t>(threads_, cap);
    if (threads_ < 1 || !schedule_) threads_ = 1;
  }

  int64_t threads() const { return threads_; }

  // body(begin, end) over consecutive ranges covering [0, n) once each, n items of
  // item_bytes bytes; on up to threads() threads, returning when every range is done.
  template <typename Body>
  void ForRanges(int64_t n, int64_t item_bytes, Body&& body) const {
    const int64_t by_size = n * std::max<int64_t>(item_bytes, 1) / kMinPieceBytes;
    const int64_t pieces = std::min({threads_ * kPiecesPerThread, by_size, n});
    if (threads_ <= 1 || pieces <= 1) {
      if (n > 0) body(int64_t(0), n);
      return;
    }
    split_calls().fetch_add(1, std::memory_order_relaxed);
    auto state = std::make_shared<State>();
    state->pieces = pieces;
    state->n = n;
    state->body = [&body](int64_t b, int64_t e) { body(b, e); };
    state->fp = fp_control();
    const int64_t helpers = std::min(threads_, pieces) - 1;
    for (int64_t h = 0; h < helpers; ++h) {
      schedule_([state] {
        const ScopedFpControl mode(state->fp);
        Work(*state);
      });
    }
    Work(*state);
    std::unique_lock<std::mutex> lock(state->mu);
    state->cv.wait(lock, [&] { return state->done == state->pieces; });
  }

  // ForRanges over a body that returns a status (0: success, else a nonzero code, e.g. the bytes
  // of a scratch allocation that failed, cpu_dispatch.h): once a piece has failed, the pieces
  // not yet started are skipped; returns the first failure recorded, or 0.
  template <typename Body>
  size_t ForRangesStatus(int64_t n, int64_t item_bytes, Body&& body) const {
    std::atomic<size_t> failed{0};
    ForRanges(n, item_bytes, [&](int64_t b, int64_t e) {
      if (failed.load(std::memory_order_relaxed) != 0) return;
      const size_t status = body(b, e);
      if (status != 0) {
        size_t none = 0;
        failed.compare_exchange_strong(none, status, std::memory_order_relaxed);
      }
    });
    return failed.load(std::memory_order_relaxed);
  }

 private:
  struct State {
    std::atomic<int64_t> next{0};
    int64_t pieces = 0;
    int64_t n = 0;
    std::function<void(int64_t, int64_t)> body;  // valid while a piece is unfinished
    uint64_t fp = 0;                              // the caller's floating-point control
    std::mutex mu;
    std::condition_variable cv;
    int64_t done = 0;  // guarded by mu
  };

  static void Work(State& s) {
    for (;;) {
      const int64_t i = s.next.fetch_add(1, std::memory_order_relaxed);
      if (i >= s.pieces) return;
      s.body(s.n * i / s.pieces, s.n * (i + 1) / s.pieces);
      std::lock_guard<std::mutex> lock(s.mu);
      if (++s.done == s.pieces) s.cv.notify_all();
    }
  }

  Schedule schedule_;
  int64_t threads_;
};

}  // namespace cpu
}  // namespace flashcomm

#endif  // FLASHCOMM_CPU_PARALLEL_H_
