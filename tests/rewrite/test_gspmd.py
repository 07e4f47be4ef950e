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
from tests.support.meshes import TP_MESHES

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
CASES = [(kind, mesh) for kind in sorted(PATTERNS) for mesh in sorted(TP_MESHES)]


@pytest.mark.parametrize("kind,mesh_name", CASES)
def test_pattern(kind, mesh_name):
    mesh = _mesh(*TP_MESHES[mesh_name])
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


def test_jit_first_equals_the_eager_call():
    """jax.jit(rewrite(f)) called before any eager call reads the shardings from the jit's own
    arguments: the same program as the eager call, and not XLA's."""
    mesh = _mesh((4,), ("tp",))
    fn = functools.partial(row_parallel, mesh=mesh, data=None)
    x, w1, w2 = _args(mesh, None, False)
    first = np.asarray(jax.jit(rewrite(fn, CFG))(x, w1, w2))
    np.testing.assert_array_equal(first, np.asarray(rewrite(fn, CFG)(x, w1, w2)))
    assert np.abs(first - np.asarray(jax.jit(fn)(x, w1, w2))).max() > 0


def test_block_stack_in_scan_on_a_2d_mesh():
    """The block stack of test_explicit_models written with with_sharding_constraint on Auto
    axes (data x tp), scan over layers, replicated and sequence-parallel: int8 bit-equal to
    the per-rank flashcomm version."""
    from tests.rewrite import test_explicit_models as em

    mesh = _mesh((2, 4), ("data", "tp"))
    pin = lambda x, *spec: lax.with_sharding_constraint(x, NamedSharding(mesh, P(*spec)))  # noqa

    def model(x, w, *, sp):
        row = ("data", "tp", None) if sp else ("data",)
        gather = (lambda h: pin(h, "data")) if sp else (lambda h: h)

        def layer(x, w):
            h = gather(x)
            o = em._attention(h, jnp.einsum("bsd,dnch->bsnch", h, w["qkv"]), jnp.arange(em.S))
            x = x + pin(jnp.einsum("bsnh,nhd->bsd", o, w["o"]), *row)
            u = jax.nn.gelu(jnp.einsum("bsd,df->bsf", gather(x), w["up"]))
            return x + pin(jnp.einsum("bsf,fd->bsd", u, w["down"]), *row), None

        return lax.scan(layer, x, w)[0]

    w = em._weights(mesh)
    for sp in (False, True):
        x = jax.device_put(em._normal(0, (em.B, em.S, em.D)),
                           NamedSharding(mesh, P("data", "tp") if sp else P("data")))
        fn = functools.partial(model, sp=sp)
        rewritten = rewrite(fn, CFG)
        islands = [r for r in rewritten.report(x, w) if r.path != "partitioner"]
        assert [r.op for r in islands] == (["all_gather", "psum_scatter"] * 2 if sp
                                           else ["psum", "psum"])
        assert {r.path for r in islands} == {"scan"}
        explicit = jax.make_mesh((2, 4), ("data", "tp"), devices=mesh.devices.flat,
                                 axis_types=(AxisType.Explicit,) * 2)
        with jax.set_mesh(explicit):
            hand = jax.jit(em.by_hand(explicit, data="data", sp=sp, config=CFG))(
                *jax.tree.map(lambda a: jax.device_put(a, NamedSharding(
                    explicit, a.sharding.spec)), (x, w)))
        np.testing.assert_array_equal(np.asarray(rewritten(x, w)), np.asarray(hand))


def test_nnx_module_under_nnx_jit():
    """An nnx module whose parameters are placed on an Auto mesh: rewritten from its state,
    called eagerly once, then under nnx.jit (the shardings of the eager call)."""
    from flax import nnx

    mesh = _mesh((4,), ("tp",))

    class MLP(nnx.Module):
        def __init__(self):
            rng = np.random.RandomState(0)
            place = lambda a, spec: jax.device_put(a.astype(np.float32),  # noqa: E731
                                                   NamedSharding(mesh, spec))
            self.up = nnx.Param(place(rng.randn(D, F) / 8, P(None, "tp")))
            self.down = nnx.Param(place(rng.randn(F, D) / 16, P("tp", None)))

        def __call__(self, x):
            h = jax.nn.silu(x @ self.up[...])
            return lax.with_sharding_constraint(h @ self.down[...], NamedSharding(mesh, P()))

    module = MLP()
    graphdef, state = nnx.split(module)
    x = jax.device_put(np.random.RandomState(1).randn(S, D).astype(np.float32),
                       NamedSharding(mesh, P()))
    rewritten = rewrite(lambda state, x: nnx.merge(graphdef, state)(x), CFG)
    assert [r.op for r in rewritten.report(state, x) if r.path != "partitioner"] == ["psum"]
    eager = rewritten(state, x)

    @nnx.jit
    def step(module, x):
        return rewritten(nnx.state(module), x)

    np.testing.assert_array_equal(np.asarray(step(module, x)), np.asarray(eager))
    assert 0 < np.abs(np.asarray(eager) - np.asarray(module(x))).max()


def test_row_parallel_within_the_psum_error_bound():
    """The GSPMD island's all-reduce is fc.psum of the per-rank partial products: bit-equal to
    the oracle's quantized psum of the same partials and within its bound of their sum."""
    from tests.support import collective_oracles as oracles

    mesh = _mesh((4,), ("tp",))
    x, w1, w2 = _args(mesh, None, False)
    h = jax.jit(lambda x, w: jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w)))(x, w1)
    h = jax.device_put(h, NamedSharding(mesh, P(None, None, "tp")))
    partial = jax.jit(jax.shard_map(lambda h, w: (h @ w)[None], mesh=mesh, in_specs=(
        P(None, None, "tp"), P("tp", None)), out_specs=P("tp")))(h, w2)
    y = rewrite(lambda h, w: lax.with_sharding_constraint(
        jnp.einsum("bsf,fd->bsd", h, w), NamedSharding(mesh, P())), CFG)(h, w2)
    oracle_mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    y_oracle, true, bound = oracles.psum_check(oracle_mesh, ("i",), np.asarray(partial), CFG)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_oracle[0]))
    err = np.abs(np.asarray(y, np.float64) - true[0])
    assert (err <= bound[0]).all() and err.max() > 0


@pytest.mark.parametrize("wrapper", ["while", "cond", "checkpoint"])
def test_inside_while_cond_and_checkpoint(wrapper):
    mesh = _mesh((4,), ("tp",))
    x, w1, w2 = _args(mesh, None, False)
    inner = functools.partial(row_parallel, mesh=mesh, data=None)
    zeros = jnp.zeros((B, S, D), jnp.float32)
    body = {"while": lambda x, w1, w2: lax.while_loop(
                lambda c: c[0] < 1, lambda c: (c[0] + 1, inner(x, w1, w2)), (0, zeros))[1],
            "cond": lambda x, w1, w2: lax.cond(True, inner, lambda *a: zeros, x, w1, w2),
            "checkpoint": jax.checkpoint(inner)}[wrapper]
    rewritten = rewrite(body, CFG)
    islands = [r for r in rewritten.report(x, w1, w2) if r.path != "partitioner"]
    assert [(r.op, r.action) for r in islands] == [("psum", "quantized")]
    plain = rewrite(inner, CFG)(x, w1, w2)
    np.testing.assert_array_equal(np.asarray(rewritten(x, w1, w2)), np.asarray(plain))
