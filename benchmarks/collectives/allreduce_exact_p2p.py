"""The exact all-reduce over the p2p transport against ``lax.psum``, in one process.

    .venv/bin/python -m benchmarks.collectives.allreduce_exact_p2p [--devices 8,3] \\
        [--dtypes float32,bfloat16] [--sizes 2048,...] [--seconds 3] \\
        [--out docs/results/exact_p2p.json]

Per mesh size (CPU devices of this process), dtype and message size (bytes per rank, 2 KiB to
64 MiB by default) it times three programs, each ``k`` chained calls in a ``fori_loop`` (the
cost of a call inside a model's program, not of a program's launch; ``k`` = 1 MiB / size, 4 to
32: a single call would also time the program's copy of its argument and the allocation of its
result): ``lax.psum``, :func:`jax_flashcomm.transport.p2p.exact_all_reduce` with one shot and with
two shots. The three run in turn, round after round, for ``--seconds`` per size (at least 3
rounds; so a slow spell of the machine hits all three alike); each reports its median. Every
size also checks that every rank's result has the same bits, and whether they are
``lax.psum``'s. Re-executes itself under ``MALLOC_KEEP`` (benchmarks/shared/runtime.py).
Writes the record, its page and a plot (docs/results/exact_p2p.*).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import MALLOC_KEEP, command_parser, reexec_with
from models import cli

KIB, MIB = 1024, 1024 * 1024
SIZES = [2 * KIB, 8 * KIB, 32 * KIB, 128 * KIB, 512 * KIB, 2 * MIB, 8 * MIB, 32 * MIB, 64 * MIB]
METHODS = ("lax.psum", "one-shot", "two-shot")


def _programs(mesh, k: int) -> dict:
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.transport import p2p

    n = mesh.shape["x"]
    bodies = {"lax.psum": lambda v: lax.psum(v, "x"),
              "one-shot": lambda v: p2p.exact_all_reduce(v, ("x",), 600_000, two_shot=False),
              "two-shot": lambda v: p2p.exact_all_reduce(v, ("x",), 600_000, two_shot=True)}

    def chained(body):
        def run(v):
            step = lambda _, u: lax.pcast(body(u), "x", to="varying") * (1.0 / n)  # noqa: E731
            return lax.fori_loop(0, k, step, v)
        return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    once = {name: jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P()))
            for name, body in bodies.items()}
    return {name: chained(body) for name, body in bodies.items()}, once


def _bits(once: dict, x, n: int) -> dict:
    """Whether every rank got the same bits, and whether they are lax.psum's."""
    import jax
    import numpy as np

    out = {}
    ref = np.asarray(jax.device_get(once["lax.psum"](x)))
    for name in METHODS[1:]:
        y = once[name](x)
        shards = [np.asarray(s.data) for s in y.addressable_shards]
        same = all(np.array_equal(shards[0].view(np.uint8), s.view(np.uint8)) for s in shards)
        got = np.asarray(jax.device_get(y))
        diff = np.abs(got.astype(np.float64) - ref.astype(np.float64))
        out[name] = {"ranks_identical": bool(same),
                     "equals_lax_psum": bool(np.array_equal(got.view(np.uint8),
                                                             ref.view(np.uint8))),
                     "max_abs_diff_vs_lax": float(diff.max())}
    return out


def run(args) -> list:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from models.eval import progress

    rows, start = [], time.perf_counter()
    total = len(args.devices) * len(args.dtypes) * len(args.sizes)
    for n in args.devices:
        mesh = jax.make_mesh((n,), ("x",), devices=jax.devices()[:n],
                             axis_types=(jax.sharding.AxisType.Explicit,))
        for dtype in args.dtypes:
            for size in args.sizes:
                m = max(size // np.dtype(dtype).itemsize, 1)
                k = max(4, min(32, MIB // size))
                host = np.random.default_rng(0).standard_normal((n * m,)).astype(dtype)
                x = jax.device_put(jnp.asarray(host), NamedSharding(mesh, P("x")))
                chained, once = _programs(mesh, k)
                for fn in chained.values():
                    jax.block_until_ready(fn(x))
                times = {name: [] for name in METHODS}
                deadline, rounds = time.time() + args.seconds, 0
                while rounds < 3 or time.time() < deadline:
                    for name, fn in chained.items():
                        t0 = time.perf_counter()
                        jax.block_until_ready(fn(x))
                        times[name].append((time.perf_counter() - t0) / k)
                    rounds += 1
                med = {name: statistics.median(t) for name, t in times.items()}
                row = {"devices": n, "dtype": dtype, "bytes": size, "calls_per_program": k,
                       "rounds": rounds, "seconds": med,
                       "speedup_vs_lax": {name: med["lax.psum"] / med[name]
                                          for name in METHODS[1:]},
                       "bits": _bits(once, x, n)}
                rows.append(row)
                progress(len(rows), total, start, unit="sizes", what=f"N={n} {dtype} {size} B")
                del x
    return rows


def markdown(rows) -> str:
    """One table per mesh size: times, speedups against lax.psum, bits."""
    out = []
    for n in sorted({r["devices"] for r in rows}, reverse=True):
        out += [f"\n{n} CPU devices (us per call; speedup = lax.psum / p2p)\n",
                "| dtype | bytes/rank | lax.psum | one-shot | two-shot | one-shot vs lax | "
                "two-shot vs lax | ranks bit-identical | = lax.psum's bits |",
                "|---|---|---|---|---|---|---|---|---|"]
        for r in (r for r in rows if r["devices"] == n):
            s, v, b = r["seconds"], r["speedup_vs_lax"], r["bits"]
            size = (f"{r['bytes'] // MIB} MiB" if r["bytes"] >= MIB
                    else f"{r['bytes'] // KIB} KiB")
            out.append(f"| {r['dtype']} | {size} | {s['lax.psum'] * 1e6:.1f} | "
                       f"{s['one-shot'] * 1e6:.1f} | {s['two-shot'] * 1e6:.1f} | "
                       f"{v['one-shot']:.2f}x | **{v['two-shot']:.2f}x** | "
                       f"{'yes' if all(x['ranks_identical'] for x in b.values()) else 'NO'} | "
                       f"{'yes' if all(x['equals_lax_psum'] for x in b.values()) else 'no'} |")
    return "\n".join(out)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meshes = sorted({r["devices"] for r in rows}, reverse=True)
    fig, axes = plt.subplots(1, len(meshes), figsize=(6 * len(meshes), 4), squeeze=False)
    for ax, n in zip(axes[0], meshes):
        for dtype in sorted({r["dtype"] for r in rows}):
            sel = [r for r in rows if r["devices"] == n and r["dtype"] == dtype]
            for name, style in (("one-shot", ":"), ("two-shot", "-")):
                ax.plot([r["bytes"] for r in sel], [r["speedup_vs_lax"][name] for r in sel],
                        style, marker="o", label=f"{dtype} {name}")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("speedup over lax.psum")
        ax.set_title(f"exact p2p all-reduce, {n} CPU devices")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = command_parser("benchmarks.collectives.allreduce_exact_p2p", __doc__)
    ap.add_argument("--devices", default="8,3")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--seconds", type=float, default=3.0, help="timing per size")
    ap.add_argument("--out", default=str(RESULTS / "exact_p2p.json"))
    args = ap.parse_args(argv)
    args.devices = [int(v) for v in args.devices.split(",")]
    args.dtypes = args.dtypes.split(",")
    args.sizes = [int(v) for v in args.sizes.split(",")]
    cli.set_devices(max(args.devices))
    from models.machine import describe, first_line

    print(first_line(), flush=True)
    rows = run(args)
    record = {"machine": describe(), "command": ".venv/bin/python -m "
              "benchmarks.collectives.allreduce_exact_p2p " + " ".join(sys.argv[1:]),
              "rows": rows}
    out = Path(args.out)
    out.write_text(json.dumps(record, indent=1))
    plot(rows, out.with_suffix(".png"))
    table = markdown(rows)
    print(table)
    write_page(out, record, tables=table + f"\n\n![speedup]({out.with_suffix('.png').name})\n")
    print("wrote", out, "its plot and its page")
    return 0


if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)
    sys.exit(main())
