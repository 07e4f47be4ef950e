"""The all-reduce between processes of one host: shared memory against XLA's gloo.

Launches N processes (``jax.distributed``, one CPU device each, gloo collectives; by default 2,
each pinned to one core of a 2-core machine) and times, in one run with the strategies
interleaved, a bf16 psum of each size per rank:

* ``lax``            ``lax.psum``: XLA's all-reduce over gloo (it moves bf16 as f32)
* ``exact-shm``      the exact sum over shared memory (``transport.p2p.exact_all_reduce``;
                     one-shot below ``TWO_SHOT_BYTES``, two-shot from it)
* ``int8-shm`` / ``int4-shm``  the quantized two-step all-reduce over shared memory
                     (``transport="p2p"``)
* ``int8-xla``       the same codec around XLA's all_to_all / all_gather (gloo)
* ``int8-shm plain`` / ``int4-shm plain``  as ``int8-shm`` / ``int4-shm`` without the accuracy
                     defaults (``rotation=0, spikes=0``): the plain codec's cost

Each program chains ``--chain`` calls (the next call's operand is the last sum, scaled back),
so a time is one call's; the figure is the median over ``--reps`` programs. Prints the table and
writes ``--out`` (JSON), speedups against ``lax`` measured in the same run.

Re-run (~3 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.allreduce_shm --out docs/results/shm_allreduce.json
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from benchmarks.shared.results import REPO, cpu_cores, save_result
from benchmarks.shared.timing import interleaved_rows

KIB, MIB = 1024, 1024 * 1024
SIZES = (2 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
STRATEGIES = ("lax", "exact-shm", "int8-shm", "int4-shm", "int8-xla", "int8-shm plain",
              "int4-shm plain")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(args) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=1")
    from benchmarks.shared.runtime import join_shm_job

    join_shm_job(args.rank, args.procs, args.port, pin=args.pin)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc
    from jax_flashcomm.transport import p2p

    n = args.procs
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    ops = {
        "lax": lambda v: lax.psum(v, "x"),
        "exact-shm": lambda v: p2p.exact_all_reduce(v, ("x",), 60_000),
        "int8-shm": lambda v: fc.psum(v, "x", config=fc.CommConfig(8, min_bytes=0,
                                                                  transport="p2p")),
        "int4-shm": lambda v: fc.psum(v, "x", config=fc.CommConfig(4, min_bytes=0,
                                                                  transport="p2p")),
        "int8-xla": lambda v: fc.psum(v, "x", config=fc.CommConfig(8, min_bytes=0,
                                                                  transport="xla")),
        # The codec without its accuracy defaults (8 bits: Hadamard rotation; 4 bits: a spike
        # per group): what the codec passes themselves cost over shared memory.
        "int8-shm plain": lambda v: fc.psum(v, "x", config=fc.CommConfig(
            8, min_bytes=0, transport="p2p", rotation=0, spikes=0)),
        "int4-shm plain": lambda v: fc.psum(v, "x", config=fc.CommConfig(
            4, min_bytes=0, transport="p2p", rotation=0, spikes=0)),
    }
    sizes = [s for s in SIZES if s <= args.max_bytes]

    def program(op):
        def body(v):
            v = v[0]
            for _ in range(args.chain):
                v = (op(v) * (1.0 / n)).astype(v.dtype)
            return v[None]
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

    sharding = jax.sharding.NamedSharding(mesh, P("x"))
    compiled = {}
    for size in sizes:
        local = np.random.default_rng(args.rank).standard_normal((1, size // 2))
        x = jax.make_array_from_process_local_data(sharding, local.astype(jnp.bfloat16),
                                                   (n, size // 2))
        for name, op in ops.items():
            compiled[size, name] = (program(op), x)
            jax.block_until_ready(compiled[size, name][0](x))  # compile and warm up
    rows = interleaved_rows(compiled, sizes, ops, args.reps, args.chain)
    if args.rank == 0:
        print("RESULT " + json.dumps({"procs": n, "pinned": args.pin, "chain": args.chain,
                                      "reps": args.reps, "rows": rows}), flush=True)
    jax.distributed.shutdown()


def markdown(result: dict) -> str:
    lines = [f"{'bytes/rank':>10}  " + "  ".join(f"{k:>16}" for k in STRATEGIES)]
    for row in result["rows"]:
        cells = [f"{row['seconds'][k] * 1e3:8.3f} ms {row['vs_lax'][k]:4.1f}x"
                 for k in STRATEGIES]
        lines.append(f"{row['bytes_per_rank']:>10}  " + "  ".join(f"{c:>16}" for c in cells))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--chain", type=int, default=4)
    ap.add_argument("--max-bytes", type=int, default=64 * MIB)
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="do not pin each process to a core of its own")
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        _worker(args)
        return 0
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "benchmarks.collectives.allreduce_shm", "--worker",
           "--port", str(port), "--procs", str(args.procs), "--reps", str(args.reps),
           "--chain", str(args.chain),
           "--max-bytes", str(args.max_bytes)] + ([] if args.pin else ["--no-pin"])
    procs = [subprocess.Popen(cmd + ["--rank", str(r)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(args.procs)]
    try:
        outputs = [p.communicate(timeout=1800)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    if any(p.returncode for p in procs):
        for r, out in enumerate(outputs):
            print(f"--- process {r} (exit {procs[r].returncode})\n{out[-3000:]}", file=sys.stderr)
        return 1
    line = next(ln for ln in outputs[0].splitlines() if ln.startswith("RESULT "))
    result = json.loads(line[len("RESULT "):])
    result["cpu"] = cpu_cores()
    print(f"{args.procs} processes{' (pinned)' if args.pin else ''}, bf16 psum, one call's "
          f"median time and speedup over lax.psum (gloo), {result['cpu']}")
    print(markdown(result))
    save_result(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
