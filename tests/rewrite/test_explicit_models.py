"""jax_flashcomm.rewrite on composed Explicit-sharding models and on the patterns it keeps.

A Llama-style block (heads over tp, SwiGLU-free MLP, causal attention) stacked with ``lax.scan``,
replicated or sequence-parallel, on 1-D and data x tp meshes: int8 bit-equal to the same block
written per rank with the flashcomm ops, bits=None equal to the model, gradients; the patterns
inside jit / checkpoint / cond / while / custom_vjp; the policy's axes on a 2-D mesh; and the
patterns that are kept, each with its reason, the program unchanged.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import RewritePolicy, RewriteWarning, rewrite

CFG = fc.CommConfig(bits=8, min_bytes=0, rotation=0)
EXACT = fc.CommConfig(bits=None)
L, B, S, D, DH, F = 2, 2, 8, 32, 8, 64


def _mesh(shape, names):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:n])


def _normal(seed, shape, scale=1.0):
    return np.asarray(np.random.RandomState(seed).randn(*shape) * scale, np.float32)


def _weights(mesh):
    n = mesh.shape["tp"]
    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    return {"qkv": put(_normal(1, (L, D, n, 3, DH), 0.2), P(None, None, "tp")),
            "o": put(_normal(2, (L, n, DH, D), 0.2), P(None, "tp")),
            "up": put(_normal(3, (L, D, F), 0.2), P(None, None, "tp")),
            "down": put(_normal(4, (L, F, D), 0.1), P(None, "tp"))}


def _attention(h, qkv, pos):
    q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
    scores = jnp.einsum("bsnh,btnh->bnst", q, k) / math.sqrt(DH)
    probs = jax.nn.softmax(jnp.where(pos[None, :] <= pos[:, None], scores, -jnp.inf), axis=-1)
    return jnp.einsum("bnst,btnh->bsnh", probs, v)


def model(x, w, *, data, sp):
    """The block stack as a model author writes it: types say where everything lives."""
    row = P(data, "tp", None) if sp else P(data)
    gather = (lambda h: jax.sharding.reshard(h, P(data))) if sp else (lambda h: h)

    def layer(x, w):
        h = gather(x)
        o = _attention(h, jnp.einsum("bsd,dnch->bsnch", h, w["qkv"]), jnp.arange(S))
        x = x + jnp.einsum("bsnh,nhd->bsd", o, w["o"], out_sharding=row)
        u = jax.nn.gelu(jnp.einsum("bsd,df->bsf", gather(x), w["up"]))
        return x + jnp.einsum("bsf,fd->bsd", u, w["down"], out_sharding=row), None

    return lax.scan(layer, x, w)[0]


def by_hand(mesh, *, data, sp, config):
    """The same stack per rank, in a shard_map, with the flashcomm collectives."""
    def body(x, w):
        def gather(h):
            return fc.all_gather(h, "tp", axis=1, tiled=True, config=config) if sp else h

        def reduce(y):
            if sp:
                return fc.psum_scatter(y, "tp", scatter_dimension=1, tiled=True, config=config)
            return fc.psum(y, "tp", config=config)

        def layer(x, w):
            h = gather(x)
            o = _attention(h, jnp.einsum("bsd,dnch->bsnch", h, w["qkv"]), jnp.arange(S))
            x = x + reduce(jnp.einsum("bsnh,nhd->bsd", o, w["o"]))
            u = jax.nn.gelu(jnp.einsum("bsd,df->bsf", gather(x), w["up"]))
            return x + reduce(jnp.einsum("bsf,fd->bsd", u, w["down"])), None

        return lax.scan(layer, x, w)[0]

    x_spec = P(data, "tp") if sp else P(data)
    w_specs = {"qkv": P(None, None, "tp"), "o": P(None, "tp"), "up": P(None, None, "tp"),
               "down": P(None, "tp")}
    return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, w_specs), out_specs=x_spec,
                         check_vma=not sp)


MESHES = {"tp4": ((4,), ("tp",)), "data2xtp4": ((2, 4), ("data", "tp"))}


@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence_parallel"])
@pytest.mark.parametrize("mesh_name", sorted(MESHES))
def test_block_stack_in_scan(mesh_name, sp):
    mesh = _mesh(*MESHES[mesh_name])
    data = "data" if "data" in mesh.axis_names else None
    with jax.set_mesh(mesh):
        w = _weights(mesh)
        x = jax.device_put(_normal(0, (B, S, D)), NamedSharding(
            mesh, P(data, "tp") if sp else P(data)))
        fn = functools.partial(model, data=data, sp=sp)
        ref = jax.jit(fn)(x, w)
        report = rewrite(fn, CFG).report(x, w)
        want = ["all_gather", "psum_scatter"] * 2 if sp else ["psum", "psum"]
        assert [r.op for r in report] == want
        assert {r.path for r in report} == {"scan"} and report.counts() == {"quantized": 4 if sp
                                                                            else 2}
        y = jax.jit(rewrite(fn, CFG))(x, w)
        hand = jax.jit(by_hand(mesh, data=data, sp=sp, config=CFG))(x, w)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(hand))
        exact = jax.jit(rewrite(fn, EXACT))(x, w)
        np.testing.assert_allclose(np.asarray(exact), np.asarray(ref), rtol=1e-5, atol=1e-5)
        fused = rewrite(fn, RewritePolicy(config=EXACT, fuse_matmul=True))
        if sp:   # the MLP's pair is in ring form; the attention's weights are not 2-D
            rows = fused.report(x, w)
            assert [r.action for r in rows] == ["exact", "exact", "fused", "fused"]
            assert all("not fused: the dot's right operand is" in r.reason for r in rows[:2])
        np.testing.assert_allclose(np.asarray(jax.jit(fused)(x, w)), np.asarray(ref),
                                   rtol=1e-5, atol=1e-5)
        grads = [jax.jit(jax.grad(lambda x, w, f=f: jnp.sum(jax.sharding.reshard(
            f(x, w), P()) ** 2), argnums=(0, 1)))(x, w) for f in (fn, rewrite(fn, EXACT))]
        for g, r in zip(jax.tree.leaves(grads[1]), jax.tree.leaves(grads[0])):
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-4, atol=1e-4)


WRAPPERS = {
    "jit": lambda f: jax.jit(f),
    "checkpoint": lambda f: jax.checkpoint(f),
    "cond": lambda f: (lambda h, w: lax.cond(True, f, lambda h, w: jnp.zeros(
        (B, S, D), h.dtype, out_sharding=P()), h, w)),
    "while": lambda f: (lambda h, w: lax.while_loop(
        lambda c: c[0] < 1, lambda c: (c[0] + 1, f(h, w)),
        (0, jnp.zeros((B, S, D), h.dtype, out_sharding=P())))[1]),
}


def _custom_vjp(f):
    @jax.custom_vjp
    def g(h, w):
        return f(h, w)

    g.defvjp(lambda h, w: (f(h, w), (h, w)), lambda res, ct: jax.vjp(f, *res)[1](ct))
    return g


WRAPPERS["custom_vjp"] = _custom_vjp


@pytest.mark.parametrize("wrapper", sorted(WRAPPERS))
def test_patterns_inside_higher_order_primitives(wrapper):
    mesh = _mesh((4,), ("tp",))
    with jax.set_mesh(mesh):
        h = jax.device_put(_normal(0, (B, S, F)), NamedSharding(mesh, P(None, None, "tp")))
        w = jax.device_put(_normal(1, (F, D), 0.1), NamedSharding(mesh, P("tp", None)))
        inner = WRAPPERS[wrapper](lambda h, w: jnp.einsum("bsf,fd->bsd", h, w, out_sharding=P()))
        fn = lambda h, w: inner(h, w) * 2.0  # noqa: E731
        report = rewrite(fn, CFG).report(h, w)
        assert [(r.op, r.action) for r in report] == [("psum", "quantized")]
        path = {"jit": "jit(<lambda>)", "checkpoint": "remat", "cond": "cond[1]",
                "while": "while", "custom_vjp": "custom_vjp"}[wrapper]
        assert report[0].path == path
        y = rewrite(fn, CFG)(h, w)                                  # eager: compiled once
        want = jax.jit(fn)(h, w)
        assert 0 < np.abs(np.asarray(y) - np.asarray(want)).max() < 0.1 * np.abs(
            np.asarray(want)).max()


def test_policy_axes_on_a_2d_mesh():
    """A dot contracting over both axes is one all-reduce over (data, tp): rewritten only if
    the policy names both; a dot sharded over data in its batch dimension stays as it is."""
    mesh = _mesh((2, 4), ("data", "tp"))
    with jax.set_mesh(mesh):
        h = jax.device_put(_normal(0, (B, S, F)), NamedSharding(mesh, P("data", None, "tp")))
        w = jax.device_put(_normal(1, (F, D), 0.1), NamedSharding(mesh, P("tp", None)))
        u = jax.device_put(_normal(2, (S, F)), NamedSharding(mesh, P(None, ("data", "tp"))))
        v = jax.device_put(_normal(3, (F, D)), NamedSharding(mesh, P(("data", "tp"), None)))

        def fn(h, w, u, v):
            return (jnp.einsum("bsf,fd->bsd", h, w, out_sharding=P("data")),
                    jnp.einsum("sf,fd->sd", u, v, out_sharding=P()))

        rows = rewrite(fn, RewritePolicy(config=CFG, axes="tp")).report(h, w, u, v)
        assert [(r.axes, r.action) for r in rows] == [(("tp",), "quantized"),
                                                      (("data", "tp"), "kept")]
        assert "policy.axes" in rows[1].reason
        both = rewrite(fn, RewritePolicy(config=CFG, axes=("data", "tp")))
        assert [r.action for r in both.report(h, w, u, v)] == ["quantized", "quantized"]
        for got, want in zip(jax.jit(both)(h, w, u, v), jax.jit(fn)(h, w, u, v)):
            assert jax.typeof(got).sharding.spec == jax.typeof(want).sharding.spec
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0.05, atol=0.5)


def test_kept_patterns_run_unchanged_with_their_reasons():
    mesh = _mesh((4,), ("tp",))
    with jax.set_mesh(mesh):
        x = jax.device_put(_normal(0, (S, F)), NamedSharding(mesh, P(None, "tp")))
        w = jax.device_put(_normal(1, (F, D), 0.1), NamedSharding(mesh, P("tp", None)))
        r = jax.device_put(_normal(2, (S, D)), NamedSharding(mesh, P()))

        def fn(x, w, r):
            moved = jax.sharding.reshard(x, P("tp", None))             # an all-to-all
            gathered_dot = jnp.einsum("sf,fd->sd", moved, jnp.ones((F, D)), out_sharding=P())
            y = jnp.einsum("sf,fd->sd", x, w, out_sharding=P(unreduced={"tp"}))
            return moved, gathered_dot, jax.sharding.reshard(y, P()) + r, y

        report = rewrite(fn, CFG).report(x, w, r)
        reasons = {row.primitive: row.reason for row in report}
        # the dot computed sharded and gathered after (XLA's all-gather) is an island
        assert [(row.op, row.action) for row in report] == [
            ("reshard", "kept"), ("all_gather", "quantized"), ("psum", "kept")]
        assert "all-to-all" in reasons["reshard"] or "uses outside" in reasons["reshard"]
        assert any("uses outside" in row.reason for row in report)
        with pytest.warns(RewriteWarning, match="every collective found was kept"):
            outs = jax.jit(rewrite(fn, RewritePolicy(config=CFG, ops=("psum",))))(x, w, r)
        for got, want in zip(outs, jax.jit(fn)(x, w, r)):
            np.testing.assert_array_equal(np.asarray(jax.sharding.reshard(got, P())),
                                          np.asarray(jax.sharding.reshard(want, P())))


def test_mesh_with_an_auto_axis_beside_the_explicit_one():
    """data Auto, tp Explicit: the island is manual over tp only; data stays with XLA."""
    mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto, AxisType.Explicit),
                         devices=jax.devices()[:8])
    with jax.set_mesh(mesh):
        h = jax.device_put(_normal(0, (B, S, F)), NamedSharding(mesh, P("data", None, "tp")))
        w = jax.device_put(_normal(1, (F, D), 0.1), NamedSharding(mesh, P("tp", None)))
        fn = lambda h, w: jnp.einsum("bsf,fd->bsd", h, w, out_sharding=P())  # noqa: E731
        report = rewrite(fn, CFG).report(h, w)      # an Auto axis: the partitioner's list too
        assert [(r.op, r.axes, r.action) for r in report if r.path != "partitioner"] == [
            ("psum", ("tp",), "quantized")]
        assert all(r.action == "quantized" for r in report.where(path="partitioner"))
        want = jax.jit(fn)(h, w)
        np.testing.assert_allclose(np.asarray(jax.jit(rewrite(fn, EXACT))(h, w)),
                                   np.asarray(want), rtol=1e-5, atol=1e-5)
        got = jax.jit(rewrite(fn, CFG))(h, w)
        assert 0 < np.abs(np.asarray(got) - np.asarray(want)).max()
