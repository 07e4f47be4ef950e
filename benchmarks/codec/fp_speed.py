"""Speed of the floating-point formats' CPU kernels against single-core memcpy and the jnp twin.

    .venv/bin/python -m benchmarks.codec.fp_speed [--mib 16] [--reps 9] \\
        [--out docs/results/fp_codec]

For each kernel build this CPU runs (avx512, avx2, baseline) and each format (fp8, mxfp4,
nvfp4, nvfp4 with a spike per group), a bf16 operand of ``--mib`` MiB, G = 128, one kernel
thread: quantize, dequantize and the fused dequantize-sum-quantize of 8 chunks, in GB/s of the
bf16 operand, as a fraction of single-core ``np.copyto`` of the same bytes on huge pages, and
the jnp twin's rate for each op (the same operand, XLA's own threads). Two fractions, both
measured beside the kernel, since this VM's speed drifts by tens of percent within minutes:
- warm: ``--reps`` kernel calls back to back, then ``--reps`` copies back to back, the ratio of
  their medians. Operand and copy stay in the last-level cache between calls (300 MiB on the
  Intel Xeon VM here), so this compares the kernel with a cache-resident copy.
- paired: each kernel call followed by one copy, the median of the per-pair ratios. Each side
  runs after the other has replaced much of the cache, nearer a main-memory copy.
GB/s are the warm medians. Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import MALLOC_KEEP, reexec_with
from benchmarks.shared.timing import HugeCopy, median_seconds, paired_seconds

if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402

SETTINGS = (("fp8", 0), ("mxfp4", 0), ("nvfp4", 0), ("nvfp4", 1))
OPS = ("quantize", "dequantize", "fused")


def calls(x, fmt, spikes, backend):
    """The three ops with ``backend`` as argument-free calls, in OPS order."""
    q = jax.jit(lambda a: codec.quantize(a, format=fmt, spikes=spikes, backend=backend))
    d = jax.jit(lambda p: codec.dequantize(p, backend=backend))
    f = jax.jit(lambda p: codec.dequantize_sum_quantize(p, backend=backend))
    p = q(x)
    chunked = codec.quantize(x, format=fmt, spikes=spikes, num_chunks=8).split_groups(8)
    return (lambda: q(x)), (lambda: d(p)), (lambda: f(chunked))


def run(mib: float, reps: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (int(mib * 2**20) // 2,), jnp.bfloat16)
    copy = HugeCopy(x.nbytes)
    copy_seconds, paired_copy_seconds, rows = [], [], []
    for fmt, spikes in SETTINGS:
        twin = {op: x.nbytes / median_seconds(fn, reps) / 1e9
                for op, fn in zip(OPS, calls(x, fmt, spikes, "jnp"))}
        for isa in codec.cpu_isas():
            ffi, vs_memcpy, vs_paired = {}, {}, {}
            with codec.use_cpu_isa(isa), codec.use_cpu_threads(1):
                for op, fn in zip(OPS, calls(x, fmt, spikes, "ffi")):
                    t = median_seconds(fn, reps)
                    c = copy.median_seconds(reps)
                    _, c_paired, vs_paired[op] = paired_seconds(fn, copy, reps)
                    ffi[op], vs_memcpy[op] = x.nbytes / t / 1e9, c / t
                    copy_seconds.append(c)
                    paired_copy_seconds.append(c_paired)
            rows.append({"format": fmt, "spikes": spikes, "isa": isa, "ffi_gbps": ffi,
                         "twin_gbps": twin, "vs_memcpy": vs_memcpy,
                         "vs_memcpy_paired": dict(vs_paired),
                         "vs_twin": {op: ffi[op] / twin[op] for op in OPS}})
            print(f"{fmt}{'+spike' if spikes else ''} {isa}: " + ", ".join(
                f"{op} {ffi[op]:.2f} GB/s ({vs_memcpy[op]:.2f} / {vs_paired[op]:.2f} of memcpy, "
                f"{ffi[op] / twin[op]:.1f}x twin)" for op in OPS), flush=True)
    return {"machine": {"cpu": kernels.cpuinfo("model name"), "features": codec.cpu_isas(),
                        "python": platform.python_version(), "jax": jax.__version__},
            "mib": mib, "reps": reps,
            "memcpy_gbps": x.nbytes / statistics.median(copy_seconds) / 1e9,
            "memcpy_paired_gbps": x.nbytes / statistics.median(paired_copy_seconds) / 1e9,
            "rows": rows}


def markdown(data: dict) -> str:
    lines = [f"CPU: {data['machine']['cpu']} (builds {', '.join(data['machine']['features'])}); "
             f"bf16 {data['mib']:g} MiB, G = 128, one kernel thread, median of {data['reps']}; "
             f"single-core memcpy {data['memcpy_gbps']:.2f} GB/s warm, "
             f"{data['memcpy_paired_gbps']:.2f} GB/s paired (medians over the run). Cells: "
             "GB/s (x memcpy warm / paired, x twin).", "",
             "| format | build | quantize | dequantize | fused sum |",
             "|---|---|---|---|---|"]
    for r in data["rows"]:
        cells = [f"{r['ffi_gbps'][op]:.2f} ({r['vs_memcpy'][op]:.2f} / "
                 f"{r['vs_memcpy_paired'][op]:.2f}, {r['vs_twin'][op]:.1f}x)" for op in OPS]
        name = r["format"] + ("+spike" if r["spikes"] else "")
        lines.append(f"| {name} | {r['isa']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(RESULTS / "fp_codec"),
                        help="output prefix: OUT.json and its page, OUT.md")
    args = parser.parse_args(argv)
    data = run(args.mib, args.reps)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    write_page(out.with_suffix(".json"), data, tables=markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
