"""CPU codec throughput beside single-core memcpy bandwidth, measured in the same run.

For each operand size and input dtype it times, on one CPU device (XLA runs the FFI kernel on
one thread):

* ``memcpy``: ``np.copyto`` into a preallocated buffer on one core, of the operand's bytes
  (may be cache-resident) and of 512 MiB (main memory: the bandwidth the target refers to);
* ``quantize`` and ``dequantize`` with the FFI kernels (``backend="ffi"``), and with the
  pure-jnp twin for reference, at 8, 6, 4 bits, G = 128;
* the fused ``dequantize_sum_quantize`` of 8 chunks (the middle of the two-step all-reduce).

Throughput is GB/s of the operand (bf16 bytes in for quantize, bf16 bytes out for dequantize).
Each figure is the median of ``--reps`` timed calls after a warm-up. The process is re-executed
once with glibc's mmap threshold raised, so that XLA's per-call output buffers are reused
instead of being mapped and page-faulted afresh on every call (that cost is the allocator's,
not the kernel's; the first lines of the output say which mode ran).

Target (issue 2): quantize of bf16 input at >= 25% of memcpy bandwidth at int8 and int4. Both
ratios are printed: against main-memory memcpy (the target) and against memcpy of the same
size (a stricter figure when the operand fits in the last-level cache).

Re-run::

    python benchmarks/codec.py                 # -> docs/codec.json
    python benchmarks/codec.py --quick
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

_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": str(32 * 2**20), "MALLOC_TRIM_THRESHOLD_": str(2**32),
               "MALLOC_TOP_PAD_": str(256 * 2**20)}
if __name__ == "__main__" and os.environ.get("FLASHCOMM_BENCH_REEXEC") != "1":
    os.environ.update(_MALLOC_ENV, FLASHCOMM_BENCH_REEXEC="1")
    os.execv(sys.executable, [sys.executable, *sys.argv])

import numpy as np  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MIB = 2**20


def median_seconds(fn, reps):
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def memcpy_gbps(nbytes, reps):
    src = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    t = median_seconds(lambda: np.copyto(dst, src), reps)
    return nbytes / t / 1e9


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


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="one size, fewer repetitions")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--out", default=str(REPO / "docs" / "codec.json"))
    args = parser.parse_args()
    if not kernels.available("cpu"):
        raise SystemExit("the CPU FFI kernels are not built: pip install . first")
    sizes = [8 * MIB] if args.quick else [1 * MIB, 8 * MIB, 32 * MIB]
    reps = 5 if args.quick else args.reps
    rows = []
    dram = memcpy_gbps(512 * MIB, 5)
    print(f"memcpy, 512 MiB (main memory, one core): {dram:.2f} GB/s")
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; "
          f"jax {jax.__version__}; malloc mmap threshold {os.environ.get('MALLOC_MMAP_THRESHOLD_')}")
    print(f"{'size':>6} {'dtype':>8} {'bits':>4} {'backend':>7} {'memcpy':>8} {'quant':>7} "
          f"{'q/dram':>7} {'q/same':>7} {'dequant':>7} {'fused':>7}   (GB/s)")
    for size in sizes:
        for dtype in (jnp.bfloat16, jnp.float32):
            mem = memcpy_gbps(size, reps)
            for bits in (8, 6, 4):
                for backend in ("ffi", "jnp"):
                    if backend == "jnp" and (dtype != jnp.bfloat16 or bits == 6):
                        continue
                    r = measure(size, dtype, bits, backend, reps)
                    row = dict(size_mib=size / MIB, dtype=jnp.dtype(dtype).name, bits=bits,
                               backend=backend, memcpy_gbps=mem, memcpy_dram_gbps=dram,
                               quantize_vs_memcpy=r["quantize_gbps"] / dram,
                               quantize_vs_memcpy_same_size=r["quantize_gbps"] / mem, **r)
                    rows.append(row)
                    print(f"{size / MIB:5.0f}M {row['dtype']:>8} {bits:4d} {backend:>7} "
                          f"{mem:8.2f} {r['quantize_gbps']:7.2f} "
                          f"{row['quantize_vs_memcpy']:7.2f} "
                          f"{row['quantize_vs_memcpy_same_size']:7.2f} {r['dequantize_gbps']:7.2f} "
                          f"{r['fused_sum_quantize_gbps']:7.2f}", flush=True)
    target = [r for r in rows if r["backend"] == "ffi" and r["dtype"] == "bfloat16"
              and r["bits"] in (8, 4)]
    worst = min(r["quantize_vs_memcpy"] for r in target)
    worst_same = min(r["quantize_vs_memcpy_same_size"] for r in target)
    print(f"\nquantize bf16 (int8, int4) / main-memory memcpy: worst {worst:.2f} "
          f"(target >= 0.25: {'met' if worst >= 0.25 else 'NOT met'}); "
          f"/ same-size memcpy: worst {worst_same:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    meta = dict(machine=f"{platform.machine()} {os.cpu_count()} cores", jax=jax.__version__,
                command="python benchmarks/codec.py", malloc_env=_MALLOC_ENV, reps=reps)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
