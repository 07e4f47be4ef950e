// Timing and memory for the C++ benchmarks (fp_loop.cc, fp_ab.cc, isa_ab.cc): a monotonic clock
// and buffers aligned to 2 MiB, touched, on transparent huge pages or not.
#ifndef FLASHCOMM_BENCH_MEMORY_H_
#define FLASHCOMM_BENCH_MEMORY_H_

#include <sys/mman.h>

#include <chrono>
#include <cstddef>
#include <cstdlib>
#include <cstring>

namespace bench {

// Seconds on a monotonic clock.
inline double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// n bytes, 2 MiB aligned, zeroed, on transparent huge pages (or, huge = false, 4 KiB pages);
// freed with std::free.
inline void* Buffer(size_t n, bool huge = true) {
  const size_t align = size_t(2) << 20, size = (n + align - 1) / align * align;
  void* p = std::aligned_alloc(align, size);
  if (p == nullptr) std::abort();
  madvise(p, size, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
  std::memset(p, 0, size);
  return p;
}

}  // namespace bench

#endif  // FLASHCOMM_BENCH_MEMORY_H_
