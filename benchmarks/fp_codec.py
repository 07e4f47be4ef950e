"""Speed of the floating-point formats' CPU kernels against single-core memcpy and the jnp twin.

    .venv/bin/python -m benchmarks.fp_codec [--mib 16] [--reps 9] [--out docs/fp_codec]

For each kernel build this CPU runs (avx512, avx2, baseline) and each format (fp8, mxfp4,
nvfp4, nvfp4 with a spike per group), a bf16 operand of ``--mib`` MiB, G = 128, one kernel
thread: quantize, dequantize and the fused dequantize-sum-quantize of 8 chunks, in GB/s of the
bf16 operand, as a fraction of single-core ``np.copyto`` of the same bytes (measured in the
same run), and the jnp twin's rate for each op (the same operand, XLA's own threads). Median
of ``--reps`` calls. Writes ``OUT.json`` and ``OUT.md``.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from benchmarks.common import MALLOC_KEEP, median_seconds, reexec_with

if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.codec import memcpy_gbps  # noqa: E402
from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402

SETTINGS = (("fp8", 0), ("mxfp4", 0), ("nvfp4", 0), ("nvfp4", 1))
OPS = ("quantize", "dequantize", "fused")


def rates(x, fmt, spikes, backend, reps):
    """GB/s of the bf16 operand for the three ops with ``backend``."""
    q = jax.jit(lambda a: codec.quantize(a, format=fmt, spikes=spikes, backend=backend))
    d = jax.jit(lambda p: codec.dequantize(p, backend=backend))
    f = jax.jit(lambda p: codec.dequantize_sum_quantize(p, backend=backend))
    p = q(x)
    chunked = codec.quantize(x, format=fmt, spikes=spikes, num_chunks=8).split_groups(8)
    times = (median_seconds(lambda: q(x), reps), median_seconds(lambda: d(p), reps),
             median_seconds(lambda: f(chunked), reps))
    return {op: x.nbytes / t / 1e9 for op, t in zip(OPS, times)}


def run(mib: float, reps: int) -> dict:
    x = jax.random.normal(jax.random.key(0), (int(mib * 2**20) // 2,), jnp.bfloat16)
    copy = memcpy_gbps(x.nbytes, reps)
    rows = []
    for fmt, spikes in SETTINGS:
        twin = rates(x, fmt, spikes, "jnp", reps)
        for isa in codec.cpu_isas():
            with codec.use_cpu_isa(isa), codec.use_cpu_threads(1):
                ffi = rates(x, fmt, spikes, "ffi", reps)
            rows.append({"format": fmt, "spikes": spikes, "isa": isa, "ffi_gbps": ffi,
                         "twin_gbps": twin,
                         "vs_memcpy": {op: ffi[op] / copy for op in OPS},
                         "vs_twin": {op: ffi[op] / twin[op] for op in OPS}})
            print(f"{fmt}{'+spike' if spikes else ''} {isa}: " + ", ".join(
                f"{op} {ffi[op]:.2f} GB/s ({ffi[op] / copy:.2f} of memcpy, "
                f"{ffi[op] / twin[op]:.1f}x twin)" for op in OPS), flush=True)
    return {"machine": {"cpu": kernels.cpuinfo("model name"), "features": codec.cpu_isas(),
                        "python": platform.python_version(), "jax": jax.__version__},
            "mib": mib, "reps": reps, "memcpy_gbps": copy, "rows": rows}


def markdown(data: dict) -> str:
    lines = [f"CPU: {data['machine']['cpu']} (builds {', '.join(data['machine']['features'])}); "
             f"bf16 {data['mib']:g} MiB, G = 128, one kernel thread, median of {data['reps']}; "
             f"single-core memcpy {data['memcpy_gbps']:.2f} GB/s.", "",
             "| format | build | quantize GB/s (x memcpy, x twin) | dequantize | fused sum |",
             "|---|---|---|---|---|"]
    for r in data["rows"]:
        cells = [f"{r['ffi_gbps'][op]:.2f} ({r['vs_memcpy'][op]:.2f}, {r['vs_twin'][op]:.1f}x)"
                 for op in OPS]
        name = r["format"] + ("+spike" if r["spikes"] else "")
        lines.append(f"| {name} | {r['isa']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=float, default=16.0)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "docs"
                                             / "fp_codec"))
    args = parser.parse_args(argv)
    data = run(args.mib, args.reps)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")
    out.with_suffix(".md").write_text("# Floating-point formats: CPU kernel speed\n\n"
                                      "Written by `.venv/bin/python -m benchmarks.fp_codec` "
                                      "(see its docstring).\n\n" + markdown(data))
    print(markdown(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
