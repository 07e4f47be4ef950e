"""jax_flashcomm.rewrite on models sharded by annotations alone (GSPMD, Auto axes).

The patterns of the Explicit-sharding tests written with ``with_sharding_constraint`` on Auto
meshes (1-D and data x tp): typed with Explicit axes (jax_flashcomm/rewrite/gspmd.py) and
rewritten; int8 bit-equal to the hand-written shard_map with the flashcomm op (whose values the
Explicit tests hold within the oracles' bounds); bits=None equal within f32 rounding; jit and
gradients (with the shardings of an earlier call); report rows naming the source lines, and
the partitioner's collectives with what was done at their equation.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import rewrite

from tests.rewrite.test_explicit import _hand

CFG = fc.CommConfig(bits=8, min_bytes=0, rotation=0)
EXACT = fc.CommConfig(bits=None)
B, S, D, F = 2, 8, 64, 256


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def _args(mesh, data, gather):
    rng = np.random.RandomState(0)
    put = lambda a, spec: jax.device_put(a.astype(np.float32), NamedSharding(mesh, spec))  # noqa
    x = put(rng.randn(B, S, D), P(data, "tp") if gather else P(data))
    return x, put(rng.randn(D, F) / 8, P(None, "tp")), put(rng.randn(F, D) / 16, P("tp", None))


def row_parallel(x, w1, w2, *, mesh, data):
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
    y = jnp.einsum("bsf,fd->bsd", h, w2)
    return lax.with_sharding_constraint(y, NamedSharding(mesh, P(data)))


def reduce_scatter(x, w1, w2, *, mesh, data):
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
    y = jnp.einsum("bsf,fd->bsd", h, w2)
    return lax.with_sharding_constraint(y, NamedSharding(mesh, P(data, "tp")))


def all_gather(x, w1, w2, *, mesh, data):
    return lax.with_sharding_constraint(x, NamedSharding(mesh, P(data))) * 2.0


PATTERNS = {"row_parallel": (row_parallel, "psum"),
            "reduce_scatter": (reduce_scatter, "psum_scatter"),
            "all_gather": (all_gather, "all_gather")}
MESHES = {"tp4": ((4,), ("tp",)), "data2xtp4": ((2, 4), ("data", "tp"))}


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_pattern(kind, mesh_name):
    mesh = _mesh(*MESHES[mesh_name])
    data = "data" if "data" in mesh.axis_names else None
    fn = functools.partial(PATTERNS[kind][0], mesh=mesh, data=data)
    x, w1, w2 = _args(mesh, data, kind == "all_gather")
    ref = jax.jit(fn)(x, w1, w2)
    quant = rewrite(fn, CFG)
    report = quant.report(x, w1, w2)
    islands = [r for r in report if r.path != "partitioner"]
    assert [(r.op, r.axes, r.action) for r in islands] == [(PATTERNS[kind][1], ("tp",),
                                                            "quantized")]
    assert islands[0].site.startswith("tests/rewrite/test_gspmd.py:")
    assert report.compile_seconds > 0 and report.where(path="partitioner")
    y = quant(x, w1, w2)                                      # eager: jitted once, cached
    with jax.set_mesh(jax.make_mesh(mesh.axis_sizes, mesh.axis_names, devices=mesh.devices.flat,
                                    axis_types=(AxisType.Explicit,) * len(mesh.axis_names))):
        hand = jax.jit(_hand(kind, jax.sharding.get_mesh(), CFG, data))(
            *(jax.device_put(a, NamedSharding(jax.sharding.get_mesh(), a.sharding.spec))
              for a in (x, w1, w2)))
    np.testing.assert_array_equal(np.asarray(y), np.asarray(hand))
    assert np.asarray(y).shape == np.asarray(ref).shape and 0 < np.abs(
        np.asarray(y) - np.asarray(ref)).max()
    exact = rewrite(fn, EXACT)
    np.testing.assert_allclose(np.asarray(exact(x, w1, w2)), np.asarray(ref), rtol=1e-5,
                               atol=1e-5)
    np.testing.assert_array_equal(np.asarray(jax.jit(quant)(x, w1, w2)), np.asarray(y))
    c = jax.device_put(np.random.RandomState(3).randn(B, S, D).astype(np.float32),
                       NamedSharding(mesh, P(data)))
    grads = [jax.jit(jax.grad(lambda x, w1, w2, f=f: jnp.sum(f(x, w1, w2) * c),
                              argnums=(0, 1, 2)))(x, w1, w2) for f in (fn, exact, quant)]
    for got in grads[1:]:
        for g, r in zip(got, grads[0]):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)


def test_unknown_shardings_under_a_trace_leave_the_program_to_xla():
    """Under jit with no earlier call, Auto shardings are not in the types: no island."""
    mesh = _mesh((4,), ("tp",))
    fn = functools.partial(row_parallel, mesh=mesh, data=None)
    x, w1, w2 = _args(mesh, None, False)
    np.testing.assert_array_equal(np.asarray(jax.jit(rewrite(fn, CFG))(x, w1, w2)),
                                  np.asarray(jax.jit(fn)(x, w1, w2)))
