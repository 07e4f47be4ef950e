"""bits=None with transport="p2p" between processes: the exact sum over shared memory takes
f32, bf16 and f16; any other dtype lax.psum takes goes to lax.psum (bits=None is the lax op),
with a reason in the plan, never a run-time error from the kernel."""

import jax.numpy as jnp
import numpy as np
import pytest

import jax_flashcomm as fc
from jax_flashcomm.planner import _plan as planner


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.int16, jnp.bool_])
def test_non_float_exact_p2p_between_processes_takes_lax(monkeypatch, dtype):
    monkeypatch.setattr(planner.p2p_transport, "across_processes", lambda: True)
    p = planner.plan("psum", ("i",), (8, 16), np.dtype(dtype), 2,
                     fc.CommConfig(bits=None, transport="p2p"), record=False)
    assert p.path == "lax" and p.transport is None
    assert "lax.psum" in p.reason and str(np.dtype(dtype)) in p.reason


def test_float_exact_p2p_between_processes_takes_shared_memory(monkeypatch):
    monkeypatch.setattr(planner.p2p_transport, "across_processes", lambda: True)
    monkeypatch.setattr(planner.p2p_transport, "unsupported_reason", lambda axes: None)
    p = planner.plan("psum", ("i",), (8, 16), np.dtype(np.float32), 2,
                     fc.CommConfig(bits=None, transport="p2p"), record=False)
    assert (p.path, p.transport) == ("exact", "p2p")
