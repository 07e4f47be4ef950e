"""Quantized all-reduce (jax_flashcomm.psum) against the best exact JAX all-reduce.

Per message size (bf16 bytes per rank, 256 KiB .. 64 MiB) it times, in the same run:

* ``lax.psum``                          exact all-reduce
* ``lax.psum_scatter + lax.all_gather`` exact two-step all-reduce
* ``jax_flashcomm.psum`` at 8, 6 and 4 bits (G=128, min_bytes=0 so it always quantizes)

and reports each quantized time against the faster of the two exact ones. Two setups:

(a) ``inproc``: one process, 8 CPU devices (XLA's in-process collectives: memory copies);
(b) ``netns``:  2 and 4 processes, one CPU device each, over gloo on a loopback rate-limited
    with ``tc tbf`` inside a private network namespace (``benchmarks/netns.py``): a
    bandwidth-bound link, what PCIe is to a GPU.

Re-run (root; ~15 min on 2 cores)::

    .venv/bin/python benchmarks/allreduce.py                # -> docs/allreduce.{json,png}
    .venv/bin/python benchmarks/allreduce.py --quick        # 2 sizes, fewer repetitions
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.netns import run_workers, worker_init, write_result  # noqa: E402

KIB, MIB = 1024, 1024 * 1024
SIZES = [256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [1 * MIB, 16 * MIB]
BITS = (8, 6, 4)
# Codec throughput here is ~0.8 GB/s per core (bf16 in); 400 Mbit/s = 50 MB/s keeps the link
# ~16x slower than the codec, roughly PCIe (~25 GB/s) vs a GPU codec (~0.5 TB/s).
RATE = "400mbit"


def _methods(mesh, n_elems):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc

    def sm(body, out):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=out))

    methods = {
        "lax.psum": sm(lambda v: lax.psum(v[0], "i"), P()),
        "lax.rs+ag": sm(lambda v: lax.all_gather(
            lax.psum_scatter(v[0], "i", tiled=True), "i", tiled=True)[None], P("i")),
    }
    perm = [(i, (i + 1) % mesh.shape["i"]) for i in range(mesh.shape["i"])]
    # link calibration: every rank sends its whole message to the next one (N*bytes in total)
    methods["ppermute"] = sm(lambda v: lax.ppermute(v, "i", perm), P("i"))
    for b in BITS:
        # spikes=0: the base format these figures were measured with (docs/allreduce.md)
        methods[f"int{b}"] = sm(lambda v, b=b: fc.psum(v[0], "i", bits=b, min_bytes=0,
                                                      spikes=0), P())
    return methods


def _time(fn, x, reps, budget_s):
    import jax
    jax.block_until_ready(fn(x))  # compile + warm up
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), len(times)


def sweep(mesh, make_input, sizes, reps, budget_s, log=print):
    """Times per size and method; ``make_input(n_elems)`` builds the global (N, n) input."""
    rows = []
    for size in sizes:
        n_elems = size // 2
        x = make_input(n_elems)
        row = {"bytes": size, "times_s": {}, "reps": {}}
        for name, fn in _methods(mesh, n_elems).items():
            r = reps if size < 16 * MIB else max(2, reps // 2)
            row["times_s"][name], row["reps"][name] = _time(fn, x, r, budget_s)
        best = min(row["times_s"]["lax.psum"], row["times_s"]["lax.rs+ag"])
        row["best_exact"] = "lax.psum" if best == row["times_s"]["lax.psum"] else "lax.rs+ag"
        row["speedup"] = {f"int{b}": best / row["times_s"][f"int{b}"] for b in BITS}
        n = mesh.shape["i"]
        row["link_MBps"] = n * size / row["times_s"]["ppermute"] / 1e6  # aggregate, measured
        log(f"  {size / MIB:7.2f} MiB  " + "  ".join(
            f"{k}={v * 1e3:8.1f}ms" for k, v in row["times_s"].items()) + "  speedup " +
            " ".join(f"{k}={v:.2f}x" for k, v in row["speedup"].items()))
        rows.append(row)
        del x
    return rows


# --- (a) one process, 8 devices -----------------------------------------------------------------

def run_inproc(sizes, reps, budget_s):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))

    def make_input(n):
        x = jax.random.normal(jax.random.key(0), (8, n), jnp.bfloat16)
        return jax.device_put(x, NamedSharding(mesh, P("i")))

    print("(a) in-process, 8 CPU devices")
    return sweep(mesh, make_input, sizes, reps, budget_s)


# --- (b) N processes on a rate-limited link -----------------------------------------------------

def worker(sizes, reps, budget_s):
    process_id, nproc = worker_init(1)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((nproc,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices())
    sharding = NamedSharding(mesh, P("i"))

    def make_input(n):
        local = np.asarray(jax.random.normal(jax.random.key(process_id), (1, n), jnp.bfloat16))
        return jax.make_array_from_process_local_data(sharding, local, (nproc, n))

    lines = []
    rows = sweep(mesh, make_input, sizes, reps, budget_s, log=lines.append)
    write_result({"rows": rows, "log": lines})


def run_netns(nprocs, sizes, reps, budget_s, rate):
    out = {}
    for n in nprocs:
        print(f"(b) {n} processes, gloo, loopback limited to {rate} (tc tbf)")
        args = ["--worker", "--sizes", *map(str, sizes), "--reps", str(reps),
                "--budget", str(budget_s)]
        results = run_workers(__file__, n, args=args, rate=rate, timeout=1500,
                              port=24000 + n)
        for line in results[0]["log"]:
            print(line)
        out[str(n)] = results[0]["rows"]
    return out


def plot(data, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("(a) in-process, 8 CPU devices", data["inproc"])] + [
        (f"(b) {n} processes, gloo, {data['rate']} link", rows)
        for n, rows in data["netns"].items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (title, rows) in zip(axes[0], panels):
        mib = [r["bytes"] / MIB for r in rows]
        for b, mark in zip(BITS, "os^"):
            ax.plot(mib, [r["speedup"][f"int{b}"] for r in rows], marker=mark, label=f"int{b}")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message (bf16 MiB per rank)")
        ax.set_ylabel("speedup vs best exact (lax)")
        ax.set_title(title, fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle("jax_flashcomm.psum (G=128) vs min(lax.psum, psum_scatter+all_gather); "
                 "2-core CPU, no GPU", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="*")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget", type=float, default=20.0, help="seconds per timing loop")
    ap.add_argument("--rate", default=RATE)
    ap.add_argument("--nprocs", type=int, nargs="*", default=[2, 4])
    ap.add_argument("--skip-inproc", action="store_true")
    ap.add_argument("--out", default=str(REPO / "docs" / "allreduce"))
    args = ap.parse_args()
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = 2 if args.quick else args.reps
    if args.worker:
        return worker(sizes, reps, args.budget)
    if not args.skip_inproc:  # before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
    from benchmarks import machine

    print(machine.first_line(), flush=True)
    data = {"machine": machine.describe(), "rate": args.rate, "sizes": sizes, "bits": list(BITS),
            "group_size": 128, "dtype": "bfloat16",
            "command": "python benchmarks/allreduce.py " + " ".join(sys.argv[1:])}
    if not args.skip_inproc:
        data["inproc"] = run_inproc(sizes, reps, args.budget)
    data["netns"] = run_netns(args.nprocs, sizes, reps, args.budget, args.rate)
    Path(args.out + ".json").write_text(json.dumps(data, indent=1))
    if "inproc" in data:
        plot(data, args.out + ".png")
    print("wrote", args.out + ".json")


if __name__ == "__main__":
    main()
