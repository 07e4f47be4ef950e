"""One process of tests/gpu/test_gpu_shm.py: the transport between processes on CUDA (CUDA IPC
over the shared-memory meeting point, ffi/cuda/shm_handlers.cc), or the CPU reference.

argv: mode, number of processes N, output folder, and for ``gpu`` / ``cpu`` the coordinator
port and the process id.

* ``reference``: ONE process with N CPU devices computes fc.psum / fc.psum_scatter /
  fc.all_gather (f32 and bf16; bits=8, rs_bits=4/ag_bits=8, int4 with a spike and the Hadamard
  rotation) with transport="xla" and writes every rank's results (their bit patterns) to
  reference.npz.
* ``gpu``: process i of N, ONE GPU each (the processes may share one physical GPU), runs the
  same programs with transport="p2p" (which, between processes, is the shm transport) and
  writes its rank's results to p<i>.npz. It also checks the exact all-reduce (bits=None), one
  shot and two shots, against the f32 rank-order sum in numpy, bit for bit, and that no meeting
  is left in progress.

* with ``FLASHCOMM_TEST_RINGS=1`` (and always in ``cpu`` mode) also the ring matmuls (the ring
  steps between processes), exact on small integers against numpy.
* ``cpu``: the same as ``gpu`` with one CPU device per process (gloo, the CPU shm transport):
  the launcher's dry run where there is no GPU.

Prints ``PASS`` at the end; a failed check is an AssertionError (traceback, nonzero exit).
"""

import os
import sys
import time

T0 = time.monotonic()
mode, nproc, outdir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if mode == "reference":
    from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

    set_cpu_devices(nproc)  # before jax is imported
    os.environ["JAX_PLATFORMS"] = "cpu"
elif mode == "cpu":
    from tests.support.devices import set_cpu_devices

    set_cpu_devices(1)
    os.environ["JAX_PLATFORMS"] = "cpu"
    port, pid = int(sys.argv[4]), int(sys.argv[5])
else:
    port, pid = int(sys.argv[4]), int(sys.argv[5])
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # several processes on one GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import ml_dtypes  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

if mode != "reference":
    if mode == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=nproc, process_id=pid,
                               initialization_timeout=60)
    assert jax.local_device_count() == 1 and jax.devices()[0].platform == mode, jax.devices()

import jax_flashcomm as fc  # noqa: E402
from jax_flashcomm import CommConfig  # noqa: E402
from jax_flashcomm.codec import kernels  # noqa: E402
from jax_flashcomm.transport import ring_steps, shm  # noqa: E402

mesh = jax.make_mesh((nproc,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                     devices=jax.devices()[:nproc])
ROWS = NamedSharding(mesh, P("x"))
SHAPES = {"a": (3, 130), "b": (16, 256), "s": (3 * nproc, 130)}
EXACT = {"small": (3, 130), "large": (256, 1024)}  # one shot; two shots (1 MiB f32 per rank)
rng = np.random.default_rng(7)  # the same on every process: each knows every operand
FULL = {k: rng.standard_normal((nproc, *s)).astype(np.float32) for k, s in {**SHAPES,
                                                                             **EXACT}.items()}
TRANSPORT = "xla" if mode == "reference" else "p2p"
CONFIGS = {
    "int8": CommConfig(bits=8, min_bytes=0, transport=TRANSPORT),
    "rs4ag8": CommConfig(bits=8, rs_bits=4, ag_bits=8, min_bytes=0, transport=TRANSPORT),
    "int4rot": CommConfig(bits=4, rotation=1, spikes=1, min_bytes=0, transport=TRANSPORT),
}
DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}


def log(*args):
    print(f"[{mode} {os.environ.get('FLASHCOMM_RANK', '')} {time.monotonic() - T0:5.1f}s]",
          *args, flush=True)


def rows_of(name: str, dt) -> jax.Array:
    """Operand `name` as an (N, *shape) array sharded over "x" (this process's rows)."""
    full = FULL[name].astype(dt)
    if mode == "reference":
        return jax.device_put(full, ROWS)
    return jax.make_array_from_process_local_data(ROWS, full[pid][None], full.shape)


def smap(body):
    def wrapped(*rows):
        return tuple(o[None] for o in body(*(r[0] for r in rows)))
    return jax.jit(jax.shard_map(wrapped, mesh=mesh, in_specs=P("x"), out_specs=P("x")))


def my_rows(out: jax.Array) -> np.ndarray:
    """Every rank's row (reference) or this process's row (gpu), as stored bit patterns."""
    if mode == "reference":
        a = np.asarray(out)
    else:
        (shard,) = out.addressable_shards
        a = np.asarray(shard.data)
    return a.view(np.uint16) if a.dtype.itemsize == 2 else a.view(np.uint32)


def quantized() -> dict[str, np.ndarray]:
    results = {}
    for cname, cfg in CONFIGS.items():
        for dname, dt in DTYPES.items():
            def body(a, b, s, cfg=cfg):
                return (fc.psum(a, "x", config=cfg), fc.psum(b, "x", config=cfg),
                        fc.psum_scatter(s, "x", scatter_dimension=0, tiled=True, config=cfg),
                        fc.all_gather(a, "x", axis=1, tiled=True, config=cfg))
            outs = smap(body)(*(rows_of(k, dt) for k in SHAPES))
            for oname, out in zip(("psum a", "psum b", "psum_scatter s", "all_gather a"), outs):
                results[f"{cname} {dname} {oname}"] = my_rows(out)
    return results


def rank_order_sum(name: str, dt) -> np.ndarray:
    xs = FULL[name].astype(dt).astype(np.float32)
    acc = xs[0].copy()
    for j in range(1, nproc):
        acc = acc + xs[j]
    return acc.astype(dt)


def exact():
    cfg = CommConfig(bits=None, transport="p2p")
    for name in EXACT:
        for dname, dt in DTYPES.items():
            (out,) = smap(lambda x: (fc.psum(x, "x", config=cfg),))(rows_of(name, dt))
            got = my_rows(out)[0]
            want = rank_order_sum(name, ml_dtypes.bfloat16 if dname == "bf16" else np.float32)
            want = want.view(np.uint16) if want.dtype.itemsize == 2 else want.view(np.uint32)
            assert np.array_equal(got, want), (
                f"exact psum {name} {dname}: {int(np.sum(got != want))} of {got.size} differ")
            log("exact psum", name, dname, "== the f32 rank-order sum, bit for bit")


def stacked(full: np.ndarray, dt) -> jax.Array:
    """An (N, ...) operand, row j on rank j (this process's row)."""
    full = full.astype(dt)
    return jax.make_array_from_process_local_data(ROWS, full[pid][None], full.shape)


def rings():
    """The ring matmuls with transport="p2p" (the ring steps between processes), exact
    (bits=None) on small integers: every product and partial sum is an integer below 256, exact
    in bf16 and f32 whatever the order, so the results must equal numpy's bit for bit."""
    r = np.random.default_rng(11)
    m, k, cols = 6, 32, 8
    x = r.integers(-2, 3, size=(nproc, m, k)).astype(np.float32)
    w = r.integers(-1, 2, size=(nproc, k, cols)).astype(np.float32)  # rank j's columns
    xs = r.integers(-2, 3, size=(nproc, nproc * m, cols)).astype(np.float32)  # K split
    ws = r.integers(-1, 2, size=(nproc, cols, cols)).astype(np.float32)
    for dname, dt in DTYPES.items():
        npdt = ml_dtypes.bfloat16 if dname == "bf16" else np.float32
        for bidirectional in (False, True):
            def ag(a, b, bidirectional=bidirectional):
                return (fc.all_gather_matmul(a, b, "x", bidirectional=bidirectional, bits=None,
                                             transport="p2p"),)

            def rs(a, b, bidirectional=bidirectional):
                return (fc.matmul_reduce_scatter(a, b, "x", bidirectional=bidirectional,
                                                 bits=None, transport="p2p"),)

            (got,) = smap(ag)(stacked(x, dt), stacked(w, dt))
            want = (x.reshape(nproc * m, k) @ w[pid]).astype(npdt)
            assert np.array_equal(np.asarray(got.addressable_shards[0].data)[0], want), (
                f"all_gather_matmul {dname} bidirectional={bidirectional}")
            (got,) = smap(rs)(stacked(xs, dt), stacked(ws, dt))
            total = sum(xs[j] @ ws[j] for j in range(nproc))
            want = total[pid * m:(pid + 1) * m].astype(npdt)
            assert np.array_equal(np.asarray(got.addressable_shards[0].data)[0], want), (
                f"matmul_reduce_scatter {dname} bidirectional={bidirectional}")
            log("ring matmuls", dname, f"bidirectional={bidirectional}: exact")


if mode == "reference":
    np.savez(os.path.join(outdir, "reference.npz"), **quantized())
else:
    os.environ["FLASHCOMM_RANK"] = str(pid)
    reason = shm.setup()
    assert reason is None, reason
    assert mode == "cpu" or kernels.cuda_module().shm_bound()
    np.savez(os.path.join(outdir, f"p{pid}.npz"), **quantized())
    exact()
    if mode == "cpu" or os.environ.get("FLASHCOMM_TEST_RINGS") == "1":
        rings()
        assert ring_steps.steps_in_progress() == 0
    assert shm.meetings_in_progress() == 0
    if mode == "gpu":
        mapped = kernels.cuda_module().shm_peer_buffers_mapped()
        assert mapped > 0, "no peer IPC buffer was mapped"
        log("peer IPC buffers mapped:", mapped)
        log("IPC signal words given out:", kernels.cuda_module().shm_signal_channels())
log("PASS")
