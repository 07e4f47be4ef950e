#!/usr/bin/env bash
# A/B of the FP formats' quantize loop (benchmarks/native/fp_ab.cc): git revision REV's headers against
# the working tree's, alternating in one process, once per x86-64 kernel build this CPU runs,
# with the flags of CMakeLists.txt's ISA builds. Exits non-zero if the two write different
# bytes. Usage: bash benchmarks/native/fp_ab.sh [REV (default HEAD)] [G (default 128)]
set -euo pipefail
cd "$(dirname "$0")/../.."
rev="${1:-HEAD}"
group="${2:-128}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
git archive "$rev" ffi | tar -x -C "$out"
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), one thread;" \
  "before: $rev ($(git rev-parse --short "$rev")), after: the working tree; G = $group"
source benchmarks/native/cpu_builds.sh
for build in "${builds[@]}"; do
  read -r name lanes march extra <<<"$build"
  common=(-O3 -ffp-contract=off -fno-fast-math -fno-trapping-math -std=c++17 -Wall -Wextra
          -Wno-psabi $march ${extra:-} -DFLASHCOMM_LANES="$lanes" -DFC_ISA_NAME="\"$name\"")
  "${CXX:-g++}" "${common[@]}" -DFP_AB_PART=1 -DFP_AB_NAME=fp_ab_before \
    -DFLASHCOMM_ISA="isa_${name}_before" -I"$out/ffi/include" -I"$out/ffi" -c benchmarks/native/fp_ab.cc \
    -o "$out/before_$name.o" & pids=($!)
  "${CXX:-g++}" "${common[@]}" -DFP_AB_PART=2 -DFP_AB_NAME=fp_ab_after \
    -DFLASHCOMM_ISA="isa_${name}_after" -Iffi/include -Iffi -c benchmarks/native/fp_ab.cc \
    -o "$out/after_$name.o" & pids+=($!)
  "${CXX:-g++}" "${common[@]}" -DFP_AB_PART=0 -I. -c benchmarks/native/fp_ab.cc -o "$out/main_$name.o" &
  pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done  # (a plain wait would hide a failed compile)
  "${CXX:-g++}" "$out/before_$name.o" "$out/after_$name.o" "$out/main_$name.o" \
    -o "$out/fp_ab_$name"
  "$out/fp_ab_$name" "$group"
done
