#!/usr/bin/env bash
# Build the CPU codec kernels with Bazel (top-level BUILD/WORKSPACE) and run
# //:codec_cpu_test and //:gather_cpu_test, offline. Usage: [PYTHON=/path/to/python]
# ffi/tests/run_bazel.sh [bazel test flags...]. The Python must have jax installed: the XLA
# FFI headers are its `jax.ffi.include_dir()` (or set FLASHCOMM_XLA_INCLUDE to a directory
# holding xla/ffi/api/).
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

include="${FLASHCOMM_XLA_INCLUDE:-}"
if [[ -z "$include" ]]; then
  python="$(command -v "${PYTHON:-python3}")" || {
    echo "run_bazel.sh: ${PYTHON:-python3} not found" >&2
    exit 1
  }
  include="$("$python" -c "from jax import ffi; print(ffi.include_dir())")"
fi
if [[ ! -f "$include/xla/ffi/api/ffi.h" ]]; then
  echo "run_bazel.sh: no xla/ffi/api/ffi.h under $include" >&2
  exit 1
fi
echo "XLA FFI headers: $include"

if [[ "${BAZEL_KEEP_SERVER:-0}" != 1 ]]; then
  trap '"$bazel" shutdown >/dev/null 2>&1 || true' EXIT
fi

"$bazel" test --repo_env=FLASHCOMM_XLA_INCLUDE="$include" "$@" //:codec_cpu_test //:gather_cpu_test

# Passed: print each test program's summary line ("N passed, M failed").
for test in codec_cpu_test gather_cpu_test; do
  log="$("$bazel" info bazel-testlogs 2>/dev/null)/$test/test.log"
  summary="$(grep -Eo '[0-9]+ passed, [0-9]+ failed' "$log" | tail -n 1 || true)"
  if [[ -z "$summary" ]]; then
    echo "run_bazel.sh: no summary line in $log" >&2
    exit 1
  fi
  echo "$test (Bazel): $summary"
done
