# long file: the measuring command: collectives, codec, link and mesh, each a function of its own
"""Measure this machine's tuning table: ``python -m jax_flashcomm.tune``.

In one process on ``max(--devices)`` CPU devices, for each axis size of ``--devices``: the time
of ``psum`` (f32 and bf16), ``psum_scatter`` and ``all_gather`` (f32) per size of ``--sizes``
(bytes per rank), by each candidate of the automatic choice (``lax``, ``quantized/p2p``,
``quantized/xla``) at each ``--bits``, per call of 8 chained in one program (as a model's are); the
codec's three passes with every CPU build (the
fastest is recorded and used from then on); and the in-process link (a ``ppermute`` at two
sizes). The table goes to the user's cache (:func:`jax_flashcomm.costs.table_path`) unless
``--out`` names a file, and the cost model's predictions are printed beside the measurements
(:func:`model_check`). A few minutes on 2 cores; ``--quick``: one axis size, four sizes.

    python -m jax_flashcomm.tune [--devices 2,3,4] [--sizes 4096,...] [--bits 8,4] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys
import time

from jax_flashcomm._progress import progress
from jax_flashcomm import costs

KIB, MIB = 1024, 1024 * 1024
SIZES = (4 * KIB, 32 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
QUICK_SIZES = (4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB)
DEVICES = (2, 3, 4)
QUICK_DEVICES = (3,)
BITS = (8, 4)
#: (op, dtype) pairs measured.
OPS = (("psum", "float32"), ("psum", "bfloat16"), ("psum_scatter", "float32"),
       ("all_gather", "float32"))
#: Calls of a collective per timed program: the table holds the time of one call inside a
#: program (as in a model), not of a program launch.
CALLS_PER_PROGRAM = 8
#: The model check's bar (issue: within 25% of the measured table).
TOLERANCE = 0.25


def _median_s(fn, x, reps: int, budget_s: float = 2.0) -> float:
    """Median seconds of up to ``reps`` calls (fewer once ``budget_s`` has passed, after 3;
    across processes exactly ``reps``: every process must run the same programs)."""
    import jax

    jax.block_until_ready(fn(x))
    times, start = [], time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
        if (time.perf_counter() - start > budget_s and len(times) >= 3
                and jax.process_count() == 1):
            break
    return statistics.median(times)


def _candidate_fn(op: str, candidate: str, bits, mesh, axis: str = "i",
                  calls: int = 8):
    """A jitted shard_map running ``op`` by ``candidate`` ``calls`` times, chained, on a
    ``(n, m)`` operand."""
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm import allreduce, scatter_gather
    from jax_flashcomm.config import CommConfig

    if candidate == "exact/p2p":  # the exact all-reduce over the p2p transport
        if op != "psum":
            raise ValueError(f"exact/p2p is an all-reduce; {op} has no exact p2p path")
        cfg = CommConfig(bits=None, transport="p2p", backend="ffi")
        body = lambda v: allreduce.psum(v, axis, config=cfg)  # noqa: E731
    elif candidate == "lax":
        body = {"psum": lambda v: lax.psum(v, axis),
                "psum_scatter": lambda v: lax.psum_scatter(v, axis, tiled=True),
                "all_gather": lambda v: lax.all_gather(v, axis, tiled=True)}[op]
    else:
        cfg = CommConfig(bits=bits[0] or bits[1], rs_bits=bits[0], ag_bits=bits[1],
                         min_bytes=0, transport=candidate.split("/")[1], backend="ffi")
        body = {"psum": lambda v: allreduce.psum(v, axis, config=cfg),
                "psum_scatter": lambda v: scatter_gather.psum_scatter(v, axis, tiled=True,
                                                                      config=cfg),
                "all_gather": lambda v: scatter_gather.all_gather(v, axis, tiled=True,
                                                                  config=cfg)}[op]
    def chained(v):
        # CALLS_PER_PROGRAM calls in one program, each depending on the one before through a
        # scalar (x * 0.0 is not folded for floats): the cost of a call inside a model's
        # program, without the launch of a program per call
        def step(v, _):
            out = body(v)
            return v + out.reshape(-1)[0] * 0.0, None
        return lax.scan(step, v[0], None, length=calls)[0][None]

    return jax.jit(jax.shard_map(chained, mesh=mesh, in_specs=P(axis), out_specs=P(axis)))


def _phase_bits(op: str, b: int):
    return {"psum": (b, b), "psum_scatter": (b, None), "all_gather": (None, b)}[op]


def measure_mesh(mesh, axis: str, sizes, bits, reps: int, *, ops=OPS, layout: str,
                 transports=("p2p", "xla"), on_step=None, calls: int | None = None,
                 rounds: int = 1, exact_p2p: bool = False) -> list:
    """Measure every candidate of ``ops`` on ``mesh``'s ``axis`` (one process or several: the
    operand is built from a callback; across processes, process 0's times are every process's,
    so that all make the same choice).

    Args:
      mesh: the mesh; ``axis``: its axis the collectives run over.
      sizes: bytes per rank; ``bits``: the quantized candidates' bits.
      reps: timed programs per candidate (each of :data:`CALLS_PER_PROGRAM` calls).
      ops: ``(op, dtype)`` pairs; ``layout``: the rows' layout.
      transports: the quantized candidates' transports.
      on_step: called with a label after each candidate.
      calls: calls per timed program (default :data:`CALLS_PER_PROGRAM`, chained); 1: each
        call a program of its own, with the host's pause between calls (as a decode step's
        collectives have their compute between them).
      rounds: the candidates measured in turn this many times per size; each keeps its
        fastest round (noise only adds time).
      exact_p2p: also the exact all-reduce over the p2p transport (``exact/p2p``, psum only:
        the devices of this process, or processes whose shared-memory transport is set up).

    Returns:
      The :class:`~jax_flashcomm.costs.Measurement` rows.
    """
    import jax
    import numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    n, k = mesh.shape[axis], calls or CALLS_PER_PROGRAM
    rows = []
    for op, dtype in ops:
        for size in sizes:
            m = max(size // np.dtype(dtype).itemsize, n)
            m -= m % n
            host = np.random.default_rng(0).standard_normal((n, m)).astype(dtype)
            x = jax.make_array_from_callback((n, m), NamedSharding(mesh, P(axis)),
                                             lambda idx, host=host: host[idx])
            cands = [("lax", None)]
            if exact_p2p and op == "psum":
                cands.append(("exact/p2p", None))
            cands += [(f"quantized/{t}", _phase_bits(op, b)) for t in transports for b in bits]
            fns = [_candidate_fn(op, cand, b, mesh, axis, k) for cand, b in cands]
            best = [math.inf] * len(cands)
            for _ in range(rounds):
                for i, fn in enumerate(fns):
                    best[i] = min(best[i], _median_s(fn, x, reps) / k)
            for (cand, b), seconds in zip(cands, best):
                rows.append(costs.Measurement(op, layout, n, dtype,
                                               m * np.dtype(dtype).itemsize, cand, b, seconds))
                if on_step is not None:
                    on_step(f"N={n} {op} {dtype} {size} B {cand}")
            del x
    if jax.process_count() > 1:
        times = multihost_utils.broadcast_one_to_all(np.array([r.seconds for r in rows]))
        rows = [dataclasses.replace(r, seconds=float(t)) for r, t in zip(rows, times)]
    return rows


def measure_collectives(devices, sizes, bits, reps, start, step, total, p2p: bool):
    """The in-process :class:`~jax_flashcomm.costs.Measurement` rows of every axis size."""
    import jax

    def on_step(label):
        step[0] += 1
        progress(step[0], total, start, what=label)

    rows = []
    for n in devices:
        mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                             axis_types=(jax.sharding.AxisType.Explicit,))
        rows += measure_mesh(mesh, "i", sizes, bits, reps, layout="in-process",
                             transports=("p2p", "xla") if p2p else ("xla",), on_step=on_step,
                             exact_p2p=p2p)
    return rows


#: The collectives' two default formats (config.auto_rotation / auto_spikes): 8 bits with the
#: Hadamard rotation, and at most 6 bits with one spike per group (here 4).
ROTATED_FORMAT = {"bits": 8, "rotation": 1, "spikes": 0}
SPIKED_FORMAT = {"bits": 4, "rotation": 0, "spikes": 1}


def measure_codec(reps: int, devices) -> dict:
    """The CPU build for the all-reduce's three passes (8 bits, 4 MiB of bf16, each build): the
    loader's default unless another is at least 5% faster. With it, per axis size ``n``: the
    values/s of each pass with ``n`` ranks running it at once, in the default 8-bit format
    (under ``"spiked"``, 4 bits with a spike per group) on 256 Ki f32 values per rank, less the
    fixed cost of a call (one group per chunk); each per call of 8 chained in one program."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm import codec
    from jax_flashcomm.codec import kernels

    x = jax.random.normal(jax.random.key(0), (2 * MIB,), jnp.bfloat16)
    q = jax.jit(lambda a: codec.quantize(a, bits=8, backend="ffi"))
    d = jax.jit(lambda p: codec.dequantize(p, backend="ffi"))
    f = jax.jit(lambda p: codec.dequantize_sum_quantize(p, backend="ffi"))
    chunked = codec.quantize(x, bits=8, num_chunks=4).split_groups(4)
    # the builds interleaved, 3 rounds, each pass's best median: the machine's noise (page
    # faults, other load) hits every build alike and a stray slow round drops out
    per_isa = {isa: {} for isa in codec.cpu_isas()}
    payload = q(x)
    for _ in range(3):
        for isa, best_t in per_isa.items():
            with codec.use_cpu_isa(isa):
                for name, fn, arg in (("q", q, x), ("f", f, chunked), ("d", d, payload)):
                    best_t[name] = min(best_t.get(name, math.inf), _median_s(fn, arg, reps))
    per_isa = {isa: sum(t.values()) for isa, t in per_isa.items()}
    best = kernels.default_isa()           # kept unless another build is 5% faster
    fastest = min(per_isa, key=per_isa.get)
    if per_isa[fastest] < 0.95 * per_isa[best]:
        best = fastest

    def per_call(n, m, fmt):
        """Seconds of one call of each pass inside a program, n ranks at once, in the format
        ``fmt`` (codec.quantize's bits, rotation and spikes)."""
        import dataclasses

        from jax import lax

        mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                             axis_types=(jax.sharding.AxisType.Explicit,))
        enc = lambda v: codec.quantize(v, **fmt, num_chunks=n, backend="ffi")  # noqa: E731

        def chain(pass_fn, carry_of):
            """CALLS_PER_PROGRAM calls of ``pass_fn``, each depending on the one before."""
            def body(v):
                def step(c, _):
                    return carry_of(c, pass_fn(c)), None
                return lax.scan(step, v, None, length=CALLS_PER_PROGRAM)[0]
            return jax.jit(jax.shard_map(
                lambda v: jax.tree.map(lambda a: a[None], body(jax.tree.map(lambda a: a[0], v))),
                mesh=mesh, in_specs=P("i"), out_specs=P("i")))

        touch = lambda p, out: dataclasses.replace(  # noqa: E731
            p, scale=p.scale + (out.reshape(-1)[0] * 0).astype(p.scale.dtype))
        v = jax.device_put(jax.random.normal(jax.random.key(1), (n, m), jnp.float32),
                           NamedSharding(mesh, P("i")))
        q = jax.jit(jax.shard_map(lambda a: jax.tree.map(lambda t: t[None], enc(a[0])),
                                  mesh=mesh, in_specs=P("i"), out_specs=P("i")))(v)
        fns = {"quantize": (chain(enc, lambda c, p: c + p.scale[0].astype(c.dtype) * 0), v),
               "dequantize_sum_quantize": (chain(
                   lambda p: codec.dequantize_sum_quantize(p.split_groups(n), backend="ffi"),
                   lambda p, out: touch(p, out.scale)), q),
               "dequantize": (chain(lambda p: codec.dequantize(p, backend="ffi"), touch), q)}
        return {k: _median_s(fn, arg, reps) / CALLS_PER_PROGRAM for k, (fn, arg) in fns.items()}

    def speed(n, fmt):
        small = per_call(n, 128 * n, fmt)
        t = per_call(n, 256 * KIB, fmt)
        return {"call_s": statistics.median(small.values()), "values_per_s": {
            k: 256 * KIB / max(v - small[k], 1e-9) for k, v in t.items()}}

    by_n = {}
    with codec.use_cpu_isa(best):
        for n in devices:
            by_n[str(n)] = speed(n, ROTATED_FORMAT)
            by_n[str(n)]["spiked"] = speed(n, SPIKED_FORMAT)
    return {"isa": best, "isa_seconds": per_isa, "by_n": by_n}


def measure_link(n: int, reps: int, p2p: bool) -> dict:
    """The in-process link from a ``ppermute`` ring step at 64 KiB and 4 MiB per rank (every
    rank sends its message at once: ``n`` messages cross the shared memory), and the p2p
    transport's latency from a one-group p2p all-gather; each per call of 8 chained in one
    program."""
    import jax
    import jax.numpy as jnp
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((n,), ("i",), devices=jax.devices()[:n],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    perm = [(i, (i + 1) % n) for i in range(n)]

    def chained(body):
        def run(v):
            return lax.scan(lambda c, _: (body(c), None), v, None, length=CALLS_PER_PROGRAM)[0]
        return jax.jit(jax.shard_map(run, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    fn = chained(lambda v: lax.ppermute(v, "i", perm))
    t = {}
    for size in (64 * KIB, 4 * MIB):
        x = jax.device_put(jnp.ones((n * size // 4,), jnp.float32), NamedSharding(mesh, P("i")))
        t[size] = _median_s(fn, x, reps) / CALLS_PER_PROGRAM
    rate = n * (4 * MIB - 64 * KIB) / max(t[4 * MIB] - t[64 * KIB], 1e-9)
    latency = max(0.0, t[64 * KIB] - n * 64 * KIB / rate)
    out = {"bytes_per_s": rate, "latency_s": latency, "n": n, "ppermute_s": t}
    if p2p:
        from jax_flashcomm.config import CommConfig
        from jax_flashcomm.scatter_gather import all_gather

        cfg = CommConfig(bits=8, min_bytes=0, transport="p2p", backend="ffi")
        g = chained(lambda v: v + all_gather(v, "i", tiled=True, config=cfg)[0] * 0.0)
        x = jax.device_put(jnp.ones((n * 128,), jnp.float32), NamedSharding(mesh, P("i")))
        out["p2p_latency_s"] = _median_s(g, x, reps) / CALLS_PER_PROGRAM
    return out


def model_check(table: costs.Table, min_bytes: int = 0) -> dict:
    """The cost model's prediction of every row of ``table`` at or above ``min_bytes``
    (its inputs: the table's codec and link entries, not its rows) and the largest error.

    Returns:
      ``{"rows": [{..., "predicted_s", "err"}], "max_abs_err", "within_tolerance"}``.
    """
    import numpy as np

    from jax_flashcomm import planner
    from jax_flashcomm.config import auto_spikes

    out = []
    cands = {c.name: c for c in planner.CANDIDATES}
    for r in table.rows:
        if r.nbytes < min_bytes or r.scope != "call":  # step rows hold a step's compute too
            continue
        # the rows were measured in the default formats: spikes where a phase has <= 6 bits
        spikes = max((auto_spikes(b) for b in (r.bits or ()) if b), default=0)
        call = planner.Call(op=r.op, nbytes=r.nbytes, itemsize=np.dtype(r.dtype).itemsize,
                              dtype=r.dtype, n=r.n, platform="cpu", layout=r.layout,
                              p2p_reason=None, bits=r.bits, spikes=spikes)
        pred = cands[r.candidate].model_s(call, planner.profile(call, table))
        out.append({**dataclasses.asdict(r), "predicted_s": pred, "err": pred / r.seconds - 1})
    worst = max((abs(r["err"]) for r in out), default=math.nan)
    return {"rows": out, "max_abs_err": worst, "within_tolerance": worst <= TOLERANCE,
            "min_bytes": min_bytes}


def _print_check(check: dict, min_bytes: int) -> None:
    """The cost model against the measured rows (:func:`model_check`), as a table."""
    print(f"\n{'N':>2} {'op':<13}{'dtype':<9}{'bytes':>9}  {'candidate':<14}{'bits':<9}"
          f"{'measured':>10}{'model':>10}{'error':>8}")
    for r in check["rows"]:
        print(f"{r['n']:>2} {r['op']:<13}{r['dtype']:<9}{r['nbytes']:>9}  {r['candidate']:<14}"
              f"{str(r['bits']):<9}{r['seconds'] * 1e3:>9.3f}m{r['predicted_s'] * 1e3:>9.3f}m"
              f"{r['err']:>+8.0%}")
    print(f"cost model vs measured (rows >= {min_bytes} B): largest |error| "
          f"{check['max_abs_err']:.0%}, within {TOLERANCE:.0%}: {check['within_tolerance']}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m jax_flashcomm.tune", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default=None, help="axis sizes, comma-separated (default "
                    f"{','.join(map(str, DEVICES))}; --quick: {QUICK_DEVICES[0]})")
    ap.add_argument("--sizes", default=None, help="bytes per rank, comma-separated")
    ap.add_argument("--bits", default=",".join(map(str, BITS)))
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None, help="write the table here (default: the cache)")
    ap.add_argument("--check-min-bytes", type=int, default=256 * KIB,
                    help="the model check covers rows of at least this many bytes")
    args = ap.parse_args(argv)

    def ints(text, what):
        try:
            values = tuple(int(v) for v in text.split(","))
        except ValueError:
            ap.error(f"--{what}: not a comma-separated list of ints: {text!r}")
        if not values or min(values) < (2 if what == "devices" else 1):
            ap.error(f"--{what}: values must be >= {2 if what == 'devices' else 1}")
        return values

    devices = ints(args.devices, "devices") if args.devices else (
        QUICK_DEVICES if args.quick else DEVICES)
    sizes = ints(args.sizes, "sizes") if args.sizes else (QUICK_SIZES if args.quick else SIZES)
    bits = ints(args.bits, "bits")
    if any(not 2 <= b <= 8 for b in bits):
        ap.error("--bits: each must be in 2..8")
    if args.reps < 1:
        ap.error("--reps must be >= 1")
    try:      # before minutes of measuring: where the table goes
        costs.check_destination(args.out if args.out is not None
                                 else costs.cache_dir() / "tune.json")  # the cache's folder
    except ValueError as e:
        ap.error(f"--out {e}" if args.out is not None else
                 f"the cache ({costs.CACHE_ENV} or ~/.cache): {e}")

    import jax

    try:
        jax.config.update("jax_num_cpu_devices", max(devices))
    except RuntimeError as e:
        ap.error(f"run it in a fresh process (JAX has started: {e})")
    from jax_flashcomm.codec import kernels

    if not kernels.available("cpu"):
        print("jax_flashcomm.tune: the CPU kernels are not built: nothing to tune (the "
              "automatic choice uses the cost model)", file=sys.stderr)
        return 2
    p2p = jax.process_count() == 1
    key = costs.machine_key()
    print(f"tuning on {key['cpu']} ({key['cores']} cores), jax {key['jax']}, axis sizes "
          f"{list(devices)}, sizes {list(sizes)} B, bits {list(bits)}", flush=True)
    start = time.perf_counter()
    codec_info = measure_codec(args.reps, devices)
    print("codec builds (seconds of quantize + fused + dequantize, 4 MiB bf16): "
          + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in codec_info["isa_seconds"].items())
          + f"; fastest: {codec_info['isa']}", flush=True)
    from jax_flashcomm import codec

    with codec.use_cpu_isa(codec_info["isa"]):
        link = measure_link(devices[0], args.reps, p2p)
        per = len(OPS) * len(sizes) * (1 + len(bits) * (2 if p2p else 1))
        step = [0]
        rows = measure_collectives(devices, sizes, bits, args.reps, start, step,
                                   per * len(devices), p2p)
    table = costs.Table(key=key, rows=tuple(rows), codec=codec_info, link=link,
                         created=costs.now())
    path = costs.save(table, args.out)
    _print_check(model_check(table, args.check_min_bytes), args.check_min_bytes)
    print(f"wrote {path} ({time.perf_counter() - start:.0f} s)")
    return 0

