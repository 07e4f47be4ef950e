"""The expert-parallel all-to-all between processes on a PCIe-class emulated link.

N processes (one CPU device each, gloo) in a private network namespace whose loopback ``tc
tbf`` limits to ``--rate`` (default 400 Mbit/s: ~16x slower than the codec, the ratio of PCIe to
a GPU codec, as benchmarks/collectives/allreduce_speed.py), and the shared-memory transport
paced as one bus of the same rate (``jax_flashcomm.transport.shm.set_link_rate``). Each row is
the dispatch of a bf16 ``(tokens, hidden)`` operand per rank, ``tiled`` over the tokens (what
an MoE layer sends), timed in one run with the strategies interleaved:

* ``lax``          ``lax.all_to_all`` (gloo over the limited loopback): the baseline
* ``lax f32``      the same of the operand cast to f32: twice the bytes, for comparison
* ``bf16-shm``     the exact rows over the shared-memory exchange (the same bytes as lax)
* ``int8-shm``     ``fc.all_to_all(bits=8)`` over shared memory
* ``fp8-shm``      ``fc.all_to_all(format="fp8")`` over shared memory
* ``int8-xla``     ``fc.all_to_all(bits=8, transport="xla")``: the codes over gloo
* ``ragged int8-shm`` / ``ragged bf16-shm``  ``fc.ragged_all_to_all`` of the same rows (even
  split), quantized and exact (XLA:CPU has no ragged-all-to-all for a lax row)

Each program chains ``--chain`` all-to-alls; a time is one call's, the median over ``--reps``.
``wire/bf16`` is the bytes each rank sends per token against bf16's (the codec's record). Prints
the table, writes ``--out`` (JSON). Needs root (network namespaces). Re-run (~4 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.all_to_all_shm --out docs/results/all_to_all_shm.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.shared.netns import available, run_workers, worker_init, write_result
from benchmarks.shared.results import cpu_cores, save_result
from benchmarks.shared.timing import interleaved_rows

KIB, MIB = 1024, 1024 * 1024
SIZES = (64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
STRATEGIES = ("lax", "lax f32", "bf16-shm", "int8-shm", "fp8-shm", "int8-xla", "ragged bf16-shm",
              "ragged int8-shm")
HIDDEN = 4096
RATE = "400mbit"
MODULE = "benchmarks.collectives.all_to_all_shm"


def _ops(n):
    import jax.numpy as jnp
    from jax import lax

    import jax_flashcomm as fc
    from jax_flashcomm.transport import exchange

    def quantized(**kw):
        return lambda v: fc.all_to_all(v, "x", 0, 0, tiled=True, min_bytes=0, **kw)

    def exact_rows(v):
        rank = lax.axis_index("x")
        return exchange.exchange(v, jnp.zeros_like(v),
                                 *exchange.uniform_offsets(n, v.shape[0] // n, rank), ("x",),
                                 60_000)

    def ragged(**kw):
        def op(v):
            rank = lax.axis_index("x")
            return fc.ragged_all_to_all(v, jnp.zeros_like(v),
                                        *exchange.uniform_offsets(n, v.shape[0] // n, rank),
                                        "x", **kw)
        return op

    return {"lax": lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
            "lax f32": lambda v: lax.all_to_all(v.astype(jnp.float32), "x", 0, 0, tiled=True),
            "bf16-shm": exact_rows,
            "int8-shm": quantized(bits=8, transport="p2p"),
            "fp8-shm": quantized(format="fp8", transport="p2p"),
            "int8-xla": quantized(bits=8, transport="xla"),
            "ragged bf16-shm": ragged(bits=None),
            "ragged int8-shm": ragged(bits=8, min_bytes=0)}


def _wire_ratio(name):
    from jax_flashcomm.codec import GroupFormat

    if "int8" in name:
        per = GroupFormat("int", 8, 128, 0, 0).wire_bytes_per_element()
    elif "fp8" in name:
        per = GroupFormat("fp8", 8, 128, 0, 0).wire_bytes_per_element()
    elif "f32" in name:
        return 2.0
    else:
        return 1.0
    extra = 1.0 / HIDDEN if name.startswith("ragged") else 0.0  # the received-row flag byte
    return per / 2.0 + extra / 2.0


def _worker(args) -> None:
    pid, n = worker_init()
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.transport import shm

    reason = shm.setup()
    if reason is not None:
        raise SystemExit(f"the shared-memory transport cannot run: {reason}")
    shm.set_link_rate(args.rate_bytes)
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    ops = _ops(n)

    def program(op):
        def body(v):
            v = v[0]
            for _ in range(args.chain):
                v = op(v).astype(v.dtype)
            return v[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    sharding = jax.sharding.NamedSharding(mesh, P("x"))
    sizes = [s for s in SIZES if s <= args.max_bytes]
    compiled = {}
    for size in sizes:
        tokens = max(n, size // (2 * HIDDEN) // n * n)
        local = np.random.default_rng(pid).standard_normal((1, tokens, HIDDEN))
        x = jax.make_array_from_process_local_data(sharding, local.astype(jnp.bfloat16),
                                                   (n, tokens, HIDDEN))
        for name, op in ops.items():
            compiled[size, name] = (program(op), x)
            jax.block_until_ready(compiled[size, name][0](x))
    rows = interleaved_rows(compiled, sizes, ops, args.reps, args.chain)
    write_result({"procs": n, "rows": rows})
    jax.distributed.shutdown()


def markdown(result: dict) -> str:
    head = f"{'bytes/rank':>10}  " + "  ".join(f"{k:>17}" for k in STRATEGIES)
    lines = [head, f"{'wire/bf16':>10}  " + "  ".join(f"{_wire_ratio(k):>17.3f}"
                                                       for k in STRATEGIES)]
    for row in result["rows"]:
        cells = [f"{row['seconds'][k] * 1e3:8.2f} ms {row['vs_lax'][k]:4.2f}x"
                 for k in STRATEGIES]
        lines.append(f"{row['bytes_per_rank']:>10}  " + "  ".join(f"{c:>17}" for c in cells))
    lines += ["", "speedup over the bf16 rows over shared memory (bf16 bytes on the same bus)",
              f"{'bytes/rank':>10}  "
              + "  ".join(f"{k:>17}" for k in STRATEGIES)]
    for row in result["rows"]:
        base = row["seconds"]["bf16-shm"]
        lines.append(f"{row['bytes_per_rank']:>10}  " + "  ".join(
            f"{base / row['seconds'][k]:>16.2f}x" for k in STRATEGIES))
    return "\n".join(lines)


def _rate_bytes(rate: str) -> float:
    units = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale / 8
    raise ValueError(f"--rate must end in kbit, mbit or gbit, got {rate!r}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--chain", type=int, default=2)
    ap.add_argument("--rate", default=RATE, help="the emulated link (tc tbf rate)")
    ap.add_argument("--max-bytes", type=int, default=16 * MIB)
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rate-bytes", type=float, default=0.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    reason = available()
    if reason:
        print(f"all_to_all_shm: cannot run here: {reason}", file=sys.stderr)
        return 2
    rate = _rate_bytes(args.rate)
    results = run_workers(MODULE, args.procs, rate=args.rate, burst="16kb", latency="2s",
                          mtu=1500, timeout=1800,
                          args=["--worker", "--reps", args.reps, "--chain", args.chain,
                                "--max-bytes", args.max_bytes, "--rate-bytes", rate])
    command = f"python -m {MODULE}" + (f" --out {args.out}" if args.out else "")
    result = dict(results[0], rate=args.rate, hidden=HIDDEN, cpu=cpu_cores(), command=command)
    print(f"{args.procs} processes, bf16 (tokens, {HIDDEN}) all-to-all per rank on a "
          f"{args.rate} emulated link; one call's median and speedup over lax.all_to_all "
          f"(gloo), {result['cpu']}")
    print(markdown(result))
    save_result(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
