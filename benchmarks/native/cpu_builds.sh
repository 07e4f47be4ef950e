# The x86-64 kernel builds this CPU runs, with the flags of CMakeLists.txt's ISA builds: sets the
# array `builds` to "NAME LANES MARCH [EXTRA]" entries, the best first. Sourced by fp_loop.sh,
# fp_ab.sh and isa_ab.sh.
cpu_flags=$(grep -m1 '^flags' /proc/cpuinfo)
builds=("baseline 4 -march=x86-64")
if [[ $cpu_flags == *" avx2 "* && $cpu_flags == *" fma "* ]]; then
  builds=("avx2 8 -march=x86-64-v3" "${builds[@]}")
fi
if [[ $cpu_flags == *" avx512f "* && $cpu_flags == *" avx512bw "* ]]; then
  builds=("avx512 16 -march=x86-64-v4 -Wno-maybe-uninitialized" "${builds[@]}")
fi
