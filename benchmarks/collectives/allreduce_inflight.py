"""Calls in flight in one process: n dispatches of a one-psum program before any result is read.

A program holding one psum (``jax.jit(jax.shard_map(...))`` over a 1-D mesh of the virtual CPU
devices of one process) is dispatched ``n`` times in a row, and only then are the n results
read (``jax.block_until_ready``). Per case it records the time the n dispatches took, the time
until every result was ready, the dispatches that stalled (took over 0.5 s), and what was
raised, or how the process ended. Two programs:

* ``lax``  ``lax.psum(x, "x")``: XLA:CPU's own all-reduce;
* ``p2p``  ``jax_flashcomm.psum(x, "x", config=CommConfig(bits=8, min_bytes=0, transport="p2p",
  p2p_timeout_ms=...))``: the in-process peer-to-peer transport.

Every case runs in a fresh subprocess under a hard timeout (XLA aborts the whole process when
its rendezvous gives up), so the CLI cannot hang. ``--every k`` reads one result every k
dispatches (the workaround); ``--env PJRT_NPROC=16`` sizes XLA's PjRt CPU client thread pool
(``max(PJRT_NPROC or NPROC or cores, devices)`` threads); ``--xla-flags`` adds XLA flags;
``--stacks S`` attaches gdb to the worker S seconds into the dispatches and counts the PjRt
threads by what they wait in. docs/reliability.md, "Calls in flight (one process)", has the
measurements and the mechanism.

Re-run (each line well under 2 min on 2 cores, except the lax cases that abort: ~45 s each)::

    .venv/bin/python -m benchmarks.collectives.allreduce_inflight --n 10,30,40,50,64,100 --kinds p2p
    .venv/bin/python -m benchmarks.collectives.allreduce_inflight --n 10,30,40 --kinds lax
    .venv/bin/python -m benchmarks.collectives.allreduce_inflight --n 50 --kinds lax --stacks 10
    .venv/bin/python -m benchmarks.collectives.allreduce_inflight --n 200 --kinds p2p,lax --every 32
    .venv/bin/python -m benchmarks.collectives.allreduce_inflight --n 200 --kinds p2p,lax \\
        --env PJRT_NPROC=16
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

from benchmarks.shared.results import REPO

STALL_S = 0.5  # a dispatch slower than this is reported as a stall


# --------------------------------------------------------------------------------------------
# The worker: one case in this (fresh) process.
# --------------------------------------------------------------------------------------------

def _emit(tag: str, payload="") -> None:
    print(f"{tag} {json.dumps(payload)}", flush=True)


def _program(spec: dict):
    """The one-psum program of the case, its operand and the exact sum."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    ndev = spec["devices"]
    mesh = Mesh(np.array(jax.devices()[:ndev]), ("x",))
    if spec["kind"] == "lax":
        def body(x):
            return jax.lax.psum(x, "x")
    else:
        import jax_flashcomm as fc

        cfg = fc.CommConfig(bits=8, min_bytes=0, transport="p2p",
                            p2p_timeout_ms=spec["timeout_ms"])

        def body(x):
            return fc.psum(x, "x", config=cfg)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    rng = np.random.default_rng(0)
    host = rng.standard_normal(ndev * spec["size"]).astype(np.float32)
    x = jax.device_put(host, NamedSharding(mesh, P("x")))
    return f, x, host.reshape(ndev, -1).sum(0)


def _watch(current) -> None:
    """Name a dispatch that is stuck (the process may die inside it): ``current`` is
    ``[the dispatch in progress or None, its start]``."""
    told = None
    while True:
        i, ta = current
        if i is not None and i != told and time.perf_counter() - ta > STALL_S:
            _emit("STUCK", i)
            told = i
        time.sleep(0.1)


def _failures(f, x, outs, res) -> None:
    """After a raise: which calls failed (what each device's shard of the first four says),
    and whether the next call works."""
    import jax

    bad, detail = 0, []
    for i, o in enumerate(outs):
        try:
            jax.block_until_ready(o)
        except Exception:  # noqa: BLE001
            bad += 1
            if len(detail) < 4:  # what each device's shard of this call says
                by_msg: dict[str, list[int]] = {}
                for sh in o.addressable_shards:
                    try:
                        jax.block_until_ready(sh.data)
                        msg = "ok"
                    except Exception as e3:  # noqa: BLE001
                        msg = str(e3).splitlines()[0]
                        msg = msg[msg.find("timed out"):] if "timed out" in msg else msg
                    by_msg.setdefault(msg, []).append(sh.device.id)
                detail.append({"call": i, "shards": by_msg})
    res["failed_calls"] = bad
    res["failures"] = detail
    try:
        ta = time.perf_counter()
        jax.block_until_ready(f(x))
        res["next_call"] = f"ok ({time.perf_counter() - ta:.2f} s)"
    except Exception as e2:  # noqa: BLE001
        res["next_call"] = f"{type(e2).__name__}: {str(e2).splitlines()[0][:120]}"


def worker(spec: dict) -> None:
    os.environ["XLA_FLAGS"] = (spec["xla_flags"] + " --xla_force_host_platform_device_count="
                               f"{spec['devices']}").strip()
    import jax
    import numpy as np

    f, x, want = _program(spec)
    ndev = spec["devices"]
    jax.block_until_ready(f(x))  # compile and warm up

    n, every = spec["n"], spec["every"]
    outs, stalls = [], []
    res = {"dispatch_s": None, "total_s": None, "error": None}
    current = [None, 0.0]  # the dispatch in progress and its start
    threading.Thread(target=_watch, args=(current,), daemon=True).start()
    _emit("START", os.getpid())
    t0 = time.perf_counter()
    try:
        for i in range(n):
            ta = time.perf_counter()
            current[:] = [i, ta]
            outs.append(f(x))
            current[0] = None
            dt = time.perf_counter() - ta
            if dt > STALL_S:
                stalls.append([i, round(dt, 2)])
                _emit("STALL", [i, round(dt, 2)])
            if every and (i + 1) % every == 0:
                jax.block_until_ready(outs[-1])
        res["dispatch_s"] = time.perf_counter() - t0
        _emit("DISPATCHED", res["dispatch_s"])
        jax.block_until_ready(outs)
        res["total_s"] = time.perf_counter() - t0
        got = np.asarray(outs[-1]).reshape(ndev, -1)
        err = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
        res["rel_err"] = err
    except Exception as e:  # noqa: BLE001 - the case's outcome is what was raised
        res["total_s"] = time.perf_counter() - t0
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        _failures(f, x, outs, res)
    res["stalls"] = stalls
    if spec["kind"] == "p2p":
        from jax_flashcomm.transport import p2p

        res["meetings_left"] = p2p.meetings_in_progress()
    _emit("RESULT", res)


# --------------------------------------------------------------------------------------------
# The parent: one subprocess per case.
# --------------------------------------------------------------------------------------------

_CHILD = None


def _kill_child(*_):
    if _CHILD is not None and _CHILD.poll() is None:
        os.killpg(_CHILD.pid, signal.SIGKILL)
    sys.exit(1)


def _gdb_summary(pid: int) -> str:
    """Count XLA's PjRt threads by what they wait in (gdb backtraces of every thread)."""
    gdb = shutil.which("gdb")
    if not gdb:
        return "gdb not found"
    out = subprocess.run([gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 40"],
                         capture_output=True, text=True, timeout=60).stdout
    threads = re.split(r"\nThread \d+ ", out)
    sem = running = helper = 0
    for t in threads:
        if "CpuPjRtRawLoadedExecutable::Execute" not in t:
            continue
        if "Semaphore::Acquire" in t:
            sem += 1  # ExecuteHelper of a later call: the device's in-flight limit is reached
        elif "BlockUntilReady" in t or "Rendezvous" in t or "rendezvous" in t:
            running += 1  # a device's program, waiting for its collective's peers
        else:
            helper += 1
    main = "CommonPjRtLoadedExecutable::Execute" in threads[0] if threads else False
    return (f"{running} threads run a program waiting for its peers, {sem} wait in "
            f"Semaphore::Acquire (in-flight limit), {helper} other"
            + ("; main thread in Execute" if main else ""))


def run_case(spec: dict, env: dict, limit_s: float, stacks_s: float | None) -> dict:
    global _CHILD
    cmd = [sys.executable, "-m", "benchmarks.collectives.allreduce_inflight", "--worker",
           json.dumps(spec)]
    full_env = {**os.environ, **env}
    lines: list[tuple[float, str]] = []
    err_lines: list[str] = []
    t_launch = time.perf_counter()
    _CHILD = proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, start_new_session=True)

    def read_out():
        for line in proc.stdout:
            lines.append((time.perf_counter(), line.rstrip("\n")))

    def read_err():
        for line in proc.stderr:
            err_lines.append(line.rstrip("\n"))

    readers = [threading.Thread(target=read_out, daemon=True),
               threading.Thread(target=read_err, daemon=True)]
    for r in readers:
        r.start()
    stack_note = None
    killed = False
    while proc.poll() is None:
        now = time.perf_counter()
        if now - t_launch > limit_s:
            os.killpg(proc.pid, signal.SIGKILL)
            killed = True
            break
        start = [t for t, s in lines if s.startswith("START")]
        if stacks_s is not None and stack_note is None and start and now - start[0] > stacks_s:
            try:
                stack_note = _gdb_summary(proc.pid)
            except Exception as e:  # noqa: BLE001
                stack_note = f"gdb failed: {e}"
        time.sleep(0.05)
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    _CHILD = None
    t_end = time.perf_counter()

    rec = {**spec, "env": env, "rc": proc.returncode}
    start = [t for t, s in lines if s.startswith("START")]
    for _t, s in lines:
        tag, _, payload = s.partition(" ")
        if tag == "RESULT":
            rec.update(json.loads(payload))
        elif tag == "DISPATCHED" and rec.get("dispatch_s") is None:
            rec["dispatch_s"] = json.loads(payload)
    rec.setdefault("stalls", [json.loads(s.partition(" ")[2]) for _, s in lines
                              if s.startswith("STALL")])
    if "error" not in rec:  # no RESULT: the process died or was killed
        since = t_end - start[0] if start else None
        rec["total_s"] = None
        stuck = [json.loads(s.partition(" ")[2]) for _, s in lines if s.startswith("STUCK")]
        if stuck:
            rec["stalls"] = [*rec["stalls"], [stuck[-1], "never returned"]]
        if killed:
            rec["error"] = f"killed by this CLI after {limit_s:.0f} s (hung)"
        else:
            fatal = next((line for line in err_lines if "Termination timeout" in line), None)
            if fatal:
                m = re.search(r"(Termination timeout for `[a-z\- ]+?) RendezvousKey.*?"
                              r"(of \d+ seconds exceeded).*?(only \d+ of them arrived)", fatal)
                msg = (f"{m[1]}` ... {m[2]} ... {m[3]}" if m
                       else fatal[fatal.find("Termination"):][:200])
            else:
                tail = [line for line in err_lines if line.strip() and not line.startswith("  ")]
                msg = tail[-1][:200] if tail else "no message"
            rec["error"] = f"process died (rc {proc.returncode}) after {since or 0:.1f} s: {msg}"
        rec["died_after_s"] = since
    if stack_note:
        rec["stacks"] = stack_note
    return rec


def _fmt_s(v) -> str:
    return "-" if v is None else (f"{v:.3f}" if v < 10 else f"{v:.1f}")


def _outcome(r: dict) -> str:
    if r.get("error") is None:
        return f"ok (max rel. err {r.get('rel_err', float('nan')):.1e})"
    extra = []
    if "failed_calls" in r:
        extra.append(f"{r['failed_calls']} of {r['n']} calls failed")
    if "next_call" in r:
        extra.append(f"next call {r['next_call']}")
    if r.get("meetings_left"):
        extra.append(f"{r['meetings_left']} meetings left")
    return r["error"] + (f" [{'; '.join(extra)}]" if extra else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", default="10,30,40,50,64,100",
                    help="comma-separated numbers of dispatches before the first read")
    ap.add_argument("--kinds", default="lax,p2p", help="comma-separated: lax, p2p")
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--size", type=int, default=1024, help="f32 values per device")
    ap.add_argument("--every", type=int, default=0,
                    help="read (block on) every k-th result while dispatching; 0: never")
    ap.add_argument("--timeout-ms", type=int, default=10_000,
                    help="the p2p psum's p2p_timeout_ms (library default 60000)")
    ap.add_argument("--xla-flags", default="", help="added to XLA_FLAGS")
    ap.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="set in the worker's environment (e.g. PJRT_NPROC=16)")
    ap.add_argument("--reps", type=int, default=1, help="runs of each case")
    ap.add_argument("--case-timeout", type=float, default=100.0,
                    help="hard limit (s) on one case's subprocess, compile included")
    ap.add_argument("--stacks", type=float, default=None, metavar="S",
                    help="attach gdb S seconds into the dispatches and count the threads")
    ap.add_argument("--json", default=None, help="append the records to this JSON-lines file")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.worker:
        worker(json.loads(a.worker))
        return 0

    signal.signal(signal.SIGTERM, _kill_child)
    signal.signal(signal.SIGINT, _kill_child)
    env = dict(kv.split("=", 1) for kv in a.env)
    kinds = [k.strip() for k in a.kinds.split(",") if k.strip()]
    if any(k not in ("lax", "p2p") for k in kinds):
        ap.error(f"--kinds must be lax and/or p2p, got {a.kinds!r}")
    ns = [int(v) for v in a.n.split(",") if v.strip()]
    from models import machine

    print(machine.first_line())
    print(f"{a.devices} CPU devices, {a.size} f32 per device, read every "
          f"{a.every or 'never'}, p2p_timeout_ms={a.timeout_ms}, XLA_FLAGS+={a.xla_flags!r}, "
          f"env={env}", flush=True)
    print("| program | n | dispatch s | total s | stalled dispatches (index: s) | outcome |\n"
          "|---|---|---|---|---|---|", flush=True)
    records = []
    for kind in kinds:
        for n in ns:
            for _ in range(a.reps):
                spec = {"kind": kind, "n": n, "devices": a.devices, "size": a.size,
                        "every": a.every, "timeout_ms": a.timeout_ms, "xla_flags": a.xla_flags}
                r = run_case(spec, env, a.case_timeout, a.stacks)
                records.append(r)
                stalls = ", ".join(f"{i}: {s}" for i, s in r["stalls"]) or "-"
                print(f"| {kind} | {n} | {_fmt_s(r.get('dispatch_s'))} | "
                      f"{_fmt_s(r.get('total_s'))} | {stalls} | {_outcome(r)} |", flush=True)
                if r.get("stacks"):
                    print(f"|   | | | | | threads at {a.stacks:g} s: {r['stacks']} |", flush=True)
    if a.json:
        with open(a.json, "a") as fh:
            for r in records:
                fh.write(json.dumps(r) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
