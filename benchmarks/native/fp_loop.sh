#!/usr/bin/env bash
# The FP formats' quantize loop without XLA (benchmarks/native/fp_loop.cc), once per x86-64 kernel build
# this CPU runs, with the flags of CMakeLists.txt's ISA builds. Usage: bash benchmarks/native/fp_loop.sh [FORMAT ...]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
echo "CPU: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'), one thread"
source benchmarks/native/cpu_builds.sh
for build in "${builds[@]}"; do
  read -r name lanes march extra <<<"$build"
  "${CXX:-g++}" -O3 -ffp-contract=off -fno-fast-math -fno-trapping-math -std=c++17 -Wall -Wextra -Wno-psabi $march ${extra:-} -DFLASHCOMM_ISA="isa_$name" -DFLASHCOMM_LANES="$lanes" \
    -DFC_ISA_NAME="\"$name\"" -I. -Iffi/include -Iffi benchmarks/native/fp_loop.cc -o "$out/fp_loop_$name"
  "$out/fp_loop_$name" "$@"
done
