"""A failed scratch allocation of the CPU codec is a Python exception, not a crash (issue 38).

The probe: ``psum(x, "i", bits=8, group_size=2**24)`` of a 16-float operand over 2 CPU devices
under an address-space limit (RLIMIT_AS) that leaves room for XLA's own buffers but not for the
fused dequantize-sum-quantize's scratch (16 sums of a 2**24-value group: 1 GiB per call). Before
the fix the kernel used the null pointer malloc returned and the process died of SIGSEGV; now
the handler returns ResourceExhausted naming the op and the size, and the process goes on.

The child measures its own address space after jax has started and the program is compiled
(thread stacks and malloc arenas differ between machines), then sets the limit that far plus
``_HEADROOM``. The C++ side covers every allocating kernel path with a failing test allocator
(ffi/tests/codec_cpu_test.cc, TestAllocFailure).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from jax_flashcomm.codec import kernels

pytestmark = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Address space left above what the warmed-up child maps: XLA's buffers of the program (the
# padded 2**24-value operand and its payloads: about 0.6 GiB here) fit; the kernel's 1 GiB
# scratch does not.
_HEADROOM = 800 << 20

_CHILD = textwrap.dedent(f"""
    import resource, sys
    sys.path.insert(0, {_REPO!r})
    from tests.support.devices import set_cpu_devices
    set_cpu_devices(2)
    import jax, jax.numpy as jnp, numpy as np
    import jax_flashcomm
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((2,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,))

    def psum(group_size):
        body = lambda a: jax_flashcomm.psum(a, "i", bits=8, group_size=group_size, min_bytes=0,
                                            transport="xla")
        return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))

    x = jax.device_put(jnp.arange(32, dtype=jnp.float32), NamedSharding(mesh, P("i")))
    small = psum(256)
    expected = np.asarray(small(x))  # warm up: the threads and arenas of a run exist
    big = psum(2**24).lower(x).compile()

    def vm_bytes():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    limit = vm_bytes() + {_HEADROOM}
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    try:
        out = np.asarray(big(x))
    except Exception as e:  # XlaRuntimeError / JaxRuntimeError
        print("RAISED", type(e).__name__, str(e).replace("\\n", " "), flush=True)
    else:
        print("RAN", out[:4], flush=True)
    # The process goes on: a small call still runs and gives the same bytes.
    assert np.asarray(small(x)).tobytes() == expected.tobytes()
    print("ALIVE", flush=True)
""")


def test_failed_scratch_allocation_raises_instead_of_crashing():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # the child sets its own device count
    proc = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True,
                          timeout=600, env=env, cwd=_REPO)
    report = f"rc={proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0, "the child crashed (a negative rc is a signal)\n" + report
    assert "RAISED" in proc.stdout, "the call ran: the limit did not bite\n" + report
    raised = proc.stdout.split("RAISED", 1)[1]
    assert "RuntimeError" in raised, report
    assert "flashcomm_dequantize_sum_quantize" in raised, report
    assert "could not allocate" in raised and "bytes of scratch memory" in raised, report
    assert "ALIVE" in proc.stdout, report
