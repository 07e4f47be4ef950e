"""Quantized ``all_to_all`` and ``ragged_all_to_all``: drop-ins for their ``lax`` namesakes.

Expert parallelism spends its communication in these two: the dispatch of tokens to the ranks
that hold their experts and the combine that brings the expert outputs back. Here each token's
row (the operand's last axis for ``all_to_all``, every row's values for ``ragged_all_to_all``) is
quantized in groups along it, zero-padded to whole groups, so a row's codes never share a group
with another row's. One quantization end to end: each rank quantizes what it sends, the codes
move, and the receiver decodes exactly them; per element the error is at most
``codec.error_bound`` of the received payload (:func:`all_to_all_with_bound`). The format is the
call's (``bits``, ``format``, ``spikes``, ``rotation``, ...), so a dispatch and a combine take
their own (e.g. ``format="fp8"`` for the dispatch, ``bits=None`` for the combine).

The codes move over the ``xla`` transport (``lax.all_to_all`` / ``lax.ragged_all_to_all`` of
one uint8 buffer) or the ``p2p`` one (one FFI exchange per rank,
:mod:`jax_flashcomm.transport.exchange`); a received row carries one flag byte so that the rows
no peer wrote keep ``output``'s values. XLA:CPU does not implement ``ragged-all-to-all``: on CPU
the ragged op, exact or quantized, runs over the p2p exchange. The plan
(:func:`jax_flashcomm.plan`, :func:`jax_flashcomm.record`) decides each call as for the other
ops. Gradients: the transpose of an all-to-all is the all-to-all back (``split_axis`` and
``concat_axis`` swapped; the ragged one with the offsets exchanged), exact or, with
``grad="quantized"``, quantized.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashcomm import _axes, codec
from jax_flashcomm.config import CommConfig, config_from, takes_options
from jax_flashcomm.planner import Plan, plan
from jax_flashcomm.transport import exchange, wire

__all__ = ["all_to_all", "ragged_all_to_all", "all_to_all_with_bound"]


# --- all_to_all -----------------------------------------------------------------------------------

@takes_options
def all_to_all(x, axis_name, split_axis: int, concat_axis: int, *, axis_index_groups=None,
               tiled: bool = False, config: CommConfig | None = None, **options):
    """Quantized all-to-all: a drop-in for ``lax.all_to_all``.

    Slice ``i`` of ``x`` along ``split_axis`` goes to rank ``i``; the slices received are
    concatenated (``tiled=True``) or stacked (``tiled=False``) along ``concat_axis`` in rank
    order. Each row along the last axis of a slice is quantized in groups (module docstring).

    Args:
      x: an array or pytree of arrays (f32, bf16 or f16 for the quantized path).
      axis_name: a mesh axis name or a tuple of them.
      split_axis, concat_axis, axis_index_groups, tiled: as for ``lax.all_to_all``
        (``axis_index_groups`` must be None).
      config, bits, ...: :class:`~jax_flashcomm.CommConfig` and its fields, as for
        :func:`jax_flashcomm.psum` (``ag_bits`` / ``ag_format`` override the one quantization);
        the path is :func:`jax_flashcomm.planner.plan`'s.

    Returns:
      ``lax.all_to_all``'s result (its shape and type, varying over the axes).
    """
    config = config_from(config, options, "all_to_all")
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.all_to_all: axis_index_groups is not supported")
    axes = _axes.normalize_axes(axis_name, "all_to_all")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _all_to_all_leaf(jnp.asarray(leaf), axes, split_axis, concat_axis,
                                            bool(tiled), config, _axes.leaf_name(path))[0], x)


def all_to_all_with_bound(x: jax.Array, axis_name, split_axis: int, concat_axis: int, *,
                          tiled: bool = False, config: CommConfig | None = None, **options):
    """:func:`all_to_all` of one array and the bound on each element's error.

    Args:
      x, axis_name, split_axis, concat_axis, tiled, config, options: as for
        :func:`all_to_all`.

    Returns:
      ``(y, bound)``: the result, and f32 of its shape: ``codec.error_bound`` of the payload
      each element arrived in (zero where the path was exact).
    """
    config = config_from(config, options, "all_to_all_with_bound")
    axes = _axes.normalize_axes(axis_name, "all_to_all_with_bound")
    return _all_to_all_leaf(jnp.asarray(x), axes, split_axis, concat_axis, bool(tiled), config,
                            "x", bound=True)


def _all_to_all_leaf(x, axes, split, concat, tiled, config, name, bound=False):
    n = _axes.axis_size(axes)
    split = _axes.check_dim(split, x.ndim, "split_axis")
    concat = _axes.check_dim(concat, x.ndim, "concat_axis")
    size = x.shape[split]
    if tiled and size % n:
        raise ValueError(f"all_to_all: split_axis {split} has size {size}, not a multiple of "
                         f"the axis size {n}")
    if not tiled and size != n:
        raise ValueError(f"all_to_all: with tiled=False split_axis {split} must have the axis "
                         f"size {n}, got {size}")
    if not config.exact:
        _axes.check_float(x, name)
    p = plan("all_to_all", axes, x.shape, x.dtype, n, config)
    if p.path == "lax":
        y = lax.all_to_all(x, axes, split, concat, tiled=tiled)
        return y, (jnp.zeros(y.shape, jnp.float32) if bound else None)
    x = _axes.to_varying(x, axes)
    if bound and p.quantized:
        return _planned_all_to_all(x, axes, split, concat, tiled, p, bound=True)
    y = _qa2a(x, axes, split, concat, tiled, p)  # quantized, or the exact rows over the exchange
    return y, (jnp.zeros(y.shape, jnp.float32) if bound else None)


def _pieces(x, n, split, tiled):
    """``(N, *piece)``: piece ``i`` of ``x`` goes to rank ``i``."""
    if not tiled:
        return jnp.moveaxis(x, split, 0)
    moved = jnp.moveaxis(x, split, 0)
    moved = moved.reshape(n, moved.shape[0] // n, *moved.shape[1:])
    return jnp.moveaxis(moved, 1, split + 1)


def _arranged(received, concat, tiled):
    """The received pieces ``(N, *piece)`` (rank order) laid out as ``lax.all_to_all``'s
    result."""
    out = jnp.moveaxis(received, 0, concat)
    if not tiled:
        return out
    shape = list(received.shape[1:])
    shape[concat] *= received.shape[0]
    return out.reshape(shape)


def _planned_all_to_all(x, axes, split, concat, tiled, p: Plan, bound=False):
    n = _axes.axis_size(axes)
    pieces = _pieces(x, n, split, tiled)
    piece_shape = pieces.shape[1:]
    hidden = piece_shape[-1] if piece_shape else 1
    rows = math.prod(piece_shape[:-1]) if piece_shape else 1
    if not p.quantized:
        flat = pieces.reshape(n, -1)
        moved = exchange.exchange(flat, jnp.zeros_like(flat),
                                  *exchange.uniform_offsets(n, 1, lax.axis_index(axes)), axes,
                                  p.timeout_ms)
        return _arranged(moved.reshape(pieces.shape), concat, tiled), None
    received = _move_rows(pieces.reshape(n, rows, hidden), axes, p)
    y = _arranged(_decode_rows(received, hidden, x.dtype, p).reshape(n, *piece_shape), concat,
                  tiled)
    if not bound:
        return y, None
    b = codec.error_bound(received)[..., :hidden].reshape(n, *piece_shape)
    return y, _arranged(b, concat, tiled)


def _group_padded(rows, g):
    """``rows`` ``(..., hidden)`` zero-padded along the last axis to whole groups of ``g``."""
    pad = -rows.shape[-1] % g
    return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, pad)]) if pad else rows


def _quantize_rows(rows, p: Plan, num_chunks: int = 1):
    return codec.quantize(_group_padded(rows, p.group_size), bits=p.ag_bits,
                          group_size=p.group_size, num_chunks=num_chunks, backend=p.backend,
                          rotation=p.rotation, spikes=p.ag_spikes, format=p.ag_format)


def _unpack_rows(buf, hp, dtype, p: Plan):
    return wire.unpack(buf, bits=p.ag_bits, group_size=p.group_size, shape=(hp,), dtype=dtype,
                       rotation=p.rotation, spikes=p.ag_spikes, format=p.ag_format)


def _move_rows(blocks, axes, p: Plan) -> codec.Payload:
    """``blocks`` ``(N, rows, hidden)`` quantized, block ``i`` sent to rank ``i``: the received
    payload, ``(N, rows * groups per row, ...)`` in rank order, of shape ``(rows, padded)``."""
    n, rows, hidden = blocks.shape
    q = _quantize_rows(blocks, p, num_chunks=n)
    buf = wire.pack(q.split_groups(n))                            # (N, groups / N, record)
    if p.transport == "p2p":
        flat = buf.reshape(n, -1)
        rank = lax.axis_index(axes)
        got = exchange.exchange(flat, jnp.zeros_like(flat), *exchange.uniform_offsets(n, 1, rank),
                                axes, p.timeout_ms)
        received = got.reshape(buf.shape)
    else:
        received = lax.all_to_all(buf, axes, 0, 0, tiled=False)  # [j] = rank j's block
    hp = q.shape[-1]
    return wire.with_meta(_unpack_rows(received, hp, blocks.dtype, p), shape=(rows, hp))


def _decode_rows(received: codec.Payload, hidden, dtype, p: Plan):
    return codec.dequantize(received, dtype=dtype, backend=p.backend)[..., :hidden]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4, 5))
def _qa2a(x, axes, split, concat, tiled, p):
    return _planned_all_to_all(x, axes, split, concat, tiled, p)[0]


def _qa2a_fwd(x, axes, split, concat, tiled, p):
    return _qa2a(x, axes, split, concat, tiled, p), None


def _qa2a_bwd(axes, split, concat, tiled, p, _, ct):
    ct = _axes.to_varying(ct, axes)
    if p.config.grad == "quantized" or not p.quantized:  # quantized, or the exact exchange
        return (_planned_all_to_all(ct, axes, concat, split, tiled, p)[0],)
    return (lax.all_to_all(ct, axes, concat, split, tiled=tiled),)


_qa2a.defvjp(_qa2a_fwd, _qa2a_bwd)


# --- ragged_all_to_all ----------------------------------------------------------------------------

@takes_options
def ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                      axis_name=None, *, axis_index_groups=None,
                      config: CommConfig | None = None, **options):
    """Quantized ragged all-to-all: a drop-in for ``lax.ragged_all_to_all``.

    This rank sends rows ``[input_offsets[j], + send_sizes[j])`` of ``operand`` to rank ``j``,
    which writes them at ``output_offsets[j]`` of its ``output``; it receives ``recv_sizes[j]``
    rows from rank ``j``. Rows nobody writes keep ``output``'s values. Each row is quantized in
    groups along its values (module docstring).

    Args:
      operand: ``(rows, ...)``: f32, bf16 or f16 for the quantized path.
      output: ``(rows', ...)``: ``operand``'s dtype and row shape.
      input_offsets, send_sizes, output_offsets, recv_sizes: ``(N,)`` int32 (or int64) arrays,
        as for ``lax.ragged_all_to_all``.
      axis_name: a mesh axis name or a tuple of them (also by keyword, as in lax).
      axis_index_groups: must be None.
      config, bits, ...: as for :func:`all_to_all`.

    Returns:
      ``output`` with the received rows written, varying over the axes.
    """
    config = config_from(config, options, "ragged_all_to_all")
    if axis_name is None:
        raise TypeError("ragged_all_to_all: axis_name is required")
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.ragged_all_to_all: axis_index_groups is not "
                                  "supported")
    axes = _axes.normalize_axes(axis_name, "ragged_all_to_all")
    operand, output = jnp.asarray(operand), jnp.asarray(output)
    metas = tuple(jnp.asarray(a) for a in (input_offsets, send_sizes, output_offsets,
                                           recv_sizes))
    _check_ragged(operand, output, metas, _axes.axis_size(axes))
    if not config.exact:
        _axes.check_float(operand, "operand")
    p = plan("ragged_all_to_all", axes, operand.shape, operand.dtype, _axes.axis_size(axes),
             config)
    if operand.size == 0 or output.shape[0] == 0:
        return _axes.to_varying(output, axes)  # no row can move
    if p.path == "lax":
        return lax.ragged_all_to_all(operand, output, *metas, axis_name=axes)
    # varying first: the cotangents the custom VJP returns vary over the axes
    operand, output = _axes.to_varying(operand, axes), _axes.to_varying(output, axes)
    return _ragged(operand, output, *metas, axes, p)


def _check_ragged(operand, output, metas, n):
    if operand.ndim < 1 or output.ndim != operand.ndim:
        raise ValueError(f"ragged_all_to_all: operand and output must have the same rank >= 1, "
                         f"got {operand.shape} and {output.shape}")
    if operand.shape[1:] != output.shape[1:]:
        raise ValueError(f"ragged_all_to_all: operand and output rows differ: {operand.shape} "
                         f"and {output.shape}")
    if operand.dtype != output.dtype:
        raise TypeError(f"ragged_all_to_all: output must have the operand's dtype "
                        f"{operand.dtype}, got {output.dtype}")
    names = ("input_offsets", "send_sizes", "output_offsets", "recv_sizes")
    for name, a in zip(names, metas):
        if a.shape != (n,) or not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"ragged_all_to_all: {name} must be an integer array of shape "
                             f"({n},) (one entry per rank), got {a.dtype}{list(a.shape)}")
    if len({a.dtype for a in metas}) != 1:
        raise TypeError("ragged_all_to_all: the offsets and sizes must share one integer dtype")


def _move_ragged(operand, output, metas, axes, p: Plan):
    """The rows moved as they are: lax's op, or the p2p exchange (CPU's only way)."""
    if p.transport == "p2p":
        return exchange.exchange(operand, output, *metas, axes, p.timeout_ms)
    return lax.ragged_all_to_all(_axes.to_varying(operand, axes), _axes.to_varying(output, axes),
                                 *metas, axis_name=axes)


def _ragged_forward(operand, output, metas, axes, p: Plan):
    """``(result, received-row mask)``."""
    if not p.quantized:
        return _move_ragged(operand, output, metas, axes, p), None
    rows_in, rows_out = operand.shape[0], output.shape[0]
    hidden = math.prod(operand.shape[1:])
    q = _quantize_rows(operand.reshape(rows_in, hidden), p)
    packed = wire.pack(q).reshape(rows_in, -1)
    flagged = jnp.concatenate([packed, jnp.ones((rows_in, 1), jnp.uint8)], axis=1)
    zeros = jnp.zeros((rows_out, flagged.shape[1]), jnp.uint8)
    got = _move_ragged(flagged, zeros, metas, axes, p)
    hp = q.shape[-1]
    groups = hp // p.group_size
    received = _unpack_rows(got[:, :-1].reshape(rows_out, groups, -1), hp, output.dtype, p)
    decoded = _decode_rows(received, hidden, output.dtype, p).reshape(output.shape)
    mask = (got[:, -1] == 1).reshape((rows_out,) + (1,) * (output.ndim - 1))
    return jnp.where(mask, decoded, _axes.to_varying(output, axes)), mask


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7))
def _ragged(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, p):
    metas = (input_offsets, send_sizes, output_offsets, recv_sizes)
    return _ragged_forward(operand, output, metas, axes, p)[0]


def _ragged_fwd(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axes, p):
    metas = (input_offsets, send_sizes, output_offsets, recv_sizes)
    y = _ragged_forward(operand, output, metas, axes, p)[0]
    return y, (jnp.zeros((operand.shape[0], 0), operand.dtype), metas)  # the operand's rows


def _ragged_bwd(axes, p, res, ct):
    rows_of, (input_offsets, send_sizes, output_offsets, recv_sizes) = res
    ct = _axes.to_varying(ct, axes)
    # where each sender's rows landed in this rank's output, and where they came from
    landed = lax.all_to_all(_axes.to_varying(output_offsets, axes), axes, 0, 0, tiled=True)
    sources = lax.all_to_all(_axes.to_varying(input_offsets, axes), axes, 0, 0, tiled=True)
    back = (landed, recv_sizes, sources, send_sizes)
    zero = jnp.zeros((rows_of.shape[0], *ct.shape[1:]), ct.dtype)
    bp = p if p.config.grad == "quantized" and p.quantized else _exact_plan(p)
    operand_t = _ragged_forward(ct, zero, back, axes, bp)[0]
    return operand_t, _unreceived(ct, landed, recv_sizes), None, None, None, None


def _unreceived(ct, landed, recv_sizes):
    """``ct`` with the rows some peer wrote zeroed (the output's cotangent)."""
    rows = ct.shape[0]
    some = (recv_sizes > 0).astype(jnp.int32)
    marks = jnp.zeros(rows + 1, jnp.int32).at[jnp.minimum(landed, rows)].add(some)
    marks = marks.at[jnp.minimum(landed + recv_sizes, rows)].add(-some)
    written = (jnp.cumsum(marks)[:rows] > 0).reshape((rows,) + (1,) * (ct.ndim - 1))
    return jnp.where(written, jnp.zeros_like(ct), ct)


def _exact_plan(p: Plan) -> Plan:
    """``p``'s exact counterpart: the rows as they are, over the same way of moving them."""
    transport = "p2p" if p.transport == "p2p" or jax.default_backend() == "cpu" else "xla"
    return dataclasses.replace(p, path="exact", transport=transport,
                               group_formats=(None, None))


_ragged.defvjp(_ragged_fwd, _ragged_bwd)
