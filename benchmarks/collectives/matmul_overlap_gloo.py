"""Decomposed (ring) vs unfused collective matmuls on processes over a rate-limited link.

Runs N JAX processes (one CPU device each, pinned to one core each) over gloo inside a network
namespace whose loopback is limited by tc tbf (``benchmarks/shared/netns.py``), and times, per
shape:

* ``unfused``:    all_gather(x) then dot  /  dot then psum_scatter   (lax reference)
* ``decomposed``: jax_flashcomm.all_gather_matmul / matmul_reduce_scatter (and bidirectional)
* ``compute``:    the same dot FLOPs on local data, no communication
* ``comm``:       the collective alone

and reports the exposed communication fraction
``(t_decomposed - t_compute) / (t_unfused - t_compute)`` (0: communication fully hidden, 1: not
at all). It also records a jax.profiler trace of one decomposed call per process and measures,
from its timeline, how long a collective-permute and a dot actually ran at the same time.

Re-run (root, ~1 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.matmul_overlap_gloo  # -> docs/results/overlap.*
    .venv/bin/python -m benchmarks.collectives.matmul_overlap_gloo --quick  # smaller, fewer reps
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.shared.netns import run_workers, worker_init, write_result
from benchmarks.shared.results import RESULTS, write_page


# Shapes: m rows per rank, k contraction (per rank for rs), n columns (per rank for ag).
# Measured here (2 processes, one core each, 2 Gbit/s): ~150 GFLOP/s per core, ~270 MB/s on
# the link. ag sends 4*m*k bytes and does 4*m*k*n FLOPs per rank: compute ~ communication at
# n ~ 1000. rs sends 4*m*n bytes of partial products for 4*m*k*n FLOPs: at k ~ 1000-2000.
SWEEP = {
    "ag": [dict(m=256, k=1024, n=n) for n in (256, 512, 1024, 2048)],
    "rs": [dict(m=256, k=k, n=1024) for k in (256, 512, 1024, 2048)],
}
QUICK = {"ag": [dict(m=256, k=1024, n=256)], "rs": [dict(m=256, k=256, n=1024)]}


def _classify(hlo_op: str) -> str | None:
    if "permute" in hlo_op:
        return "permute"
    if any(s in hlo_op for s in ("all-gather", "all_gather", "reduce-scatter",
                                 "reduce_scatter", "all-reduce", "psum")):
        return "collective"
    if "ynn_fusion" in hlo_op or hlo_op.startswith("dot") or "onednn" in hlo_op:
        return "dot"
    return None


def _trace_timeline(fn, args, tmp: str) -> dict:
    """Run fn once under jax.profiler.trace; return its permute/dot intervals and overlap."""
    import jax

    with jax.profiler.trace(tmp):
        jax.block_until_ready(fn(*args))
    (path,) = glob.glob(os.path.join(tmp, "**", "*.trace.json.gz"), recursive=True)
    events = json.load(gzip.open(path))["traceEvents"]
    ops = []
    for e in events:
        kind = _classify(e.get("args", {}).get("hlo_op", "")) if e.get("ph") == "X" else None
        if kind and not e["name"].startswith("end:"):
            ops.append((kind, e["args"]["hlo_op"], float(e["ts"]), float(e["dur"]), e["tid"]))
    t0 = min(o[2] for o in ops)
    ops = [(k, name, ts - t0, dur, tid) for k, name, ts, dur, tid in ops]

    def total(kind):
        return sum(d for k, _, _, d, _ in ops if k == kind)

    overlap = 0.0  # time during which a permute and a dot both ran
    for k1, _, s1, d1, _ in ops:
        for k2, _, s2, d2, _ in ops:
            if k1 == "permute" and k2 == "dot":
                overlap += max(0.0, min(s1 + d1, s2 + d2) - max(s1, s2))
    return {"ops": [dict(kind=k, hlo_op=n, start_us=s, dur_us=d, thread=str(t))
                    for k, n, s, d, t in ops],
            "permute_us": total("permute"), "dot_us": total("dot"),
            "permute_dot_overlap_us": overlap,
            "threads_running_ops": len({t for *_, t in ops})}


def _case(op, m, k, n, nproc, rng):
    """One case's operands (this process's blocks), specs and functions: ``(x, w, specs, out,
    fns, comm_out, local, local_specs, sent)``; ``local`` are the operands of the same FLOPs
    with no communication, ``sent`` the bytes each rank sends."""
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm import all_gather_matmul, matmul_reduce_scatter

    if op == "ag":
        xl = rng.standard_normal((m, k), np.float32)
        wl = rng.standard_normal((k, n), np.float32)
        specs, out = (P("i", None), P(None, "i")), P(None, "i")
        fns = {
            "unfused": lambda a, b: lax.all_gather(a, "i", tiled=True) @ b,
            "decomposed": lambda a, b: all_gather_matmul(a, b, "i"),
            "bidirectional": lambda a, b: all_gather_matmul(a, b, "i", bidirectional=True),
            "comm": lambda a, b: lax.all_gather(a, "i", tiled=True),
        }
        # each rank's gathered copy; the same FLOPs, no communication
        return (xl, wl, specs, out, fns, P("i", None), (np.tile(xl, (nproc, 1)), wl), specs,
                m * k * 4 * (nproc - 1))
    xl = rng.standard_normal((nproc * m, k), np.float32)
    wl = rng.standard_normal((k, n), np.float32)
    specs, out = (P(None, "i"), P("i", None)), P("i", None)
    fns = {
        "unfused": lambda a, b: lax.psum_scatter(a @ b, "i", tiled=True),
        "decomposed": lambda a, b: matmul_reduce_scatter(a, b, "i"),
        "bidirectional": lambda a, b: matmul_reduce_scatter(a, b, "i", bidirectional=True),
        "comm": lambda a, b: lax.psum_scatter(
            jnp.zeros((a.shape[0], b.shape[1]), a.dtype) + a[:, :1], "i", tiled=True),
    }
    return xl, wl, specs, out, fns, P("i", None), (xl, wl), specs, m * n * 4 * (nproc - 1)


def _interleaved(jitted, inputs, reps, sync, one) -> dict:
    """``{name: [seconds]}``: every program compiled and warmed up, then ``reps`` rounds of one
    call each, in turn, each call started in step by a psum."""
    import jax

    times = {name: [] for name in jitted}
    for name, f in jitted.items():  # compile and warm up
        for _ in range(2):
            jax.block_until_ready(f(*inputs[name]))
    for _ in range(reps):  # interleaved, each call started in step by a psum
        for name, f in jitted.items():
            jax.block_until_ready(sync(one))
            t = time.perf_counter()
            jax.block_until_ready(f(*inputs[name]))
            times[name].append(time.perf_counter() - t)
    return times


def worker(quick: bool, reps: int) -> None:
    process_id, nproc = worker_init()
    import jax
    import numpy as np
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((nproc,), ("i",))
    rng = np.random.default_rng(process_id)
    sync = jax.jit(jax.shard_map(lambda a: lax.psum(a, "i"), mesh=mesh, in_specs=P("i"),
                                 out_specs=P()))

    def glob_arr(local, spec):
        return jax.make_array_from_process_local_data(NamedSharding(mesh, spec), local)

    results = []
    with jax.set_mesh(mesh):
        one = glob_arr(np.ones((1,), np.float32), P("i"))
        for op, cases in (QUICK if quick else SWEEP).items():
            for c in cases:
                m, k, n = c["m"], c["k"], c["n"]
                xl, wl, specs, out, fns, comm_out, local, local_specs, sent = _case(
                    op, m, k, n, nproc, rng)
                args = (glob_arr(xl, specs[0]), glob_arr(wl, specs[1]))
                jitted = {
                    name: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs,
                                                out_specs=comm_out if name == "comm" else out))
                    for name, f in fns.items()
                }
                jitted["compute"] = jax.jit(jax.shard_map(  # each rank: its local dot only
                    lambda a, b: a @ b, mesh=mesh, in_specs=local_specs, out_specs=P("i", None)))
                inputs = {name: args for name in fns}
                inputs["compute"] = tuple(glob_arr(a, s) for a, s in zip(local, local_specs))
                times = _interleaved(jitted, inputs, reps, sync, one)
                med = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
                flops = 2 * nproc * m * k * n
                res = dict(op=op, nproc=nproc, **c, bytes_sent_per_rank=sent,
                           gflops_compute=flops / med["compute"] / 1e6, ms=med,
                           ms_all=times)
                for name in ("decomposed", "bidirectional"):
                    res[f"exposed_{name}"] = ((med[name] - med["compute"])
                                              / (med["unfused"] - med["compute"]))
                with tempfile.TemporaryDirectory() as tmp:
                    res["timeline"] = _trace_timeline(jitted["decomposed"], args, tmp)
                results.append(res)
    write_result(results)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = data["processes"][0]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    labels = [f"{r['op']} m{r['m']} k{r['k']} n{r['n']}" for r in rows]
    xs = range(len(rows))
    ax = axes[0]
    for off, name in ((-0.3, "compute"), (-0.1, "comm"), (0.1, "unfused"), (0.3, "decomposed")):
        ax.bar([x + off for x in xs], [data["summary"][i]["ms"][name] for i in xs], width=0.2,
               label=name)
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("ms per call (median, slowest process)")
    ax.set_title("time")
    ax.legend(fontsize=8)
    ax = axes[1]
    ax.bar([x - 0.2 for x in xs], [s["exposed_decomposed"] for s in data["summary"]], width=0.4,
           label="ring")
    ax.bar([x + 0.2 for x in xs], [s["exposed_bidirectional"] for s in data["summary"]],
           width=0.4, label="bidirectional ring")
    ax.axhline(0.3, color="k", ls="--", lw=1, label="target 0.3")
    ax.axhline(1.0, color="r", ls=":", lw=1, label="no overlap")
    ax.set_xticks(list(xs), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("(t_dec - t_compute) / (t_unfused - t_compute)")
    ax.set_title("exposed communication fraction")
    ax.legend(fontsize=8)
    ax = axes[2]
    pick = min(xs, key=lambda i: abs(math.log(data["summary"][i]["comm_over_compute"])))
    tl = rows[pick]["timeline"]  # the case where communication ~ compute
    colors = {"permute": "tab:red", "dot": "tab:blue", "collective": "tab:orange"}
    for o in tl["ops"]:
        y = {"permute": 1, "dot": 0}.get(o["kind"], 2)
        ax.broken_barh([(o["start_us"] / 1e3, o["dur_us"] / 1e3)], (y - 0.4, 0.8),
                       color=colors[o["kind"]])
    ax.set_yticks([0, 1], ["dot", "collective-permute"])
    ax.set_xlabel("ms (process 0, one decomposed call)")
    ax.set_title(f"trace: {labels[pick]}, permute/dot overlap "
                 f"{tl['permute_dot_overlap_us'] / 1e3:.2f} ms", fontsize=9)
    fig.suptitle(f"{data['machine']['cpu']} ({data['machine']['cores']} cores, no GPU), "
                 f"{data['nproc']} processes over gloo, loopback limited to {data['rate']}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="one shape per op, 5 repetitions")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--rate", default="2gbit")
    ap.add_argument("--out", default=str(RESULTS / "overlap"),
                    help="output prefix: OUT.json, OUT.png and the page, OUT.md")
    ap.add_argument("--xla-flags", default="", help="extra XLA_FLAGS for the workers")
    ap.add_argument("--no-pin", action="store_true", help="do not pin process i to core i")
    a = ap.parse_args()
    reps = a.reps or (5 if a.quick else 15)
    if a.worker:
        return worker(a.quick, reps)
    args = ["--worker", "--reps", reps] + (["--quick"] if a.quick else [])
    t0 = time.time()
    procs = run_workers("benchmarks.collectives.matmul_overlap_gloo", a.nproc, args=args,
                        rate=a.rate, timeout=3600, pin_cpus=not a.no_pin,
                        env={"XLA_FLAGS": a.xla_flags})
    import jax

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo")
                if ln.startswith("model name")), platform.processor())
    summary = []
    for rows in zip(*procs):  # per case: the slowest process's median
        ms = {name: max(r["ms"][name] for r in rows) for name in rows[0]["ms"]}
        s = {key: rows[0][key] for key in ("op", "m", "k", "n", "bytes_sent_per_rank")}
        s["ms"] = ms
        for name in ("decomposed", "bidirectional"):
            s[f"exposed_{name}"] = (ms[name] - ms["compute"]) / (ms["unfused"] - ms["compute"])
        s["comm_over_compute"] = ms["comm"] / ms["compute"]
        s["trace_permute_dot_overlap_us"] = [r["timeline"]["permute_dot_overlap_us"]
                                             for r in rows]
        summary.append(s)
    data = dict(
        command=" ".join(["python", "-m", "benchmarks.collectives.matmul_overlap_gloo",
                          *sys.argv[1:]]),
        machine=dict(cpu=cpu, cores=os.cpu_count(), gpu=None, python=platform.python_version(),
                     jax=jax.__version__),
        nproc=a.nproc, rate=a.rate, xla_flags=a.xla_flags, pinned=not a.no_pin, reps=reps,
        wall_s=time.time() - t0, summary=summary, processes=procs,
    )
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=1))
    plot(data, out.with_suffix(".png"))
    write_page(out.with_suffix(".json"), {**data, "rows": [
        {k: v for k, v in s.items() if k != "ms"} | s["ms"] for s in summary]})
    for s in summary:
        print(f"{s['op']} m={s['m']} k={s['k']} n={s['n']}: "
              + " ".join(f"{k}={v:.2f}ms" for k, v in s["ms"].items())
              + f" | exposed ring={s['exposed_decomposed']:.2f}"
              f" bidi={s['exposed_bidirectional']:.2f} comm/compute={s['comm_over_compute']:.2f}"
              f" | trace overlap us={s['trace_permute_dot_overlap_us']}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
