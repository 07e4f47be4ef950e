"""Overlap of the p2p ring steps with the dots, in one process, on an emulated link.

Two CPU devices in one process (XLA_FLAGS below: plain dot thunks, no YNNPACK fusion; it also
measures how the two devices share the cores: one chunk's dot alone and on both at once). The
p2p transport's copies are paced
(``jax_flashcomm.transport.ring_steps.link_emulation``) at the rate that makes one ring step's move
take as long as that step's dot (measured first): communication ~ computation. Per op it times,
in one run, L ring matmuls in a loop inside one program (launch skew and dispatch amortized):

* ``compute``  the same dots, no communication
* ``comm``     the same moves over the same link, no dots
* ``unfused``  the same moves, then the dots (p2p: no overlap possible)
* ``ring``     the op with ``transport="p2p"``: start, dot, done per step

and the exposed communication fraction of docs/overlap.md, ``(ring - compute) / (unfused -
compute)`` (0: hidden, 1: not at all; target <= 0.3). For the xla transport in the same
process (ppermute, unpaced: its "link" is a memcpy) it times ``ring`` and ``unfused``
(lax.all_gather then dot, dot then lax.psum_scatter). It also records one looped ring call on
the transport's own timeline (moves, each rank's compute between its start and done calls,
its waits) and measures how long moves and compute ran at the same time
(docs/results/ring_overlap.png).

With ``--processes 2`` the two ranks are two processes (``jax.distributed``, one CPU device
each, each pinned to one core), the p2p transport runs over shared memory and the paced copies
run in the receiving process (docs/transport.md, "Across processes"); no timeline is recorded
and no xla rows are timed (gloo's figures are docs/results/overlap.json's).

Re-run (~2 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.matmul_overlap_p2p  # -> docs/results/ring_overlap.*
    .venv/bin/python -m benchmarks.collectives.matmul_overlap_p2p --quick  # one op, fewer reps
    .venv/bin/python -m benchmarks.collectives.matmul_overlap_p2p --processes 2
        # -> docs/results/ring_overlap_processes.*
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.shared.results import REPO, RESULTS, write_page


DEVICES = 2
FLAGS = ("--xla_cpu_multi_thread_eigen=false --xla_cpu_experimental_ynn_fusion_type= "
         f"--xla_force_host_platform_device_count={DEVICES}")
M, K, NCOL = 512, 1024, 1024  # per rank: rows, contraction, columns
OPS = ("ag", "ag_bidi", "ag_int8", "rs", "rs_bidi")


def _xla_over_gloo(op):
    """The xla transport's exposed fraction for the same op where communication ~ computation,
    as benchmarks/collectives/matmul_overlap_gloo.py measured it (2 processes over gloo on a 2
    Gbit/s netns link: XLA:CPU's collective-permute is synchronous, and in one process its "link" is
    a memcpy that
    cannot be paced). None when docs/results/overlap.json has no such row."""
    path = RESULTS / "overlap.json"
    if not path.exists() or op == "ag_int8":
        return None
    kind = op.split("_")[0]
    rows = [r for r in json.loads(path.read_text())["summary"] if r["op"] == kind]
    if not rows:
        return None
    best = min(rows, key=lambda r: abs(r["comm_over_compute"] - 1))
    return best["exposed_bidirectional" if op.endswith("bidi") else "exposed_decomposed"]


def _time(fn, args, reps):
    import jax

    jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t)
    return out


def _cores_busy(fn, args, reps):
    """Median seconds of fn, and the process's CPU time over the wall time of those calls (how
    many cores it kept busy)."""
    cpu0, wall0 = os.times(), time.perf_counter()
    times = _time(fn, args, reps)
    cpu1, wall1 = os.times(), time.perf_counter()
    cpu = (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system)
    return statistics.median(times), cpu / (wall1 - wall0)


def _shared_executor(mesh, reps):
    """One chunk's dot on one device alone, and on both devices at once (ms), and the cores
    each kept busy: equal times when the devices compute in parallel, twice when they share
    XLA:CPU's intra-op pool (a lone dot then already uses every core)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    x = jax.random.normal(jax.random.key(1), (DEVICES * M, K))
    w = jax.random.normal(jax.random.key(2), (K, DEVICES * NCOL))
    alone = jax.jit(lambda x, w: x @ w)
    both = jax.jit(jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("i"), P(None, "i")),
                                 out_specs=P("i")))
    one = (jax.device_put(x[:M], jax.devices()[0]), jax.device_put(w[:, :NCOL], jax.devices()[0]))
    two = (jax.device_put(x, NamedSharding(mesh, P("i"))),
           jax.device_put(w, NamedSharding(mesh, P(None, "i"))))
    t_alone, cores_alone = _cores_busy(alone, one, reps)
    t_both, cores_both = _cores_busy(both, two, reps)
    return dict(alone=t_alone * 1e3, both=t_both * 1e3, cores_alone=cores_alone,
                cores_both=cores_both)


def run(ops, loops, reps):
    import jax

    from jax_flashcomm.transport import ring_steps

    from benchmarks.collectives.ring_programs import RingPrograms

    mesh = jax.make_mesh((DEVICES,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    rows = []
    multi = jax.process_count() > 1
    dot_ms = None if multi else _shared_executor(mesh, reps)
    if dot_ms:
        print(f"one chunk's dot: {dot_ms['alone']:.2f} ms on one device alone "
          f"({dot_ms['cores_alone']:.2f} cores busy), {dot_ms['both']:.2f} ms on both devices "
          f"at once ({dot_ms['cores_both']:.2f} cores busy)", flush=True)
    with jax.set_mesh(mesh):
        for op in ops:
            built = RingPrograms(op, mesh, loops, (M, K, NCOL))
            progs, args, payload = built.programs(), built.operands(), built.payload
            t_compute = statistics.median(_time(progs["compute"], args, reps)) / loops
            local = (M, args[0].shape[1]) if op.startswith("ag") else (M, NCOL)
            moved = jax.eval_shape(payload, jax.ShapeDtypeStruct(local, args[0].dtype))
            step_bytes = int(moved.size * moved.dtype.itemsize)
            if op.endswith("bidi"):
                step_bytes //= 2  # each direction carries half a chunk per step
            rate = step_bytes * DEVICES / t_compute  # one step's move ~ one step's dot
            samples = {"compute": []}
            with ring_steps.link_emulation(rate):
                timed = {k: v for k, v in progs.items() if k != "compute"}
                for name in timed:  # traced inside the emulation: the link is paced
                    jax.block_until_ready(timed[name](*args))
                for _ in range(reps):  # interleaved: drift hits every program alike
                    samples["compute"] += _time(progs["compute"], args, 1)
                    for name, fn in timed.items():
                        samples.setdefault(name, []).extend(_time(fn, args, 1))
            t = {k: statistics.median(v) / loops * 1e3 for k, v in samples.items()}
            row = dict(op=op, step_bytes=step_bytes, link_bytes_per_s=rate, ms=t,
                       samples_ms={k: [s / loops * 1e3 for s in v] for k, v in samples.items()})
            row["exposed_p2p"] = (t["ring"] - t["compute"]) / (t["unfused"] - t["compute"])
            row["exposed_xla_gloo"] = _xla_over_gloo(op)
            rows.append(row)
            if multi and jax.process_index() != 0:
                continue
            print(f"{op:8s} link {rate / 1e6:7.1f} MB/s  " + "  ".join(
                f"{k} {v:6.2f}" for k, v in t.items())
                + f"  exposed p2p {row['exposed_p2p']:.2f}",
                flush=True)
            if not multi:
                row["timeline"] = _timeline(progs["ring"], args, rate, loops)
    return rows, dot_ms


def _timeline(fn, args, rate, loops):
    """One looped ring call with the transport's own timeline recorded: per rank the moves into
    it, its compute (from a start call's return to its done call: the step's dot, which the
    data dependences put there, with the chunk's small placement fusions) and its waits in done;
    and how long moves and compute overlapped. (jax.profiler's trace of these dot thunks shows
    their dispatch, not their run.)"""
    import jax

    from jax_flashcomm.transport import ring_steps

    with ring_steps.link_emulation(rate), ring_steps.recording() as events:
        jax.block_until_ready(fn(*args))
    t0 = min(e["begin_us"] for e in events)
    ms = lambda us: (us - t0) / 1e3  # noqa: E731
    lanes = {k: sorted((ms(e["begin_us"]), ms(e["end_us"]), e["rank"], e["peer"])
                       for e in events if e["kind"] == k) for k in ("move", "wait", "start")}
    compute = []
    for r in range(DEVICES):
        by_site: dict = {}
        waits_by_site: dict = {}
        for e in sorted((e for e in events if e["rank"] == r), key=lambda e: e["begin_us"]):
            if e["kind"] == "start":
                by_site.setdefault(e["site"], []).append(e["end_us"])
            elif e["kind"] == "wait":
                waits_by_site.setdefault(e["site"], []).append(e["begin_us"])
        for site, ends in by_site.items():
            for a, b in zip(ends, waits_by_site.get(site, [])):
                compute.append((ms(a), ms(b), r, -1))
    overlap = sum(_intersection(_union([(a, b) for a, b, rr, _ in lanes["move"] if rr == r]),
                                _union([(a, b) for a, b, rr, _ in compute if rr == r]))
                  for r in range(DEVICES))
    moving = sum(b - a for a, b, *_ in lanes["move"])
    waiting = sum(b - a for a, b, *_ in lanes["wait"])
    return dict(compute=sorted(compute), **lanes, overlap_ms=overlap, moving_ms=moving,
                waiting_ms=waiting, loops=loops)


def _union(iv):
    out = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def _intersection(xs, ys):
    total, i, j = 0.0, 0, 0
    while i < len(xs) and j < len(ys):
        lo, hi = max(xs[i][0], ys[j][0]), min(xs[i][1], ys[j][1])
        total += max(0.0, hi - lo)
        if xs[i][1] < ys[j][1]:
            i += 1
        else:
            j += 1
    return total


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tl = next(r["timeline"] for r in rows if "timeline" in r)
    fig, (ax, bx) = plt.subplots(2, 1, figsize=(11, 7), gridspec_kw=dict(height_ratios=[3, 2]))
    window = (0.0, max(b for _, b, *_ in tl["move"]) * min(1.0, 3.5 / tl["loops"]))
    lane, labels = 0, []
    for r in range(DEVICES):
        for kind, color, label in (("compute", "tab:blue", f"rank {r}: start -> done (dot)"),
                                   ("move", "tab:orange", f"rank {r}: chunk arriving"),
                                   ("wait", "tab:red", f"rank {r}: waiting in done")):
            bars = [(a, b - a) for a, b, rank, _ in tl[kind] if rank == r]
            ax.broken_barh(bars, (lane, 0.8), color=color)
            labels.append(label)
            lane += 1
    ax.set_yticks([i + 0.4 for i in range(lane)], labels)
    ax.set_xlim(*window)
    ax.invert_yaxis()
    ax.set_xlabel("ms (the transport's own timeline; between steps: the dot of the last chunk, "
                  "which needs no move)")
    ax.set_title(f"all_gather_matmul ring, p2p, 2 devices, paced link: moves overlap compute "
                 f"{tl['overlap_ms']:.0f} of {tl['moving_ms']:.0f} ms; "
                 f"{tl['waiting_ms']:.0f} ms waited in done", fontsize=10)
    names = [r["op"] for r in rows]
    xs = range(len(names))
    bx.bar([i - 0.2 for i in xs], [r["exposed_p2p"] for r in rows], 0.4, label="p2p (paced)")
    bx.bar([i + 0.2 for i in xs], [r["exposed_xla_gloo"] or 0 for r in rows], 0.4,
           label="xla: 2 processes over gloo, 2 Gbit/s (docs/results/overlap.json)")
    bx.axhline(0.3, color="k", ls="--", lw=1, label="target 0.3")
    bx.set_xticks(list(xs), names)
    bx.set_ylabel("exposed communication")
    bx.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(rows) -> str:
    head = ("| op | step bytes | link MB/s | compute | comm | unfused | ring | exposed p2p | "
            "xla unfused | xla ring | exposed xla, gloo |\n"
            "|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        t = r["ms"]
        lines.append(f"| {r['op']} | {r['step_bytes']} | {r['link_bytes_per_s'] / 1e6:.0f} | "
                     f"{t['compute']:.2f} | {t['comm']:.2f} | {t['unfused']:.2f} | "
                     f"{t['ring']:.2f} | **{r['exposed_p2p']:.2f}** | "
                     f"{_fmt(t.get('xla unfused'))} | {_fmt(t.get('xla ring'))} | "
                     f"{_fmt(r['exposed_xla_gloo'])} |")
    return "\n".join(lines)


def _fmt(v):
    return "-" if v is None else f"{v:.2f}"


def _processes(args) -> int:
    """Run the benchmark as ``args.processes`` processes; process 0 writes the results."""
    import socket
    import subprocess

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = [a for a in sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.collectives.matmul_overlap_p2p",
                               *argv, "--rank", str(r), "--port", str(port)], cwd=REPO, env=env)
             for r in range(args.processes)]
    try:
        codes = [p.wait(timeout=1800) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return max(codes)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the plain all-gather ring only")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--loops", type=int, default=8, help="ring calls per timed program")
    ap.add_argument("--ops", nargs="*", choices=OPS, help=f"a subset of {OPS}")
    ap.add_argument("--out", help="default: docs/results/ring_overlap.json, or "
                    "docs/results/ring_overlap_processes.json with --processes")
    ap.add_argument("--processes", type=int, default=1, choices=(1, DEVICES),
                    help="1: the ranks are devices of one process; 2: processes (shared memory)")
    ap.add_argument("--rank", type=int, default=-1, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    multi = args.processes > 1
    args.out = args.out or str(RESULTS / ("ring_overlap_processes.json" if multi
                                          else "ring_overlap.json"))
    if multi and args.rank < 0:
        sys.exit(_processes(args))
    flags = FLAGS.replace(f"count={DEVICES}", "count=1") if multi else FLAGS
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flags).strip()
    if multi:
        from benchmarks.shared.runtime import join_shm_job

        join_shm_job(args.rank, args.processes, args.port)
    from jax_flashcomm import codec
    from models import machine

    print(machine.first_line(), flush=True)
    ops = args.ops or (OPS[:1] if args.quick else OPS)
    reps = 3 if args.quick else args.reps
    rows, dot_ms = run(ops, args.loops, reps)
    if multi and args.rank != 0:
        return
    data = {"machine": machine.describe(), "cpu_isa": codec.cpu_isa(), "devices": DEVICES,
            "processes": args.processes, "xla_flags": flags,
            "shape_per_rank": dict(m=M, k=K, n=NCOL), "loops": args.loops,
            "reps": reps, "dot_ms": dot_ms,
            "command": ".venv/bin/python -m benchmarks.collectives.matmul_overlap_p2p "
                       + " ".join(a for a in sys.argv[1:] if not a.startswith("--")
                                  or a in ("--quick", "--processes")),
            "rows": rows}
    Path(args.out).write_text(json.dumps(data, indent=1))
    png = str(Path(args.out).with_suffix(".png"))
    if not multi:
        plot(rows, png)
    write_page(args.out, data, tables=markdown(rows))
    print(markdown(rows))
    tl = rows[0].get("timeline")
    if tl:
        print(f"timeline: moves overlapped compute {tl['overlap_ms']:.1f} ms of "
              f"{tl['moving_ms']:.1f} ms of moving; {tl['waiting_ms']:.1f} ms waited in done "
              f"({tl['loops']} calls, {DEVICES} ranks)")
    print("wrote", args.out, *([] if multi else [png]))


if __name__ == "__main__":
    main()
