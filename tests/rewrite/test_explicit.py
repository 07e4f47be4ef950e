"""jax_flashcomm.rewrite on models written with sharding in types (Explicit axes, no shard_map).

Each pattern alone (row-parallel dot: all-reduce; dot with a sequence-sharded output:
reduce-scatter; reshard to replicated: all-gather; unreduced dots reduced at a reshard), and
composed (an attention + MLP block, sequence parallel, scan over layers), on 1-D and 2-D
(data x tp) meshes: int8 values bit-equal to the hand-written shard_map with the flashcomm op
and within the op's error bound of the exact sum (tests/support/collective_oracles.py);
bits=None equal to the model within f32 rounding; gradients; jit; report rows; the patterns kept,
each with its reason.
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
from jax_flashcomm.rewrite import RewritePolicy, rewrite

from tests.support import collective_oracles as oracles
from tests.support.meshes import TP_MESHES

CFG = fc.CommConfig(bits=8, min_bytes=0, rotation=0)
EXACT = fc.CommConfig(bits=None)
B, S, D, F = 2, 8, 64, 256


def _mesh(shape=(4,), names=("tp",)):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:n])


def _normal(seed, shape):
    return np.asarray(np.random.RandomState(seed).randn(*shape), np.float32)


def _args(mesh, x_spec):
    data = "data" if "data" in mesh.axis_names else None
    x = jax.device_put(_normal(0, (B, S, D)), NamedSharding(mesh, x_spec))
    w1 = jax.device_put(_normal(1, (D, F)) / 8, NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(_normal(2, (F, D)) / 16, NamedSharding(mesh, P("tp", None)))
    return x, w1, w2, data


# --- the four patterns, as a model author writes them -----------------------------------------

def row_parallel(x, w1, w2, *, data):
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
    return jnp.einsum("bsf,fd->bsd", h, w2, out_sharding=P(data))


def reduce_scatter(x, w1, w2, *, data):
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
    return jnp.einsum("bsf,fd->bsd", h, w2, out_sharding=P(data, "tp"))


def all_gather(x, w1, w2, *, data):
    return jax.sharding.reshard(x, P(data)) * 2.0


def unreduced(x, w1, w2, *, data):
    h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
    a = jnp.einsum("bsf,fd->bsd", h, w2, out_sharding=P(data, unreduced={"tp"}))
    b = jnp.einsum("bsf,fd->bsd", 2.0 * h, w2, out_sharding=P(data, unreduced={"tp"}))
    return jax.sharding.reshard(a + b, P(data))


def _hand(kind, mesh, config, data):
    """The pattern written by hand: shard_map with the flashcomm op (per-rank math)."""
    spec_x = P(data, "tp") if kind == "all_gather" else P(data)

    def body(x, w1, w2):
        if kind == "all_gather":
            return fc.all_gather(x, "tp", axis=1, tiled=True, config=config) * 2.0
        h = jax.nn.silu(x @ w1)
        if kind == "unreduced":
            return fc.psum(h @ w2 + (2.0 * h) @ w2, "tp", config=config)
        if kind == "reduce_scatter":
            return fc.psum_scatter(h @ w2, "tp", scatter_dimension=1, tiled=True, config=config)
        return fc.psum(h @ w2, "tp", config=config)

    out = P(data, "tp") if kind == "reduce_scatter" else P(data)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec_x, P(None, "tp"), P("tp", None)),
                         out_specs=out, check_vma=kind != "all_gather")


PATTERNS = {"row_parallel": (row_parallel, "psum"), "reduce_scatter": (reduce_scatter,
            "psum_scatter"), "all_gather": (all_gather, "all_gather"),
            "unreduced": (unreduced, "psum")}
MESHES = TP_MESHES


@pytest.mark.parametrize("mesh_name", sorted(MESHES))
@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_pattern_rewritten_like_the_hand_written_shard_map(kind, mesh_name):
    mesh = _mesh(*MESHES[mesh_name])
    with jax.set_mesh(mesh):
        x, w1, w2, data = _args(mesh, P(None, "tp") if kind == "all_gather" else P())
        if data:
            x = jax.sharding.reshard(x, P(data, "tp") if kind == "all_gather" else P(data))
        fn, op = functools.partial(PATTERNS[kind][0], data=data), PATTERNS[kind][1]
        ref = jax.jit(fn)(x, w1, w2)
        quant = rewrite(fn, CFG)
        report = quant.report(x, w1, w2)
        assert [(r.op, r.axes, r.action) for r in report] == [(op, ("tp",), "quantized")]
        assert report[0].site.startswith("tests/rewrite/test_explicit.py:")
        y = jax.jit(quant)(x, w1, w2)
        assert jax.typeof(y).sharding.spec == jax.typeof(ref).sharding.spec
        hand = jax.jit(_hand(kind, mesh, CFG, data))(x, w1, w2)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(hand))
        assert 0 < np.abs(np.asarray(y) - np.asarray(ref)).max()
        exact = jax.jit(rewrite(fn, EXACT))(x, w1, w2)
        np.testing.assert_allclose(np.asarray(exact), np.asarray(ref), rtol=1e-5, atol=1e-5)
        assert rewrite(fn, EXACT).report(x, w1, w2)[0].action == "exact"


def test_row_parallel_within_the_psum_error_bound():
    """The island's all-reduce is fc.psum of the per-rank partial products: bit-equal to the
    oracle's quantized psum of the same partials, and within its bound of their exact sum."""
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x, w1, w2, _ = _args(mesh, P())
        h = jax.jit(lambda x, w: jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w)))(x, w1)
        partial = jax.jit(jax.shard_map(lambda h, w: (h @ w)[None], in_specs=(
            P(None, None, "tp"), P("tp", None)), out_specs=P("tp")))(h, w2)
        y = jax.jit(rewrite(lambda h, w: jnp.einsum("bsf,fd->bsd", h, w, out_sharding=P()),
                            CFG))(h, w2)
    oracle_mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    y_oracle, true, bound = oracles.psum_check(oracle_mesh, ("i",), np.asarray(partial), CFG)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(y_oracle[0]))
    err = np.abs(np.asarray(y, np.float64) - true[0])
    assert (err <= bound[0]).all() and err.max() > 0


def test_gather_and_scatter_within_their_error_bounds():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        x, w1, w2, _ = _args(mesh, P(None, "tp"))
        gathered = jax.jit(rewrite(lambda x: jax.sharding.reshard(x, P()), CFG))(x)
        h = jax.jit(lambda x, w: jnp.einsum("bsd,df->bsf", x, w))(
            jax.sharding.reshard(x, P()), w1)
        partial = jax.jit(jax.shard_map(lambda h, w: (h @ w)[None], in_specs=(
            P(None, None, "tp"), P("tp", None)), out_specs=P("tp")))(h, w2)
        scattered = jax.jit(rewrite(lambda h, w: jnp.einsum(
            "bsf,fd->bsd", h, w, out_sharding=P(None, "tp")), CFG))(h, w2)
    oracle_mesh = jax.make_mesh((4,), ("i",), devices=jax.devices()[:4])
    rows = np.stack(np.split(np.asarray(x), 4, axis=1))              # (4, B, S/4, D) per rank
    y, true, bound = oracles.all_gather_check(oracle_mesh, ("i",), rows, CFG, axis=1, tiled=True)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(y[0]))
    assert (np.abs(np.asarray(gathered, np.float64) - true[0]) <= bound[0]).all()
    y, true, bound = oracles.psum_scatter_check(oracle_mesh, ("i",), np.asarray(partial), CFG,
                                                scatter_dimension=1, tiled=True)
    local = np.stack(np.split(np.asarray(scattered), 4, axis=1))
    np.testing.assert_array_equal(local, np.asarray(y))
    assert (np.abs(local.astype(np.float64) - true) <= bound).all()


@pytest.mark.parametrize("kind", sorted(PATTERNS))
def test_gradients(kind):
    """Exact policy: the model's gradients. int8 with exact cotangents (the default grad mode):
    a loss linear in the output has the exact gradient whatever the forward quantization."""
    mesh = _mesh((2, 4), ("data", "tp"))
    with jax.set_mesh(mesh):
        x, w1, w2, data = _args(mesh, P("data", "tp") if kind == "all_gather" else P("data"))
        fn = functools.partial(PATTERNS[kind][0], data=data)
        c = jax.device_put(_normal(3, (B, S, D)), NamedSharding(mesh, P("data")))

        def loss(f, square):
            def value(x, w1, w2):
                y = jax.sharding.reshard(f(x, w1, w2), P("data"))
                return jnp.sum(y * y if square else y * c)
            return jax.jit(jax.grad(value, argnums=(0, 1, 2)))

        for square in (True, False):
            want = loss(fn, square)(x, w1, w2)
            got = loss(rewrite(fn, EXACT), square)(x, w1, w2)
            for g, r in zip(got, want):
                assert jax.typeof(g).sharding.spec == jax.typeof(r).sharding.spec
                np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
        got = loss(rewrite(fn, CFG), False)(x, w1, w2)
        for g, r in zip(got, loss(fn, False)(x, w1, w2)):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=2e-5, atol=2e-5)
