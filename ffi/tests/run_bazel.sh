#!/usr/bin/env bash
# Build the CPU codec kernels with Bazel (top-level BUILD/WORKSPACE) and run
# //:codec_cpu_test and //:gather_cpu_test, offline. Usage: ffi/tests/run_bazel.sh [bazel test
# flags...]. The XLA FFI headers are the vendored copy (third_party/xla_ffi), or the directory
# FLASHCOMM_XLA_INCLUDE names (holding xla/ffi/api/).
# Needs bazel on PATH (BAZEL=... to choose one); tested with Debian bookworm's bazel-bootstrap
# (Bazel 4.2.3: apt-get install bazel-bootstrap) and gcc 12. The Bazel server is shut down on
# exit unless BAZEL_KEEP_SERVER=1.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
bazel="${BAZEL:-bazel}"
if ! command -v "$bazel" >/dev/null 2>&1; then
  echo "run_bazel.sh: '$bazel' not found (Debian/Ubuntu: apt-get install bazel-bootstrap)" >&2
  exit 1
fi

flags=()
if [[ -n "${FLASHCOMM_XLA_INCLUDE:-}" ]]; then
  flags+=(--repo_env=FLASHCOMM_XLA_INCLUDE="$FLASHCOMM_XLA_INCLUDE")
fi

if [[ "${BAZEL_KEEP_SERVER:-0}" != 1 ]]; then
  trap '"$bazel" shutdown >/dev/null 2>&1 || true' EXIT
fi

targets=(//:codec_cpu_test //:gather_cpu_test //:p2p_rendezvous_test //:shm_rendezvous_test
  //:cpu_parallel_test //:norm_cpu_test)
# Build first, then run the tests one at a time: the multi-process and timing checks of the
# rendezvous tests never share the machine with a compile or with each other.
"$bazel" build "${flags[@]}" "$@" "${targets[@]}"
"$bazel" test "${flags[@]}" --local_test_jobs=1 "$@" "${targets[@]}"

# Passed: print each test program's summary line ("N passed, M failed").
for test in codec_cpu_test gather_cpu_test p2p_rendezvous_test shm_rendezvous_test cpu_parallel_test norm_cpu_test; do
  log="$("$bazel" info bazel-testlogs 2>/dev/null)/$test/test.log"
  summary="$(grep -Eo '[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1 || true)"
  if [[ -z "$summary" ]]; then
    echo "run_bazel.sh: no summary line in $log" >&2
    exit 1
  fi
  echo "$test (Bazel): $summary"
done
