"""CPU codec throughput beside single-core memcpy bandwidth, measured in the same run.

For each operand size and input dtype it times, on one CPU device, each FFI kernel build twice:
on one thread (``use_cpu_threads(1)``: the single-core figures the memcpy targets refer to) and
split over XLA's intra-op thread pool (the default, as XLA runs its own ops and so the jnp twin:
the figure the "at least as fast as the twin" target compares):

* ``memcpy``: ``np.copyto`` into a preallocated buffer on one core, of the operand's bytes
  (may be cache-resident) and of 512 MiB (main memory: the bandwidth the target refers to);
* ``quantize`` and ``dequantize`` with the FFI kernels (``backend="ffi"``), and with the
  pure-jnp twin for reference, at 8, 6, 4 bits, G = 128;
* the fused ``dequantize_sum_quantize`` of 8 chunks (the middle of the two-step all-reduce);
* the rotation section: quantize and dequantize with rotation 0 (plain), 1
  (Hadamard) and 2 (signed Hadamard) for f32/bf16/f16 operands, bits 8, 6, 4 and G = 32, 128,
  512, on an operand of ``--rotation-mib`` MiB of bf16 (the same element count for every
  dtype). The three rotations' calls alternate, round after round, and each ratio is the
  median over the rounds of rotated time / plain time of the same round, so a change in
  machine load hits both sides alike.

Throughput is GB/s of the operand (bf16 bytes in for quantize, bf16 bytes out for dequantize).
Each figure is the median of ``--reps`` timed calls after a warm-up. The process is re-executed
once with glibc's mmap threshold raised, so that XLA's per-call output buffers are reused
instead of being mapped and page-faulted afresh on every call (that cost is the allocator's,
not the kernel's; the first lines of the output say which mode ran).

Target: quantize of bf16 input at >= 25% of memcpy bandwidth at int8 and int4. Both ratios
are printed: against main-memory memcpy (the target) and against memcpy of the same size (a
stricter figure when the operand fits in the last-level cache). Target of the rotation
section: with rotation, at most 2x the plain codec's time.

Re-run::

    .venv/bin/python -m benchmarks.codec.cpu_speed                 # -> docs/results/codec.*
    .venv/bin/python -m benchmarks.codec.cpu_speed --quick
    .venv/bin/python -m benchmarks.codec.cpu_speed --rotation-only # that section of codec.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import MALLOC_KEEP, reexec_with

from benchmarks.shared.timing import median_seconds

if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402
from models import machine  # noqa: E402

MIB = 2**20


_MEMCPY = """
import sys, time, numpy as np
nbytes, reps = int(sys.argv[1]), int(sys.argv[2])
src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
dst = np.empty_like(src)
times = []
for _ in range(reps + 1):
    t = time.perf_counter(); np.copyto(dst, src); times.append(time.perf_counter() - t)
print(nbytes / sorted(times[1:])[reps // 2] / 1e9)
"""


def memcpy_gbps(nbytes, reps):
    """np.copyto of ``nbytes`` on one core, median of ``reps``, in a child process with glibc's
    default malloc: this process runs with ``MALLOC_KEEP``, whose heap arrays numpy cannot
    back with transparent huge pages (their TLB misses made the copy ~4x slower on the VM
    here), and main-memory memcpy is the reference of every codec figure."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in MALLOC_KEEP}
    out = subprocess.run([sys.executable, "-c", _MEMCPY, str(nbytes), str(reps)], env=env,
                         check=True, capture_output=True, text=True)
    return float(out.stdout.strip().splitlines()[-1])


def measure(size_bytes, dtype, bits, backend, reps):
    n = size_bytes // jnp.dtype(dtype).itemsize
    x = jax.random.normal(jax.random.key(0), (n,), dtype)
    quantize = jax.jit(lambda a: codec.quantize(a, bits=bits, backend=backend))
    dequantize = jax.jit(lambda p: codec.dequantize(p, backend=backend))
    payload = quantize(x)
    t_q = median_seconds(lambda: quantize(x), reps)
    t_d = median_seconds(lambda: dequantize(payload), reps)
    chunked = codec.quantize(x, bits=bits, num_chunks=8).split_groups(8)
    fused = jax.jit(lambda p: codec.dequantize_sum_quantize(p, backend=backend))
    t_f = median_seconds(lambda: fused(chunked), reps)
    return {"quantize_gbps": x.nbytes / t_q / 1e9, "dequantize_gbps": x.nbytes / t_d / 1e9,
            "fused_sum_quantize_gbps": x.nbytes / t_f / 1e9}


def interleaved_times(fns, reps):
    """Seconds of reps calls of each of fns, their calls alternating (after a warm-up call each):
    times[i][k] is fns[i]'s k-th call, made right after fns[i - 1]'s."""
    for fn in fns:
        jax.block_until_ready(fn())
    times = [[] for _ in fns]
    for _ in range(reps):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            jax.block_until_ready(fn())
            times[i].append(time.perf_counter() - t0)
    return times


ROTATIONS = (0, 1, 2)


def measure_rotation(n, dtype, bits, group_size, reps):
    """Quantize and dequantize times for rotation 0, 1 and 2 (FFI kernels), alternating."""
    x = jax.random.normal(jax.random.key(0), (n,), dtype)
    quantizers = [jax.jit(lambda a, r=r: codec.quantize(a, bits=bits, group_size=group_size,
                                                          rotation=r, backend="ffi"))
                  for r in ROTATIONS]
    dequantize = jax.jit(lambda p: codec.dequantize(p, backend="ffi"))
    payloads = [q(x) for q in quantizers]
    t_q = interleaved_times([lambda q=q: q(x) for q in quantizers], reps)
    t_d = interleaved_times([lambda p=p: dequantize(p) for p in payloads], reps)

    def ratio(times, r):  # median over the rounds of (rotated / plain) in the same round
        return statistics.median(a / b for a, b in zip(times[r], times[0]))

    rows = []
    for r in ROTATIONS:
        tq, td = statistics.median(t_q[r]), statistics.median(t_d[r])
        rows.append(dict(dtype=jnp.dtype(dtype).name, bits=bits, group_size=group_size,
                         rotation=r, elements=n, quantize_ms=tq * 1e3, dequantize_ms=td * 1e3,
                         quantize_min_ms=min(t_q[r]) * 1e3, dequantize_min_ms=min(t_d[r]) * 1e3,
                         quantize_gbps=x.nbytes / tq / 1e9, dequantize_gbps=x.nbytes / td / 1e9,
                         quantize_vs_plain=ratio(t_q, r), dequantize_vs_plain=ratio(t_d, r)))
    return rows


def rotation_section(mib, reps):
    n = int(mib * MIB) // 2  # elements of a bf16 operand of `mib` MiB; the same n for every dtype
    print(f"\nrotation: {n} elements ({mib:g} MiB of bf16), median of {reps} rounds "
          f"of alternating calls; x plain = median over the rounds of the time / the plain "
          f"(rotation 0) time of the same round; target <= 2")
    print(f"{'dtype':>8} {'bits':>4} {'G':>4} {'rot':>3} {'quant ms':>9} {'x plain':>7} "
          f"{'dequant ms':>10} {'x plain':>7}")
    rows = []
    for dtype in (jnp.bfloat16, jnp.float32, jnp.float16):
        for bits in (8, 6, 4):
            for group_size in (32, 128, 512):
                with codec.use_cpu_threads(1):  # one thread, as the section was measured
                    measured = measure_rotation(n, dtype, bits, group_size, reps)
                for row in measured:
                    rows.append(row)
                    print(f"{row['dtype']:>8} {bits:4d} {group_size:4d} {row['rotation']:3d} "
                          f"{row['quantize_ms']:9.2f} {row['quantize_vs_plain']:7.2f} "
                          f"{row['dequantize_ms']:10.2f} {row['dequantize_vs_plain']:7.2f}",
                          flush=True)
    rotated = [r for r in rows if r["rotation"] != 0]
    worst_q = max(r["quantize_vs_plain"] for r in rotated)
    worst_d = max(r["dequantize_vs_plain"] for r in rotated)
    print(f"rotated / plain, worst: quantize {worst_q:.2f}, dequantize {worst_d:.2f} "
          f"(target <= 2: {'met' if max(worst_q, worst_d) <= 2 else 'NOT met'})")
    meta = dict(machine=f"{platform.machine()} {os.cpu_count()} cores", jax=jax.__version__,
                command="python -m benchmarks.codec.cpu_speed --rotation-only",
                malloc_env=MALLOC_KEEP,
                elements=n, operand_mib_bf16=mib, reps=reps, load_average=os.getloadavg(),
                backend="ffi",
                note="*_ms: median of reps calls; *_vs_plain: median over the reps rounds of "
                "time / rotation 0's time in the same round (calls of the three rotations "
                "alternate, so a change in machine load hits them alike)")
    return dict(meta=meta, rows=rows)


# Targets, bf16 at 8, 6 and 4 bits, fractions of one-core main-memory memcpy (the
# one-thread rows): quantize and dequantize >= 0.5 on AVX-512 and >= 0.4 on AVX2; the fused op
# >= 0.4 on both; every FFI kernel at least as fast as the jnp twin on every build (the pool
# rows: the twin runs on XLA's pool too). The baseline and NEON builds have the twin target only.
QD_TARGET = {"avx512": 0.5, "avx2": 0.4}
OPS = ("quantize_gbps", "dequantize_gbps", "fused_sum_quantize_gbps")


def summarize(rows):
    twin = {(r["size_mib"], r["bits"]): r for r in rows if r["backend"] == "jnp"}
    pool = {(r["isa"], r["size_mib"], r["bits"]): r for r in rows
            if r["backend"] == "ffi" and r["dtype"] == "bfloat16" and r["threads"] == 0}
    print("\nbf16 targets (one thread: fraction of main-memory memcpy; x twin = FFI / jnp twin, "
          "both on XLA's pool, and [one FFI thread / the twin]):")
    for r in rows:
        if r["backend"] != "ffi" or r["dtype"] != "bfloat16" or r["threads"] != 1:
            continue
        qd = QD_TARGET.get(r["isa"])
        t = twin.get((r["size_mib"], r["bits"]))
        p = pool.get((r["isa"], r["size_mib"], r["bits"]))
        ok = qd is None or (r["quantize_vs_memcpy"] >= qd and r["dequantize_vs_memcpy"] >= qd
                            and r["fused_vs_memcpy"] >= 0.4)
        targets = "(no memcpy target)" if qd is None else f"(target {qd}; fused 0.4)"
        vs = ""
        if t is not None and p is not None:
            ratios = [p[k] / t[k] for k in OPS]
            single = [r[k] / t[k] for k in OPS]
            vs = (" x twin " + "/".join(f"{v:.1f}" for v in ratios)
                  + " [" + "/".join(f"{v:.1f}" for v in single) + "]")
            ok = ok and min(ratios) >= 1.0
        print(f"  {r['isa']:>8} {r['size_mib']:4.0f}M {r['bits']} bits: quantize "
              f"{r['quantize_vs_memcpy']:.2f} dequantize {r['dequantize_vs_memcpy']:.2f} "
              f"fused {r['fused_vs_memcpy']:.2f} {targets}{vs}: {'met' if ok else 'NOT met'}")


def _args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one size, fewer repetitions")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(RESULTS / "codec.json"))
    parser.add_argument("--no-rotation", action="store_true", help="skip the rotation section")
    parser.add_argument("--rotation-only", action="store_true",
                        help="only the rotation section (the rest of --out is kept)")
    parser.add_argument("--rotation-mib", type=float, default=8.0,
                        help="operand size of the rotation section, MiB of bf16")
    parser.add_argument("--rotation-reps", type=int, default=21)
    parser.add_argument("--isa", action="append", choices=("avx512", "avx2", "baseline", "neon"),
                        help="measure this instruction-set build of the kernels (repeatable; "
                        "default: every build this CPU runs)")
    parser.add_argument("--sizes-mib", type=float, nargs="+",
                        help="operand sizes in MiB (default 1 8 32; --quick: 8)")
    return parser.parse_args()


def sweep(isas, sizes, reps, dram) -> list:
    """Every row: per kernel build two blocks, one thread and XLA's pool (the jnp twin once,
    on the pool: it uses neither the builds nor the cap); per block every size, dtype and
    bits."""
    rows = []
    blocks = [(isa, threads) for isa in isas for threads in (1, 0)] + [("jnp", 0)]
    for block, threads in blocks:
        backend = "jnp" if block == "jnp" else "ffi"
        where = "one thread" if threads == 1 else "XLA's intra-op pool"
        print(f"\n== {'jnp twin' if block == 'jnp' else 'FFI kernels, ' + block + ' build'}, "
              f"{where}")
        print(f"{'size':>6} {'dtype':>8} {'bits':>4} {'memcpy':>8} {'quant':>7} {'q/dram':>7} "
              f"{'dequant':>7} {'d/dram':>7} {'fused':>7} {'f/dram':>7}   (GB/s)")
        for size in sizes:
            for dtype in (jnp.bfloat16, jnp.float32):
                if backend == "jnp" and dtype != jnp.bfloat16:
                    continue
                mem = memcpy_gbps(size, reps)
                for bits in (8, 6, 4):
                    with codec.use_cpu_isa(block if backend == "ffi" else codec.cpu_isa()), \
                            codec.use_cpu_threads(threads):
                        r = measure(size, dtype, bits, backend, reps)
                    row = dict(size_mib=size / MIB, dtype=jnp.dtype(dtype).name, bits=bits,
                               backend=backend, isa=block if backend == "ffi" else None,
                               threads=threads,
                               memcpy_gbps=mem, memcpy_dram_gbps=dram,
                               quantize_vs_memcpy=r["quantize_gbps"] / dram,
                               dequantize_vs_memcpy=r["dequantize_gbps"] / dram,
                               fused_vs_memcpy=r["fused_sum_quantize_gbps"] / dram,
                               quantize_vs_memcpy_same_size=r["quantize_gbps"] / mem, **r)
                    rows.append(row)
                    print(f"{size / MIB:5.0f}M {row['dtype']:>8} {bits:4d} {mem:8.2f} "
                          f"{r['quantize_gbps']:7.2f} {row['quantize_vs_memcpy']:7.2f} "
                          f"{r['dequantize_gbps']:7.2f} {row['dequantize_vs_memcpy']:7.2f} "
                          f"{r['fused_sum_quantize_gbps']:7.2f} {row['fused_vs_memcpy']:7.2f}",
                          flush=True)
    return rows


def main():
    args = _args()
    if not kernels.available("cpu"):
        raise SystemExit("the CPU FFI kernels are not built: pip install . first")
    print(machine.first_line())
    print(f"jax {jax.__version__}; malloc arenas {os.environ.get('MALLOC_ARENA_MAX')}, mmap max "
          f"{os.environ.get('MALLOC_MMAP_MAX_')}; load average {os.getloadavg()[0]:.2f}")
    isas = args.isa or codec.cpu_isas()
    out = Path(args.out)
    if args.rotation_only:
        rotation = rotation_section(args.rotation_mib, args.rotation_reps)
        data = json.loads(out.read_text()) if out.exists() else {}
        data["rotation"] = rotation
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1))
        write_page(out, data)
        print(f"wrote the rotation section of {out}")
        return
    sizes = [int(m * MIB) for m in args.sizes_mib] if args.sizes_mib else (
        [8 * MIB] if args.quick else [1 * MIB, 8 * MIB, 32 * MIB])
    reps = 5 if args.quick else args.reps
    dram = memcpy_gbps(512 * MIB, 5)
    print(f"memcpy, 512 MiB (main memory, one core): {dram:.2f} GB/s")
    rows = sweep(isas, sizes, reps, dram)
    summarize(rows)
    if args.no_rotation:
        rotation = None
    else:
        rotation = rotation_section(args.rotation_mib, 5 if args.quick else args.rotation_reps)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=machine.describe(), jax=jax.__version__,
                command="python -m benchmarks.codec.cpu_speed " + " ".join(sys.argv[1:]),
                malloc_env=MALLOC_KEEP, reps=reps, load_average=os.getloadavg())
    out.write_text(json.dumps(dict(meta=meta, rows=rows, rotation=rotation), indent=1))
    write_page(out)
    print(f"wrote {args.out} and its page")


if __name__ == "__main__":
    main()
