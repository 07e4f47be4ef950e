# long file: the one worker process of every shared-memory scenario (each a function)
"""One process of tests/transport/test_shm.py: ONE CPU device, gloo, jax.distributed; the
``p2p`` transport then runs between the processes over shared memory
(jax_flashcomm/transport/shm.py, FFI targets ``flashcomm_shm_*``). With
FLASHCOMM_TEST_PLATFORM=gpu (tests/gpu/test_gpu_shm.py) the processes share one GPU instead and
the transport is CUDA IPC (ffi/cuda/shm_handlers.cc); ``soak`` then compares with the same calls
made one at a time (no XLA collective runs between processes on one GPU).

argv: coordinator port, process id, number of processes, scenario:

* ``parity``: fc.psum / fc.psum_scatter / fc.all_gather (f32 and bf16; bits=8 and
  rs_bits=4/ag_bits=8; shapes that are and are not multiples of nproc*128) and their gradients
  (grad="quantized", so the backward collectives take the transport too) with transport="p2p"
  are bit-identical to transport="xla"; p2p.exact_all_reduce one-shot == two-shot == the f32
  rank-order sum (numpy), and == lax.psum with 2 processes. ``shm.setup()`` is None and no
  meeting is left in progress.
* ``soak``: 1000 calls of one jitted p2p psum dispatched without reading a result in between,
  every call's operand scaled differently; every result equals the xla transport's of the same
  operand, bit for bit.
* ``mismatch``: process 0 passes a (4, 256) operand, the others (8, 256), at the same call site:
  every process raises ("different shapes or options", or a timeout); a following good call
  works (on a GPU, or with FLASHCOMM_TEST_EXACT_GOOD_CALL=1: the exact all-reduce, against the
  f32 rank-order sum).
* ``killed``: the last process exits (os._exit) right before its first collective; the others'
  psum (p2p_timeout_ms=60000) must raise within BOUND_S seconds ("exited" / "timed out").
* ``killed_after_first``: the same, but the last process exits after one successful psum, right
  before the second.

Prints ``RAISED <seconds> <type>: <first line>`` where a call raises (as the scenario wants),
``PASS`` at the end; any failed check is an AssertionError (traceback, nonzero exit).
"""

import os
import sys
import time

from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

T0 = time.monotonic()
PLATFORM = os.environ.get("FLASHCOMM_TEST_PLATFORM", "cpu")  # "gpu": the processes share one
if PLATFORM == "cpu":
    set_cpu_devices(1)  # before jax is imported: one device per process
    os.environ["JAX_PLATFORMS"] = "cpu"
else:
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # several processes on one GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

port, pid, nproc = (int(a) for a in sys.argv[1:4])
scenario = sys.argv[4]
BOUND_S = 15.0  # "killed": the survivors must raise within this many seconds
EXACT_GOOD_CALL = PLATFORM != "cpu" or os.environ.get("FLASHCOMM_TEST_EXACT_GOOD_CALL") == "1"

if PLATFORM == "cpu":
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import dataclasses  # noqa: E402

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import CommConfig  # noqa: E402
from jax_flashcomm.transport import p2p, shm  # noqa: E402

assert jax.local_device_count() == 1 and jax.device_count() == nproc
assert jax.devices()[0].platform == PLATFORM, jax.devices()
mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
ROWS = NamedSharding(mesh, P("x"))
F32 = jnp.float32


def log(*args):
    print(f"[{pid} {time.monotonic() - T0:5.1f}s]", *args, flush=True)


def global_of(local: np.ndarray) -> jax.Array:
    """This process's operand as its row of an (nproc, *shape) array sharded over "x"."""
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(ROWS, local[None], (nproc, *local.shape))


def smap(body, n_in: int, n_out: int):
    """jit(shard_map(body)) over the (nproc,) mesh: every operand and result is one row per
    rank (the body sees and returns the rows without their leading 1)."""
    def wrapped(*rows):
        outs = body(*(r[0] for r in rows))
        return tuple(o[None] for o in outs)
    return jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=(P("x"),) * n_in,
                                 out_specs=(P("x"),) * n_out))


def local(out: jax.Array) -> np.ndarray:
    """This process's row of a result (reading it: raises the computation's error)."""
    shards = out.addressable_shards
    assert len(shards) == 1
    return np.asarray(shards[0].data)[0]


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


def assert_bits_equal(a: np.ndarray, b: np.ndarray, what: str):
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if bits(a) != bits(b):
        diff = np.abs(a.astype(np.float64) - b.astype(np.float64))
        raise AssertionError(f"{what}: not bit-identical ({int(np.sum(diff > 0))} of {a.size} "
                             f"differ, max |diff| {float(np.nanmax(diff)):.3g})")


def first_line(err: BaseException) -> str:
    text = str(err).strip()
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0][:300] if lines else repr(err)


# --- parity -----------------------------------------------------------------------------------

def parity():
    # long function: one scenario: every op over shared memory against the in-process results
    log("initialized")
    assert shm.setup() is None, shm.setup()
    rng = np.random.default_rng(1234)  # the same on every process: each knows every operand
    n = nproc
    shapes = {
        "a": (3, 130),          # 390 values: not a multiple of nproc*128
        "b": (16, 256),         # 4096 values
        "s1": (3 * n, 130),     # psum_scatter tiled over dim 0: chunks of 390 values
        "s2": (5, n, 40),       # psum_scatter tiled=False over dim 1
        "g2": (4, 256),         # all_gather tiled over dim 1
    }
    full = {k: rng.standard_normal((n, *s)).astype(np.float32) for k, s in shapes.items()}
    u_full = rng.standard_normal(shapes["a"]).astype(np.float32)  # the same on every rank
    w = {k: rng.standard_normal((n, *s)).astype(np.float32)
         for k, s in (("a", shapes["a"]), ("s1", (3, 130)), ("g", (n, 3, 130)))}
    dtypes = (jnp.float32, jnp.bfloat16)
    configs = {"bits8": CommConfig(bits=8, min_bytes=0, grad="quantized"),
               "rs4ag8": CommConfig(bits=8, rs_bits=4, ag_bits=8, min_bytes=0,
                                    grad="quantized")}
    names = ["psum a", "psum b", "psum_scatter s1", "psum_scatter s2", "all_gather a",
             "all_gather g2", "grad psum/a", "grad psum/w", "grad vary-psum/u",
             "grad psum_scatter/s1", "grad all_gather/a"]
    # operands: per dtype a, b, s1, s2, g2; then the f32 weights wa, ws, wg
    args = [global_of(full[k][pid].astype(dt)) for dt in dtypes for k in shapes]
    args += [global_of(w[k][pid]) for k in ("a", "s1", "g")]

    def ops_of(cfg, dt, a, b, s1, s2, g2, wa, ws, wg):
        u = jnp.asarray(u_full, dt)  # a constant: invariant over "x"
        outs = [
            fc.psum(a, "x", config=cfg),
            fc.psum(b, "x", config=cfg),
            fc.psum_scatter(s1, "x", scatter_dimension=0, tiled=True, config=cfg),
            fc.psum_scatter(s2, "x", scatter_dimension=1, tiled=False, config=cfg),
            fc.all_gather(a, "x", axis=0, tiled=False, config=cfg),
            fc.all_gather(g2, "x", axis=1, tiled=True, config=cfg),
        ]
        # gradients: d/da, d/dwa of sum(psum(a) * wa); d/du through the vary transpose (a
        # quantized psum of the cotangent, grad="quantized"); psum_scatter's transpose (a
        # quantized all_gather) and all_gather's (a quantized psum_scatter).
        ga, gw = jax.grad(lambda v, ww: jnp.sum(fc.psum(v, "x", config=cfg).astype(F32) * ww),
                          argnums=(0, 1))(a, wa)
        gu = jax.grad(lambda v: jnp.sum(fc.psum(v, "x", config=cfg).astype(F32) * wa))(u)
        gs = jax.grad(lambda v: jnp.sum(fc.psum_scatter(
            v, "x", scatter_dimension=0, tiled=True, config=cfg).astype(F32) * ws))(s1)
        gg = jax.grad(lambda v: jnp.sum(fc.all_gather(
            v, "x", axis=0, tiled=False, config=cfg).astype(F32) * wg))(a)
        return outs + [ga, gw, gu, gs, gg]

    combos = [(dt, cname) for dt in dtypes for cname in configs]
    results = {}
    for tr in ("xla", "p2p"):
        def body(*rows, tr=tr):
            weights = rows[-3:]
            outs = []
            for dt, cname in combos:
                per = rows[dtypes.index(dt) * len(shapes):][:len(shapes)]
                cfg = dataclasses.replace(configs[cname], transport=tr)
                outs += ops_of(cfg, dt, *per, *weights)
            return outs

        lowered = smap(body, len(args), len(combos) * len(names)).lower(*args)
        hlo = lowered.as_text()
        uses_shm = {t for t in shm.TARGETS if t in hlo}
        if tr == "p2p":  # the transport's collectives are shared-memory calls
            assert uses_shm == set(shm.TARGETS) - {"flashcomm_shm_psum"}, uses_shm
            # (JAX's own all_reduce stays: the transpose of the implicit pvary in psum(a) * w)
            xla_ops = [op for op in ("all_to_all", "all_gather", "reduce_scatter")
                       if f"stablehlo.{op}" in hlo]
            assert not xla_ops, f"the xla transport's collectives in the p2p program: {xla_ops}"
        else:
            assert not uses_shm, uses_shm
        compiled = lowered.compile()
        results[tr] = [local(o) for o in compiled(*args)]
        log(tr, "compiled and ran")
    checked = 0
    for i, (dt, cname) in enumerate(combos):
        for j, name in enumerate(names):
            k = i * len(names) + j
            x_out, p_out = results["xla"][k], results["p2p"][k]
            assert_bits_equal(p_out, x_out, f"{dt.__name__} {cname} {name}")
            assert np.all(np.isfinite(x_out.astype(np.float32))), name
            checked += 1
        # the quantized sum is near the true one (a sanity check of the reference itself)
        true = full["a"].astype(dt).astype(np.float64).sum(0)
        err = float(np.max(np.abs(results["p2p"][i * len(names)].astype(np.float64) - true)))
        assert err < 0.25 * n, (cname, err)
        log(dt.__name__, cname, "p2p == xla bitwise:", len(names), "results; psum err", err)

    # exact_all_reduce: one shot == two shots == the f32 rank-order sum (== lax.psum, n=2)
    ex = [full[k].astype(dt) for dt in dtypes for k in ("a", "b")]

    def exact_body(*vs):
        outs = []
        for v in vs:
            outs += [p2p.exact_all_reduce(v, ("x",), 10_000, two_shot=False),
                     p2p.exact_all_reduce(v, ("x",), 10_000, two_shot=True),
                     lax.psum(v, "x")]
        return outs

    f = smap(exact_body, len(ex), 3 * len(ex))
    outs = [local(o) for o in f(*(global_of(e[pid]) for e in ex))]
    for i, e in enumerate(ex):
        one, two, ref_lax = outs[3 * i: 3 * i + 3]
        acc = e[0].astype(np.float32)
        for r in range(1, n):
            acc = (acc + e[r].astype(np.float32)).astype(np.float32)
        ref = acc.astype(e.dtype)
        what = f"{e.dtype} exact {e.shape[1:]}"
        assert_bits_equal(one, two, what + " one-shot vs two-shot")
        assert_bits_equal(one, ref, what + " vs numpy f32 rank-order sum")
        lax_equal = bits(one) == bits(ref_lax)
        if n == 2:
            assert_bits_equal(one, ref_lax, what + " vs lax.psum")
        log(what, "one == two == numpy; lax.psum equal:", lax_equal)
        checked += 3
    # bits=None over p2p with operands the shared-memory sum does not take: lax.psum's answer
    ints = [full["a"].astype(dt) * 7 for dt in (np.int32, np.int8, np.uint8, np.int16)]
    ints.append(full["a"] > 0)
    g = smap(lambda *vs: tuple(fc.psum(v, "x", bits=None, transport="p2p") for v in vs)
             + tuple(lax.psum(v, "x") for v in vs), len(ints), 2 * len(ints))
    outs = [local(o) for o in g(*(global_of(v[pid]) for v in ints))]
    for v, got, want in zip(ints, outs[:len(ints)], outs[len(ints):]):
        assert_bits_equal(got, want, f"{v.dtype} bits=None p2p vs lax.psum")
    log("non-float bits=None over p2p == lax.psum:", len(ints), "dtypes")
    assert shm.meetings_in_progress() == 0, shm.meetings_in_progress()
    log("checked", checked, "segments", shm.segments())
    ring_parity()


def ring_parity():
    """The ring matmuls over shared memory (ring start / done steps) give the xla transport's
    bits: plain, bidirectional and quantized rings, values and gradients."""
    rng = np.random.default_rng(99)
    n, m, k, cols = nproc, 6, 32, 24
    xs = rng.standard_normal((n, m, k)).astype(np.float32)         # all_gather_matmul: x rows
    ws = rng.standard_normal((n, k, cols)).astype(np.float32)      # its column shard of w
    xr = rng.standard_normal((n, 2 * n * 3, k)).astype(np.float32)  # matmul_reduce_scatter
    wr = rng.standard_normal((n, k, cols)).astype(np.float32)
    settings = {"plain": dict(bits=None), "bidirectional": dict(bits=None, bidirectional=True),
                "quantized": dict(bits=8, min_bytes=0)}

    def body_for(transport, opts):
        bidir = opts.get("bidirectional", False)
        cfg = CommConfig(bits=opts["bits"], min_bytes=opts.get("min_bytes", "auto"),
                         transport=transport)

        def body(x, w, x2, w2):
            def loss(x, w, x2, w2):
                y = fc.all_gather_matmul(x, w, "x", bidirectional=bidir, config=cfg)
                z = fc.matmul_reduce_scatter(x2, w2, "x", bidirectional=bidir, config=cfg)
                return jnp.sum(y * y) + jnp.sum(jnp.sin(z)), (y, z)
            grads, (y, z) = jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, x2, w2)
            return (y, z) + grads
        return body

    checked = 0
    for name, opts in settings.items():
        outs = {}
        for transport in ("xla", "p2p"):
            f = smap(body_for(transport, opts), 4, 6)
            args = [global_of(a[pid]) for a in (xs, ws, xr, wr)]
            outs[transport] = [local(o) for o in f(*args)]
            if transport == "p2p":
                text = f.lower(*args).as_text()
                assert "flashcomm_shm_ring_start" in text, name
        for i, what in enumerate(("all_gather_matmul", "matmul_reduce_scatter", "d/dx",
                                  "d/dw", "d/dx2", "d/dw2")):
            assert_bits_equal(outs["p2p"][i], outs["xla"][i], f"ring {name} {what}")
            checked += 1
        log("ring", name, "p2p == xla bitwise (values and gradients)")
    from jax_flashcomm.transport import ring_steps
    assert ring_steps.steps_in_progress() == 0, ring_steps.steps_in_progress()
    log("ring checked", checked)


# --- soak -------------------------------------------------------------------------------------

def soak(calls: int = 1000):
    assert shm.setup() is None, shm.setup()
    rng = np.random.default_rng(7)
    full = rng.standard_normal((nproc, 8, 256)).astype(np.float32)
    x = global_of(full[pid])
    scales = [global_of(np.array([(i + 1) / 64.0], np.float32)) for i in range(calls)]

    def make(tr):
        cfg = CommConfig(bits=8, min_bytes=0, transport=tr)
        return smap(lambda v, s: (fc.psum(v * s[0], "x", config=cfg),), 2, 1)

    f_p2p, f_xla = make("p2p"), make("xla")
    jax.block_until_ready(f_p2p(x, scales[0]))  # compile, and one warm call
    refs = None
    if PLATFORM != "cpu":  # no XLA collective between processes sharing one GPU (NCCL)
        refs = [jax.block_until_ready(f_p2p(x, s))[0] for s in scales]  # one call at a time
    t0 = time.perf_counter()
    outs = [f_p2p(x, s)[0] for s in scales]
    dispatched = time.perf_counter() - t0
    jax.block_until_ready(outs)
    done = time.perf_counter() - t0
    log(f"dispatched {calls} calls in {dispatched:.3f} s, all done after {done:.3f} s")
    refs = refs or [f_xla(x, s)[0] for s in scales]
    bad = []
    for i, (o, r) in enumerate(zip(outs, refs)):
        if bits(local(o)) != bits(local(r)):
            bad.append(i)
    assert not bad, f"{len(bad)} of {calls} calls differ from the reference: {bad[:20]}"
    # and the calls' results differ from each other (a mispairing would show)
    assert bits(local(outs[0])) != bits(local(outs[1]))
    assert shm.meetings_in_progress() == 0, shm.meetings_in_progress()
    print(f"SOAK dispatch_s={dispatched:.3f} total_s={done:.3f}", flush=True)


# --- mismatch ---------------------------------------------------------------------------------

def mismatch():
    assert shm.setup() is None, shm.setup()
    cfg = CommConfig(bits=8, min_bytes=0, transport="p2p", p2p_timeout_ms=5000)
    rows = 4 if pid == 0 else 8
    x = global_of(np.full((rows, 256), pid + 1.0, np.float32))
    f = smap(lambda v: (fc.psum(v, "x", config=cfg),), 1, 1)  # one site, traced once each
    t0 = time.monotonic()
    try:
        y = local(f(x)[0])
    except Exception as err:  # noqa: BLE001 - whatever the runtime raises
        msg = first_line(err)
        print(f"RAISED {time.monotonic() - t0:.2f} {type(err).__name__}: {msg}", flush=True)
        full = " ".join(str(err).split())
        assert "different shapes or options" in full or "timed out" in full, full[:2000]
    else:
        raise AssertionError(f"the mismatched call returned {y.shape}")
    # one good call after it: the same shape everywhere, a fresh site on every process
    rng = np.random.default_rng(3)
    full = rng.standard_normal((nproc, 8, 256)).astype(np.float32)
    good = global_of(full[pid])
    if EXACT_GOOD_CALL:
        # No XLA collective runs between processes on one GPU: the exact all-reduce of the
        # transport, against the f32 rank-order sum.
        g = smap(lambda v: (p2p.exact_all_reduce(v, ("x",), 10_000),), 1, 1)
        y = local(g(good)[0])
        ref = full[0]
        for r in range(1, nproc):
            ref = (ref + full[r]).astype(np.float32)
        assert_bits_equal(y, ref, "good call after the mismatch")
        log("good call after the mismatch: == the f32 rank-order sum bitwise")
        assert shm.meetings_in_progress() == 0, shm.meetings_in_progress()
        return
    cfg_x = dataclasses.replace(cfg, transport="xla")
    g = smap(lambda v: (fc.psum(v, "x", config=cfg),), 1, 1)
    y = local(g(good)[0])
    ref = local(smap(lambda v: (fc.psum(v, "x", config=cfg_x),), 1, 1)(good)[0])
    assert_bits_equal(y, ref, "good call after the mismatch")
    log("good call after the mismatch: p2p == xla bitwise")
    assert shm.meetings_in_progress() == 0, shm.meetings_in_progress()


# --- killed -----------------------------------------------------------------------------------

def killed(after_first: bool):
    assert shm.setup() is None, shm.setup()
    cfg = CommConfig(bits=8, min_bytes=0, transport="p2p", p2p_timeout_ms=60_000)
    rng = np.random.default_rng(5)
    x = global_of(rng.standard_normal((nproc, 8, 256)).astype(np.float32)[pid])
    f = smap(lambda v: (fc.psum(v, "x", config=cfg),), 1, 1)
    compiled = f.lower(x).compile()  # traced and compiled: only the run is left
    if after_first:
        local(compiled(x)[0])
        print("FIRST_OK", flush=True)
    print("READY", flush=True)
    if pid == nproc - 1:
        time.sleep(0.5)  # let the survivors enter the call first
        print(f"EXITING {time.time():.3f}", flush=True)
        os._exit(3)
    t0 = time.monotonic()
    try:
        local(compiled(x)[0])
    except Exception as err:  # noqa: BLE001 - whatever the runtime raises
        elapsed = time.monotonic() - t0
        msg = first_line(err)
        print(f"RAISED {elapsed:.2f} {type(err).__name__}: {msg}", flush=True)
        full = " ".join(str(err).split())
        ok = ("exited" in full or "timed out" in full) and elapsed <= BOUND_S
        print("PASS" if ok else f"FAIL elapsed {elapsed:.2f} s: {full[:1000]}", flush=True)
        os._exit(0 if ok else 1)  # the coordinator's peer is gone: no distributed shutdown
    print(f"RETURNED {time.monotonic() - t0:.2f}", flush=True)  # must not happen
    os._exit(1)


if scenario == "parity":
    parity()
elif scenario == "ring_paced":
    # the emulated bus: each ring chunk holds it from its sender's start (the reservation's
    # end published beside the chunk, the receiver's move completing no earlier)
    from jax_flashcomm.transport import shm as shm_transport

    shm_transport.set_link_rate(20e6)
    ring_parity()
    shm_transport.set_link_rate(0.0)
elif scenario == "soak":
    soak()
elif scenario == "mismatch":
    mismatch()
elif scenario in ("killed", "killed_after_first"):
    killed(scenario == "killed_after_first")
else:
    raise SystemExit(f"unknown scenario {scenario!r}")
print("PASS", flush=True)
jax.distributed.shutdown()
