"""Run a quantized collective on a mesh and return, per rank, its result, the exact lax result
and the elementwise error bound derived from the stored scales of the payloads it sent.

Used by tests/package/test_reliability.py and tests/collectives/test_fuzz_collectives.py. Every jitted program is
cached by its static parameters (op, mesh, axes, local shape, dtype, config, options), so
repeated examples with the same parameters do not recompile.

Bounds (float64, on the host):

* psum: ``sum_r b1_r + b2 + n * eps32 * (sum_r |x_r| + sum_r b1_r)`` (two quantizations, f32
  summation rounding), as in tests/collectives/test_psum.py;
* psum_scatter: ``sum_r b1_r + n * eps32 * (sum_r |x_r| + sum_r b1_r) + n * FLT_MIN`` (f32
  summation rounding and flush to zero) plus the rounding of the f32 sum to the operand dtype
  (half an ulp of the dtype at the sum's magnitude);
* all_gather: ``codec.error_bound`` of the sender's payload (it includes the final rounding).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce, codec, scatter_gather, transport


# The meshes every collective is checked on: (mesh shape, mesh axis names, reduced axes).
MESH_CASES = (
    ((2,), ("i",), ("i",)),
    ((4,), ("i",), ("i",)),
    ((8,), ("i",), ("i",)),
    ((2, 4), ("a", "b"), ("a",)),
    ((2, 4), ("a", "b"), ("b",)),
    ((2, 4), ("a", "b"), ("a", "b")),
)

EPS32 = float(np.finfo(np.float32).eps)
FLT_MIN = float(np.finfo(np.float32).tiny)


def put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


def _axis_arg(axes):
    return axes if len(axes) > 1 else axes[0]


@functools.lru_cache(maxsize=None)
def _program(op, mesh, axes, local_shape, dtype, config, opts):
    """jit(shard_map(...)) returning per-rank rows (y, lax reference, bound arrays...)."""
    names = mesh.axis_names
    opts = dict(opts)
    ax = _axis_arg(axes)

    def body(v):
        v = v.reshape(local_shape)
        if op == "psum":
            y = fc.psum(v, ax, config=config)
            ref = lax.psum(v, axes)
            y2, p1, p2 = allreduce.two_step(allreduce.vary(v, axes, config), axes, config)
            extra = (y2, codec.error_bound(p1), codec.error_bound(p2))
        elif op == "psum_scatter":
            y = fc.psum_scatter(v, ax, config=config, **opts)
            dim = opts["scatter_dimension"] % v.ndim
            ref = lax.psum_scatter(v, axes, scatter_dimension=dim, tiled=opts["tiled"])
            y2, p1 = scatter_gather.reduce_scatter_parts(
                allreduce.vary(v, axes, config), axes, dim, opts["tiled"], config)
            extra = (y2, codec.error_bound(p1))
        elif op == "all_gather":
            y = fc.all_gather(v, ax, config=config, **opts)
            axis = opts["axis"] % (v.ndim + 1 - opts["tiled"])
            ref = lax.all_gather(v, axes, axis=axis, tiled=opts["tiled"])
            y2, p = scatter_gather.all_gather_parts(
                allreduce.vary(v, axes, config), axes, axis, opts["tiled"], config)
            extra = (y2, codec.error_bound(transport.xla.gather_payloads(p, axes)))
        else:
            raise ValueError(op)
        return tuple(r[None] for r in (y, ref) + extra)

    n_out = {"psum": 5, "psum_scatter": 4, "all_gather": 4}[op]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                 out_specs=(P(names),) * n_out))


def run(op, mesh, axes, x, config, **opts):
    """Per-rank numpy rows of ``(y, lax_ref, y_parts, bounds...)`` for global rows ``x``."""
    x = jnp.asarray(x)
    f = _program(op, mesh, tuple(axes), tuple(x.shape[1:]), np.dtype(x.dtype), config,
                 tuple(sorted(opts.items())))
    return [np.asarray(o) for o in f(put(mesh, x))]


def groups_of(mesh, axes):
    """Rank index lists of the reduction groups (ranks numbered row-major over the mesh)."""
    shape = tuple(mesh.devices.shape)
    names = mesh.axis_names
    ranks = np.arange(math.prod(shape)).reshape(shape)
    red = [names.index(a) for a in axes]
    keep = [i for i in range(len(shape)) if i not in red]
    moved = np.transpose(ranks, keep + red).reshape(-1, math.prod(shape[i] for i in red))
    return [list(g) for g in moved]  # each group in the collective's rank order


def assert_same(a, b):
    """Bit-equal values, NaN == NaN (via f32, exact for bf16/f16: numpy's NaN handling does not
    cover ml_dtypes' bfloat16)."""
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


def as64(a):
    return np.asarray(a, np.float64)


def half_ulp(values, dtype):
    """Half an ulp of ``dtype`` at ``|values|`` (the rounding of an f32 result to ``dtype``)."""
    info = np.finfo(dtype) if np.dtype(dtype) != jnp.bfloat16 else jnp.finfo(dtype)
    eps = float(info.eps)
    tiny = float(info.smallest_subnormal)
    return 0.5 * eps * np.abs(values) + 0.5 * tiny


def psum_check(mesh, axes, x, config):
    """Asserts the quantized psum's contract; returns (y, true, bound, n) per rank."""
    y, ref, y2, b1, b2 = run("psum", mesh, axes, x, config)
    assert_same(y, y2)  # the public op is the algorithm the bounds describe
    x64 = as64(x)
    true = np.empty_like(x64)
    bound = np.empty_like(x64)
    for g in groups_of(mesh, axes):
        s = x64[g].sum(0)
        b1s = as64(b1[g]).sum(0)
        rounding = len(g) * EPS32 * (np.abs(x64[g]).sum(0) + b1s)
        for r in g:
            true[r] = s
            bound[r] = b1s + as64(b2[r]) + rounding
        for r in g[1:]:  # every rank of the group holds the same bits
            assert_same(y[r], y[g[0]])
    return y, true, bound


def psum_scatter_check(mesh, axes, x, config, scatter_dimension, tiled):
    y, ref, y2, b1 = run("psum_scatter", mesh, axes, x, config,
                         scatter_dimension=scatter_dimension, tiled=tiled)
    assert_same(y, y2)
    x64 = as64(x)
    dim = scatter_dimension % (x.ndim - 1)
    true = np.empty(y.shape, np.float64)
    bound = np.empty(y.shape, np.float64)
    for g in groups_of(mesh, axes):
        n = len(g)
        s = x64[g].sum(0)
        a = np.abs(x64[g]).sum(0)
        for i, r in enumerate(g):
            pieces = []
            for arr in (s, a):
                moved = np.moveaxis(arr, dim, 0)
                piece = moved.reshape(n, -1)[i]
                pieces.append(piece)
            m = pieces[0].size
            b1s = sum(as64(b1[q][i][:m]) for q in g)
            f32_sum = n * EPS32 * (pieces[1] + b1s) + n * FLT_MIN  # rounding, flush to zero
            flat_bound = b1s + f32_sum + half_ulp(np.abs(pieces[0]) + b1s + f32_sum, x.dtype)
            rest = np.moveaxis(s, dim, 0).shape[1:]
            if tiled:
                shape = (s.shape[dim] // n, *rest)
                true[r] = np.moveaxis(pieces[0].reshape(shape), 0, dim)
                bound[r] = np.moveaxis(flat_bound.reshape(shape), 0, dim)
            else:
                true[r] = pieces[0].reshape(rest)
                bound[r] = flat_bound.reshape(rest)
    return y, true, bound


def all_gather_check(mesh, axes, x, config, axis, tiled):
    y, ref, y2, bg = run("all_gather", mesh, axes, x, config, axis=axis, tiled=tiled)
    assert_same(y, y2)
    x64 = as64(x)
    true = np.empty(y.shape, np.float64)
    bound = np.empty(y.shape, np.float64)
    ax = axis % (x.ndim - 1 if tiled else x.ndim)  # among the local dims (+1 when stacked)
    for g in groups_of(mesh, axes):
        stacked = x64[g]                                    # (N, *local)
        for r in g:
            t = np.moveaxis(stacked, 0, ax)
            b = np.moveaxis(as64(bg[r]), 0, ax)  # (N, *local): every sender's bound
            if tiled:
                shape = list(x.shape[1:])
                shape[ax] *= len(g)
                t, b = t.reshape(shape), b.reshape(shape)
            true[r], bound[r] = t, b
        for r in g[1:]:
            assert_same(y[r], y[g[0]])
    return y, true, bound


def rotated_psum_bound(mesh_shape, names, axes, x, bounds, g, dtype):
    """The true sum and the elementwise error bound of a rotated two-step psum.

    Args:
      mesh_shape, names, axes: the mesh and the reduced axes.
      x: the operands, ``(devices, *local)``.
      bounds: ``(b1, t1, b2, t2)``: the two payloads' rotated-domain bounds per rank
        (:func:`jax_flashcomm.codec.rotated_domain_bound`), flattened per rank.
      g: the group size.
      dtype: the operand dtype (its rounding in the bound).

    Returns:
      ``(true, bound)``, f64 ``(devices, local size)``.
    """
    b1, t1, b2, t2 = bounds
    red = tuple(names.index(a) for a in axes)

    def rsum(v):
        grid = v.reshape(*mesh_shape, *v.shape[1:])
        return np.broadcast_to(grid.sum(axis=red, keepdims=True), grid.shape).reshape(v.shape)

    n = math.prod(mesh_shape[names.index(a)] for a in axes)
    b1s, t1s = rsum(b1), rsum(t1)
    rot_b = b1s + b2 + n * EPS32 * (t1s + b1s)  # rotated domain, elementwise, per group
    bound_g = np.asarray(codec.rotation_bound(rot_b, t1s + t2, g, np.dtype(dtype)), np.float64)
    bound = np.repeat(bound_g, g, axis=1)[:, :math.prod(x.shape[1:])]
    return rsum(np.asarray(x, np.float64).reshape(x.shape[0], -1)), bound
