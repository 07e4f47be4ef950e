"""One process of tests/transport/test_multiprocess_failure.py: 2 CPU devices, gloo,
jax.distributed with a short heartbeat timeout. Runs the quantized psum once over both
processes, then process 1 fails while process 0 is inside the second psum.

argv: coordinator port, process id, mode ("exit": process 1 dies with os._exit; "stop": it
freezes itself with SIGSTOP, alive but silent), heartbeat timeout in seconds.
Process 0 prints ``RAISED <seconds> <exception>`` when the collective raises, process 1 prints
``FAILING <unix time>`` just before it fails.
"""

import os
import signal
import sys
import time

from tests.support.devices import set_cpu_devices  # PYTHONPATH: the repo root

set_cpu_devices(2)  # before jax is imported

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

port, pid, mode, heartbeat = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=2, process_id=pid,
                           initialization_timeout=60, heartbeat_timeout_seconds=heartbeat,
                           shutdown_timeout_seconds=heartbeat)

import jax_flashcomm as fc  # noqa: E402

mesh = jax.make_mesh((2, 2), ("a", "b"), devices=jax.devices(),
                     axis_types=(jax.sharding.AxisType.Explicit,) * 2)
sharding = NamedSharding(mesh, P(("a", "b")))
full = np.random.default_rng(0).standard_normal((4, 64, 256)).astype(np.float32)
rows = [i for i, d in enumerate(mesh.devices.reshape(-1)) if d.process_index == pid]
x = jax.make_array_from_process_local_data(sharding, full[rows], full.shape)
f = jax.jit(jax.shard_map(lambda v: fc.psum(v[0], ("a", "b"), bits=4, min_bytes=0)[None],
                          mesh=mesh, in_specs=P(("a", "b")), out_specs=P(("a", "b"))))
f(x).block_until_ready()
print("FIRST_OK", flush=True)

if pid == 1:
    time.sleep(2.0)  # process 0 is blocked in the second psum's all-to-all by now
    print(f"FAILING {time.time():.3f}", flush=True)
    if mode == "exit":
        os._exit(17)
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(3600)

t0 = time.monotonic()
try:
    f(x).block_until_ready()
except Exception as err:  # noqa: BLE001 - report whatever the runtime raises
    msg = " ".join(str(err).split())[:400]
    print(f"RAISED {time.monotonic() - t0:.2f} {type(err).__name__}: {msg}", flush=True)
    sys.exit(3)
print("SECOND_RETURNED", flush=True)  # must not happen: the peer never took part
sys.exit(0)
