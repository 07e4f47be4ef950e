"""Quantized ``psum_scatter`` and ``all_gather``: drop-ins for their ``lax`` namesakes.

``psum_scatter``: each rank quantizes its operand in N chunks (chunk i = the slice rank i
keeps, zero-padded to whole groups), one ``all_to_all`` moves chunk i to rank i, which
dequantizes the N chunks and sums them in f32. One quantization; per element the error is at
most ``sum_r b1_r`` (the phase-1 bounds of the N ranks' chunks) plus f32 summation rounding.

``all_gather``: each rank quantizes its operand once; the packed payloads go N-1 steps round
a ring (``ppermute``), and each step decodes the payload in hand straight into its sender's
slot of the output (``codec.dequantize_into``, in place), so no rank ever holds more than one
received payload. Every rank decodes every payload (its own too) with the same kernel, so the
gathered array is bit-identical on every rank and to decoding the gathered payloads at once.
One quantization: the error is ``codec.error_bound`` of the sender's payload.

Both keep the result types of lax (varying over the axes) and their keyword arguments
(``scatter_dimension``/``axis``, ``tiled``). They are each other's transpose: the cotangent
collective is the exact lax one, or this quantized one with ``grad="quantized"``.

The exchanges above are the ``xla`` transport's (``jax_flashcomm/transport/xla.py``); in one
process the default ``p2p`` transport runs the same steps in one fused FFI call per rank, with
the same bits (``jax_flashcomm/transport/p2p.py``, docs/transport.md).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashcomm import _axes, transport
from jax_flashcomm.allreduce import vary
from jax_flashcomm.config import CommConfig, config_from, takes_options
from jax_flashcomm.planner import Plan, as_plan, plan

if TYPE_CHECKING:
    from jax_flashcomm.codec import Payload

__all__ = ["psum_scatter", "all_gather"]


# --- psum_scatter ---------------------------------------------------------------------------------

@takes_options
def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False, config: CommConfig | None = None, **options):
    """Quantized reduce-scatter: a drop-in for ``lax.psum_scatter``.

    Rank i gets the sum over ranks of slice i of ``x`` along ``scatter_dimension`` (that
    dimension removed when ``tiled=False``, where its size must be N; divided by N when
    ``tiled=True``). One quantization, at ``rs_bits`` (default ``bits``).

    Args:
      x: an array or pytree of arrays (f32, bf16 or f16 for the quantized path).
      axis_name: a mesh axis name or a tuple of them.
      scatter_dimension, axis_index_groups, tiled: as for ``lax.psum_scatter``
        (``axis_index_groups`` must be None).
      config, bits, ...: :class:`~jax_flashcomm.CommConfig` and its fields, as for
        :func:`jax_flashcomm.psum` (options given beside ``config`` update it); the path is
        :func:`jax_flashcomm.planner.plan`'s (``lax.psum_scatter`` below ``min_bytes`` per rank).

    Returns:
      This rank's slice of the sum, varying over the axes (``lax.psum_scatter``'s type).
    """
    return _per_leaf("psum_scatter", _psum_scatter_leaf, x, axis_name, scatter_dimension,
                     axis_index_groups, tiled, config, options)


def _per_leaf(op, leaf_fn, x, axis_name, dim, axis_index_groups, tiled, config, options):
    """``leaf_fn(leaf, axes, dim, tiled, config, name)`` over the leaves of ``x``, the options
    and axes checked once (``op``: the entry point's name for errors)."""
    config = config_from(config, options, op)
    if axis_index_groups is not None:
        raise NotImplementedError(f"jax_flashcomm.{op}: axis_index_groups is not supported")
    axes = _axes.normalize_axes(axis_name, op)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: leaf_fn(leaf, axes, dim, bool(tiled), config, _axes.leaf_name(path)),
        x)


def _psum_scatter_leaf(x, axes, dim, tiled, config, name="x"):
    if not config.exact:
        _axes.check_float(x, name)
    n = _axes.axis_size(axes)
    dim = _axes.check_dim(dim, jnp.ndim(x), "scatter_dimension")
    size = x.shape[dim]
    if tiled and size % n:
        raise ValueError(f"psum_scatter: scatter_dimension {dim} has size {size}, not a "
                         f"multiple of the axis size {n}")
    if not tiled and size != n:
        raise ValueError(f"psum_scatter: with tiled=False scatter_dimension {dim} must have "
                         f"the axis size {n}, got {size}")
    if x.size == 0:
        shape = list(x.shape)
        if tiled:
            shape[dim] //= n
        else:
            del shape[dim]
        return _empty_result(x, axes, shape)
    p = plan("psum_scatter", axes, x.shape, x.dtype, n, config)
    if not p.quantized:
        return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled)
    return _qpsum_scatter(vary(x, axes, config), axes, dim, tiled, p)


def _empty_result(x, axes, shape):
    """The (empty) ``shape`` result of a collective of an empty operand, without a collective:
    XLA rejects a reduce-scatter or an all-gather whose scattered or gathered dimension has
    size 0, which lax.psum_scatter / lax.all_gather would emit."""
    out = jnp.zeros(shape, x.dtype) + jnp.sum(x).astype(x.dtype)  # x's varying axes, no values
    return _axes.to_varying(out, axes)


def _chunked(x, n, dim):
    """``x`` as ``(N, M)``: row i is the (flattened) slice that rank i keeps."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(n, -1), moved.shape[1:]


def reduce_scatter_parts(x: jax.Array, axes: tuple[str, ...], dim: int, tiled: bool,
                         p: Plan | CommConfig) -> tuple[jax.Array, Payload]:
    """Quantized reduce-scatter of a varying ``x``; also returns this rank's payload.

    Args:
      x: one array (f32, bf16 or f16), varying over ``axes``.
      axes: normalized mesh axes.
      dim: the scatter dimension (non-negative).
      tiled: as for ``lax.psum_scatter``.
      p: a quantized :class:`~jax_flashcomm.planner.Plan` of op ``"psum_scatter"``, or a
        config (its quantized plan).

    Returns:
      ``(y, p1)``: ``y`` this rank's slice of the sum; ``p1`` holds this rank's N chunks
      ``(N, groups, ...)``, its ``shape`` the padded chunk ``(Mp,)``, so
      ``codec.error_bound(p1)`` is ``(N, Mp)``.
    """
    p = as_plan("psum_scatter", x, axes, p)
    n = _axes.axis_size(axes)
    g = p.group_size
    rows, rest = _chunked(x, n, dim)                               # (N, M)
    m = rows.shape[1]
    mp = -(-m // g) * g
    if mp != m:
        rows = jnp.pad(rows, ((0, 0), (0, mp - m)))
    summed, p1 = transport.by_name(p.transport).reduce_scatter(rows, axes, p)
    summed = summed[:m]
    rest = tuple(rest)
    if tiled:
        out = summed.reshape(x.shape[dim] // n, *rest)
        out = jnp.moveaxis(out, 0, dim)
    else:
        out = summed.reshape(rest)
    return out, p1


def _quantized_op(name, parts, quantized_transpose, lax_transpose):
    """The quantized collective ``parts(x, axes, dim, tiled, plan)[0]`` with its transpose as
    the VJP: the quantized one under ``grad="quantized"``, else the ``lax`` one. ``name`` is
    its custom_vjp's name in jaxprs (the rewrite and its tests find the op by it)."""

    def op(x, axes, dim, tiled, p):
        return parts(x, axes, dim, tiled, p)[0]

    op.__name__ = op.__qualname__ = name
    op = jax.custom_vjp(op, nondiff_argnums=(1, 2, 3, 4))

    def fwd(x, axes, dim, tiled, p):
        return op(x, axes, dim, tiled, p), None

    def bwd(axes, dim, tiled, p, _, ct):
        ct = _axes.to_varying(ct, axes)
        if p.config.grad == "quantized":
            return (quantized_transpose(ct, axes, dim, tiled, config=p.config),)
        return (lax_transpose(ct, axes, dim, tiled),)

    op.defvjp(fwd, bwd)
    return op


_qpsum_scatter = _quantized_op(
    "_qpsum_scatter", reduce_scatter_parts,
    lambda ct, axes, dim, tiled, config: all_gather(ct, axes, axis=dim, tiled=tiled,
                                                    config=config),
    lambda ct, axes, dim, tiled: lax.all_gather(ct, axes, axis=dim, tiled=tiled))


# --- all_gather -----------------------------------------------------------------------------------

@takes_options
def all_gather(x, axis_name, *, axis: int = 0, axis_index_groups=None, tiled: bool = False,
               config: CommConfig | None = None, **options):
    """Quantized all-gather: a drop-in for ``lax.all_gather``.

    Stacks the N ranks' operands on a new dimension ``axis`` (``tiled=False``) or concatenates
    them along ``axis`` (``tiled=True``). One quantization, at ``ag_bits`` (default ``bits``).

    Args:
      x: an array or pytree of arrays (f32, bf16 or f16 for the quantized path).
      axis_name: a mesh axis name or a tuple of them.
      axis, axis_index_groups, tiled: as for ``lax.all_gather`` (``axis_index_groups`` must
        be None).
      config, bits, ...: :class:`~jax_flashcomm.CommConfig` and its fields, as for
        :func:`jax_flashcomm.psum` (options given beside ``config`` update it); the path is
        :func:`jax_flashcomm.planner.plan`'s (``lax.all_gather`` below ``min_bytes`` per rank).

    Returns:
      The gathered operands, varying over the axes (``lax.all_gather``'s type).
    """
    return _per_leaf("all_gather", _all_gather_leaf, x, axis_name, axis, axis_index_groups,
                     tiled, config, options)


def _all_gather_leaf(x, axes, axis, tiled, config, name="x"):
    if not config.exact:
        _axes.check_float(x, name)
    n = _axes.axis_size(axes)
    ndim = jnp.ndim(x)
    axis = _axes.check_dim(axis, ndim if tiled else ndim + 1, "axis")
    if tiled and ndim == 0:
        raise ValueError("all_gather: tiled=True needs an operand of rank >= 1")
    if tiled and x.shape[axis] == 0:  # n empty slices: the empty operand's shape
        return _empty_result(x, axes, x.shape)
    p = plan("all_gather", axes, x.shape, x.dtype, n, config)
    if not p.quantized:
        return lax.all_gather(x, axes, axis=axis, tiled=tiled)
    return _qall_gather(vary(x, axes, config), axes, axis, tiled, p)


def all_gather_parts(x: jax.Array, axes: tuple[str, ...], axis: int, tiled: bool,
                     p: Plan | CommConfig) -> tuple[jax.Array, Payload]:
    """Quantized all-gather of a varying ``x`` (one array, f32, bf16 or f16) over the normalized
    ``axes`` along ``axis`` (non-negative; ``tiled`` as for ``lax.all_gather``), by the
    quantized plan ``p`` of op ``"all_gather"`` (or a config's).

    Returns ``(y, p)``: ``y`` the gathered array; ``p`` this rank's payload of ``x`` (``x``'s
    shape); :func:`jax_flashcomm.transport.xla.gather_payloads` of it gives every sender's,
    whose ``codec.error_bound`` is ``(N, *x.shape)``.
    """
    p = as_plan("all_gather", x, axes, p)
    return transport.by_name(p.transport).all_gather(x, axes, axis, tiled, p)


_qall_gather = _quantized_op(
    "_qall_gather", all_gather_parts,
    lambda ct, axes, axis, tiled, config: psum_scatter(ct, axes, scatter_dimension=axis,
                                                       tiled=tiled, config=config),
    lambda ct, axes, axis, tiled: lax.psum_scatter(ct, axes, scatter_dimension=axis, tiled=tiled))
