"""Relative RMS error of jax_flashcomm.psum (N=8, G=128) per bits, on Gaussian and on
heavy-tailed (outlier-channel) activations, against the exact f64 sum.

    rel_rms = sqrt(mean((y - s)^2)) / sqrt(mean(s^2)),   s = sum over the 8 ranks in f64

Data per rank: (tokens=256, hidden=4096) bf16.
* gaussian: N(0, 1).
* outlier channels: N(0, 1) with 8 of 4096 hidden channels scaled by 50 (the massive
  activation channels of LLMs); rows are tokens, so each 128-group of a token holds at most a
  few outliers, which widens that group's range.

Re-run: ``.venv/bin/python -m benchmarks.collectives.allreduce_error`` ->
docs/results/allreduce_error.{json,md}
"""

from __future__ import annotations

import json
import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_flashcomm as fc  # noqa: E402

from benchmarks.shared.results import RESULTS, write_page

N, TOKENS, HIDDEN = 8, 256, 4096
# spikes=0: the base format; the defaults (spikes="auto": 1 spike per group at <= 6 bits) are
# the "+ spike" rows.
SETTINGS = [dict(bits=8, spikes=0), dict(bits=6, spikes=0), dict(bits=6, spikes=1),
            dict(bits=4, spikes=0), dict(bits=4, spikes=1),
            dict(bits=8, rs_bits=4, ag_bits=8, spikes=0), dict(bits=3, spikes=0),
            dict(bits=3, spikes=1), dict(bits=2, spikes=0)]


def data(kind, rng):
    x = rng.standard_normal((N, TOKENS, HIDDEN)).astype(np.float32)
    if kind == "outlier_channels":
        channels = rng.choice(HIDDEN, size=8, replace=False)
        x[:, :, channels] *= 50.0
    return x.astype(jnp.bfloat16)


def main():
    mesh = jax.make_mesh((N,), ("i",))
    rng = np.random.default_rng(0)
    results = []
    for kind in ("gaussian", "outlier_channels"):
        xb = data(kind, rng)
        exact = xb.astype(np.float64).sum(axis=0)
        x = jax.device_put(jnp.asarray(xb), NamedSharding(mesh, P("i")))
        lax_out = jax.jit(jax.shard_map(lambda v: lax.psum(v[0], "i"), mesh=mesh,
                                        in_specs=P("i"), out_specs=P()))(x)
        denom = np.sqrt(np.mean(exact ** 2))
        rel = lambda y: float(np.sqrt(np.mean((np.asarray(y, np.float64) - exact) ** 2)) / denom)  # noqa: E731,E501
        results.append({"data": kind, "setting": "lax.psum (bf16)", "rel_rms": rel(lax_out)})
        for s in SETTINGS:
            f = jax.jit(jax.shard_map(lambda v, s=s: fc.psum(v[0], "i", min_bytes=0, **s),
                                      mesh=mesh, in_specs=P("i"), out_specs=P()))
            name = (f"int{s['bits']}" if "rs_bits" not in s
                    else f"rs int{s['rs_bits']} / ag int{s['ag_bits']}")
            name += " + 1 spike/group (default)" if s["spikes"] else ""
            results.append({"data": kind, "setting": name, "rel_rms": rel(f(x))})
    out = {"N": N, "group_size": 128, "shape_per_rank": [TOKENS, HIDDEN], "dtype": "bfloat16",
           "results": results,
           "command": ".venv/bin/python -m benchmarks.collectives.allreduce_error"}
    (RESULTS / "allreduce_error.json").write_text(json.dumps(out, indent=1))
    write_page(RESULTS / "allreduce_error.json", out)
    print("| setting | gaussian | outlier channels |\n|---|---|---|")
    for s in dict.fromkeys(r["setting"] for r in results):
        g, o = (next(r["rel_rms"] for r in results if r["setting"] == s and r["data"] == k)
                for k in ("gaussian", "outlier_channels"))
        print(f"| {s} | {g:.2e} | {o:.2e} |")


if __name__ == "__main__":
    main()
