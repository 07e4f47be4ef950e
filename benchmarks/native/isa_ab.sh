#!/usr/bin/env bash
# A/B of two compilations of the CPU kernels (benchmarks/native/isa_ab.cc): ffi/cpu/isa_kernels.cc
# under the optimization flags BEFORE and AFTER, alternating call by call in one process, once
# per x86-64 kernel build this CPU runs (with CMakeLists.txt's other flags). BEFORE_REV=REV
# compiles the "before" side from git revision REV's sources instead of the working tree's (a
# code change under the same flags: BEFORE_REV=HEAD bash benchmarks/native/isa_ab.sh -O3 -O3). Exits
# non-zero if the two write different bytes. Usage: bash benchmarks/native/isa_ab.sh "-O3" "-O2"
set -euo pipefail
cd "$(dirname "$0")/../.."
read -r -a opt_before <<<"${1:?usage: isa_ab.sh BEFORE_FLAGS AFTER_FLAGS}"
read -r -a opt_after <<<"${2:?usage: isa_ab.sh BEFORE_FLAGS AFTER_FLAGS}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
src_before=.
if [[ -n "${BEFORE_REV:-}" ]]; then
  mkdir "$out/src" && git archive "$BEFORE_REV" ffi third_party | tar -x -C "$out/src"
  src_before="$out/src"
fi
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //');" \
  "before: ${opt_before[*]}${BEFORE_REV:+ at $BEFORE_REV}, after: ${opt_after[*]}"
source benchmarks/native/cpu_builds.sh
common=(-ffp-contract=off -fno-fast-math -fno-trapping-math -std=c++17 -Wall -Wextra -Wno-psabi
        -DNDEBUG)
# -I.../ffi: the CPU-only headers (ffi/cpu/*.h, included as "cpu/..."); a revision that kept
# them in ffi/include/flashcomm finds them through -I.../ffi/include.
inc_before=(-I"$src_before/ffi/include" -I"$src_before/ffi" -isystem "$src_before/third_party/xla_ffi/include")
inc_after=(-Iffi/include -Iffi -isystem third_party/xla_ffi/include)
for build in "${builds[@]}"; do
  read -r name lanes march extra <<<"$build"
  [[ -n "${ISA_AB_ONLY:-}" && " $ISA_AB_ONLY " != *" $name "* ]] && continue  # e.g. "avx512 avx2"
  isa=(-DFLASHCOMM_LANES="$lanes" $march ${extra:-})
  "${CXX:-g++}" "${opt_before[@]}" "${common[@]}" "${inc_before[@]}" "${isa[@]}" \
    -DFLASHCOMM_ISA="isa_${name}_before" -c "$src_before/ffi/cpu/isa_kernels.cc" \
    -o "$out/before_$name.o" & pids=($!)
  "${CXX:-g++}" "${opt_after[@]}" "${common[@]}" "${inc_after[@]}" "${isa[@]}" \
    -DFLASHCOMM_ISA="isa_${name}_after" -c ffi/cpu/isa_kernels.cc -o "$out/after_$name.o" &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done  # (a plain wait would hide a failed compile)
  "${CXX:-g++}" -O2 "${common[@]}" "${inc_after[@]}" -I. -DFLASHCOMM_ISA=isa_ab_driver \
    -DISA_AB_BEFORE="isa_${name}_before" -DISA_AB_AFTER="isa_${name}_after" benchmarks/native/isa_ab.cc \
    "$out/before_$name.o" "$out/after_$name.o" -o "$out/isa_ab_$name"
  "$out/isa_ab_$name"
done
