"""One process of tests/transport/test_shm_all_to_all.py: ONE CPU device, gloo,
jax.distributed; the all-to-alls over the p2p transport between the processes (the exchange over
shared memory, FFI target ``flashcomm_shm_exchange``).

argv: coordinator port, process id, number of processes, scenario (``a2a``):

* fc.all_to_all at int8 and fp8 with transport="p2p" is bit-identical to transport="xla" (gloo's
  all-to-all), and the exact setting to lax.all_to_all;
* fc.ragged_all_to_all, exact, equals the NumPy reference of an uneven send matrix (a rank that
  sends nothing, a rank that receives nothing); at int8 the received rows are the decoded codes
  of the rows sent (codec.dequantize(codec.quantize(row)) in the NumPy layout) and the other
  rows keep output's values.

Prints ``PASS`` at the end; a failed check is an AssertionError (nonzero exit).
"""

import os
import sys

from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

set_cpu_devices(1)
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

port, pid, nproc = (int(a) for a in sys.argv[1:4])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                           initialization_timeout=60)

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import codec  # noqa: E402

mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
ROWS = NamedSharding(mesh, P("x"))


def global_of(local):
    local = np.asarray(local)
    return jax.make_array_from_process_local_data(ROWS, local[None], (nproc, *local.shape))


def run(body, *locals_):
    def wrapped(*rows):
        return tuple(o[None] for o in body(*(r[0] for r in rows)))
    f = jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=(P("x"),) * len(locals_),
                              out_specs=P("x")))
    return [np.asarray(o.addressable_shards[0].data)[0] for o in f(*map(global_of, locals_))]


rng = np.random.default_rng(pid)
x = rng.standard_normal((nproc * 3, 200)).astype(np.float32)
for opts in (dict(bits=8), dict(format="fp8")):
    cfg = fc.CommConfig(min_bytes=0, **opts)
    a, b, e, r = run(lambda v: (fc.all_to_all(v, "x", 0, 0, tiled=True, config=cfg,
                                              transport="p2p"),
                                fc.all_to_all(v, "x", 0, 0, tiled=True, config=cfg,
                                              transport="xla"),
                                fc.all_to_all(v, "x", 0, 0, tiled=True, bits=None),
                                lax.all_to_all(v, "x", 0, 0, tiled=True)), x)
    assert a.tobytes() == b.tobytes(), f"{opts}: p2p != xla"
    assert e.tobytes() == r.tobytes(), "exact != lax.all_to_all"
    assert 0 < np.max(np.abs(a - r)) < 0.2, opts

# uneven sends: rank 1 sends nothing, every rank sends nothing to the last rank
sends = np.array([[(i + j) % 3 + (j == 0) for j in range(nproc)] for i in range(nproc)])
sends[1] = 0
sends[:, -1] = 0
rows_in, rows_out = 6, 12
inoff = np.concatenate([[0], np.cumsum(sends[pid])[:-1]]).astype(np.int32)
outoff = np.array([sends[:pid, j].sum() for j in range(nproc)], np.int32)
meta = [inoff, sends[pid].astype(np.int32), outoff, sends[:, pid].astype(np.int32)]
all_x = [np.random.default_rng(r).standard_normal((rows_in, 2, 100)).astype(np.float32)
         for r in range(nproc)]
out = np.full((rows_out, 2, 100), -3.0, np.float32)


def reference(rows_of):
    ref = out.copy()
    for i in range(nproc):
        i_off = np.concatenate([[0], np.cumsum(sends[i])[:-1]])
        n = sends[i, pid]
        at = sends[:i, pid].sum()
        ref[at:at + n] = rows_of(i)[i_off[pid]:i_off[pid] + n]
    return ref


def decoded(i):
    flat = jnp.asarray(all_x[i].reshape(rows_in, 200))
    padded = jnp.pad(flat, ((0, 0), (0, 56)))
    p = fc.plan("ragged_all_to_all", (), padded.shape, padded.dtype, 2,
                fc.CommConfig(8, min_bytes=0))
    q = codec.quantize(padded, bits=8, group_size=128, rotation=p.rotation, spikes=p.ag_spikes)
    return np.asarray(codec.dequantize(q))[:, :200].reshape(rows_in, 2, 100)


exact, quant = run(lambda v, o, a, b, c, d: (
    fc.ragged_all_to_all(v, o, a, b, c, d, "x", bits=None),
    fc.ragged_all_to_all(v, o, a, b, c, d, "x", bits=8, min_bytes=0)), all_x[pid], out, *meta)
assert exact.tobytes() == reference(lambda i: all_x[i]).tobytes(), "ragged exact != NumPy"
assert quant.tobytes() == reference(decoded).tobytes(), "ragged int8 != decoded codes"
print(f"[{pid}] checked all_to_all and ragged_all_to_all over shared memory", flush=True)
print("PASS", flush=True)
jax.distributed.shutdown()
