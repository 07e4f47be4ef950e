// The CHECK of the threaded C++ tests (p2p_rendezvous_test.cc, cpu_parallel_test.cc): counts
// passes and failures (atomically: checks run on the tests' threads too) and prints each
// failure with its place; main prints the counts and fails if any check did.
#ifndef FLASHCOMM_TESTS_CHECK_H_
#define FLASHCOMM_TESTS_CHECK_H_

#include <atomic>
#include <cstdio>

inline std::atomic<int> g_passed{0};
inline std::atomic<int> g_failed{0};

#define CHECK(cond)                                                                  \
  do {                                                                               \
    if (cond) {                                                                      \
      ++g_passed;                                                                    \
    } else {                                                                         \
      ++g_failed;                                                                    \
      std::fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);  \
    }                                                                                \
  } while (0)

// "<name>: N passed, M failed" (the line run_sanitizers.sh and run_bazel.sh look for); the
// process's exit status.
inline int ReportChecks(const char* name) {
  std::printf("%s: %d passed, %d failed\n", name, g_passed.load(), g_failed.load());
  return g_failed.load() == 0 ? 0 : 1;
}

#endif  // FLASHCOMM_TESTS_CHECK_H_
