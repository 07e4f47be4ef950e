"""The expert-parallel all-to-all in one process: N CPU devices, no link between them.

Times one call of a bf16 ``(tokens, hidden)`` all-to-all per rank (tiled over the tokens, what
an MoE dispatch sends), the strategies interleaved in one run:

* ``lax``              ``lax.all_to_all`` (XLA:CPU's in-process collective)
* ``exact-p2p``        the rows as they are over the in-process exchange (``bits=None,
  transport="p2p"``)
* ``int8`` / ``fp8``   ``fc.all_to_all`` over the in-process exchange (``transport="p2p"``)
* ``int8-xla``         the codes through ``lax.all_to_all``
* ``ragged exact`` / ``ragged int8``  ``fc.ragged_all_to_all`` of the same rows (XLA:CPU has no
  ragged-all-to-all: both run over the exchange)
* ``auto``             ``fc.all_to_all`` with the library's default (``min_bytes="auto"``)

In one process the ranks share memory: there is no link for the codec to save, so the quantized
rows cost their codec passes on top of the copies. The figure shows what a quantized dispatch
costs where bandwidth is free, and which path ``auto`` takes. Prints the table and writes
``--out`` (JSON). Re-run (~2 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.all_to_all_inproc \\
        --out docs/results/all_to_all_inproc.json
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

KIB, MIB = 1024, 1024 * 1024
SIZES = (64 * KIB, 1 * MIB, 4 * MIB)
STRATEGIES = ("lax", "exact-p2p", "int8", "fp8", "int8-xla", "ragged exact", "ragged int8", "auto")
HIDDEN = 4096
MODULE = "benchmarks.collectives.all_to_all_inproc"


def _ops(n):
    import jax.numpy as jnp
    from jax import lax

    import jax_flashcomm as fc
    from jax_flashcomm.transport import exchange

    def dispatch(**kw):
        return lambda v: fc.all_to_all(v, "x", 0, 0, tiled=True, **kw)

    def ragged(**kw):
        def op(v):
            offsets = exchange.uniform_offsets(n, v.shape[0] // n, lax.axis_index("x"))
            return fc.ragged_all_to_all(v, jnp.zeros_like(v), *offsets, "x", **kw)
        return op

    return {"lax": lambda v: lax.all_to_all(v, "x", 0, 0, tiled=True),
            "exact-p2p": dispatch(bits=None, transport="p2p"),
            "int8": dispatch(bits=8, min_bytes=0, transport="p2p"),
            "fp8": dispatch(format="fp8", min_bytes=0, transport="p2p"),
            "int8-xla": dispatch(bits=8, min_bytes=0, transport="xla"),
            "ragged exact": ragged(bits=None),
            "ragged int8": ragged(bits=8, min_bytes=0),
            "auto": dispatch()}


def run(n: int, reps: int, max_bytes: int) -> dict:
    """The table's rows (module docstring) on ``n`` CPU devices of this process."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc
    from benchmarks.shared.timing import median_seconds

    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    rows, chosen = [], {}
    for size in (s for s in SIZES if s <= max_bytes):
        tokens = max(n, size // (2 * HIDDEN) // n * n)
        x = jax.device_put(jax.random.normal(jax.random.key(0), (n * tokens, HIDDEN),
                                             jnp.bfloat16), NamedSharding(mesh, P("x")))
        calls = {}
        for name, op in _ops(n).items():
            with fc.record() as plans:
                f = jax.jit(jax.shard_map(op, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
                jax.block_until_ready(f(x))
            if name == "auto":
                chosen[size] = str(plans[0].path) + (f" over {plans[0].transport}"
                                                     if plans[0].transport else "")
            calls[name] = f
        seconds = {name: median_seconds(lambda f=f: f(x), reps) for name, f in calls.items()}
        rows.append({"bytes_per_rank": size, "seconds": seconds, "auto_took": chosen[size],
                     "vs_lax": {k: seconds["lax"] / v for k, v in seconds.items()}})
    return {"devices": n, "hidden": HIDDEN, "rows": rows}


def markdown(result: dict) -> str:
    lines = [f"{'bytes/rank':>10}  " + "  ".join(f"{k:>16}" for k in STRATEGIES)
             + "  auto took"]
    for row in result["rows"]:
        cells = [f"{row['seconds'][k] * 1e3:7.2f} ms {row['vs_lax'][k]:4.2f}x"
                 for k in STRATEGIES]
        lines.append(f"{row['bytes_per_rank']:>10}  " + "  ".join(f"{c:>16}" for c in cells)
                     + f"  {row['auto_took']}")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--max-bytes", type=int, default=4 * MIB)
    ap.add_argument("--out", type=Path, help="write the result as JSON here")
    args = ap.parse_args(argv)
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={args.devices}")
    from benchmarks.shared.results import cpu_cores, save_result

    result = run(args.devices, args.reps, args.max_bytes)
    result["cpu"] = cpu_cores()
    result["command"] = f"python -m {MODULE}" + (f" --out {args.out}" if args.out else "")
    print(f"{args.devices} CPU devices in one process, bf16 (tokens, {HIDDEN}) all-to-all per "
          f"rank; one call's median and speedup over lax.all_to_all, {result['cpu']}")
    print(markdown(result))
    save_result(args.out, result, markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
