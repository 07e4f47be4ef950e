"""Quantized all-reduce (jax_flashcomm.psum) against the best exact JAX all-reduce.

Per message size (bf16 bytes per rank, 256 KiB .. 64 MiB) it times, in the same run:

* ``lax.psum``                          exact all-reduce
* ``lax.psum_scatter + lax.all_gather`` exact two-step all-reduce
* ``bf16 two-step``                     exact two-step all-reduce moving bf16 bytes (uint16
  all_to_all + all_gather, f32 sum in rank order; ``benchmarks/collectives/bf16_baseline.py``): the
  measured bf16 baseline, since XLA:CPU moves bf16 ``lax`` collectives as f32
* ``jax_flashcomm.psum`` at 8, 6 and 4 bits (G=128, min_bytes=0 so it always quantizes)

and reports each quantized time against the faster of the two lax ones (``speedup``), against
``lax.psum`` (``speedup_vs_psum``) and against the bf16 two-step (``speedup_vs_bf16``).
``--breakdown`` also times the quantized psum's pieces (quantize, phase-1 all_to_all, fused
dequantize-sum-quantize, phase-2 all_gather, dequantize), each jitted alone, in the netns
workers (JSON key ``breakdown``). Two setups:

(a) ``inproc``: one process, 8 CPU devices (XLA's in-process collectives: memory copies);
(b) ``netns``:  2 and 4 processes, one CPU device each, over gloo on a loopback rate-limited
    with ``tc tbf`` inside a private network namespace (``benchmarks/shared/netns.py``): a
    bandwidth-bound link, what PCIe is to a GPU.

``--malloc keep`` (the default) re-executes the benchmark (and so its workers) with glibc's
malloc told to serve every buffer from one heap and keep freed memory
(``benchmarks/shared/runtime.py``): by default glibc maps any block above 32 MiB afresh on each
allocation and unmaps it on free, and XLA's threads' arenas hand freed memory back to the
kernel, so each call of a 64 MiB all-reduce, exact or quantized, faults in its large buffers
page by page again (docs/allreduce.md measures both); a server would run with such a setting or
an allocator that keeps memory. ``--malloc glibc`` leaves glibc's defaults.

Re-run (root; ~15 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.allreduce_speed         # -> docs/results/allreduce.*
    .venv/bin/python -m benchmarks.collectives.allreduce_speed --quick  # 2 sizes, fewer reps
    .venv/bin/python -m benchmarks.collectives.allreduce_speed --sizes 16777216 67108864 \\
        --nprocs 2 \
        --skip-inproc --breakdown --out /tmp/allreduce_bf16.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import MALLOC_KEEP, reexec_with

from benchmarks.shared.timing import time_calls
from benchmarks.shared.netns import run_workers, worker_init, write_result


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
    from benchmarks.collectives.bf16_baseline import bf16_two_step_psum

    def sm(body, out):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=out))

    methods = {
        "lax.psum": sm(lambda v: lax.psum(v[0], "i"), P()),
        "lax.rs+ag": sm(lambda v: lax.all_gather(
            lax.psum_scatter(v[0], "i", tiled=True), "i", tiled=True)[None], P("i")),
        # exact, bf16 bytes on the wire (lax moves bf16 as f32 on XLA:CPU)
        "bf16 two-step": sm(lambda v: bf16_two_step_psum(v[0], "i"), P()),
    }
    perm = [(i, (i + 1) % mesh.shape["i"]) for i in range(mesh.shape["i"])]
    # link calibration: every rank sends its whole message to the next one (N*bytes in total)
    methods["ppermute"] = sm(lambda v: lax.ppermute(v, "i", perm), P("i"))
    for b in BITS:
        # spikes=0, rotation=0: the base format these figures were measured with
        # (docs/allreduce.md); the defaults' rotation is measured in docs/accuracy.md
        methods[f"int{b}"] = sm(lambda v, b=b: fc.psum(v[0], "i", bits=b, min_bytes=0,
                                                      spikes=0, rotation=0), P())
    return methods


def sweep(mesh, make_input, sizes, reps, budget_s, log=print):
    """Times per size and method; ``make_input(n_elems)`` builds the global (N, n) input."""
    rows = []
    for size in sizes:
        n_elems = size // 2
        x = make_input(n_elems)
        row = {"bytes": size, "times_s": {}, "reps": {}}
        for name, fn in _methods(mesh, n_elems).items():
            r = reps if size < 16 * MIB else max(2, reps // 2)
            row["times_s"][name], row["reps"][name] = time_calls(fn, x, r, budget_s)
        best = min(row["times_s"]["lax.psum"], row["times_s"]["lax.rs+ag"])
        row["best_exact"] = "lax.psum" if best == row["times_s"]["lax.psum"] else "lax.rs+ag"
        t = row["times_s"]
        row["speedup"] = {f"int{b}": best / t[f"int{b}"] for b in BITS}
        row["speedup_vs_psum"] = {f"int{b}": t["lax.psum"] / t[f"int{b}"] for b in BITS}
        row["speedup_vs_bf16"] = {f"int{b}": t["bf16 two-step"] / t[f"int{b}"] for b in BITS}
        row["bf16_two_step_vs_psum"] = t["lax.psum"] / t["bf16 two-step"]
        n = mesh.shape["i"]
        row["link_MBps"] = n * size / t["ppermute"] / 1e6  # aggregate, measured
        log(f"  {size / MIB:7.2f} MiB  " + "  ".join(
            f"{k}={v * 1e3:8.1f}ms" for k, v in t.items()))
        for key, what in (("speedup", "best lax"), ("speedup_vs_psum", "lax.psum"),
                          ("speedup_vs_bf16", "bf16 two-step")):
            log(f"  {'':11s}speedup vs {what:13s} " +
                " ".join(f"{k}={v:.2f}x" for k, v in row[key].items()))
        log(f"  {'':11s}bf16 two-step vs lax.psum {row['bf16_two_step_vs_psum']:.2f}x")
        rows.append(row)
        del x
    return rows


# --- time breakdown of the quantized psum (xla transport: the pieces psum runs) ---------------

BREAKDOWN_PIECES = ("quantize", "all_to_all", "dequantize_sum_quantize", "all_gather",
                    "dequantize")


def breakdown(mesh, make_input, sizes, reps, budget_s, log=print):
    """Each piece of ``jax_flashcomm.psum``'s xla-transport two-step (the calls of
    ``jax_flashcomm/transport/xla.py`` ``all_reduce``), jitted alone and timed on the previous
    piece's real output, against the whole psum timed in the same loop. The pieces' sum leaves
    out only the dispatch and fusion differences of one program against five."""
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc
    from jax_flashcomm import codec
    from jax_flashcomm.jax_compat import all_gather_invariant
    from jax_flashcomm.transport import wire

    n = mesh.shape["i"]
    axes = ("i",)

    def sm(body, in_spec, out_spec):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_spec, out_specs=out_spec))

    out = []
    for size in sizes:
        n_elems = size // 2
        x = make_input(n_elems)
        r = reps if size < 16 * MIB else max(2, reps // 2)
        for b in BITS:
            cfg = fc.CommConfig(bits=b, min_bytes=0, spikes=0, rotation=0)
            shape, dtype = (n_elems,), x.dtype
            plan = fc.plan("psum", axes, shape, dtype, n, cfg, record=False)
            g, b1, b2 = plan.group_size, plan.rs_bits, plan.ag_bits
            k1, k2, backend = plan.rs_spikes, plan.ag_spikes, plan.backend
            transport = plan.transport

            def quantize(v):
                p1 = codec.quantize(v[0], bits=b1, group_size=g, num_chunks=n,
                                    backend=backend, rotation=0, spikes=k1)
                return wire.pack(p1.split_groups(n))[None]             # (1, N, groups/N, B)

            def a2a(c):
                return jax.lax.all_to_all(c[0], axes, 0, 0, tiled=False)[None]

            def dsq(rc):
                recv = wire.unpack(rc[0], bits=b1, group_size=g, shape=shape, dtype=dtype,
                                   rotation=0, spikes=k1)
                summed = codec.dequantize_sum_quantize(recv, bits=b2, spikes=k2,
                                                       backend=backend)
                return wire.pack(summed)[None]                         # (1, groups/N, B)

            def ag(s_):
                return all_gather_invariant(s_[0], axes, axis=0, tiled=True)

            def deq(gathered):
                p2 = wire.unpack(gathered, bits=b2, group_size=g, shape=shape, dtype=dtype,
                                 rotation=0, spikes=k2)
                return codec.dequantize(p2, backend=backend)

            whole = sm(lambda v: fc.psum(v[0], "i", config=cfg), P("i"), P())
            fns = [sm(quantize, P("i"), P("i")), sm(a2a, P("i"), P("i")),
                   sm(dsq, P("i"), P("i")), sm(ag, P("i"), P()), sm(deq, P(), P())]
            entry = {"bytes": size, "bits": b, "transport": transport, "times_s": {},
                     "payload_bytes": {}}
            arg = x
            for name, fn in zip(BREAKDOWN_PIECES, fns):
                res = jax.block_until_ready(fn(arg))  # compile + warm up; next piece's input
                entry["times_s"][name], _ = time_calls(fn, arg, r, budget_s, warm=False)
                if name in ("all_to_all", "all_gather"):  # bytes this rank holds after the op
                    entry["payload_bytes"][name] = int(res.addressable_shards[0].data.nbytes)
                arg = res
            entry["pieces_sum_s"] = sum(entry["times_s"].values())
            entry["psum_s"], _ = time_calls(whole, x, r, budget_s)
            entry["pieces_over_psum"] = entry["pieces_sum_s"] / entry["psum_s"]
            log(f"  breakdown {size / MIB:5.0f} MiB int{b} ({transport}): " + "  ".join(
                f"{k}={v * 1e3:.1f}ms" for k, v in entry["times_s"].items())
                + f"  | sum={entry['pieces_sum_s'] * 1e3:.1f}ms"
                f"  psum={entry['psum_s'] * 1e3:.1f}ms  sum/psum={entry['pieces_over_psum']:.2f}")
            out.append(entry)
            del arg, res
        del x
    return out


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
    rows = sweep(mesh, make_input, sizes, reps, budget_s)
    print(markdown(rows))
    return rows


# --- (b) N processes on a rate-limited link -----------------------------------------------------

def worker(sizes, reps, budget_s, do_breakdown=False):
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
    result = {"rows": rows, "log": lines}
    if do_breakdown:
        result["breakdown"] = breakdown(mesh, make_input, sizes, reps, budget_s,
                                        log=lines.append)
    write_result(result)


def run_netns(nprocs, sizes, reps, budget_s, rate, do_breakdown=False):
    out, parts = {}, {}
    for n in nprocs:
        print(f"(b) {n} processes, gloo, loopback limited to {rate} (tc tbf)", flush=True)
        args = ["--worker", "--sizes", *map(str, sizes), "--reps", str(reps),
                "--budget", str(budget_s)] + (["--breakdown"] if do_breakdown else [])
        results = run_workers("benchmarks.collectives.allreduce_speed", n, args=args, rate=rate,
                              timeout=1500, port=24000 + n)
        for line in results[0]["log"]:
            print(line)
        out[str(n)] = results[0]["rows"]
        if do_breakdown:
            parts[str(n)] = results[0]["breakdown"]
        print(markdown(results[0]["rows"]))
        if do_breakdown:
            print(markdown_breakdown(parts[str(n)]))
    return out, parts


def page_tables(data) -> str:
    """The tables of a run's page: in-process, then each process count (and its breakdown)."""
    out = ([f"### (a) in-process, 8 CPU devices\n\n{markdown(data['inproc'])}"]
           if "inproc" in data else [])
    for n, rows in data["netns"].items():
        out.append(f"### (b) {n} processes, {data['rate']} link\n\n{markdown(rows)}")
        if n in data.get("breakdown", {}):
            out.append(markdown_breakdown(data["breakdown"][n]))
    return "\n\n".join(out)


def markdown(rows) -> str:
    """One table: times, and each quantized psum's speedup against lax.psum and against the
    measured bf16 two-step."""
    names = ["lax.psum", "lax.rs+ag", "bf16 two-step", "ppermute"] + [f"int{b}" for b in BITS]
    head = (["message (bf16/rank)"] + names + ["bf16 two-step vs lax.psum"]
            + [f"int{b} vs lax.psum" for b in BITS] + [f"int{b} vs bf16 two-step" for b in BITS])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [f"{r['bytes'] / MIB:g} MiB"] + [f"{r['times_s'][k] * 1e3:.1f} ms" for k in names]
        cells.append(f"{r['bf16_two_step_vs_psum']:.2f}x")
        cells += [f"**{r['speedup_vs_psum'][f'int{b}']:.2f}x**" for b in BITS]
        cells += [f"**{r['speedup_vs_bf16'][f'int{b}']:.2f}x**" for b in BITS]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def markdown_breakdown(entries) -> str:
    head = (["message (bf16/rank)", "bits"] + list(BREAKDOWN_PIECES)
            + ["sum of pieces", "whole psum", "sum / psum"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        cells = [f"{e['bytes'] / MIB:g} MiB", f"int{e['bits']}"]
        cells += [f"{e['times_s'][k] * 1e3:.1f} ms" for k in BREAKDOWN_PIECES]
        cells += [f"{e['pieces_sum_s'] * 1e3:.1f} ms", f"{e['psum_s'] * 1e3:.1f} ms",
                  f"{e['pieces_over_psum']:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


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
    ap.add_argument("--breakdown", action="store_true",
                    help="also time the quantized psum's pieces in the netns workers")
    ap.add_argument("--malloc", choices=("keep", "glibc"), default="keep",
                    help="glibc malloc settings (see the module docstring)")
    ap.add_argument("--out", default=str(RESULTS / "allreduce"),
                    help="output path prefix (.json/.png are added; a trailing .json is kept)")
    args = ap.parse_args()
    if not args.worker and args.malloc == "keep":
        reexec_with(MALLOC_KEEP)
    out = args.out[:-len(".json")] if args.out.endswith(".json") else args.out
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    reps = 2 if args.quick else args.reps
    if args.worker:
        return worker(sizes, reps, args.budget, args.breakdown)
    if not args.skip_inproc:  # before jax is imported
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_force_host_platform_device_count=8").strip()
    from models import machine

    print(machine.first_line(), flush=True)
    data = {"machine": machine.describe(), "rate": args.rate, "sizes": sizes, "bits": list(BITS),
            "group_size": 128, "dtype": "bfloat16",
            "command": "python -m benchmarks.collectives.allreduce_speed "
                       + " ".join(sys.argv[1:]),
            "malloc_env": MALLOC_KEEP if args.malloc == "keep" else {}}
    if not args.skip_inproc:
        data["inproc"] = run_inproc(sizes, reps, args.budget)
    data["netns"], parts = run_netns(args.nprocs, sizes, reps, args.budget, args.rate,
                                     args.breakdown)
    if args.breakdown:
        data["breakdown"] = parts
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    if "inproc" in data:
        plot(data, out + ".png")
    write_page(out + ".json", data, tables=page_tables(data))
    print("wrote", out + ".json", "and its page")


if __name__ == "__main__":
    main()
