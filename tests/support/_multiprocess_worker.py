"""One process of tests/transport/test_multiprocess.py: 2 CPU devices, gloo, jax.distributed.

argv: coordinator port, process id, number of processes. Prints ``PASS <json>`` on success.
"""

import json
import sys

from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

set_cpu_devices(2)  # before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

port, pid, nproc = (int(a) for a in sys.argv[1:4])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import codec  # noqa: E402
from jax_flashcomm import allreduce  # noqa: E402
from jax_flashcomm import CommConfig  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)
ndev = jax.device_count()
mesh = jax.make_mesh((nproc, ndev // nproc), ("a", "b"), devices=jax.devices(),
                     axis_types=(jax.sharding.AxisType.Explicit,) * 2)
sharding = NamedSharding(mesh, P(("a", "b")))
shape = (3, 130)
rng = np.random.default_rng(0)
full = rng.standard_normal((ndev, *shape)).astype(np.float32)  # same on every process
local_rows = [i for i, d in enumerate(mesh.devices.reshape(-1)) if d.process_index == pid]
x = jax.make_array_from_process_local_data(sharding, full[local_rows], full.shape)
config = CommConfig(bits=8, rs_bits=4, ag_bits=8, min_bytes=0)
report = {}

for axes in (("a", "b"), ("a",)):
    def body(v):
        v = v[0]
        y = fc.psum(v, axes, config=config)
        y2, p1, p2 = allreduce.two_step(v, axes, config)
        rows = (y, fc.psum(v, axes, bits=None), lax.psum(v, axes), y2,
                codec.error_bound(p1), codec.error_bound(p2))
        return tuple(r[None] for r in rows)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")),
                              out_specs=(P(("a", "b")),) * 6))
    outs = [np.asarray(multihost_utils.process_allgather(o, tiled=True)) for o in f(x)]
    y, y_exact, ref, y2, b1, b2 = outs
    grid = lambda a: a.reshape(nproc, ndev // nproc, *shape)  # noqa: E731
    red = tuple(("a", "b").index(a) for a in axes)
    summed = lambda a: np.broadcast_to(  # noqa: E731
        grid(a).sum(axis=red, keepdims=True), grid(a).shape).reshape(a.shape)
    true = summed(full.astype(np.float64))
    b1s = summed(b1.astype(np.float64))
    n = int(np.prod([grid(y).shape[i] for i in red]))
    bound = b1s + b2 + n * EPS32 * (summed(np.abs(full).astype(np.float64)) + b1s)
    err = np.abs(y - true)
    assert np.array_equal(y_exact, ref), "exact setting differs from lax.psum"
    assert np.array_equal(y, y2)
    assert np.all(err <= bound), float(np.max(err - bound))
    g = grid(y)
    for i in red:  # identical on every rank of the reduction group, across processes
        assert np.array_equal(g, np.broadcast_to(np.take(g, [0], axis=i), g.shape))
    report["+".join(axes)] = {"max_err": float(err.max()), "max_bound": float(bound.max())}

print("PASS", json.dumps(report), flush=True)
jax.distributed.shutdown()
