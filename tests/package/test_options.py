"""One option set, one decision point: CommConfig, the ops' signatures, plan() and record()."""

import dataclasses
import inspect
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import nn
from jax_flashcomm.config import OPTION_NAMES, CommConfig, is_default

#: Every public entry point that takes the option set (TPComm and RewritePolicy: __init__).
ENTRY_POINTS = {
    "psum": fc.psum, "pmean": fc.pmean, "psum_scatter": fc.psum_scatter,
    "all_gather": fc.all_gather, "all_gather_matmul": fc.all_gather_matmul,
    "matmul_reduce_scatter": fc.matmul_reduce_scatter, "TPComm": nn.TPComm.__init__,
    "RewritePolicy": fc.RewritePolicy.__init__,
}
DEFAULTS = {f.name: f.default for f in dataclasses.fields(CommConfig)}


@pytest.mark.parametrize("name", sorted(ENTRY_POINTS))
def test_every_entry_point_takes_one_option_set_with_one_set_of_defaults(name):
    params = inspect.signature(ENTRY_POINTS[name]).parameters
    assert "config" in params and params["config"].default is None, name
    for option in OPTION_NAMES:
        assert option in params, f"{name} lacks the option {option}"
        p = params[option]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY, (name, option)
        assert is_default(p.default), (name, option)  # a given option is told from a default
        assert p.default.value == DEFAULTS[option], (name, option, p.default.value)
        assert repr(p.default) == repr(DEFAULTS[option])  # help() shows the library default


def test_tp_attention_options_have_the_library_defaults():
    params = inspect.signature(fc.tp_attention).parameters
    for option in ("transport", "p2p_timeout_ms"):
        assert params[option].default.value == DEFAULTS[option]


def test_replace_does_not_carry_a_rotation_resolved_for_other_bits():
    """The bug of issue 30: __post_init__ resolved rotation="auto" at construction, so a
    replace() kept Hadamard at 4 bits (and none at 8)."""
    four = dataclasses.replace(CommConfig(), bits=4)
    assert four.rotation == "auto" and four.resolved_rotation == 0
    eight = dataclasses.replace(CommConfig(bits=4), bits=8)
    assert eight.rotation == "auto" and eight.resolved_rotation == 1
    assert dataclasses.replace(CommConfig(), rs_bits=4, ag_bits=8).resolved_rotation == 0
    assert dataclasses.replace(CommConfig(), group_size=96).resolved_rotation == 0  # not pow2
    assert CommConfig(bits=None).resolved_rotation == 0


def test_numpy_integers_are_converted_to_python_ints():
    c = CommConfig(bits=np.uint8(4), group_size=np.int16(64), min_bytes=np.int64(0),
                   spikes=np.int8(2), rotation=np.uint8(1), p2p_timeout_ms=np.int32(5))
    assert (c.bits, c.group_size, c.min_bytes, c.spikes, c.rotation, c.p2p_timeout_ms) == (
        4, 64, 0, 2, 1, 5)
    assert all(type(v) is int for v in (c.bits, c.group_size, c.spikes, c.p2p_timeout_ms))
    with pytest.raises(TypeError, match="bits must be an int"):
        CommConfig(bits=8.0)
    with pytest.raises(ValueError, match="p2p_timeout_ms"):
        CommConfig(p2p_timeout_ms=2**62)


def _mesh(n=4):
    return jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def _plans(fn, *args, mesh=None, in_specs=None, out_specs=P()):
    mesh = mesh or _mesh()
    in_specs = in_specs or tuple(P() for _ in args)
    with fc.record() as plans:
        jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)).trace(
            *args).lower()
    return plans


def test_options_beside_a_config_update_it():
    x = jnp.ones((4096,), jnp.float32)
    base = CommConfig(bits=8, min_bytes=0)
    (p,) = _plans(lambda v: fc.psum(v, "i", config=base, bits=4), x)
    assert (p.rs_bits, p.ag_bits, p.rs_spikes, p.rotation) == (4, 4, 1, 0)
    (p,) = _plans(lambda v: fc.psum(v, "i", config=base), x)
    assert (p.rs_bits, p.ag_bits, p.rs_spikes, p.rotation) == (8, 8, 0, 1)
    with pytest.raises(TypeError, match="config must be a jax_flashcomm.CommConfig"):
        _plans(lambda v: fc.psum(v, "i", config={"bits": 4}), x)


def test_quantized_ring_runs_the_kernels_on_both_sides():
    """backend="auto" in a quantized ring: the FFI quantize and dequantize (the twin's cost
    more, its decode too: docs/ttft_shm.md); backend="jnp": the twin for both."""
    x, w = jnp.ones((64, 32), jnp.float32), jnp.ones((32, 32), jnp.float32)

    def hlo(**options):
        fn = jax.shard_map(lambda a, b: fc.all_gather_matmul(a, b, "i", min_bytes=0, **options),
                           mesh=_mesh(), in_specs=(P("i"), P(None, "i")), out_specs=P(None, "i"))
        return jax.jit(fn).lower(x, w).as_text()

    auto, twin = hlo(), hlo(backend="jnp")
    assert "flashcomm_quantize" in auto and "flashcomm_dequantize" in auto
    assert "flashcomm_quantize" not in twin and "flashcomm_dequantize" not in twin


def test_psum_scatter_and_all_gather_take_their_phase_bits():
    x = jnp.ones((4096,), jnp.float32)
    (p,) = _plans(lambda v: fc.psum_scatter(v, "i", tiled=True, rs_bits=4, min_bytes=0), x,
                  out_specs=P("i"))
    assert (p.op, p.rs_bits, p.ag_bits) == ("psum_scatter", 4, None)
    (p,) = _plans(lambda v: fc.all_gather(v, "i", tiled=True, ag_bits=6, min_bytes=0), x,
                  in_specs=(P("i"),), out_specs=P("i"))
    assert (p.op, p.rs_bits, p.ag_bits) == ("all_gather", None, 6)


def test_plan_paths():
    """Every path of the plan table (jax_flashcomm/planner/_plan.py), from one function."""
    x = jnp.ones((64, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
    paths = {}
    for label, fn in {
        "exact": lambda v: fc.psum(v, "i", bits=None),
        "small": lambda v: fc.psum(v, "i"),
        "exact p2p": lambda v: fc.psum(v, "i", bits=None, transport="p2p"),
        "quantized": lambda v: fc.psum(v, "i", min_bytes=0),
        "quantized xla": lambda v: fc.psum(v, "i", min_bytes=0, transport="xla"),
    }.items():
        (p,) = _plans(fn, x)
        paths[label] = (p.path, p.transport)
    assert paths == {"exact": ("lax", None), "small": ("exact", "p2p"),
                     "exact p2p": ("exact", "p2p"),
                     "quantized": ("quantized", "p2p"), "quantized xla": ("quantized", "xla")}
    spec = (P("i"), P(None, "i"))
    (p,) = _plans(lambda a, b: fc.all_gather_matmul(a, b, "i"), x, w, in_specs=spec,
                  out_specs=P(None, "i"))
    assert (p.path, p.transport) == ("ring", "xla")
    (p,) = _plans(lambda a, b: fc.all_gather_matmul(a, b, "i", min_bytes=0), x, w,
                  in_specs=spec, out_specs=P(None, "i"))
    assert (p.path, p.ag_bits, p.backend) == ("quantized ring", 8, "auto")
    spec = (P(None, "i"), P("i", None))
    (p,) = _plans(lambda a, b: fc.matmul_reduce_scatter(a, b, "i", bits=None), x, w,
                  in_specs=spec, out_specs=P("i"))
    assert p.path == "ring"
    plans = _plans(lambda a, b: fc.matmul_reduce_scatter(a, b, "i", min_bytes=0, rs_bits=4),
                   x, w, in_specs=spec, out_specs=P("i"))
    assert [(q.op, q.path, q.rs_bits) for q in plans] == [
        ("matmul_reduce_scatter", "matmul, quantized", 4), ("psum_scatter", "quantized", 4)]
    with pytest.raises(ValueError, match="transport='p2p' cannot run here: backend='jnp'"):
        _plans(lambda v: fc.psum(v, "i", min_bytes=0, transport="p2p", backend="jnp"), x)


def test_tpcomm_kinds_follow_the_config():
    assert nn.TPComm("exact").config == CommConfig(bits=None)
    assert nn.TPComm("quantized").config == CommConfig()
    assert nn.TPComm("quantized", bits=4, min_bytes=0).config == CommConfig(bits=4, min_bytes=0)
    assert nn.TPComm(layout="sequence_parallel", transport="p2p").config == CommConfig(
        bits=None, transport="p2p")
    with pytest.raises(ValueError, match="does not quantize"):
        nn.TPComm("exact", bits=8)
    with pytest.raises(ValueError, match="quantizes"):
        nn.TPComm("quantized", bits=None)
    assert hash(nn.TPComm("quantized")) == hash(nn.TPComm("quantized", config=CommConfig()))


def test_rewrite_policy_takes_the_options():
    assert fc.RewritePolicy().config is None
    assert fc.RewritePolicy(bits=4).config == CommConfig(bits=4)
    assert fc.RewritePolicy(CommConfig(bits=6), min_bytes=0).config == CommConfig(bits=6,
                                                                                 min_bytes=0)


def test_record_is_context_local_under_threads():
    """Two threads tracing at once each record their own plans, none of the other's."""
    x = jnp.ones((4096,), jnp.float32)
    barrier, seen, errors = threading.Barrier(2), {}, []

    def trace(bits):
        try:
            with fc.record() as plans:
                barrier.wait(timeout=30)
                for _ in range(3):
                    _plans(lambda v: fc.psum(v, "i", bits=bits, min_bytes=0), x)
                barrier.wait(timeout=30)
            seen[bits] = [p.rs_bits for p in plans]
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=trace, args=(b,)) for b in (4, 8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert seen == {4: [4, 4, 4], 8: [8, 8, 8]}


def test_cli_flags_are_the_config_fields_with_the_library_defaults():
    import argparse

    from models import cli

    parser = argparse.ArgumentParser()
    cli.add_common(parser)
    args = parser.parse_args(["--comm", "flash"])
    assert cli.comm_from_args(args).config == CommConfig()
    assert set(cli.CONFIG_FLAGS) == set(OPTION_NAMES)
    args = parser.parse_args(["--comm", "flash", "--config", '{"bits": 4, "min_bytes": 0}',
                              "--rotation", "hadamard", "--spikes", "2"])
    assert cli.comm_from_args(args).config == CommConfig(bits=4, min_bytes=0,
                                                         rotation="hadamard", spikes=2)


def test_an_unknown_option_is_a_type_error():
    with pytest.raises(TypeError, match="psum: unknown options \\['bitz'\\]"):
        fc.psum(jnp.ones(4), "i", bitz=4)
    with pytest.raises(TypeError, match="TPComm: unknown options"):
        nn.TPComm("quantized", ring_transport="p2p")
