"""jax_flashcomm.psum_scatter / all_gather against their lax namesakes: exact setting
bit-equal; quantized within the bound from the stored scales (elementwise); scatter_dimension,
axis and tiled semantics; lax's result types; gathered values identical on every rank; VJPs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import CommConfig, allreduce, codec, transport
from jax_flashcomm.planner import _plan as planner
from jax_flashcomm import scatter_gather as sg

from tests.support.meshes import make_mesh
from tests.support.pairwise import all_pairs

EPS32 = float(np.finfo(np.float32).eps)
CASES = [((4,), ("i",), ("i",)), ((2, 4), ("a", "b"), ("b",)),
         ((2, 4), ("a", "b"), ("a", "b"))]


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


def _rs_checks(xl, axes, n, dim, tiled, cfg):
    """(|y - lax|, bound, exact == lax) for one psum_scatter variant, on this rank."""
    y = fc.psum_scatter(xl, axes, scatter_dimension=dim, tiled=tiled, config=cfg)
    ref = lax.psum_scatter(xl, axes, scatter_dimension=dim, tiled=tiled)
    exact = fc.psum_scatter(xl, axes, scatter_dimension=dim, tiled=tiled, bits=None)
    y2, p1 = sg.reduce_scatter_parts(xl, axes, dim, tiled, cfg)
    b = lax.psum(codec.error_bound(p1).astype(jnp.float32), axes)     # (N, Mp): sum over r
    row = b[lax.axis_index(axes)][: math.prod(y.shape)]
    moved_shape = (y.shape[dim], *[s for i, s in enumerate(y.shape) if i != dim]) if tiled \
        else y.shape
    bound = row.reshape(moved_shape)
    if tiled:
        bound = jnp.moveaxis(bound, 0, dim)
    absum = lax.psum_scatter(jnp.abs(xl), axes, scatter_dimension=dim, tiled=tiled)
    bound = bound * (1 + 4 * n * EPS32) + 2 * n * EPS32 * (absum + bound)
    err = jnp.abs(y - ref)
    return (jnp.all(err <= bound), jnp.max(err / bound), jnp.all(exact == ref),
            jnp.all(y == y2))


def _ag_checks(xl, axes, axis, tiled, cfg):
    y = fc.all_gather(xl, axes, axis=axis, tiled=tiled, config=cfg)
    ref = lax.all_gather(xl, axes, axis=axis, tiled=tiled)
    exact = fc.all_gather(xl, axes, axis=axis, tiled=tiled, bits=None)
    y2, p = sg.all_gather_parts(xl, axes, axis, tiled, cfg)
    pg = transport.xla.gather_payloads(p, axes)
    b = jnp.moveaxis(codec.error_bound(pg), 0, axis).reshape(y.shape)
    assert jax.typeof(y).mat.varying == jax.typeof(ref).mat.varying
    # the ring == decoding all gathered payloads at once (the one-shot gather), bit for bit
    one_shot = transport.xla.decode_gathered(pg, axis, tiled,
                                             planner.as_plan("all_gather", xl, axes, cfg))
    same = jnp.all(lax.bitcast_convert_type(y, jnp.uint32)
                   == lax.bitcast_convert_type(one_shot, jnp.uint32))
    return (jnp.all(jnp.abs(y - ref) <= b), jnp.max(jnp.abs(y - ref) / b),
            jnp.all(exact == ref), jnp.all(y == y2) & same), y


@pytest.mark.parametrize("mesh_shape,names,axes", CASES)
def test_parity_and_bounds(mesh_factory, mesh_shape, names, axes):
    mesh = mesh_factory(mesh_shape, names)
    n = math.prod(mesh_shape[names.index(a)] for a in axes)
    rng = np.random.default_rng(n + len(axes))
    local = (2 * n, 3, 50)  # 300 * 2n values; chunks of 300 -> padded to whole groups
    x = rng.standard_normal((math.prod(mesh_shape), *local)).astype(np.float32)
    x[:, :, 0, :5] *= 30.0
    cfg = CommConfig(bits=6, min_bytes=0)

    def body(xl):
        xl = xl[0]
        checks = [
            _rs_checks(xl, axes, n, 0, True, cfg),
            _rs_checks(xl, axes, n, 2, True, cfg) if 50 % n == 0 else
            _rs_checks(xl[:, :, :48], axes, n, 2, True, cfg),
            _rs_checks(xl[:n], axes, n, 0, False, cfg),
            _rs_checks(jnp.moveaxis(xl[:n], 0, 1), axes, n, 1, False, cfg),
        ]
        ag = []
        for axis, tiled in ((0, False), (2, False), (0, True), (1, True)):
            c, y = _ag_checks(xl, axes, axis, tiled, cfg)
            checks.append(c)
            ag.append(y[None])
        flat = jnp.stack([jnp.stack([jnp.asarray(v, jnp.float32) for v in c]) for c in checks])
        return (flat[None], *ag)

    out_specs = (P(names),) * 5
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=out_specs))
    flat, *gathered = f(_put(mesh, x))
    flat = np.asarray(flat)  # (ranks, checks, 4)
    assert np.all(flat[:, :, 0] == 1), "quantized result outside the stored-scale bound"
    assert np.all(flat[:, :, 1] > 0.02), "bound is vacuous"
    assert np.all(flat[:, :, 2] == 1), "exact setting is not bit-equal to lax"
    assert np.all(flat[:, :, 3] == 1), "public op differs from the bounded two-phase run"
    # the gathered array is bit-identical on every rank of a gather group
    for y in gathered:
        grid = np.asarray(y).reshape(*mesh_shape, *y.shape[1:])
        for ax in axes:
            first = np.take(grid, [0], axis=names.index(ax))
            np.testing.assert_array_equal(grid, np.broadcast_to(first, grid.shape))


def test_shapes_dtypes_and_errors(mesh_factory):
    mesh = mesh_factory((4,), ("i",))
    x = _put(mesh, np.ones((4, 8, 256), np.float32)).astype(jnp.bfloat16)

    def body(v):
        v = v[0]
        rs = fc.psum_scatter(v, "i", scatter_dimension=1, tiled=True, min_bytes=0)
        ag = fc.all_gather(v, "i", axis=-1, tiled=True, min_bytes=0)
        assert rs.dtype == jnp.bfloat16 and rs.shape == (8, 64)
        assert ag.dtype == jnp.bfloat16 and ag.shape == (8, 1024)
        return rs[None], ag[None]

    jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))).trace(x)

    def trace(fn):
        return jax.jit(jax.shard_map(lambda v: fn(v[0])[None], mesh=mesh, in_specs=P("i"),
                                     out_specs=P("i"))).trace(x)

    with pytest.raises(ValueError, match="tiled=False scatter_dimension 0 must have"):
        trace(lambda v: fc.psum_scatter(v, "i", min_bytes=0))
    with pytest.raises(ValueError, match="scatter_dimension=3 is out of range"):
        trace(lambda v: fc.psum_scatter(v, "i", scatter_dimension=3, tiled=True))
    with pytest.raises(ValueError, match="not a multiple of the axis size"):
        trace(lambda v: fc.psum_scatter(v[:6], "i", tiled=True))
    with pytest.raises(ValueError, match="axis=5 is out of range"):
        trace(lambda v: fc.all_gather(v, "i", axis=5))
    with pytest.raises(TypeError, match="x must have dtype"):
        trace(lambda v: fc.all_gather(v.astype(jnp.int8), "i", min_bytes=0))
    with pytest.raises(ValueError, match="axis_name.*'k'"):
        trace(lambda v: fc.psum_scatter(v, "k", tiled=True))


@pytest.mark.slow
def test_vjps(mesh_factory):
    """psum_scatter's VJP is all_gather and vice versa: exact (bit-equal to lax's gradients)
    or, with grad='quantized', this library's quantized counterpart."""
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(7)
    x = _put(mesh, rng.standard_normal((4, 8, 256)).astype(np.float32))
    w_rs = _put(mesh, rng.standard_normal((4, 2, 256)).astype(np.float32))
    w_ag = _put(mesh, rng.standard_normal((4, 32, 256)).astype(np.float32))

    def loss(op, x, w):
        f = jax.shard_map(lambda x, w: (op(x[0]) * w[0])[None], mesh=mesh,
                          in_specs=(P("i"), P("i")), out_specs=P("i"))
        return jnp.sum(f(x, w))

    def apply(op, w):
        return jax.jit(jax.shard_map(lambda w: op(w[0])[None], mesh=mesh, in_specs=P("i"),
                                     out_specs=P("i")))(w)

    rs = dict(scatter_dimension=0, tiled=True)
    ag = dict(axis=0, tiled=True)
    def grad_of(op, w):  # jitted: one compilation (eager, the shard_map runs op by op)
        return jax.jit(jax.grad(lambda x: loss(op, x, w)))(x)

    with jax.set_mesh(mesh):
        for grad in ("exact", "quantized"):
            g_rs = grad_of(lambda v: fc.psum_scatter(v, "i", min_bytes=0, grad=grad, **rs), w_rs)
            g_ag = grad_of(lambda v: fc.all_gather(v, "i", min_bytes=0, grad=grad, **ag), w_ag)
            if grad == "exact":
                np.testing.assert_array_equal(
                    g_rs, grad_of(lambda v: lax.psum_scatter(v, "i", **rs), w_rs))
                np.testing.assert_array_equal(
                    g_ag, grad_of(lambda v: lax.all_gather(v, "i", **ag), w_ag))
            else:
                np.testing.assert_array_equal(
                    g_rs, apply(lambda c: fc.all_gather(c, "i", min_bytes=0, **ag), w_rs))
                np.testing.assert_array_equal(
                    g_ag, apply(lambda c: fc.psum_scatter(c, "i", min_bytes=0, **rs), w_ag))


RING_CASES = [((2,), ("i",), ("i",)), ((8,), ("i",), ("i",)), ((2, 4), ("a", "b"), ("b",)),
              ((2, 4), ("a", "b"), ("a",)), ((2, 4), ("a", "b"), ("a", "b")),
              ((2, 4), ("a", "b"), ("b", "a"))]


RING_IDS = dict(zip(RING_CASES, ["2", "8", "2x4-b", "2x4-a", "2x4-ab", "2x4-ba"]))
# Every mesh with every codec configuration, each with each dtype (all pairs).
RING_ROWS = all_pairs(RING_CASES, [(0, 0, "ffi"), (2, 2, "ffi"), (0, 1, "jnp")],
                      [jnp.float32, jnp.bfloat16, jnp.float16])


@pytest.mark.slow
@pytest.mark.parametrize(
    "mesh_shape,names,axes,rotation,spikes,backend,dtype",
    [(*m, *c, d) for m, c, d in RING_ROWS],
    ids=[f"{RING_IDS[m]}-r{c[0]}k{c[1]}{c[2]}-{jnp.dtype(d).name}" for m, c, d in RING_ROWS])
def test_ring_all_gather_equals_one_shot(mesh_shape, names, axes, rotation, spikes, backend,
                                         dtype):
    """The ring all-gather (N-1 ppermutes, each payload decoded into its slot) gives the bits of
    gathering every payload and decoding them at once, for every axis / tiled, contiguous slots
    or not, multi-axis gathers in lax's rank order, rotation, spikes, both codec backends."""
    mesh = make_mesh(mesh_shape, names, jax.sharding.AxisType.Explicit)
    rng = np.random.default_rng(len(axes) + sum(mesh_shape))
    local = (1, 3, 50)  # 150 values: not a whole number of groups
    x = (rng.standard_normal((math.prod(mesh_shape), *local)) * 10).astype(np.float32)
    x[:, 0, 1, 3] = np.nan
    cfg = CommConfig(bits=4, min_bytes=0, rotation=rotation, spikes=spikes, backend=backend,
                     group_size=32)

    def body(xl):
        ok = []
        for v, axis, tiled in ((xl, 0, True), (xl[0], 0, True), (xl, 1, True), (xl[0], 1, True),
                               (xl, 0, False), (xl, 1, False), (xl[0], 2, False)):
            v = allreduce.vary(v.astype(dtype), axes, cfg)
            y, p = sg.all_gather_parts(v, axes, axis, tiled, cfg)
            one_shot = transport.xla.decode_gathered(
                transport.xla.gather_payloads(p, axes), axis, tiled, planner.as_plan("all_gather", v, axes,
                                                                          cfg))
            ok.append(jnp.all(lax.bitcast_convert_type(y, jnp.uint16 if dtype != jnp.float32
                                                       else jnp.uint32)
                              == lax.bitcast_convert_type(one_shot, jnp.uint16
                                                          if dtype != jnp.float32
                                                          else jnp.uint32)))
            assert y.shape == lax.all_gather(v, axes, axis=axis, tiled=tiled).shape
        return jnp.stack(ok)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=P(names)))
    ok = np.asarray(f(_put(mesh, x)))
    assert ok.all(), ok
