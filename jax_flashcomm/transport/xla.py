"""The ``xla`` transport: the quantized collectives over XLA's own collectives.

``all_reduce``: quantize (N chunks) -> ``all_to_all`` -> dequantize + f32 sum + re-quantize
(one fused codec op) -> ``all_gather`` -> dequantize. ``reduce_scatter``: quantize ->
``all_to_all`` -> dequantize + f32 sum. ``all_gather``: quantize -> N-1 ``ppermute`` steps round
a ring, each decoding the payload in hand into its sender's slot. Each phase moves one uint8
buffer (``wire.pack``). Runs on every platform and across processes (gloo, NCCL, ICI).
The ``p2p`` transport (:mod:`jax_flashcomm.transport.p2p`) has the same functions and gives
the same bits.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.jax_compat import all_gather_invariant
from jax_flashcomm.transport import wire
from jax_flashcomm import codec


def all_reduce(x: jax.Array, axes: tuple[str, ...], plan,
               decode: bool = True) -> tuple[jax.Array | None, codec.Payload, codec.Payload]:
    """The two-step all-reduce of a varying ``x``.

    Args:
      x: the operand (f32, bf16 or f16), varying over ``axes``.
      axes: the reduced mesh axes.
      plan: the call's quantized :class:`~jax_flashcomm.planner.Plan` (bits, spikes,
        rotation, group size, backend).
      decode: False: stop at the gathered phase-2 payload (``y`` is None).

    Returns:
      ``(y, p1, p2)``: the sum (replicated), ``p1`` this rank's phase-1 payload, ``p2`` the
      gathered phase-2 payload (replicated).
    """
    n = _axes.axis_size(axes)
    g, b1, b2 = plan.group_size, plan.rs_bits, plan.ag_bits
    rot, k1, k2 = plan.rotation, plan.rs_spikes, plan.ag_spikes
    f1, f2 = plan.rs_format, plan.ag_format
    p1 = codec.quantize(x, bits=b1, group_size=g, num_chunks=n, backend=plan.backend,
                        rotation=rot, spikes=k1, format=f1)
    chunks = wire.pack(p1.split_groups(n))                     # (N, groups/N, bytes)
    received = lax.all_to_all(chunks, axes, 0, 0, tiled=False)    # [i] = chunk from rank i
    recv = wire.unpack(received, bits=b1, group_size=g, shape=x.shape, dtype=x.dtype,
                          rotation=rot, spikes=k1, format=f1)
    summed = codec.dequantize_sum_quantize(recv, bits=b2, spikes=k2, backend=plan.backend,
                                           format=f2)
    gathered = all_gather_invariant(wire.pack(summed), axes, axis=0, tiled=True)
    p2 = wire.unpack(gathered, bits=b2, group_size=g, shape=x.shape, dtype=x.dtype,
                        rotation=rot, spikes=k2, format=f2)
    y = codec.dequantize(p2, backend=plan.backend) if decode else None
    return y, p1, p2


def reduce_scatter(rows: jax.Array, axes: tuple[str, ...],
                   plan) -> tuple[jax.Array, codec.Payload]:
    """Quantized reduce-scatter of varying ``rows``.

    Args:
      rows: ``(N, Mp)`` (``Mp`` whole groups): row i is the slice rank i keeps.
      axes: the reduced mesh axes.
      plan: the call's quantized :class:`~jax_flashcomm.planner.Plan`.

    Returns:
      ``(y, p1)``: ``y`` this rank's f32-summed row ``(Mp,)`` in ``rows``' dtype, ``p1`` this
      rank's payload split in N chunks.
    """
    n, mp = rows.shape
    g, bits = plan.group_size, plan.rs_bits
    p1 = codec.quantize(rows, bits=bits, group_size=g, num_chunks=n, backend=plan.backend,
                        rotation=plan.rotation, spikes=plan.rs_spikes, format=plan.rs_format)
    p1 = wire.with_meta(p1.split_groups(n), shape=(mp,))
    received = lax.all_to_all(wire.pack(p1), axes, 0, 0, tiled=False)
    recv = wire.unpack(received, bits=bits, group_size=g, shape=(mp,), dtype=rows.dtype,
                          rotation=plan.rotation, spikes=plan.rs_spikes, format=plan.rs_format)
    return codec.dequantize_sum(recv, backend=plan.backend), p1


def all_gather(x: jax.Array, axes: tuple[str, ...], axis: int, tiled: bool,
               plan) -> tuple[jax.Array, codec.Payload]:
    """Quantized all-gather of a varying ``x`` (a ring of ``ppermute`` steps).

    Args:
      x: the operand (f32, bf16 or f16), varying over ``axes``.
      axes: the gathered mesh axes.
      axis, tiled: as for ``lax.all_gather``.
      plan: the call's quantized :class:`~jax_flashcomm.planner.Plan`.

    Returns:
      ``(y, p)``: ``y`` laid out as ``lax.all_gather(x, axes, axis=axis, tiled=tiled)``,
      ``p`` this rank's payload.
    """
    p = codec.quantize(x, bits=plan.ag_bits, group_size=plan.group_size,
                       backend=plan.backend, rotation=plan.rotation,
                       spikes=plan.ag_spikes, format=plan.ag_format)
    n = _axes.axis_size(axes)
    if n * x.size > np.iinfo(np.int32).max:  # beyond an int32 element offset
        return decode_gathered(gather_payloads(p, axes), axis, tiled, plan), p
    return _ring_gather(x, p, axes, axis, tiled, plan), p


def gather_payloads(p: codec.Payload, axes: tuple[str, ...]) -> codec.Payload:
    """Every rank's payload ``p``, gathered in rank order (one ``lax.all_gather``).

    For error bounds in tests; the all-gather itself never holds them all.

    Args:
      p: this rank's payload.
      axes: the mesh axes to gather over.

    Returns:
      A payload with arrays ``(N, groups, ...)`` and ``p``'s ``shape``.
    """
    gathered = lax.all_gather(wire.pack(p), axes, axis=0, tiled=False)
    return wire.unpack(gathered, bits=p.bits, group_size=p.group_size, shape=p.shape,
                          dtype=p.dtype, rotation=p.rotation, spikes=p.spikes, format=p.format)


def decode_gathered(pg: codec.Payload, axis: int, tiled: bool, plan) -> jax.Array:
    """The gathered array from gathered payloads ``(N, ...)``, decoded at once.

    The one-shot all-gather; used when the output is too large for int32 offsets, and as the
    tests' oracle of the ring.

    Args:
      pg: gathered payloads (:func:`gather_payloads`).
      axis, tiled: as for ``lax.all_gather``.
      plan: the call's plan (its codec ``backend``).

    Returns:
      The array ``lax.all_gather`` lays out.
    """
    stacked = codec.dequantize(pg, backend=plan.backend)          # (N, *x.shape)
    return arrange_gathered(stacked, axis, tiled)


def arrange_gathered(stacked: jax.Array, axis: int, tiled: bool) -> jax.Array:
    """The N decoded operands ``(N, *x.shape)`` as lax.all_gather lays them out.

    Args:
      stacked: ``(N, *x.shape)``, in lax's rank order.
      axis, tiled: as for ``lax.all_gather``.

    Returns:
      ``stacked`` moved (and with ``tiled`` merged) to that layout.
    """
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


def _ring_gather(x, p, axes, axis, tiled, plan):
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
    n = _axes.axis_size(axes)
    size = x.size
    contiguous = math.prod(x.shape[:axis]) == 1
    shape = _gathered_shape(x.shape, n, axis, tiled) if contiguous else (n, *x.shape)
    out = jnp.zeros(shape, x.dtype)
    vma = tuple(_axes.varying_axes(x))
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
        return wire.unpack(buf, bits=p.bits, group_size=p.group_size, shape=p.shape,
                              dtype=p.dtype, rotation=p.rotation, spikes=p.spikes,
                              format=p.format)

    def decode(out, buf, k):
        sender = slot((me + n - k) % n)
        return codec.dequantize_into(out, unpack(buf), sender * size, backend=plan.backend)

    def step(k, carry):
        out, buf = carry
        return decode(out, buf, k), lax.ppermute(buf, ring_axes, ring)

    out, buf = lax.fori_loop(0, n - 1, step, (out, wire.pack(p)))
    out = decode(out, buf, n - 1)
    if not contiguous:
        out = jnp.moveaxis(out, 0, axis)
        if tiled:
            out = out.reshape(_gathered_shape(x.shape, n, axis, tiled))
    return out
