#!/usr/bin/env bash
# The GPU check, one command: bash benchmarks/gpu_check.sh
#
# For a machine with an NVIDIA GPU and no network, whose Python already has JAX, its CUDA plugin
# and the build tools (scikit-build-core, nanobind, cmake, ninja), with nvcc installed. Nothing
# is downloaded. It
#   1. builds the CUDA module in place: FLASHCOMM_CUDA=ON pip install --no-deps
#      --no-build-isolation -e . (falling back to a plain CMake build copied into
#      jax_flashcomm/ when pip cannot build);
#   2. runs the tests marked gpu, all in tests/gpu (pytest -m gpu -rs: every skip is listed
#      with its reason);
#   3. measures (benchmarks/gpu/check.py) and writes docs/results/cuda_check.json and the table between
#      the gpu_check markers in docs/cuda.md.
# Without a GPU it does the same, as CI would: the build (the CUDA module compiles without a
# GPU where nvcc is present), the gpu tests collected and skipped with their reasons (the few
# that need only the built module run), and the table with "not run". Exit status 0 when every
# step that could run passed.
#
# Environment: PYTHON (default: .venv/bin/python if present, else python3), CUDA_ARCHS (the
# CMAKE_CUDA_ARCHITECTURES list; default 80;89;90 plus the GPU's own), FLASHCOMM_XLA_INCLUDE
# ("jaxlib": build against the installed jaxlib's XLA FFI headers instead of the vendored
# ones; also tried by itself when the module built with the vendored ones cannot register),
# GPU_CHECK_QUICK=1 (16 MiB measurements only), GPU_CHECK_SKIP_BUILD=1 (use the build there is),
# GPU_CHECK_PROFILE=1 (with a GPU and ncu, the codec kernels' Nsight Compute profile goes to
# docs/cuda_profile.txt: up to 4 minutes, so off by default), GPU_CHECK_TESTS (the test paths;
# default tests/gpu), GPU_CHECK_BENCH=0 (no measurements: a quick rerun of some tests).
set -uo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
if [[ -n "${PYTHON:-}" ]]; then PY=$PYTHON
elif [[ -x .venv/bin/python ]]; then PY=$PWD/.venv/bin/python
else PY=$(command -v python3)
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
say() { echo "== $*"; }

say "machine"
"$PY" - <<'EOF'
import importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
for name in ("jax", "jaxlib", "jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt",
             "jax-cuda12-pjrt", "scikit-build-core", "nanobind", "cmake", "ninja", "pytest"):
    try:
        print(f"  {name} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
EOF
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi -L || true
else
  echo "nvidia-smi: not found"
fi
gpus=$("$PY" -c "
import jax
try:
    print(len(jax.devices('gpu')))
except RuntimeError:
    print(0)" 2>/dev/null | tail -1)
gpus=${gpus:-0}
if [[ "$gpus" -gt 0 ]]; then
  say "JAX sees $gpus GPU(s): the full check"
else
  say "no GPU (jax.devices('gpu') is empty): the no-GPU mode (build, collect, skip, 'not run')"
fi

say "build tools"
missing=()
"$PY" -c "import scikit_build_core" 2>/dev/null || missing+=("scikit-build-core (python module)")
"$PY" -c "import nanobind" 2>/dev/null || missing+=("nanobind (python module)")
pybin=$(dirname "$PY")
export PATH="$PATH:$pybin"
command -v cmake >/dev/null 2>&1 || missing+=("cmake")
command -v ninja >/dev/null 2>&1 || missing+=("ninja")
nvcc=""
if command -v nvcc >/dev/null 2>&1; then nvcc=$(command -v nvcc)
elif [[ -x /usr/local/cuda/bin/nvcc ]]; then nvcc=/usr/local/cuda/bin/nvcc
fi
if [[ -n "$nvcc" ]]; then
  export CUDACXX=$nvcc PATH="$PATH:$(dirname "$nvcc")"
  echo "nvcc: $nvcc ($("$nvcc" --version | tail -1))"
else
  missing+=("nvcc (the CUDA toolkit)")
fi
if [[ ${#missing[@]} -gt 0 ]]; then
  echo "MISSING: ${missing[*]} -- install them from a local wheel or package (no network is"
  echo "         assumed here); the build step can not do everything without them"
fi

archs=${CUDA_ARCHS:-}
if [[ -z "$archs" ]]; then
  archs="80;89;90"
  if [[ "$gpus" -gt 0 ]] && command -v nvidia-smi >/dev/null 2>&1; then
    for cap in $(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | tr -d . | sort -u); do
      [[ ";$archs;" == *";$cap;"* ]] || archs="$archs;$cap"
    done
  fi
fi

xla_include=""
jaxlib_headers() { "$PY" -c "import jax; print(jax.ffi.include_dir())"; }
if [[ "${FLASHCOMM_XLA_INCLUDE:-}" == "jaxlib" ]]; then
  xla_include=$(jaxlib_headers)
elif [[ -n "${FLASHCOMM_XLA_INCLUDE:-}" ]]; then
  xla_include=$FLASHCOMM_XLA_INCLUDE
fi

build_pip() {  # the editable install CI does, without downloads
  local defs=(-Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$archs")
  [[ -n "$xla_include" ]] && defs+=(-Ccmake.define.FLASHCOMM_XLA_INCLUDE="$xla_include")
  FLASHCOMM_CUDA=$1 "$PY" -m pip install --no-deps --no-build-isolation --no-index -e . \
    "${defs[@]}" >"$tmp/build.log" 2>&1 && return 0
  # A distribution's Python (PEP 668) refuses pip installs unless told: this is a test machine.
  grep -q "externally-managed-environment" "$tmp/build.log" || return 1
  echo "(the Python is externally managed: retrying with PIP_BREAK_SYSTEM_PACKAGES=1)"
  PIP_BREAK_SYSTEM_PACKAGES=1 FLASHCOMM_CUDA=$1 "$PY" -m pip install --no-deps \
    --no-build-isolation --no-index -e . "${defs[@]}" >"$tmp/build.log" 2>&1
}
build_cmake() {  # fallback: plain CMake into build/gpu_check, modules copied into the tree
  local defs=(-DPython_EXECUTABLE="$PY" -DFLASHCOMM_CUDA="$1" -DCMAKE_CUDA_ARCHITECTURES="$archs")
  [[ -n "$xla_include" ]] && defs+=(-DFLASHCOMM_XLA_INCLUDE="$xla_include")
  { cmake -S . -B build/gpu_check -G Ninja "${defs[@]}" &&
    cmake --build build/gpu_check -j"$(nproc)" &&
    cp build/gpu_check/_flashcomm_*.so jax_flashcomm/ &&
    { [[ "$1" != ON ]] || cp build/gpu_check/cuda_ptxas.log jax_flashcomm/; }
  } >>"$tmp/build.log" 2>&1
}
module_check() {  # the CUDA module imports and its handlers answer; on a GPU, one quantize runs
  "$PY" - "$gpus" <<'EOF'
import sys
from jax_flashcomm.codec import kernels
assert kernels.available("cpu"), kernels._import_errors
assert kernels.available("cuda"), kernels._import_errors
import jax_flashcomm._flashcomm_cuda as m
meta = m.handler_metadata()
print(f"  CUDA module: {len(meta)} handlers, FFI API "
      f"{sorted({f'{v[1]}.{v[2]}' for v in meta.values()})}")
if int(sys.argv[1]) > 0:
    import jax, jax.numpy as jnp
    from jax_flashcomm import codec
    x = jax.device_put(jnp.arange(1024, dtype=jnp.float32), jax.devices("gpu")[0])
    p = jax.jit(lambda a: codec.quantize(a, backend="ffi"))(x)
    print("  one quantize on the GPU:", p.codes.shape, p.codes.dtype)
EOF
}

build="not run"
cuda=ON
[[ -z "$nvcc" ]] && cuda=OFF
if [[ "${GPU_CHECK_SKIP_BUILD:-0}" == 1 ]]; then
  say "build skipped (GPU_CHECK_SKIP_BUILD=1): the module there is"
  build="skipped (GPU_CHECK_SKIP_BUILD=1)"
else
  say "build (FLASHCOMM_CUDA=$cuda, CMAKE_CUDA_ARCHITECTURES=$archs${xla_include:+, XLA FFI headers $xla_include})"
  t0=$(date +%s)
  how=""
  if build_pip "$cuda"; then how="pip install --no-deps --no-build-isolation -e ."
  else
    tail -30 "$tmp/build.log"
    echo "pip could not build; trying a plain CMake build into build/gpu_check"
    if build_cmake "$cuda"; then how="CMake into build/gpu_check, modules copied into jax_flashcomm/"
    else tail -30 "$tmp/build.log"
    fi
  fi
  secs=$(( $(date +%s) - t0 ))
  if [[ -z "$how" ]]; then
    build="FAILED after $secs s (log above)"
    status=1
  elif [[ $cuda == OFF ]]; then
    build="CPU module only: no nvcc ($how, $secs s)"
  else
    build="ok: $how, sm ${archs//;/\/}, $secs s"
  fi
  echo "$build"
fi
if [[ $cuda == ON && $status == 0 ]]; then
  if ! module_check 2>"$tmp/check.err"; then
    tail -5 "$tmp/check.err"
    if [[ -z "$xla_include" ]] && grep -qi "version" "$tmp/check.err"; then
      say "the handlers built against the vendored XLA FFI headers do not register with this"
      say "jaxlib: rebuilding against jaxlib's own headers"
      xla_include=$(jaxlib_headers)
      if build_pip ON || build_cmake ON; then
        build="$build; rebuilt against jaxlib's XLA FFI headers"
        module_check || { build="$build; the module still fails its check"; status=1; }
      else
        build="$build; the rebuild against jaxlib's headers FAILED"; status=1
      fi
    else
      build="$build; the module fails its check ($(tail -1 "$tmp/check.err"))"
      status=1
    fi
  fi
fi

say "tests: pytest -m gpu tests/gpu (every skip listed with its reason)"
# Every test marked gpu lives in tests/gpu: collecting only there keeps the check independent
# of the rest of the suite (CI runs that).
export FLASHCOMM_TEST_XLA_OPT=default  # XLA's default code generation, as users run it
t0=$(date +%s)
read -r -a test_paths <<<"${GPU_CHECK_TESTS:-tests/gpu}"
"$PY" -m pytest -m gpu -rs -p no:cacheprovider --junitxml="$tmp/gpu_tests.xml" "${test_paths[@]}"
rc=$?
echo "pytest: exit status $rc, $(( $(date +%s) - t0 )) s"
if [[ $rc -ne 0 ]]; then status=1; fi

if [[ "${GPU_CHECK_BENCH:-1}" == 1 ]]; then
  say "measurements and report"
  quick=()
  [[ "${GPU_CHECK_QUICK:-0}" == 1 ]] && quick=(--quick)
  "$PY" -m benchmarks.gpu.check --junit "$tmp/gpu_tests.xml" --build "$build" \
    --json docs/results/cuda_check.json --markdown docs/cuda.md "${quick[@]}" || status=1
else
  say "measurements skipped (GPU_CHECK_BENCH=0): docs/cuda.md keeps its table"
fi

# Where Nsight Compute runs (it did on the Firecracker H200s, not under gVisor), a profile of the
# codec kernels for the next round of kernel work: never a failure of the check.
if [[ "$gpus" -gt 0 && "${GPU_CHECK_PROFILE:-0}" == 1 ]]; then
  say "kernel profile (Nsight Compute) -> docs/cuda_profile.txt"
  ncu_bin=$(command -v ncu || true)  # nvcc's folder is on PATH since the build tools step
  if [[ -z "$ncu_bin" && -n "$nvcc" && -x "$(dirname "$nvcc")/ncu" ]]; then
    ncu_bin="$(dirname "$nvcc")/ncu"
  fi
  if [[ -z "$ncu_bin" ]]; then
    echo "ncu: not found (no profile)"
  elif timeout 240 "$ncu_bin" --target-processes all --launch-count 10 \
      -k regex:'Quantize|Dequantize' \
      --section SpeedOfLight --section LaunchStats --section Occupancy \
      --section ComputeWorkloadAnalysis \
      "$PY" -m benchmarks.gpu.codec_speed --once --sizes 64 >"$tmp/ncu.txt" 2>&1; then
    { echo "# Nsight Compute on the codec kernels ($(date -u '+%Y-%m-%d %H:%M UTC'), $(
        nvidia-smi -L 2>/dev/null | head -1)); written by benchmarks/gpu_check.sh"
      grep -v '^==PROF==' "$tmp/ncu.txt"; } >docs/cuda_profile.txt
    grep -E "^  [a-z].*Kernel|Duration|Compute \(SM\) Throughput|DRAM Throughput" \
      docs/cuda_profile.txt | head -40
  else
    echo "ncu failed or timed out (no profile):"; tail -5 "$tmp/ncu.txt"
  fi
fi

say "gpu_check: exit status $status, $(( $(date +%s) - start )) s (GPUs: $gpus)"
exit $status
