"""The pallas transport's quantized collectives: one Pallas TPU (Mosaic) kernel per call.

Each kernel moves the codec's payload between ranks by remote DMA
(``pltpu.make_async_remote_copy``), one buffer and one DMA per array (codes, and in the integer
formats the bf16 scale and zero: :func:`_parts`; the returned payloads are the
:mod:`jax_flashcomm.transport.wire` ones), and runs the codec itself on VMEM values: the
functions of the jnp twin (:mod:`jax_flashcomm.codec.reference`), traced once outside the kernel
and evaluated inside it (:func:`jax_flashcomm.transport.pallas_base.eval_for_mosaic`), their
constant tables passed in as VMEM inputs. The bytes and the arithmetic are the twin's, so the
results equal the ``xla`` transport with ``backend="jnp"`` bit for bit. An operand whose buffers
exceed the VMEM budget (:func:`jax_flashcomm.transport.pallas_base.vmem_budget`) runs as one
kernel per tile of whole groups.

* :func:`all_reduce`: every rank encodes its N chunks one after the other and starts each
  chunk's DMA to its owner before encoding the next (the codec of chunk s+1 runs while chunk s
  moves); the owner decodes the N chunks, sums them in f32 (the twin's order) and re-encodes;
  the sum's codes go to every rank, which decodes each one as it lands while the others still
  move.
* :func:`reduce_scatter`: the first half (encode, DMA, decode and f32 sum).
* :func:`all_gather`: each rank encodes its operand once, sends it to every peer and decodes the
  payloads as they land.

Where it runs: on a TPU the kernels compile with Mosaic; on any other backend they run in
Pallas's TPU interpret mode (``pallas_base.interpret_params``), which simulates the DMAs,
semaphores and VMEM of the chips on CPU devices.
"""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_flashcomm import _axes, codec
from jax_flashcomm.transport import wire, xla
from jax_flashcomm.transport.pallas_base import (Codec, barrier, call_kernel, concat, out_type,
                                                 peer_id, tile_bounds, vmem_per_group)

__all__ = ["all_reduce", "reduce_scatter", "all_gather"]


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _formats(plan, phase: str):
    """``(bits, spikes, format)`` of a plan's phase ``"rs"`` or ``"ag"``."""
    return ((plan.rs_bits, plan.rs_spikes, plan.rs_format) if phase == "rs"
            else (plan.ag_bits, plan.ag_spikes, plan.ag_format))


def _parts(p) -> tuple:
    """A payload's arrays as a kernel moves them, each in its own buffer by its own DMA: the
    codes record (uint8), and in the integer formats the bf16 scale and zero ``(..., 1)``
    (no bitcast to bytes, which Mosaic does not lower: "Changing bitwidths")."""
    if p.format != "int":
        return (p.codes,)
    return p.codes, p.scale[..., None], p.zero[..., None]


def _payload(parts, plan, phase: str, shape, dtype):
    """Inverse of :func:`_parts`: the payload of phase ``phase`` for an operand ``shape``."""
    bits, spikes, fmt = _formats(plan, phase)
    if fmt != "int":
        return wire.unpack(parts[0], bits=bits, group_size=plan.group_size, shape=shape,
                           dtype=dtype, rotation=plan.rotation, spikes=spikes, format=fmt)
    codes, scale, zero = parts
    return codec.Payload(codes, scale[..., 0], zero[..., 0], bits=bits,
                         group_size=plan.group_size, shape=tuple(shape), dtype=np.dtype(dtype),
                         rotation=plan.rotation, spikes=spikes)


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _encoder(plan, phase: str, dtype):
    """``values (groups, g) -> wire parts (groups, ...)`` at the phase's format."""
    bits, spikes, fmt = _formats(plan, phase)

    def encode(v):
        return _parts(codec.quantize(v.astype(dtype), bits=bits, group_size=plan.group_size,
                                     backend="jnp", rotation=plan.rotation, spikes=spikes,
                                     format=fmt))
    return encode


def _decoder(plan, phase: str, dtype):
    """``wire parts (groups, ...) -> values (groups, g)`` of ``dtype``."""
    def decode(*parts):
        shape = (parts[0].shape[0], plan.group_size)
        return codec.dequantize(_payload(parts, plan, phase, shape, dtype), backend="jnp")
    return decode


def _remote(src, dst, send_sem, recv_sem, axes, rank):
    return pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem,
                                        device_id=peer_id(axes, rank),
                                        device_id_type=pl.DeviceIdType.MESH)


def _copies(srcs, dsts, sems, slots, axes, rank):
    """One remote copy per wire part: ``srcs[i] -> dsts[i]`` on ``rank``, signalling
    ``sems = (send, recv)`` at ``[i, slots[0]]`` and ``[i, slots[1]]``."""
    return [_remote(a, b, sems[0].at[i, slots[0]], sems[1].at[i, slots[1]], axes, rank)
            for i, (a, b) in enumerate(zip(srcs, dsts))]


def _phase1(refs, fns, enc, axes, me, n):
    """Encode chunk ``(me + s) % N`` for s = 0 .. N-1 and start its DMAs to its owner before
    encoding the next (its HBM -> VMEM load is double-buffered too); the local chunk is stored
    in place. ``send`` and ``recv`` are lists (one buffer per wire part). Returns the pending
    copies ``(outgoing, incoming)``."""
    xg, consts, xv, load_sem, send, recv, sems = refs
    loads = [None, None]

    def load(s):
        c = pltpu.make_async_copy(xg.at[(me + s) % n], xv.at[s % 2], load_sem.at[s % 2])
        c.start()
        loads[s % 2] = c

    load(0)
    outgoing, incoming = [], []
    for s in range(n):
        j = (me + s) % n
        if s + 1 < n:
            load(s + 1)
        loads[s % 2].wait()
        parts = _tuple(fns.run(enc, consts, xv[s % 2]))
        if s == 0:
            for r, part in zip(recv, parts):
                r[me] = part
            continue
        for r, part in zip(send, parts):
            r[s] = part
        src_bufs = [r.at[s] for r in send]
        copies = _copies(src_bufs, [r.at[me] for r in recv], sems, (s, me), axes, j)
        for c in copies:
            c.start()
        outgoing += copies
        src = (me - s) % n
        incoming += _copies(src_bufs, [r.at[src] for r in recv], sems, (s, src), axes, src)
    return outgoing, incoming


def _phase2(own, recv, out, yv, sems, decode, axes, me, n):
    """Send ``own`` (VMEM, one buffer per wire part) to slot ``me`` of every peer's ``recv``;
    decode each slot as it lands, the local one first, into ``out`` (HBM) with
    ``decode(slot index)``."""
    outgoing = []
    for s in range(1, n):
        copies = _copies(own, [r.at[me] for r in recv], sems, (s, me), axes, (me + s) % n)
        for c in copies:
            c.start()
        outgoing += copies
    for r, o in zip(recv, own):
        r[me] = o[...]
    for s in range(n):
        src = (me - s) % n
        if s:
            for c in _copies(own, [r.at[src] for r in recv], sems, (s, src), axes, src):
                c.wait_recv()
        yv[...] = decode(src)
        pltpu.sync_copy(yv, out.at[src])
    for c in outgoing:
        c.wait_send()


def _check_shapes(x, plan, n: int, where: str):
    if n * x.size > 2**31 - 1:
        raise ValueError(f"{where}: transport='pallas' takes at most 2^31 - 1 gathered values, "
                         f"got {n} x {x.size}")


def reduce_scatter(rows: jax.Array, axes: tuple, plan):
    """Quantized reduce-scatter of ``rows`` ``(N, Mp)`` (row i: rank i's slice; ``Mp`` whole
    groups) in one kernel. Returns ``(this rank's f32-summed row (Mp,), its payload split in N
    chunks)``, as :func:`jax_flashcomm.transport.xla.reduce_scatter`."""
    return _exchange(rows, axes, plan, rows.dtype, (rows.shape[1],), sum_only=True)


def all_reduce(x: jax.Array, axes: tuple, plan, decode: bool = True):
    """The two-step quantized all-reduce of ``x`` in one kernel; returns ``(sum, phase-1
    payload, gathered phase-2 payload)`` as :func:`jax_flashcomm.transport.xla.all_reduce`
    (the sum is None when ``decode`` is False, but the kernel decodes it all the same)."""
    _check_shapes(x, plan, 1, "psum")
    y, p1, p2 = _exchange(x, axes, plan, x.dtype, x.shape, sum_only=False)
    return (y if decode else None), p1, p2


def _take(refs, counts):
    """Split ``refs`` into consecutive groups of ``counts`` (an int: a single ref)."""
    out, i = [], 0
    for c in counts:
        out.append(refs[i] if c is None else list(refs[i:i + c]))
        i += 1 if c is None else c
    return out


def _stacked(parts, n):
    """VMEM buffers of ``n`` of each wire part (``parts``: ShapeDtypeStructs)."""
    return [pltpu.VMEM((n, *p.shape), p.dtype) for p in parts]


def _requantizer(plan, shape, dtype):
    """``N received phase-1 chunks' parts -> the f32 sum's phase-2 parts``."""
    b2_bits, b2_spikes, b2_fmt = _formats(plan, "ag")

    def requant(*parts):
        p = _payload(parts, plan, "rs", shape, dtype)
        return _parts(codec.dequantize_sum_quantize(p, bits=b2_bits, spikes=b2_spikes,
                                                    backend="jnp", format=b2_fmt))
    return requant


def _exchange_parts(plan, dtype, shape, gc, xdtype, n, sum_only):
    """``(phase-1 parts, phase-2 parts)`` of ``gc`` groups a chunk (ShapeDtypeStructs)."""
    p1 = _tuple(jax.eval_shape(_encoder(plan, "rs", dtype), _sds((gc, plan.group_size), xdtype)))
    if sum_only:
        return p1, ()
    stacked = [_sds((n, *p.shape), p.dtype) for p in p1]
    return p1, _tuple(jax.eval_shape(_requantizer(plan, shape, dtype), *stacked))


def _exchange_fns(plan, dtype, shape, gc, xdtype, n, sum_only, p1, p2):
    """The kernel's codec: ``(fns, enc, tail, dec)``: ``tail`` sums the N received chunks
    (sum_only) or sums and re-encodes them."""
    g = plan.group_size
    fns = Codec()
    enc = fns.add(_encoder(plan, "rs", dtype), _sds((gc, g), xdtype))
    stacked = [_sds((n, *p.shape), p.dtype) for p in p1]
    if sum_only:
        def summed(*parts):
            p = _payload(parts, plan, "rs", (gc, g), dtype)
            return codec.dequantize_sum(p, backend="jnp").reshape(gc, g)
        return fns, enc, fns.add(summed, *stacked), None
    tail = fns.add(_requantizer(plan, shape, dtype), *stacked)
    return fns, enc, tail, fns.add(_decoder(plan, "ag", dtype), *p2)


def _exchange_scratch(xdtype, dtype, gc, g, n, p1, p2, sum_only):
    """:func:`_exchange_tile`'s scratch: the double-buffered chunk load, the N phase-1 parts
    sent and received, the decoded rows, and the phase-2 buffers and semaphores."""
    k1, k2 = len(p1), len(p2)
    sems = [pltpu.SemaphoreType.DMA((k1, n))] * 2
    scratch = [pltpu.VMEM((2, gc, g), xdtype), pltpu.SemaphoreType.DMA((2,)),
               *_stacked(p1, n), *_stacked(p1, n)]
    if sum_only:
        return scratch + [pltpu.VMEM((gc, g), dtype), *sems]
    scratch += [pltpu.VMEM(p.shape, p.dtype) for p in p2] + _stacked(p2, n)
    return scratch + [pltpu.VMEM((gc, g), dtype), *sems, *[pltpu.SemaphoreType.DMA((k2, n))] * 2]


def _exchange(x, axes, plan, dtype, shape, sum_only: bool):
    n = _axes.axis_size(axes)
    g = plan.group_size
    groups = codec.as_groups(x, g, n)
    gc = groups.shape[0] // n
    xg = groups.reshape(n, gc, g)
    p1, p2 = _exchange_parts(plan, dtype, shape, gc, x.dtype, n, sum_only)
    # the codec's temporaries, estimated: three f32 copies of the N decoded chunks
    per_group = vmem_per_group(_exchange_scratch(x.dtype, dtype, gc, g, n, p1, p2, sum_only),
                                 gc, 3 * n * gc * g * 4)
    tiles = [_exchange_tile(xg[:, a:b], axes, plan, dtype, shape, sum_only)
             for a, b in tile_bounds(gc, per_group)]
    k1 = tiles[0][1]
    # every output has its groups on axis 1 ((N, groups, ...)) but the reduce-scatter's sum
    results = [concat(parts, 0 if sum_only and i == k1 else 1)
               for i, parts in enumerate(zip(*(t[0] for t in tiles)))]
    pay1 = _payload(results[:k1], plan, "rs", shape, dtype)
    if sum_only:
        return results[k1].reshape(shape), pay1
    pay2 = _payload([r.reshape(n * gc, *r.shape[2:]) for r in results[k1:-1]], plan,
                    "ag", shape, dtype)
    y = codec.restore_shape(results[-1].reshape(n * gc, g), tuple(shape)).astype(dtype)
    return y, pay1.merge_groups(), pay2


def _exchange_tile(xg, axes, plan, dtype, shape, sum_only: bool):
    """One kernel over the groups ``xg`` ``(N, groups, G)`` of every rank's chunk; returns
    ``(its outputs, how many are phase-1 parts)``: the phase-1 parts, then the sum
    (``sum_only``) or the phase-2 parts and the decoded chunks."""
    n, gc, g = xg.shape
    p1, p2 = _exchange_parts(plan, dtype, shape, gc, xg.dtype, n, sum_only)
    fns, enc, tail, dec = _exchange_fns(plan, dtype, shape, gc, xg.dtype, n, sum_only, p1, p2)
    nc, k1, k2 = len(fns.consts), len(p1), len(p2)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        me = lax.axis_index(axes)
        if sum_only:
            p1_ref, y_ref, xv, load_sem, send, recv, yv, sems = _take(
                refs[1 + nc:], [k1, None, None, None, k1, k1, None, 2])
        else:
            (p1_ref, p2_ref, y_ref, xv, load_sem, send, recv, own, recv2, yv, sems,
             sems2) = _take(refs[1 + nc:], [k1, k2, None, None, None, k1, k1, k2, k2, None, 2,
                                           2])
        barrier(axes, me, n)
        outgoing, incoming = _phase1((xg_ref, consts, xv, load_sem, send, recv, sems), fns,
                                     enc, axes, me, n)
        for c in incoming:
            c.wait_recv()
        summed = fns.run(tail, consts, *[r[...] for r in recv])
        if sum_only:
            yv[...] = summed
            pltpu.sync_copy(yv, y_ref)
        else:
            for o, part in zip(own, _tuple(summed)):
                o[...] = part
            _phase2(own, recv2, y_ref, yv, sems2,
                    lambda src: fns.run(dec, consts, *[r[src] for r in recv2]), axes, me, n)
            for r, o in zip(recv2, p2_ref):
                pltpu.sync_copy(r, o)
        for c in outgoing:
            c.wait_send()
        # this rank's phase-1 payload: its own chunk from recv, the others from send
        for sb, rb, o in zip(send, recv, p1_ref):
            for s in range(1, n):
                pltpu.sync_copy(sb.at[s], o.at[(me + s) % n])
            pltpu.sync_copy(rb.at[me], o.at[me])

    scratch = _exchange_scratch(xg.dtype, dtype, gc, g, n, p1, p2, sum_only)
    outs = [out_type((n, *p.shape), p.dtype, xg) for p in p1]
    if sum_only:
        outs += [out_type((gc, g), dtype, xg)]
    else:
        outs += [out_type((n, *p.shape), p.dtype, xg, axes) for p in p2]
        outs += [out_type((n, gc, g), dtype, xg, axes)]
    return call_kernel(kernel, outs, [xg], scratch, fns,
                       "flashcomm_pallas_" + ("reduce_scatter" if sum_only else "all_reduce")), k1


def all_gather(x: jax.Array, axes: tuple, axis: int, tiled: bool, plan):
    """Quantized all-gather of ``x`` along ``axis`` (one kernel per tile of its groups,
    :func:`vmem_budget`); returns ``(y, this rank's payload)`` as
    :func:`jax_flashcomm.transport.xla.all_gather`."""
    n = _axes.axis_size(axes)
    _check_shapes(x, plan, n, "all_gather")
    g = plan.group_size
    xg = codec.as_groups(x, g, 1)
    ng = xg.shape[0]
    parts = _gather_parts(plan, ng, x.dtype)
    # the codec's temporaries, estimated: two f32 copies of the decoded groups
    per_group = vmem_per_group(_gather_scratch(x.dtype, ng, g, n, parts), ng, 2 * ng * g * 4)
    tiles = [_gather_tile(xg[a:b], axes, plan) for a, b in tile_bounds(ng, per_group)]
    k = len(parts)
    results = [concat(parts, 1 if i == k else 0) for i, parts in enumerate(zip(*tiles))]
    p = _payload(results[:k], plan, "ag", x.shape, x.dtype)
    size = math.prod(x.shape)
    stacked = results[k].reshape(n, -1)[:, :size].reshape(n, *x.shape)
    return xla.arrange_gathered(stacked, axis, tiled), p


def _gather_parts(plan, ng: int, dtype):
    """The payload's parts of ``ng`` groups (ShapeDtypeStructs)."""
    return _tuple(jax.eval_shape(_encoder(plan, "ag", dtype), _sds((ng, plan.group_size), dtype)))


def _gather_scratch(dtype, ng, g, n, parts):
    """:func:`_gather_tile`'s scratch: the groups, their parts, every rank's parts, the decoded
    rows, the semaphores."""
    return [pltpu.VMEM((ng, g), dtype), *[pltpu.VMEM(p.shape, p.dtype) for p in parts],
            *_stacked(parts, n), pltpu.VMEM((ng, g), dtype),
            *[pltpu.SemaphoreType.DMA((len(parts), n))] * 2]


def _gather_tile(xg, axes, plan):
    """One all-gather kernel over this rank's groups ``xg`` ``(groups, G)``; returns its
    outputs: the payload's parts, then every rank's decoded groups ``(N, groups, G)``."""
    n = _axes.axis_size(axes)
    g = plan.group_size
    ng = xg.shape[0]
    fns = Codec()
    enc = fns.add(_encoder(plan, "ag", xg.dtype), _sds((ng, g), xg.dtype))
    parts = _gather_parts(plan, ng, xg.dtype)
    dec = fns.add(_decoder(plan, "ag", xg.dtype), *parts)
    nc, k = len(fns.consts), len(parts)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        p_ref, y_ref, xv, own, recv, yv, sems = _take(refs[1 + nc:],
                                                       [k, None, None, k, k, None, 2])
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(xg_ref, xv)
        for o, part in zip(own, _tuple(fns.run(enc, consts, xv[...]))):
            o[...] = part
        _phase2(own, recv, y_ref, yv, sems,
                lambda src: fns.run(dec, consts, *[r[src] for r in recv]), axes, me, n)
        for o, r in zip(own, p_ref):
            pltpu.sync_copy(o, r)

    outs = [out_type(p.shape, p.dtype, xg) for p in parts]
    outs += [out_type((n, ng, g), xg.dtype, xg, axes)]
    return call_kernel(kernel, outs, [xg], _gather_scratch(xg.dtype, ng, g, n, parts), fns,
                       "flashcomm_pallas_all_gather")
