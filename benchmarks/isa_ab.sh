#!/usr/bin/env bash
# A/B of two compilations of the CPU kernels (benchmarks/isa_ab.cc): ffi/cpu/isa_kernels.cc
# under the optimization flags BEFORE and AFTER, alternating call by call in one process, once
# per x86-64 kernel build this CPU runs (with CMakeLists.txt's other flags). Exits non-zero if
# the two write different bytes. Usage: bash benchmarks/isa_ab.sh "-O3" "-O2"
set -euo pipefail
cd "$(dirname "$0")/.."
read -r -a opt_before <<<"${1:?usage: isa_ab.sh BEFORE_FLAGS AFTER_FLAGS}"
read -r -a opt_after <<<"${2:?usage: isa_ab.sh BEFORE_FLAGS AFTER_FLAGS}"
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //');" \
  "before: ${opt_before[*]}, after: ${opt_after[*]}"
flags=$(grep -m1 '^flags' /proc/cpuinfo)
builds=("baseline 4 -march=x86-64")
[[ $flags == *" avx2 "* && $flags == *" fma "* ]] && builds=("avx2 8 -march=x86-64-v3" "${builds[@]}")
[[ $flags == *" avx512f "* && $flags == *" avx512bw "* ]] && builds=("avx512 16 -march=x86-64-v4 -Wno-maybe-uninitialized" "${builds[@]}")
common=(-ffp-contract=off -fno-fast-math -fno-trapping-math -std=c++17 -Wall -Wextra -Wno-psabi
        -DNDEBUG -Iffi/include -isystem third_party/xla_ffi/include)
for build in "${builds[@]}"; do
  read -r name lanes march extra <<<"$build"
  isa=(-DFLASHCOMM_LANES="$lanes" $march ${extra:-})
  "${CXX:-g++}" "${opt_before[@]}" "${common[@]}" "${isa[@]}" -DFLASHCOMM_ISA="isa_${name}_before" \
    -c ffi/cpu/isa_kernels.cc -o "$out/before_$name.o" & pids=($!)
  "${CXX:-g++}" "${opt_after[@]}" "${common[@]}" "${isa[@]}" -DFLASHCOMM_ISA="isa_${name}_after" \
    -c ffi/cpu/isa_kernels.cc -o "$out/after_$name.o" & pids+=($!)
  for pid in "${pids[@]}"; do wait "$pid"; done  # (a plain wait would hide a failed compile)
  "${CXX:-g++}" -O2 "${common[@]}" -DFLASHCOMM_ISA=isa_ab_driver -DISA_AB_BEFORE="isa_${name}_before" \
    -DISA_AB_AFTER="isa_${name}_after" benchmarks/isa_ab.cc "$out/before_$name.o" \
    "$out/after_$name.o" -o "$out/isa_ab_$name"
  "$out/isa_ab_$name"
done
