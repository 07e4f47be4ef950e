"""jax_flashcomm.psum against lax.psum: exact setting bit-equal, quantized within the bound
derived from the stored scales of both phases (elementwise), every rank's result identical,
psum's result type (out_specs=P() with check_vma=True), jit/scan/vmap, autodiff, policy."""

import logging
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce
from jax_flashcomm import codec
from jax_flashcomm import CommConfig

from tests.support.collective_oracles import MESH_CASES

EPS32 = float(np.finfo(np.float32).eps)



def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


def _true_sum(rows, mesh_shape, names, axes):
    """float64 sum over the reduced mesh axes, broadcast back to every rank's row."""
    grid = rows.reshape(*mesh_shape, *rows.shape[1:])
    red = tuple(names.index(a) for a in axes)
    return np.broadcast_to(grid.sum(axis=red, keepdims=True), grid.shape).reshape(rows.shape)


def _run(mesh, axes, x, config, local_shape):
    """Per-rank rows of: public psum, exact psum, lax.psum, phase-1 bound, phase-2 bound,
    and the public psum once more with out_specs over the non-reduced axes only."""
    names = mesh.axis_names
    rest = tuple(a for a in names if a not in axes)

    def body(xl):
        xl = xl.reshape(local_shape)
        y = fc.psum(xl, axes if len(axes) > 1 else axes[0], config=config)
        y_exact = fc.psum(xl, axes, bits=None)
        ref = lax.psum(xl, axes)
        y2, p1, p2 = allreduce.two_step(xl, axes, config)
        b1 = codec.error_bound(p1)
        b2 = codec.error_bound(p2)
        rows = tuple(v[None] for v in (y, y_exact, ref, y2, b1, b2))
        return rows + (y[None],)

    out_specs = (P(names),) * 6 + (P(rest if rest else None),)
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=out_specs))
    return [np.asarray(o) for o in f(_put(mesh, x))]


@pytest.mark.parametrize("mesh_shape,names,axes", MESH_CASES)
def test_psum_parity_and_bound(mesh_factory, mesh_shape, names, axes):
    mesh = mesh_factory(mesh_shape, names)
    n_dev = math.prod(mesh_shape)
    local_shape = (3, 100)  # 300 values: not a multiple of N * G, so padding is exercised
    rng = np.random.default_rng(sum(mesh_shape) + len(axes))
    x = rng.standard_normal((n_dev, *local_shape)).astype(np.float32)
    x[:, 0, :7] *= 40.0  # a few outlier values
    # no rotation: this bound is the one of plain groups (tests/codec/test_rotation.py: rotated ones)
    config = CommConfig(bits=8, rs_bits=4, ag_bits=8, min_bytes=0, rotation=0)
    y, y_exact, ref, y2, b1, b2, y_reduced = _run(mesh, axes, x, config, local_shape)

    # exact setting: bit-equal to lax.psum
    np.testing.assert_array_equal(y_exact, ref)
    # the public op is the two-step algorithm whose payloads the bounds come from
    np.testing.assert_array_equal(y, y2)
    # the bound from the stored scales of both phases, elementwise
    true = _true_sum(x.astype(np.float64), mesh_shape, names, axes)
    b1_sum = _true_sum(b1.astype(np.float64), mesh_shape, names, axes)
    abs_sum = _true_sum(np.abs(x).astype(np.float64), mesh_shape, names, axes)
    n = math.prod(mesh_shape[names.index(a)] for a in axes)
    rounding = n * EPS32 * (abs_sum + b1_sum)
    bound = b1_sum + b2.astype(np.float64) + rounding
    err = np.abs(y.astype(np.float64) - true)
    assert np.all(err <= bound), float(np.max(err - bound))
    assert np.all(np.isfinite(bound)) and float(np.max(err / bound)) > 0.05  # not vacuous
    # every rank in a reduction group holds the identical result
    grid = y.reshape(*mesh_shape, *local_shape)
    for ax in axes:
        first = np.take(grid, [0], axis=names.index(ax))
        np.testing.assert_array_equal(grid, np.broadcast_to(first, grid.shape))
    # out_specs over the non-reduced axes only (psum's replicated type under check_vma=True)
    red = tuple(names.index(a) for a in axes)
    np.testing.assert_array_equal(
        y_reduced, np.take(grid, [0] * 1, axis=red[0]).reshape(-1, *local_shape)
        if len(red) == 1 else grid.reshape(-1, *local_shape)[:1])


def test_psum_bf16_pytree_and_result_type(mesh_factory):
    """A pytree of bf16 and f16 leaves on 4 devices: shapes, dtypes and the replicated type."""
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(1)
    tree = {"a": jnp.asarray(rng.standard_normal((4, 5, 130)), jnp.bfloat16),
            "b": jnp.asarray(rng.standard_normal((4, 64)), jnp.float16)}
    tree = jax.tree.map(lambda v: _put(mesh, v), tree)

    def body(t):
        t = jax.tree.map(lambda v: v[0], t)
        out = fc.psum(t, "i", bits=6, min_bytes=0)
        assert jax.typeof(out["a"]).mat.varying == frozenset()
        return out, lax.psum(t, "i")

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))
    out, ref = f(tree)
    for k in tree:
        assert out[k].dtype == tree[k].dtype and out[k].shape == tree[k].shape[1:]
        scale = float(jnp.max(jnp.abs(ref[k].astype(jnp.float32))))
        err = float(jnp.max(jnp.abs(out[k].astype(jnp.float32) - ref[k].astype(jnp.float32))))
        assert err < 0.1 * scale  # 6-bit, 4 ranks; the elementwise bound is checked above


def test_psum_scan_vmap_bit_identical(mesh_factory):
    """Inside jit, scan and vmap (in and around shard_map) the result is bit-identical to the
    un-batched psum of each slice."""
    mesh = mesh_factory((2, 4), ("a", "b"))
    rng = np.random.default_rng(2)
    xs = _put(mesh, rng.standard_normal((8, 3, 256)).astype(np.float32))
    ps = lambda v: fc.psum(v, "b", bits=4, min_bytes=0)  # noqa: E731

    def body(x):
        x = x[0]
        plain = jnp.stack([ps(x[i]) for i in range(x.shape[0])])
        vm = jax.vmap(ps)(x)
        init = lax.pcast(jnp.zeros((0, 256), jnp.float32), "a", to="varying")
        _, sc = lax.scan(lambda c, r: (c, ps(r)), init, x)
        return plain[None], vm[None], sc[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")), out_specs=P("a")))
    plain, vm, sc = f(xs)
    np.testing.assert_array_equal(vm, plain)
    np.testing.assert_array_equal(sc, plain)
    outer = jax.jit(jax.vmap(jax.shard_map(lambda v: ps(v[0])[None], mesh=mesh,
                                           in_specs=P(("a", "b")), out_specs=P("a")),
                             in_axes=1, out_axes=1))(xs)
    np.testing.assert_array_equal(outer, plain)


@pytest.mark.slow
def test_psum_grad(mesh_factory):
    """Straight-through cotangents: equal to lax.psum's; an operand invariant over the axis gets
    its cotangent all-reduced, exactly or by the quantized psum (grad='quantized')."""
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(3)
    x = _put(mesh, rng.standard_normal((4, 300)).astype(np.float32))
    w = _put(mesh, rng.standard_normal((4, 300)).astype(np.float32))
    xi = jax.device_put(rng.standard_normal((300,)).astype(np.float32),
                        NamedSharding(mesh, P()))

    def loss(op, x, w):
        f = jax.shard_map(lambda x, w: (op(x[0], "i") * w[0])[None], mesh=mesh,
                          in_specs=(P("i"), P("i")), out_specs=P("i"))
        return jnp.sum(f(x, w) ** 2)

    def loss_inv(op, xi, w):
        f = jax.shard_map(lambda x, w: (op(x, "i") * w[0])[None], mesh=mesh,
                          in_specs=(P(), P("i")), out_specs=P("i"))
        return jnp.sum(f(xi, w))

    q_exact = lambda v, a: fc.psum(v, a, bits=8, min_bytes=0)  # noqa: E731
    q_quant = lambda v, a: fc.psum(v, a, bits=8, min_bytes=0, grad="quantized")  # noqa: E731
    # the gradients jitted: one compilation each (eager, the shard_maps run op by op)
    with jax.set_mesh(mesh):
        # x varying: the cotangent of x is that of y, as for lax.psum (loss uses psum(x))
        gq = jax.jit(jax.grad(lambda w: loss(q_exact, x, w)))(w)
        gl = jax.jit(jax.grad(lambda w: loss(lax.psum, x, w)))(w)
        assert float(jnp.max(jnp.abs(gq - gl))) <= 0.05 * float(jnp.max(jnp.abs(gl)))
        gxq = jax.jit(jax.grad(lambda x: loss_inv(q_exact, x, w)))(xi)
        gxl = jax.jit(jax.grad(lambda x: loss_inv(lax.psum, x, w)))(xi)
        np.testing.assert_array_equal(gxq, gxl)  # exact cotangent all-reduce: bit-equal
        gxqq = jax.jit(jax.grad(lambda x: loss_inv(q_quant, x, w)))(xi)
        # grad="quantized": the cotangent all-reduce is the quantized psum of the per-rank
        # cotangents (psum over i of w, pvary'd, then all-reduced again over the 4 ranks)
        ct = jnp.broadcast_to(jnp.sum(w, axis=0), (4, 300))
        expect = jax.jit(jax.shard_map(
            lambda c: fc.psum(c[0], "i", bits=8, min_bytes=0), mesh=mesh,
            in_specs=P("i"), out_specs=P()))(_put(mesh, ct))
        np.testing.assert_array_equal(gxqq, expect)
        assert not np.array_equal(np.asarray(gxqq), np.asarray(gxl))  # it did quantize


def test_size_policy_decision_visible(mesh_factory, caplog):
    """Below min_bytes the exact lax.psum runs (an all-reduce in the HLO); the decision is
    logged and recorded."""
    mesh = mesh_factory((4,), ("i",))
    x = _put(mesh, np.ones((4, 1024), np.float32))  # 4 KiB per rank

    def hlo(**opts):
        f = jax.jit(jax.shard_map(lambda v: fc.psum(v[0], "i", **opts), mesh=mesh,
                                  in_specs=P("i"), out_specs=P()))
        return f.lower(x).as_text()

    with caplog.at_level(logging.DEBUG, logger="jax_flashcomm"), fc.record() as decisions:
        small = hlo(min_bytes=1 << 20)
        big = hlo(min_bytes=4096, transport="xla")  # its wire: all_to_all (p2p: test_transport)
    assert [d.quantized for d in decisions] == [False, True]
    assert "4096 B < min_bytes=1048576" in decisions[0].reason
    assert "all_reduce" in small and "all_to_all" not in small
    assert "all_to_all" in big and "all_reduce" not in big
    assert any("exact lax" in r.message for r in caplog.records)
    assert any("quantized rs_bits=8 ag_bits=8" in r.message for r in caplog.records)


def test_bad_input_raises_at_trace_time(mesh_factory):
    mesh = mesh_factory((2,), ("i",))
    xf = _put(mesh, np.ones((2, 256), np.float32))
    xi = _put(mesh, np.ones((2, 256), np.int32))

    def trace(x, **opts):
        f = jax.shard_map(lambda v: fc.psum(v[0], opts.pop("axis", "i"), **opts), mesh=mesh,
                          in_specs=P("i"), out_specs=P())
        return jax.jit(f).trace(x)

    with pytest.raises(TypeError, match="x must have dtype"):
        trace(xi, min_bytes=0)
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        trace(xf, bits=9)
    with pytest.raises(ValueError, match="rs_bits"):
        trace(xf, rs_bits=1)
    with pytest.raises(ValueError, match="group_size"):
        trace(xf, group_size=100)
    with pytest.raises(ValueError, match="axis_name.*'j'"):
        trace(xf, axis="j")
    with pytest.raises(ValueError, match="grad must be one of"):
        trace(xf, grad="bogus")
    with pytest.raises(ValueError, match="min_bytes"):
        trace(xf, min_bytes=-1)
