"""transport="pallas" in the config, the planner and the cost model: it is accepted, the plans
of psum / psum_scatter / all_gather / the rings name it, "auto" takes it on TPU only, and the TPU
profiles predict where quantizing pays."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import costs, planner, transport
from jax_flashcomm.planner import _choose
from jax_flashcomm.transport import Call
from benchmarks import tpu_costs


def test_config_accepts_pallas():
    """CommConfig(transport="pallas") is valid; another name is still a ValueError."""
    assert fc.CommConfig(transport="pallas").transport == "pallas"
    with pytest.raises(ValueError, match="pallas"):
        fc.CommConfig(transport="mosaic")


def test_plans_name_the_pallas_transport():
    """Under record(), every op's plan says transport='pallas', fixed and automatic size
    policy alike."""
    n = 2
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    x = jax.device_put(jnp.ones((n * 8, 256)), NamedSharding(mesh, P("x")))
    w = jax.device_put(jnp.ones((256, n * 8)), NamedSharding(mesh, P(None, "x")))

    def f(a, b):
        kw = dict(transport="pallas", backend="jnp")
        return (fc.psum(a, "x", min_bytes=0, **kw),
                fc.psum(a, "x", **kw),  # min_bytes="auto": lax or quantized/pallas
                fc.psum_scatter(a, "x", min_bytes=0, tiled=True, **kw),
                fc.all_gather(a, "x", min_bytes=0, tiled=True, **kw),
                fc.all_gather_matmul(a, b, "x", bits=None, **kw))

    with planner.record() as plans:
        jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("x"), P(None, "x")),
                              out_specs=P("x"), check_vma=False)).lower(x, w)
    fixed = [p for p in plans if p.path != "lax"]
    assert {p.op for p in fixed} >= {"psum", "psum_scatter", "all_gather", "all_gather_matmul"}
    assert all(p.transport == "pallas" for p in fixed)
    assert any(p.op == "all_gather_matmul" and p.path == "ring" for p in fixed)


def test_auto_takes_pallas_on_tpu_only():
    """The automatic choice lists quantized/pallas; off a TPU it cannot take the call unless
    asked for; on a TPU it is priced with the TPU profile and beats quantized/xla's tie."""
    call = Call(op="psum", nbytes=32 << 20, itemsize=2, dtype="bfloat16", n=8, platform="cpu",
                layout="in-process", p2p_reason="x", bits=(8, 8))
    pallas = transport.by_name("pallas")
    assert "not a TPU" in pallas.unavailable(call, exact=False)
    assert pallas.as_pinned().unavailable(call, exact=False) is None
    tpu_call = dataclasses.replace(call, platform="tpu")
    assert pallas.unavailable(tpu_call, exact=False) is None
    assert pallas.link(tpu_call, None) == costs.local_tpu().link
    names = [c.name for c in _choose.CANDIDATES]
    assert names.index("quantized/pallas") < names.index("quantized/xla")


def test_tpu_profiles_from_public_specs():
    """Each generation's link is two ICI links' one-way share at the link efficiency, and its
    HBM the published figure."""
    for name, (ici_bits, links, hbm, _) in costs.TPU_SPECS.items():
        tpu = costs.TPUS[name]
        assert tpu.hbm_bytes_per_s == hbm
        np.testing.assert_allclose(tpu.link.bytes_per_s,
                                   ici_bits / 8 / links * costs.LINK_EFFICIENCY)


def test_cost_model_predicts_where_quantizing_pays():
    """A decode-sized all-reduce (1 token) does not pay; a prefill-sized one (2048 tokens)
    does, on every generation, and int4 more than int8."""
    for name, tpu in costs.TPUS.items():
        assert tpu_costs.speedup(tpu, 1, 8, 8)[2] < 1.0, name
        int8 = tpu_costs.speedup(tpu, 2048, 8, 8)[2]
        int4 = tpu_costs.speedup(tpu, 2048, 8, 4, spikes=1)[2]
        assert 1.2 < int8 < int4, name
