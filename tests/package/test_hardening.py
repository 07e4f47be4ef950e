"""Issue 38's probes of the library (the checkpoint and CLI probes are in tests/models): each
test failed on the code before the fix (a wrong answer, a crash, a false timeout or an unclear
error) and passes after."""

import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce, codec
from jax_flashcomm.codec import spec


def _mesh(n=4, axis_type=jax.sharding.AxisType.Auto):
    return jax.make_mesh((n,), ("i",), axis_types=(axis_type,), devices=jax.devices()[:n])


def test_large_groups_keep_no_spike_whose_position_would_wrap():
    """G = 131072 at 4 bits: spikes="auto" kept one spike with a 2-byte position, so the
    outlier at index 70000 came back at 70000 - 65536 (an error of 1000 against a bound of 4).
    Now "auto" keeps none there and an explicit spike count is a clear error."""
    n, g = 4, 131072
    mesh = _mesh(n)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 2 * g)).astype(np.float32)
    x[0, 70000] = 1000.0
    config = fc.CommConfig(bits=4, group_size=g, min_bytes=0)
    assert (config.phase1_spikes, config.phase2_spikes) == (0, 0)

    def body(v):
        y, p1, p2 = allreduce.two_step(allreduce.vary(v[0], ("i",), config), ("i",), config)
        bound = lax.psum(codec.error_bound(p1, dtype=jnp.float32), "i") + codec.error_bound(
            p2, dtype=jnp.float32)
        return fc.psum(v[0], "i", config=config), y, bound

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P(), P(), P())))
    y, y2, bound = (np.asarray(a) for a in f(x))
    err = np.abs(y - x.sum(0))
    np.testing.assert_array_equal(y, y2)
    assert np.all(err <= bound * (1 + 1e-5) + 1e-3), err.max()
    assert err[70000] < 100 and err[70000 - 65536] < 100
    with pytest.raises(ValueError, match="needs group_size <= 65536"):
        fc.CommConfig(bits=4, group_size=g, spikes=1)
    for backend in ("jnp", "ffi"):
        with pytest.raises(ValueError, match="needs group_size <= 65536"):
            codec.quantize(jnp.ones(2 * g), bits=4, group_size=g, spikes=1, backend=backend)


def test_a_group_size_past_the_limit_is_a_clear_error():
    """group_size=2**62 aborted the process ("overflow in static extent product")."""
    for bad in (2**62, spec.MAX_GROUP_SIZE + 8):
        with pytest.raises(ValueError, match="group_size must be at most 16777216"):
            codec.quantize(jnp.ones(16), bits=8, group_size=bad)
        with pytest.raises(ValueError, match="group_size must be at most"):
            fc.CommConfig(group_size=bad)


@pytest.mark.parametrize("timeout", [9e15, 2**62, sys.maxsize, 10**30])
def test_timeouts_that_would_overflow_a_deadline_are_rejected(timeout):
    """9e15, 2**62, sys.maxsize made a healthy p2p psum time out at once (the deadline
    overflowed); 10**30 passed CommConfig and raised OverflowError at trace time."""
    with pytest.raises((ValueError, TypeError), match="p2p_timeout_ms"):
        fc.CommConfig(p2p_timeout_ms=timeout)


def test_the_largest_timeout_runs_a_healthy_p2p_psum():
    mesh = _mesh(4)
    x = np.random.default_rng(1).standard_normal((4, 4096)).astype(np.float32)
    f = jax.jit(jax.shard_map(
        lambda v: fc.psum(v[0], "i", min_bytes=0, transport="p2p", p2p_timeout_ms=2**31 - 1),
        mesh=mesh, in_specs=P("i"), out_specs=P()))
    g = jax.jit(jax.shard_map(lambda v: fc.psum(v[0], "i", min_bytes=0, transport="xla"),
                              mesh=mesh, in_specs=P("i"), out_specs=P()))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(g(x)))


@pytest.mark.parametrize("transport", ["xla", "p2p"])
def test_numpy_integer_options_are_the_python_ints(transport):
    """bits=np.uint8(8) gave "zero-size array to reduction", group_size=np.uint8(128) an
    OverflowError, bits=np.uint8(4) with p2p a kernel error: now they are 8, 128 and 4."""
    mesh = _mesh(4)
    x = np.random.default_rng(2).standard_normal((4, 8192)).astype(np.float32)

    def run(**options):
        f = jax.jit(jax.shard_map(
            lambda v: fc.psum(v[0], "i", min_bytes=0, transport=transport, **options),
            mesh=mesh, in_specs=P("i"), out_specs=P()))
        return np.asarray(f(x))

    np.testing.assert_array_equal(run(bits=np.uint8(8)), run(bits=8))
    np.testing.assert_array_equal(run(bits=np.uint8(4)), run(bits=4))
    np.testing.assert_array_equal(run(group_size=np.uint8(128)), run(group_size=128))
    np.testing.assert_array_equal(run(bits=np.int16(6), group_size=np.int64(64)),
                                  run(bits=6, group_size=64))


@pytest.mark.parametrize("fn", [fc.all_gather_matmul, fc.matmul_reduce_scatter])
def test_a_repeated_axis_in_a_ring_op_is_a_trace_time_error(fn):
    """("i", "i") was accepted at trace time, then failed in numpy at lowering (xla) or after
    a 60 s timeout (p2p)."""
    mesh = _mesh(4)
    specs = ((P("i"), P(None, "i")) if fn is fc.all_gather_matmul else (P(None, "i"), P("i")))
    f = jax.shard_map(lambda a, b: fn(a, b, ("i", "i"), transport="p2p"), mesh=mesh,
                      in_specs=specs, out_specs=P())
    with pytest.raises(ValueError, match="repeats an axis"):
        jax.jit(f).trace(jnp.ones((8, 16)), jnp.ones((16, 8)))


@pytest.mark.parametrize("bits", [None, 8])
def test_all_gather_of_an_empty_operand(bits):
    """A tiled all_gather of an operand whose gathered dimension is empty failed in XLA's MLIR
    verifier; now it returns the empty result, as psum_scatter already did."""
    mesh = _mesh(4)
    f = jax.jit(jax.shard_map(lambda v: fc.all_gather(v, "i", tiled=True, bits=bits),
                              mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    assert f(jnp.zeros((0, 3))).shape == (0, 3)


def test_rewrite_of_a_nested_shard_map_called_without_jit():
    """On an Explicit mesh, the rewrite of a nested shard_map called eagerly raised an
    in_specs mismatch (an eager shard_map bind), where jax.jit of the same model runs."""
    mesh = jax.make_mesh((2, 4), ("i", "j"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)

    def outer(v):
        w = jax.shard_map(lambda u: lax.psum(u, "j"), in_specs=P(None, "j"), out_specs=P(),
                          axis_names={"j"})(v)
        return lax.psum(w, "i")

    f = jax.shard_map(outer, mesh=mesh, in_specs=P("i", None), out_specs=P(),
                      axis_names={"i"})
    x = jax.device_put(jnp.arange(32.0).reshape(4, 8), NamedSharding(mesh, P("i", None)))
    with jax.set_mesh(mesh):
        want = np.asarray(jax.jit(f)(x))
        got = np.asarray(fc.rewrite(f, fc.CommConfig(bits=None))(x))
    np.testing.assert_array_equal(got, want)
