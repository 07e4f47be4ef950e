#!/usr/bin/env bash
# The CUDA kernels under compute-sanitizer: bash benchmarks/native/gpu_sanitize.sh
#
# For the GPU machine of benchmarks/gpu_check.sh (same Python, nvcc, no network). Builds the CUDA
# module when it is not there (as gpu_check.sh does), then runs the GPU half of the GPU tests'
# programs (tests/gpu/sanitize_driver.py: every codec, floating-point, fused-norm and gather
# configuration) under compute-sanitizer, one tool at a time:
#   memcheck   out-of-bounds and misaligned accesses, hardware exceptions
#   racecheck  shared-memory hazards
#   synccheck  invalid uses of barriers and warp synchronization
# Only kernels of the flashcomm namespace are instrumented (--kernel-name kns=flashcomm): XLA's
# own kernels run as usual. A tool's run ends at its time limit; the parts it finished are in the
# log. Exit status 0 when every tool ran the driver to the end with no error reported. (pytest
# itself under the sanitizer crashed with SIGSEGV in its first tests on an H200: docs/cuda.md.)
#
# Environment: PYTHON (as gpu_check.sh), CUDA_ARCHS (default 90), SANITIZE_TOOLS (default
# "memcheck racecheck synccheck"), SANITIZE_TIMEOUT (seconds per tool, default 240; a list
# gives each tool its own, in order),
# SANITIZE_PARTS (the driver's parts; default "codec fp norm gather"), SANITIZE_TARGETS
# (--target-processes; default application-only: with "all" the sanitizer itself crashed
# with SIGSEGV on an H200, see docs/cuda.md),
# SANITIZE_LOG (a folder for each tool's full log; default a temporary one), SANITIZE_XLA_FLAGS
# (added to XLA_FLAGS; default: no command buffers, no autotuning), SANITIZE_FILTER=0 (every
# kernel instrumented, XLA's too).
set -uo pipefail
cd "$(dirname "$0")/../.."
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=$PWD/.venv/bin/python
else PY=$(command -v python3)
fi
logs=${SANITIZE_LOG:-$(mktemp -d)}
mkdir -p "$logs"
say() { echo "== $*"; }

sanitizer=$(command -v compute-sanitizer || true)
for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [[ -z "$sanitizer" && -x $c ]] && sanitizer=$c
done
if [[ -z "$sanitizer" ]]; then
  echo "compute-sanitizer: not found (it comes with the CUDA toolkit)"; exit 2
fi
say "$sanitizer ($("$sanitizer" --version | grep -i version | head -1))"
nvidia-smi -L 2>/dev/null || true

if ! "$PY" -c "import jax_flashcomm._flashcomm_cuda" 2>/dev/null; then
  say "build (FLASHCOMM_CUDA=ON, sm ${CUDA_ARCHS:-90})"
  export PATH="$PATH:$(dirname "$PY"):/usr/local/cuda/bin"
  t0=$(date +%s)
  FLASHCOMM_CUDA=ON "$PY" -m pip install -q --no-deps --no-build-isolation --no-index -e . \
    -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >"$logs/build.log" 2>&1 ||
    PIP_BREAK_SYSTEM_PACKAGES=1 FLASHCOMM_CUDA=ON "$PY" -m pip install -q --no-deps \
      --no-build-isolation --no-index -e . \
      -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="${CUDA_ARCHS:-90}" >>"$logs/build.log" 2>&1 ||
    { tail -30 "$logs/build.log"; echo "build FAILED"; exit 1; }
  echo "built in $(( $(date +%s) - t0 )) s"
fi

read -r -a parts <<<"${SANITIZE_PARTS:-codec fp norm gather}"
export FLASHCOMM_TEST_XLA_OPT=default XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
# XLA's command buffers (CUDA graphs) and autotuning launch work the tools need not see.
export XLA_FLAGS="${XLA_FLAGS:-} ${SANITIZE_XLA_FLAGS---xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0}"
filter=(--kernel-name kns=flashcomm)
[[ "${SANITIZE_FILTER:-1}" == 0 ]] && filter=()
usage=$("$sanitizer" --help 2>&1)  # not piped into grep -q: SIGPIPE would fail the pipeline
[[ ${#filter[@]} -eq 0 || $usage == *--kernel-name* ]] ||
  { filter=(); echo "(this compute-sanitizer has no --kernel-name: every kernel is checked)"; }
read -r -a limits <<<"${SANITIZE_TIMEOUT:-240}"
status=0
summary=()
i=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
  limit=${limits[$i]:-${limits[-1]}}
  i=$((i + 1))
  say "$tool (at most $limit s): ${parts[*]}"
  t0=$(date +%s)
  timeout "$limit" "$sanitizer" --tool "$tool" --target-processes "${SANITIZE_TARGETS:-application-only}" \
    "${filter[@]}" --error-exitcode 86 --print-limit 50 \
    "$PY" -X faulthandler -m tests.gpu.sanitize_driver "${parts[@]}" >"$logs/$tool.log" 2>&1
  rc=$?
  if [[ $rc -ne 0 && $rc -ne 86 && $rc -ne 124 && ${#filter[@]} -gt 0 ]] &&
     grep -qiE "unrecognized|invalid (value|option)|usage:" "$logs/$tool.log"; then
    echo "(the sanitizer refused ${filter[*]}: again with every kernel checked)"
    filter=()
    timeout "$limit" "$sanitizer" --tool "$tool" --target-processes "${SANITIZE_TARGETS:-application-only}" --error-exitcode 86 \
      --print-limit 50 "$PY" -X faulthandler -m tests.gpu.sanitize_driver "${parts[@]}" \
      >"$logs/$tool.log" 2>&1
    rc=$?
  fi
  secs=$(( $(date +%s) - t0 ))
  errors=$(grep -E "^========= (ERROR SUMMARY|RACECHECK SUMMARY)" "$logs/$tool.log" | tail -1)
  result=$(grep -E "programs ran on" "$logs/$tool.log" | tr '\n' ';')
  grep -E "^========= [^=]" "$logs/$tool.log" | grep -v "^========= COMPUTE-SANITIZER$" | head -40
  case $rc in
    0) line="$tool: clean, $secs s; ${result:-?} ${errors:-no summary}";;
    86) line="$tool: ERRORS REPORTED, $secs s; ${result:-?} $errors"; status=1;;
    124) line="$tool: stopped at $limit s, parts finished: ${result:-none};"
         line="$line ${errors:-no errors reported until then}"; status=1;;
    *) line="$tool: exit status $rc, $secs s; ${result:-?} ${errors:-}"; status=1
       tail -15 "$logs/$tool.log";;
  esac
  echo "$line"
  summary+=("$line")
done
say "summary"
printf '%s\n' "${summary[@]}"
echo "logs: $logs"
exit $status
