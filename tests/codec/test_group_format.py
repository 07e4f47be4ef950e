"""One value carries a phase's format from the call to the kernel: ``bits=4`` given to
``fc.psum`` is the config's GroupFormat, the plan's, and the FFI attribute of the custom call
(docs/layout.md, "The walk of bits")."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.codec import GroupFormat, kernels
from tests.support import collective_oracles as oracles

needs_ffi = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")


def test_the_config_resolves_each_phase_into_one_value():
    rs, ag = fc.CommConfig(bits=8, rs_bits=4, ag_bits=8).group_formats
    assert rs == GroupFormat("int", 4, 128, 0, 1)       # no rotation with a 4-bit phase
    assert ag == GroupFormat("int", 8, 128, 0, 0)       # one spike per group only at <= 6 bits
    assert fc.CommConfig(bits=None).group_formats is None
    fp = fc.CommConfig(format="nvfp4", ag_format="fp8").group_formats
    assert [(f.format, f.bits) for f in fp] == [("nvfp4", 4), ("fp8", 8)]


def test_a_group_format_checks_its_fields():
    for bad in (dict(format="int3"), dict(bits=9), dict(group_size=12), dict(rotation=3),
                dict(spikes=-1)):
        with pytest.raises((TypeError, ValueError)):
            GroupFormat(**bad)


@needs_ffi
@pytest.mark.parametrize("transport", ["p2p", "xla"])
def test_bits_reach_the_kernel_as_the_plans_group_format(mesh_factory, transport):
    mesh = mesh_factory((3,), ("tp",))
    config = fc.CommConfig(bits=4, min_bytes=0, transport=transport)

    def body(x):
        return fc.psum(x, "tp", config=config)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("tp"), out_specs=P()))
    x = oracles.put(mesh, jnp.asarray(np.random.default_rng(0).standard_normal((3, 1024)),
                                     jnp.float32))
    with fc.record() as plans:
        text = f.lower(x).as_text()
    (plan,) = plans
    assert plan.transport == transport
    assert plan.group_formats == config.group_formats == (GroupFormat("int", 4, 128, 0, 1),) * 2
    # every quantizing custom call carries the phase's format as one dictionary attribute
    attrs = re.findall(r"fmt = \{([^}]*)\}", text)
    assert attrs, text[:2000]
    for attr in attrs:
        fields = dict(re.findall(r"(\w+) = (-?\d+)", attr))
        assert fields == {"bits": "4", "format": "0", "group_size": "128", "rotation": "0",
                          "spikes": "1"}, attr
