"""Quantized all_gather: the ring (what ``jax_flashcomm.all_gather`` runs) against the one-shot
gather it replaced and ``lax.all_gather`` (docs/reliability.md, "Memory" -> "Speed").

8 virtual CPU devices, one ``(size,)`` operand per device, gathered along axis 0, tiled, at
``--bits`` (8 by default: ``spikes="auto"`` keeps none), every dtype. The one-shot gather is
``xla.decode_gathered(xla.gather_payloads(p))`` (``jax_flashcomm.transport.xla``): one
``lax.all_gather`` of every rank's packed payload, then one decode of all N (the code before the
ring). Each program is compiled and called once, then the three are called in turn ``--reps``
times; the median of each is printed.

    .venv/bin/python -m benchmarks.collectives.all_gather_ring               # 16 MiB per device
    .venv/bin/python -m benchmarks.collectives.all_gather_ring --mib 4 --reps 5 \\
        --out docs/results/all_gather_ring.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from benchmarks.shared.results import write_page  # noqa: E402
import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import allreduce  # noqa: E402
from jax_flashcomm.transport import xla  # noqa: E402
from models import machine  # noqa: E402

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def programs(mesh, config):
    """name -> jit(shard_map) of one per-device gather along axis 0, tiled."""
    axes = ("i",)

    def one_shot(v):
        v = allreduce.vary(v, axes, config)
        plan = fc.plan("all_gather", axes, v.shape, v.dtype, lax.axis_size("i"), config,
                       record=False)
        p = fc.codec.quantize(v, bits=plan.ag_bits, group_size=plan.group_size,
                              backend=plan.backend, rotation=plan.rotation,
                              spikes=plan.ag_spikes)
        return xla.decode_gathered(xla.gather_payloads(p, axes), 0, True, plan)

    bodies = {
        "one-shot": one_shot,
        "ring": lambda v: fc.all_gather(v, "i", axis=0, tiled=True, config=config),
        "lax.all_gather": lambda v: lax.all_gather(v, "i", axis=0, tiled=True),
    }
    return {name: jax.jit(jax.shard_map(lambda x, b=body: b(x[0])[None], mesh=mesh,
                                        in_specs=P("i"), out_specs=P("i")))
            for name, body in bodies.items()}


def measure(mesh, dtype, size, config, reps):
    x = jax.device_put(jax.random.normal(jax.random.key(0), (8, size), dtype),
                       NamedSharding(mesh, P("i")))
    progs = programs(mesh, config)
    outs = {name: jax.block_until_ready(f(x)) for name, f in progs.items()}  # compile + warm-up
    assert all(o.shape == (8, 8 * size) for o in outs.values())
    times = {name: [] for name in progs}
    for rep in range(reps):
        for name, f in progs.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(x))
            times[name].append(time.perf_counter() - t0)
        print(f"  {jnp.dtype(dtype).name}: rep {rep + 1}/{reps}", end="\r", file=sys.stderr)
    print(file=sys.stderr)
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=float, default=16.0, help="MiB per device (default 16)")
    parser.add_argument("--bits", type=int, default=8)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--dtypes", default="float32,bfloat16,float16")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    print(machine.first_line())
    mesh = jax.make_mesh((8,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    config = fc.CommConfig(bits=args.bits, min_bytes=0, rotation=0)  # the measured base format
    rows = []
    print(f"all_gather of {args.mib:g} MiB per device over 8 devices, axis 0, tiled, "
          f"{args.bits} bits; median of {args.reps} calls in turn (seconds)")
    print(f"{'dtype':10} {'one-shot':>10} {'ring':>10} {'lax':>10}  ring/one-shot  ring/lax")
    for name in args.dtypes.split(","):
        dtype = DTYPES[name]
        size = int(args.mib * 2**20) // jnp.dtype(dtype).itemsize
        t = measure(mesh, dtype, size, config, args.reps)
        rows.append({"dtype": name, "elements_per_device": size, **t})
        print(f"{name:10} {t['one-shot']:10.3f} {t['ring']:10.3f} {t['lax.all_gather']:10.3f}"
              f"  {t['ring'] / t['one-shot']:13.2f}  {t['ring'] / t['lax.all_gather']:8.2f}")
    if args.out:
        record = {"machine": machine.describe(), "mib_per_device": args.mib, "bits": args.bits,
                  "reps": args.reps, "seconds": rows,
                  "command": ".venv/bin/python -m benchmarks.collectives.all_gather_ring "
                             + " ".join(argv if argv is not None else sys.argv[1:])}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=1)
        write_page(args.out, {**record, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
