#!/usr/bin/env bash
# The CPU codec on aarch64 (Grace, Graviton, Apple silicon under Linux), tested from an x86-64
# machine: cross-compile the kernels' NEON and baseline builds with Debian's
# g++-aarch64-linux-gnu, run the C++ codec tests (codec_cpu_test, gather_cpu_test) under
# qemu-user, and compare the codec fingerprint (ffi/tests/codec_fingerprint.cc: every output
# byte of a fixed set of operands, hashed) of every aarch64 build with every x86-64 build this
# CPU runs: the codes must be bit-identical across architectures.
# Needs: apt-get install g++-aarch64-linux-gnu qemu-user (INSTALL=1 does it). About 3 minutes
# on 2 cores, so not part of .ci/run. Usage: ffi/tests/run_aarch64.sh
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$repo"
cross="${CROSS_CXX:-aarch64-linux-gnu-g++}"
qemu="${QEMU:-qemu-aarch64}"
if [[ "${INSTALL:-0}" == 1 ]] && ! command -v "$cross" >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq g++-aarch64-linux-gnu qemu-user >/dev/null
fi
for tool in "$cross" "$qemu" g++; do
  command -v "$tool" >/dev/null 2>&1 || {
    echo "run_aarch64.sh: $tool not found (apt-get install g++-aarch64-linux-gnu qemu-user)" >&2
    exit 1
  }
done

build="$(mktemp -d "${TMPDIR:-/tmp}/flashcomm-aarch64.XXXXXX")"
trap 'rm -rf "$build"' EXIT
# The flags of CMakeLists.txt's FLASHCOMM_CXX_FLAGS.
flags=(-O3 -std=c++17 -ffp-contract=off -fno-fast-math -fno-trapping-math -Wall -Wextra
       -Wno-psabi -Werror -Iffi/include -Iffi -isystem third_party/xla_ffi/include)

# Compile jobs two at a time (2 cores).
jobs_run() { while (($(jobs -rp | wc -l) >= 2)); do wait -n; done; "$@" & }

echo "== cross-compiling for aarch64 (neon and baseline builds)"
a="$build/aarch64"; x="$build/x86"
mkdir -p "$a" "$x"
jobs_run "$cross" "${flags[@]}" -DFLASHCOMM_ISA=isa_neon -DFLASHCOMM_LANES=4 \
  -c ffi/cpu/isa_kernels.cc -o "$a/isa_neon.o"
jobs_run "$cross" "${flags[@]}" -DFLASHCOMM_ISA=isa_baseline -DFLASHCOMM_LANES=4 \
  -DFLASHCOMM_NO_INTRINSICS -c ffi/cpu/isa_kernels.cc -o "$a/isa_baseline.o"
for src in codec_handlers gather_handlers dispatch; do
  jobs_run "$cross" "${flags[@]}" -DFLASHCOMM_HAVE_ISA_NEON -c "ffi/cpu/$src.cc" -o "$a/$src.o"
done
for t in codec_cpu_test gather_cpu_test codec_fingerprint; do
  jobs_run "$cross" "${flags[@]}" -c "ffi/tests/$t.cc" -o "$a/$t.o"
done
echo "== compiling the x86-64 builds for the fingerprint"
jobs_run g++ "${flags[@]}" -DFLASHCOMM_ISA=isa_avx512 -DFLASHCOMM_LANES=16 -march=x86-64-v4 \
  -Wno-maybe-uninitialized -c ffi/cpu/isa_kernels.cc -o "$x/isa_avx512.o"
jobs_run g++ "${flags[@]}" -DFLASHCOMM_ISA=isa_avx2 -DFLASHCOMM_LANES=8 -march=x86-64-v3 \
  -c ffi/cpu/isa_kernels.cc -o "$x/isa_avx2.o"
jobs_run g++ "${flags[@]}" -DFLASHCOMM_ISA=isa_baseline -DFLASHCOMM_LANES=4 \
  -c ffi/cpu/isa_kernels.cc -o "$x/isa_baseline.o"
jobs_run g++ "${flags[@]}" -DFLASHCOMM_HAVE_ISA_AVX512 -DFLASHCOMM_HAVE_ISA_AVX2 \
  -c ffi/cpu/dispatch.cc -o "$x/dispatch.o"
jobs_run g++ "${flags[@]}" -c ffi/tests/codec_fingerprint.cc -o "$x/codec_fingerprint.o"
wait

lib=("$a/isa_neon.o" "$a/isa_baseline.o" "$a/codec_handlers.o" "$a/gather_handlers.o" "$a/dispatch.o")
for t in codec_cpu_test gather_cpu_test codec_fingerprint; do
  "$cross" -static "$a/$t.o" "${lib[@]}" -o "$a/$t"
done
g++ "$x/codec_fingerprint.o" "$x"/isa_*.o "$x/dispatch.o" -o "$x/codec_fingerprint"

echo "== C++ tests on aarch64 (qemu-user)"
status=0
for t in codec_cpu_test gather_cpu_test; do
  out="$("$qemu" "$a/$t")" || status=1
  echo "$out" | grep -E "^ISA |passed" | sed "s/^/$t (aarch64): /"
done

echo "== fingerprints"
"$x/codec_fingerprint" | sed 's/^/x86-64: /' | tee "$build/x86.txt"
"$qemu" "$a/codec_fingerprint" | sed 's/^/aarch64: /' | tee "$build/arm.txt"
hashes="$(cat "$build/x86.txt" "$build/arm.txt" | awk '$2 == "fingerprint" {print $4}' | sort -u)"
if [[ "$(echo "$hashes" | wc -l)" != 1 ]]; then
  echo "run_aarch64.sh: the fingerprints differ" >&2
  status=1
else
  echo "every build on both architectures: $hashes"
fi
exit $status
