"""The p2p transport against lax.psum and the xla transport, in one process on 8 CPU devices.

Per message size (bf16 bytes per rank, 256 KiB .. 64 MiB) it times, in the same run:

* ``lax.psum``                     XLA's exact all-reduce (in-process memory copies)
* ``xla intN``                     jax_flashcomm.psum, transport="xla" (all_to_all + all_gather)
* ``p2p intN``                     jax_flashcomm.psum, transport="p2p" (one fused FFI call)

at 8 and 4 bits (G = 128, spikes = 0, min_bytes = 0), and prints every time against
``lax.psum`` (speedup > 1: faster) and p2p against xla. The programs run one after another
(each call blocked on before the next), the median of ``--reps`` calls after a warm-up.

Re-run (~5 min on 2 cores)::

    .venv/bin/python -m benchmarks.collectives.allreduce_p2p          # -> docs/results/transport.*
    .venv/bin/python -m benchmarks.collectives.allreduce_p2p --quick         # 2 sizes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.timing import time_calls


KIB, MIB = 1024, 1024 * 1024
SIZES = [256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB]
QUICK_SIZES = [1 * MIB, 16 * MIB]
BITS = (8, 4)
DEVICES = 8


def _methods(mesh):
    import jax
    from jax import lax
    from jax.sharding import PartitionSpec as P

    import jax_flashcomm as fc

    def sm(body):
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))

    methods = {"lax.psum": sm(lambda v: lax.psum(v[0], "i"))}
    for transport in ("xla", "p2p"):
        for b in BITS:
            cfg = fc.CommConfig(bits=b, spikes=0, rotation=0, min_bytes=0, transport=transport)
            methods[f"{transport} int{b}"] = sm(lambda v, cfg=cfg: fc.psum(v[0], "i",
                                                                           config=cfg))
    return methods


def run(sizes, reps, budget_s):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((DEVICES,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))
    methods = _methods(mesh)
    rows = []
    for size in sizes:
        x = jax.random.normal(jax.random.key(0), (DEVICES, size // 2), jnp.bfloat16)
        x = jax.device_put(x, NamedSharding(mesh, P("i")))
        row = {"bytes": size, "times_s": {}, "reps": {}}
        for name, fn in methods.items():
            r = reps if size < 16 * MIB else max(3, reps // 2)
            row["times_s"][name], row["reps"][name] = time_calls(fn, x, r, budget_s)
        t = row["times_s"]
        row["vs_lax_psum"] = {k: t["lax.psum"] / v for k, v in t.items() if k != "lax.psum"}
        row["p2p_vs_xla"] = {f"int{b}": t[f"xla int{b}"] / t[f"p2p int{b}"] for b in BITS}
        print(f"  {size / MIB:6.2f} MiB  " + "  ".join(
            f"{k}={v * 1e3:8.1f}ms" for k, v in t.items()), flush=True)
        print("            vs lax.psum: " + "  ".join(
            f"{k}={v:.2f}x" for k, v in row["vs_lax_psum"].items()) + "   p2p vs xla: " +
            "  ".join(f"{k}={v:.2f}x" for k, v in row["p2p_vs_xla"].items()), flush=True)
        rows.append(row)
        del x
    return rows


def markdown(rows) -> str:
    """The table of docs/transport.md and docs/allreduce.md from the rows of one run."""
    names = list(rows[0]["times_s"])
    head = ("| message (bf16/rank) | " + " | ".join(names) + " | " +
            " | ".join(f"{k} vs lax.psum" for k in names[1:]) + " |")
    lines = [head, "|" + "---|" * (1 + 2 * len(names) - 1)]
    for row in rows:
        t = row["times_s"]
        lines.append(f"| {row['bytes'] / MIB:g} MiB | " +
                     " | ".join(f"{t[k] * 1e3:.1f} ms" for k in names) + " | " +
                     " | ".join(f"**{row['vs_lax_psum'][k]:.2f}x**" for k in names[1:]) + " |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", type=int, nargs="*")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--budget", type=float, default=30.0, help="seconds per timing loop")
    ap.add_argument("--out", default=str(RESULTS / "transport.json"))
    args = ap.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + f" --xla_force_host_platform_device_count={DEVICES}").strip()
    from jax_flashcomm import codec
    from models import machine

    print(machine.first_line(), flush=True)
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    data = {"machine": machine.describe(), "cpu_isa": codec.cpu_isa(), "devices": DEVICES,
            "sizes": sizes, "bits": list(BITS), "group_size": 128, "dtype": "bfloat16",
            "spikes": 0, "command": ".venv/bin/python -m benchmarks.collectives.allreduce_p2p " +
            " ".join(sys.argv[1:]), "rows": run(sizes, args.reps, args.budget)}
    Path(args.out).write_text(json.dumps(data, indent=1))
    print(markdown(data["rows"]))
    write_page(args.out, data, tables=markdown(data["rows"]))
    print("wrote", args.out, "and its page")


if __name__ == "__main__":
    main()
