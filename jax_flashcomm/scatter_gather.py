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
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _common
from jax_flashcomm import codec
from jax_flashcomm import transport
from jax_flashcomm.allreduce import vary
from jax_flashcomm.policy import DEFAULT_MIN_BYTES, CommConfig, decide, make_config

__all__ = ["psum_scatter", "all_gather"]


def _config(config, **options) -> CommConfig:
    return make_config(config) if config is not None else make_config(**options)


def _check_dim(dim, ndim, name):
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for an operand of rank {ndim}")
    return dim % ndim


# --- psum_scatter ---------------------------------------------------------------------------------

def psum_scatter(x, axis_name, *, scatter_dimension: int = 0, axis_index_groups=None,
                 tiled: bool = False, bits: int | None = 8, group_size: int = 128,
                 min_bytes: int = DEFAULT_MIN_BYTES, backend: str = "auto",
                 grad: str = "exact", config: CommConfig | None = None, rotation=0,
                 spikes="auto", transport="auto"):
    """Quantized reduce-scatter: a drop-in for ``lax.psum_scatter``.

    Rank i gets the sum over ranks of slice i of ``x`` along ``scatter_dimension`` (that
    dimension removed when ``tiled=False``, where its size must be N; divided by N when
    ``tiled=True``). ``bits=None`` is exactly ``lax.psum_scatter``; below ``min_bytes`` per rank
    the lax op is used. ``config`` (a :class:`CommConfig`) replaces the option arguments;
    ``transport`` ("auto", "xla", "p2p") how the payloads move (docs/transport.md).
    """
    config = _config(config, bits=bits, group_size=group_size, min_bytes=min_bytes,
                     backend=backend, grad=grad, rotation=rotation, spikes=spikes,
                     transport=transport)
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.psum_scatter: axis_index_groups is not "
                                  "supported")
    axes = _common.normalize_axes(axis_name)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _psum_scatter_leaf(leaf, axes, scatter_dimension, bool(tiled), config,
                                              _common.leaf_name(path)), x)


def _psum_scatter_leaf(x, axes, dim, tiled, config, name="x"):
    if not config.exact:
        _common.check_float(x, name)
    n = _common.axis_size(axes)
    dim = _check_dim(dim, jnp.ndim(x), "scatter_dimension")
    size = x.shape[dim]
    if tiled and size % n:
        raise ValueError(f"psum_scatter: scatter_dimension {dim} has size {size}, not a "
                         f"multiple of the axis size {n}")
    if not tiled and size != n:
        raise ValueError(f"psum_scatter: with tiled=False scatter_dimension {dim} must have "
                         f"the axis size {n}, got {size}")
    if x.size == 0:
        return _empty_scatter(x, axes, dim, tiled, n)
    if config.exact:
        return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled)
    decision = decide("psum_scatter", axes, x.shape, x.dtype, n, config, phases=("rs",))
    if not decision.quantized or x.size == 0:
        return lax.psum_scatter(x, axes, scatter_dimension=dim, tiled=tiled)
    return _qpsum_scatter(vary(x, axes, config), axes, dim, tiled, config)


def _empty_scatter(x, axes, dim, tiled, n):
    """The (empty) result of reducing an empty operand, without a collective: XLA rejects a
    reduce-scatter whose scattered dimension has size 0, which lax.psum_scatter emits."""
    shape = list(x.shape)
    if tiled:
        shape[dim] //= n
    else:
        del shape[dim]
    out = jnp.zeros(shape, x.dtype) + jnp.sum(x).astype(x.dtype)  # x's varying axes, no values
    return _common.to_varying(out, axes)


def _chunked(x, n, dim):
    """``x`` as ``(N, M)``: row i is the (flattened) slice that rank i keeps."""
    moved = jnp.moveaxis(x, dim, 0)
    return moved.reshape(n, -1), moved.shape[1:]


def reduce_scatter_parts(x, axes, dim, tiled, config: CommConfig):
    """Quantized reduce-scatter of a varying ``x``; also returns this rank's payload.

    Returns ``(y, p1)``: ``p1`` holds this rank's N chunks ``(N, groups, ...)``, its ``shape``
    the padded chunk ``(Mp,)``, so ``codec.error_bound(p1)`` is ``(N, Mp)``.
    """
    n = _common.axis_size(axes)
    g, bits = config.group_size, config.phase1_bits
    rows, rest = _chunked(x, n, dim)                               # (N, M)
    m = rows.shape[1]
    mp = -(-m // g) * g
    if mp != m:
        rows = jnp.pad(rows, ((0, 0), (0, mp - m)))
    if transport.choose(config, axes, x.size * x.dtype.itemsize) == "p2p":
        summed, p1 = transport.p2p.reduce_scatter(rows, axes, config, config.p2p_timeout_ms)
    else:
        p1 = codec.quantize(rows, bits=bits, group_size=g, num_chunks=n,
                            backend=config.backend, rotation=config.rotation,
                            spikes=config.phase1_spikes)
        p1 = _common.with_meta(p1.split_groups(n), shape=(mp,))
        received = lax.all_to_all(_common.pack(p1), axes, 0, 0, tiled=False)
        recv = _common.unpack(received, bits=bits, group_size=g, shape=(mp,), dtype=x.dtype,
                              rotation=config.rotation, spikes=config.phase1_spikes)
        summed = codec.dequantize_sum(recv, backend=config.backend)
    summed = summed[:m]
    rest = tuple(rest)
    if tiled:
        out = summed.reshape(x.shape[dim] // n, *rest)
        out = jnp.moveaxis(out, 0, dim)
    else:
        out = summed.reshape(rest)
    return out, p1


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _qpsum_scatter(x, axes, dim, tiled, config):
    return reduce_scatter_parts(x, axes, dim, tiled, config)[0]


def _qpsum_scatter_fwd(x, axes, dim, tiled, config):
    return _qpsum_scatter(x, axes, dim, tiled, config), None


def _qpsum_scatter_bwd(axes, dim, tiled, config, _, ct):
    ct = _common.to_varying(ct, axes)
    if config.grad == "quantized":
        return (all_gather(ct, axes, axis=dim, tiled=tiled, config=config),)
    return (lax.all_gather(ct, axes, axis=dim, tiled=tiled),)


_qpsum_scatter.defvjp(_qpsum_scatter_fwd, _qpsum_scatter_bwd)


# --- all_gather -----------------------------------------------------------------------------------

def all_gather(x, axis_name, *, axis: int = 0, axis_index_groups=None, tiled: bool = False,
               bits: int | None = 8, group_size: int = 128,
               min_bytes: int = DEFAULT_MIN_BYTES, backend: str = "auto",
               grad: str = "exact", config: CommConfig | None = None, rotation=0,
               spikes="auto", transport="auto"):
    """Quantized all-gather: a drop-in for ``lax.all_gather``.

    Stacks the N ranks' operands on a new dimension ``axis`` (``tiled=False``) or concatenates
    them along ``axis`` (``tiled=True``). ``bits=None`` is exactly ``lax.all_gather``; below
    ``min_bytes`` per rank the lax op is used. ``config`` replaces the option arguments;
    ``transport`` ("auto", "xla", "p2p") how the payloads move (docs/transport.md).
    """
    config = _config(config, bits=bits, group_size=group_size, min_bytes=min_bytes,
                     backend=backend, grad=grad, rotation=rotation, spikes=spikes,
                     transport=transport)
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.all_gather: axis_index_groups is not "
                                  "supported")
    axes = _common.normalize_axes(axis_name)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _all_gather_leaf(leaf, axes, axis, bool(tiled), config,
                                            _common.leaf_name(path)), x)


def _all_gather_leaf(x, axes, axis, tiled, config, name="x"):
    if not config.exact:
        _common.check_float(x, name)
    n = _common.axis_size(axes)
    ndim = jnp.ndim(x)
    axis = _check_dim(axis, ndim if tiled else ndim + 1, "axis")
    if tiled and ndim == 0:
        raise ValueError("all_gather: tiled=True needs an operand of rank >= 1")
    if config.exact:
        return lax.all_gather(x, axes, axis=axis, tiled=tiled)
    decision = decide("all_gather", axes, x.shape, x.dtype, n, config, phases=("ag",))
    if not decision.quantized or x.size == 0:
        return lax.all_gather(x, axes, axis=axis, tiled=tiled)
    return _qall_gather(vary(x, axes, config), axes, axis, tiled, config)


def all_gather_parts(x, axes, axis, tiled, config: CommConfig):
    """Quantized all-gather of a varying ``x``; also returns this rank's payload.

    Returns ``(y, p)``: ``p`` is this rank's payload of ``x`` (``x``'s shape);
    :func:`gather_payloads` of it gives every sender's, whose ``codec.error_bound`` is
    ``(N, *x.shape)``.
    """
    if transport.choose(config, axes, x.size * x.dtype.itemsize) == "p2p":
        stacked, p = transport.p2p.all_gather(x, axes, config, config.p2p_timeout_ms)
        return _arrange_gathered(stacked, axis, tiled), p
    p = codec.quantize(x, bits=config.phase2_bits, group_size=config.group_size,
                       backend=config.backend, rotation=config.rotation,
                       spikes=config.phase2_spikes)
    n = _common.axis_size(axes)
    if n * x.size > np.iinfo(np.int32).max:  # beyond an int32 element offset
        return _decode_gathered(gather_payloads(p, axes), axis, tiled, config), p
    return _ring_gather(x, p, axes, axis, tiled, config), p


def gather_payloads(p, axes):
    """Every rank's payload ``p``, gathered in rank order: ``(N, groups, ...)`` with ``p``'s
    shape (one ``lax.all_gather`` of the packed payloads). For error bounds in tests; the
    all-gather itself never holds them all."""
    gathered = lax.all_gather(_common.pack(p), axes, axis=0, tiled=False)
    return _common.unpack(gathered, bits=p.bits, group_size=p.group_size, shape=p.shape,
                          dtype=p.dtype, rotation=p.rotation, spikes=p.spikes)


def _decode_gathered(pg, axis, tiled, config):
    """The gathered array from gathered payloads ``(N, ...)``, decoded at once (the one-shot
    all-gather; used when the output is too large for int32 offsets, and as the tests' oracle
    of the ring)."""
    stacked = codec.dequantize(pg, backend=config.backend)          # (N, *x.shape)
    return _arrange_gathered(stacked, axis, tiled)


def _arrange_gathered(stacked, axis, tiled):
    """The N decoded operands ``(N, *x.shape)`` as lax.all_gather lays them out."""
    out = jnp.moveaxis(stacked, 0, axis)
    if tiled:
        shape = list(stacked.shape[1:])
        shape[axis] *= stacked.shape[0]
        out = out.reshape(shape)
    return out


def _gathered_shape(shape, n, axis, tiled):
    if tiled:
        return (*shape[:axis], n * shape[axis], *shape[axis + 1:])
    return (*shape[:axis], n, *shape[axis:])


def _ring_gather(x, p, axes, axis, tiled, config):
    """The ring: N decodes into one output buffer, N-1 ``ppermute`` steps of a packed payload.

    Step k (k = 0 .. N-1) decodes the payload in hand, which came from the rank k places back
    on the ring, into that rank's slot, then (k < N-1) passes it on to the next rank. The slots
    are ``lax.all_gather``'s: ranks in the linearized index over ``axes``, in that order.

    When the slots are contiguous in the output (every dimension before ``axis`` has size 1,
    e.g. ``axis=0``) the output buffer is the result itself, written in place by
    ``codec.dequantize_into``: temp is about three payloads. Otherwise the payloads are decoded
    into an ``(N, *x.shape)`` buffer that is then transposed into place (a copy of the output,
    held with it).
    """
    n = _common.axis_size(axes)
    size = x.size
    contiguous = math.prod(x.shape[:axis]) == 1
    shape = _gathered_shape(x.shape, n, axis, tiled) if contiguous else (n, *x.shape)
    out = jnp.zeros(shape, x.dtype)
    vma = tuple(_common.varying_axes(x))
    if vma:
        out = lax.pcast(out, vma, to="varying")
    # The ring runs over the axes in mesh order: ppermute numbers ranks that way whatever the
    # order of the tuple it is given, while lax.all_gather (and axis_index) number them in
    # the order of ``axes``. ``slot`` maps a ring position to its all_gather slot.
    mesh_names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    ring_axes = tuple(a for a in mesh_names if a in axes)
    if len(ring_axes) != len(axes):  # pragma: no cover - axes always belong to the mesh
        ring_axes = axes
    sizes = [int(lax.axis_size(a)) for a in ring_axes]
    coords = np.stack(np.unravel_index(np.arange(n), sizes), axis=-1)     # ring pos -> coords
    order = [ring_axes.index(a) for a in axes]
    slots = np.ravel_multi_index(tuple(coords[:, order].T), [sizes[i] for i in order])
    me = lax.axis_index(ring_axes)
    ring = [(j, (j + 1) % n) for j in range(n)]

    def slot(pos):
        if np.array_equal(slots, np.arange(n)):
            return pos
        return jnp.asarray(slots, jnp.int32)[pos]

    def unpack(buf):
        return _common.unpack(buf, bits=p.bits, group_size=p.group_size, shape=p.shape,
                              dtype=p.dtype, rotation=p.rotation, spikes=p.spikes)

    def decode(out, buf, k):
        sender = slot((me + n - k) % n)
        return codec.dequantize_into(out, unpack(buf), sender * size, backend=config.backend)

    def step(k, carry):
        out, buf = carry
        return decode(out, buf, k), lax.ppermute(buf, ring_axes, ring)

    out, buf = lax.fori_loop(0, n - 1, step, (out, _common.pack(p)))
    out = decode(out, buf, n - 1)
    if not contiguous:
        out = jnp.moveaxis(out, 0, axis)
        if tiled:
            out = out.reshape(_gathered_shape(x.shape, n, axis, tiled))
    return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2, 3, 4))
def _qall_gather(x, axes, axis, tiled, config):
    return all_gather_parts(x, axes, axis, tiled, config)[0]


def _qall_gather_fwd(x, axes, axis, tiled, config):
    return _qall_gather(x, axes, axis, tiled, config), None


def _qall_gather_bwd(axes, axis, tiled, config, _, ct):
    ct = _common.to_varying(ct, axes)
    if config.grad == "quantized":
        return (psum_scatter(ct, axes, scatter_dimension=axis, tiled=tiled, config=config),)
    return (lax.psum_scatter(ct, axes, scatter_dimension=axis, tiled=tiled),)


_qall_gather.defvjp(_qall_gather_fwd, _qall_gather_bwd)
