"""One process of the cross-process protocol fuzzer (tests/transport/test_shm_fuzz.py): ONE
CPU device, jax.distributed; the p2p transport between the processes over shared memory.

argv: coordinator port, process id, number of processes, seed (-1: the fixed ``orders``
scenario below). Environment: FLASHCOMM_FUZZ_CASES (cases, default 50).

``orders``: programs F and G (an int8 psum and an exact all-reduce each, the same shapes) traced
F, G on even processes and G, F on odd ones, process 0 first tracing a program whose second
call raises; then every process runs F, G, F: each result is checked as below. Last, every
process but the last calls an exact all-reduce that the last never calls: their errors must
name its rank.

Every case builds random programs from one random description that every process draws alike
(1-3 collectives each: the exact all-reduce, and int8 psum / psum_scatter / all_gather over
p2p; shapes and axes drawn too), then each process:

* traces and compiles them in its own random order;
* sometimes first traces a program that makes p2p calls and then raises (a bad option): a
  failed trace must use up nothing;
* runs them in one shared random order, each one to three times, every operand scaled by its
  program and run (4**(3k + e), independent normal draws) so that a call paired with another
  program's or run's gives a sum far outside the tolerance.

Exact results must equal the f32 rank-order sum bit for bit; int8 results must lie within 4%
of the largest |reference| (they stay under 1%; a sum with another draw in it is off by the
order of the values). In about
one case in five the processes disagree: one process runs a program whose collectives differ
(another collective, or another shape) with a 600 ms timeout; then some process must raise,
and a process whose every call met a peer's call of the same site and shapes (the changed
program shares some calls, and XLA ran them while its extra call waited) must have the right
numbers.
Those cases run after the others, over 64 mesh axis names of their own: a call that one
process made and another never will leaves its site and its channel misaligned between them,
and later calls there fail (an error, not a wrong number) until the job restarts.

Prints one ``CASE`` line per case and ``FUZZ <counts>`` and ``PASS`` at the end; a wrong number
is an AssertionError.
"""

import os
import sys
import time

from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

T0 = time.monotonic()
set_cpu_devices(1)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

port, pid, nproc, seed = (int(a) for a in sys.argv[1:5])
CASES = int(os.environ.get("FLASHCOMM_FUZZ_CASES", "50"))

jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import CommConfig  # noqa: E402
from jax_flashcomm.transport import p2p, shm  # noqa: E402

OPS = ("exact", "psum", "psum_scatter", "all_gather")
TOL = 0.04  # int8 (group 128): the error stays well under it; a mispairing lands far over it


def log(*args):
    print(f"[{pid} {time.monotonic() - T0:6.1f}s]", *args, flush=True)


def draw_program(rng, k: int) -> dict:
    ops = [str(rng.choice(OPS)) for _ in range(int(rng.integers(1, 4)))]
    rows = nproc * int(rng.choice([1, 2, 4]))
    cols = int(rng.choice([128, 256]))
    return {"k": k, "ops": ops, "shape": (rows, cols)}


def make(program: dict, axis: str, timeout_ms: int, fail_after_first: bool = False):
    """jit(shard_map) of the program over a (nproc,) mesh named ``axis``: one row per rank."""
    mesh = jax.make_mesh((nproc,), (axis,), axis_types=(jax.sharding.AxisType.Explicit,))
    cfg = CommConfig(bits=8, min_bytes=0, transport="p2p", p2p_timeout_ms=timeout_ms)

    def body(row):
        v = row[0]
        outs = []
        for i, op in enumerate(program["ops"]):
            if fail_after_first and i == 1:
                fc.psum(v, axis, config=cfg, bits=1)  # raises ValueError at trace time
            if op == "exact":
                outs.append(p2p.exact_all_reduce(v, (axis,), timeout_ms))
            elif op == "psum":
                outs.append(fc.psum(v, axis, config=cfg))
            elif op == "psum_scatter":
                outs.append(fc.psum_scatter(v, axis, scatter_dimension=0, tiled=True,
                                            config=cfg))
            else:
                outs.append(fc.all_gather(v, axis, axis=0, tiled=True, config=cfg))
        return tuple(o[None] for o in outs)

    rows = NamedSharding(mesh, P(axis))
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axis),
                              out_specs=(P(axis),) * len(program["ops"])))
    return f, rows


def operands(program: dict, run: int, case: int) -> np.ndarray:
    """Every rank's operand of this program's run (each process draws all of them alike)."""
    rng = np.random.default_rng((abs(seed), case, program["k"], run))
    scale = np.float32(4.0 ** (3 * program["k"] + run))
    x = rng.standard_normal(size=(nproc, *program["shape"])).astype(np.float32)
    return x * scale


def references(program: dict, xs: np.ndarray) -> list[np.ndarray]:
    total = xs[0].copy()
    for r in range(1, nproc):
        total = (total + xs[r]).astype(np.float32)
    rows = program["shape"][0] // nproc
    out = []
    for op in program["ops"]:
        if op in ("exact", "psum"):
            out.append(total)
        elif op == "psum_scatter":
            out.append(total[pid * rows:(pid + 1) * rows])
        else:
            out.append(np.concatenate(list(xs), axis=0))
    return out


def check(program, ys, refs, what):
    for op, y, ref in zip(program["ops"], ys, refs):
        y = np.asarray(y.addressable_shards[0].data)[0]
        assert y.shape == ref.shape, (what, op, y.shape, ref.shape)
        if op == "exact":
            assert y.tobytes() == ref.tobytes(), (
                f"{what}: exact all-reduce differs from the f32 rank-order sum "
                f"(max |diff| {float(np.max(np.abs(y - ref))):.4g})")
        else:
            err = float(np.max(np.abs(y - ref))) / float(np.max(np.abs(ref)))
            assert err <= TOL, f"{what}: {op} off by {err:.3f} of max |ref| (a wrong pairing)"


def disagrees(case: int) -> bool:
    """Whether the processes disagree in ``case`` (every process draws it alike)."""
    return bool(np.random.default_rng((seed, case, 0)).random() < 0.2)


def run_case(case: int, counts: dict):
    shared = np.random.default_rng((seed, case))
    mine = np.random.default_rng((seed, case, 1000 + pid))
    disagree = disagrees(case)
    axis = f"d{case % 64}" if disagree else "x"  # 64 names: the member table holds 256
    timeout_ms = 600 if disagree else 20_000
    programs = [draw_program(shared, k) for k in range(int(shared.integers(1, 4)))]
    if disagree:  # one process runs programs[0] changed: another collective or another shape
        victim = int(shared.integers(nproc))
        changed = dict(programs[0])
        if shared.random() < 0.5:
            changed["ops"] = list(changed["ops"]) + ["psum"]
            changed["ops"][0] = {"exact": "psum"}.get(changed["ops"][0], "exact")
        else:
            changed["shape"] = (changed["shape"][0] + nproc, changed["shape"][1])
        if pid == victim:
            programs = [changed]
        else:
            programs = programs[:1]
    if not disagree and mine.random() < 0.4:  # a trace that makes p2p calls and then raises
        bad = dict(programs[0], ops=list(programs[0]["ops"]) + ["psum"])
        f, rows = make(bad, axis, timeout_ms, fail_after_first=True)
        x = jax.ShapeDtypeStruct((nproc, *bad["shape"]), np.float32, sharding=rows)
        try:
            f.lower(x)
        except ValueError:
            counts["failed traces"] += 1
        else:
            raise AssertionError("the bad program traced")
    compiled = {}
    for k in mine.permutation(len(programs)):
        prog = programs[int(k)]
        f, rows = make(prog, axis, timeout_ms)
        x = jax.ShapeDtypeStruct((nproc, *prog["shape"]), np.float32, sharding=rows)
        compiled[int(k)] = (f.lower(x).compile(), rows)
    if disagree:
        fn, rows = compiled[0]
        xs = operands(programs[0], 0, case)
        x = jax.make_array_from_process_local_data(rows, xs[pid][None])
        t0 = time.monotonic()
        try:
            ys = fn(x)
            for y in ys:
                np.asarray(y.addressable_shards[0].data)
        except Exception as err:  # noqa: BLE001 - the runtime's error type
            text = " ".join(str(err).split())
            # "failed (its own error ...)": a peer's record of an earlier disagreeing case's
            # call at this site and sequence number (the misalignment the docstring names)
            assert ("timed out" in text or "different shapes" in text
                    or "another call" in text or "its own error says why" in text), text[:1500]
            counts["disagreements raised"] += 1
            log(f"CASE {case} disagreement raised in {time.monotonic() - t0:.2f} s: "
                f"{text[text.find('shared-memory'):][:400]}")
            return
        # Every call of this process met a peer's call of the same site and shapes (the
        # changed program shares those, and XLA ran them while the extra call waited): its
        # numbers must be right; the test checks that some other process raised.
        check(programs[0], ys, references(programs[0], xs), f"case {case} (disagreeing)")
        counts["disagreements returned right"] += 1
        log(f"CASE {case} disagreement returned right in {time.monotonic() - t0:.2f} s")
    schedule = [(int(k), e) for k in range(len(programs))
                for e in range(int(shared.integers(1, 4)))]
    for i in shared.permutation(len(schedule)):
        k, e = schedule[int(i)]
        fn, rows = compiled[k]
        xs = operands(programs[k], e, case)
        x = jax.make_array_from_process_local_data(rows, xs[pid][None])
        check(programs[k], fn(x), references(programs[k], xs), f"case {case} program {k} run {e}")
        counts["calls checked"] += len(programs[k]["ops"])
    counts["agreeing cases"] += 1
    log(f"CASE {case} ok: {len(programs)} programs, {len(schedule)} runs")


def orders():
    programs = [{"k": k, "ops": ["psum", "exact"], "shape": (2 * nproc, 256)} for k in (0, 1)]
    if pid == 0:
        f, rows = make(dict(programs[0], ops=["psum", "psum"]), "x", 20_000,
                       fail_after_first=True)
        try:
            f.lower(jax.ShapeDtypeStruct((nproc, 2 * nproc, 256), np.float32, sharding=rows))
        except ValueError as err:
            log(f"the failed trace raised: {str(err).splitlines()[0][:120]}")
        else:
            raise AssertionError("the bad program traced")
    order = [0, 1] if pid % 2 == 0 else [1, 0]
    compiled = {}
    for k in order:
        f, rows = make(programs[k], "x", 20_000)
        x = jax.ShapeDtypeStruct((nproc, 2 * nproc, 256), np.float32, sharding=rows)
        compiled[k] = (f.lower(x).compile(), rows)
    for run, k in enumerate([0, 1, 0]):
        fn, rows = compiled[k]
        xs = operands(programs[k], run, 0)
        x = jax.make_array_from_process_local_data(rows, xs[pid][None])
        check(programs[k], fn(x), references(programs[k], xs), f"program {'FG'[k]} run {run}")
    log(f"ORDERS traced {'then '.join('FG'[k] + ' ' for k in order)}and ran F, G, F: "
        "every result right")
    # the last process never calls this one: the others' error names its rank
    if pid != nproc - 1:
        prog = {"k": 0, "ops": ["exact"], "shape": (nproc, 128)}
        f, rows = make(prog, "never", 500)
        x = jax.make_array_from_process_local_data(rows, operands(prog, 0, 0)[pid][None])
        try:
            np.asarray(f(x)[0].addressable_shards[0].data)
        except Exception as err:  # noqa: BLE001 - the runtime's error type
            text = " ".join(str(err).split())
            want = f"rank {nproc - 1} of the group never joined"
            assert want in text, text[:1500]
            log(f"NEVER_JOINED {text[text.find('timed out'):][:300]}")
        else:
            raise AssertionError("a call whose peer never came returned")


assert shm.setup() is None, shm.setup()
if seed < 0:
    orders()
    print("PASS", flush=True)
    sys.exit(0)
counts = {"agreeing cases": 0, "disagreements raised": 0, "disagreements returned right": 0,
          "failed traces": 0, "calls checked": 0}
# The disagreeing cases run last: a call that one process made and another never will leaves
# its channel's tickets misaligned between them (docs/transport.md), so later calls on that
# channel fail (an error, never a wrong number) until the job restarts.
for case in sorted(range(CASES), key=disagrees):
    run_case(case, counts)
assert shm.meetings_in_progress() == 0, shm.meetings_in_progress()
log("FUZZ " + ", ".join(f"{k} {v}" for k, v in counts.items()))
print("PASS", flush=True)
