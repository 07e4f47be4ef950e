#!/usr/bin/env bash
# Build the CPU codec kernels and their C++ tests (ffi/tests/codec_cpu_test.cc,
# ffi/tests/gather_cpu_test.cc, ffi/tests/codec_fingerprint.cc: every instruction-set build the
# CPU runs, checking that they all give the same bytes; ffi/tests/p2p_rendezvous_test.cc: the
# p2p transport's rendezvous with real threads; ffi/tests/shm_rendezvous_test.cc: its
# shared-memory meeting point with real processes) with
# AddressSanitizer and UndefinedBehaviorSanitizer, and run them under ctest. Any sanitizer
# report aborts the test (-fno-sanitize-recover=all, halt_on_error=1), so a clean exit means no
# reports. Usage: [PYTHON=/path/to/python] ffi/tests/run_sanitizers.sh  (the Python must have
# jax and nanobind installed: CMake takes the XLA FFI headers and nanobind from it).
# BUILD_DIR=dir keeps the build there (default: a temporary directory, removed on exit).
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
python="$(command -v "${PYTHON:-python3}")"

if [[ -n "${BUILD_DIR:-}" ]]; then
  build="$BUILD_DIR"
  mkdir -p "$build"
else
  build="$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-asan.XXXXXX")"
  trap 'rm -rf "$build"' EXIT
fi

generator=()
if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi

# On x86-64, only the kernel builds this CPU runs (the tests run those alone; the package's own
# build compiles every one): jax_flashcomm, when installed, knows which; else all of them.
isas="$("$python" -c "from jax_flashcomm import codec; print(';'.join(i for i in codec.cpu_isas() if i != 'baseline'))" 2>/dev/null || echo "avx512;avx2")"

cmake -S "$repo" -B "$build" "${generator[@]}" \
  -DPython_EXECUTABLE="$python" \
  -DFLASHCOMM_X86_ISAS="$isas" \
  -DCMAKE_BUILD_TYPE=Debug \
  -DFLASHCOMM_SANITIZE=ON \
  -DFLASHCOMM_CPU_TESTS=ON \
  -DFLASHCOMM_WERROR=ON >"$build/configure.log" 2>&1 || { cat "$build/configure.log"; exit 1; }
cmake --build "$build" --target codec_cpu_test gather_cpu_test codec_fingerprint \
  p2p_rendezvous_test shm_rendezvous_test cpu_parallel_test norm_cpu_test

export ASAN_OPTIONS="detect_leaks=1:abort_on_error=1:strict_string_checks=1:detect_stack_use_after_return=1${ASAN_OPTIONS:+:$ASAN_OPTIONS}"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1${UBSAN_OPTIONS:+:$UBSAN_OPTIONS}"
ctest --test-dir "$build" --output-on-failure

# ctest passed: print each test program's summary line ("N passed, M failed").
for test in codec_cpu_test gather_cpu_test codec_fingerprint p2p_rendezvous_test \
    shm_rendezvous_test cpu_parallel_test norm_cpu_test; do
  summary="$(sed -n "/^[0-9]*\/[0-9]* Testing: $test\$/,/^\"$test\" end time/p" \
    "$build/Testing/Temporary/LastTest.log" \
    | grep -Eo '[0-9]+ passed, [0-9]+ failed' | tail -n 1)"
  if [[ -z "$summary" ]]; then
    echo "run_sanitizers.sh: no summary line of $test in the test output" >&2
    exit 1
  fi
  echo "$test (ASan+UBSan): $summary"
done
