"""The pallas transport's rings: a ring step as a Pallas kernel (:class:`PallasLink`, what
``all_gather_matmul`` / ``matmul_reduce_scatter`` with ``transport="pallas"`` run), and the
collective matmuls as one fused kernel each (:func:`all_gather_matmul`,
:func:`matmul_reduce_scatter`), whose step k starts the DMA of a chunk, computes the dot of the
chunk in hand while it moves, then waits.

The fused kernels walk the rings of :mod:`jax_flashcomm._rings` (the same chunks, the same dots
of the same shapes, the same placement and accumulation order), so their results are the
``xla`` rings' bit for bit. Each direction of a ring has two receive slots on the neighbour; a
sender waits for the neighbour's "slot free" signal before reusing one (:class:`_Channel`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_flashcomm import _axes, codec
from jax_flashcomm.transport import wire
from jax_flashcomm.transport.pallas_kernels import (Codec, barrier, call_kernel, out_type,
                                                    peer_id)

__all__ = ["PallasLink", "shift", "all_gather_matmul", "matmul_reduce_scatter"]


def shift(buf: jax.Array, axes: tuple, step: int) -> jax.Array:
    """The ``buf`` of rank ``r - step`` (ranks numbered as ``lax.axis_index(axes)``): one remote
    DMA from HBM to the neighbour's HBM, in a Pallas kernel."""
    n = _axes.axis_size(axes)

    def kernel(src, dst, send_sem, recv_sem):
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        c = pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem,
                                         device_id=peer_id(axes, (me + step) % n),
                                         device_id_type=pl.DeviceIdType.MESH)
        c.start()
        c.wait_send()
        c.wait_recv()

    dma = pltpu.SemaphoreType.DMA(())
    return call_kernel(kernel, [out_type(buf.shape, buf.dtype, buf)], [buf], [dma, dma], Codec(),
                       "flashcomm_pallas_ring_step")[0]


class PallasLink:
    """Ring steps (:mod:`jax_flashcomm.transport.ring_steps`) as :func:`shift` kernels.

    Args:
      axis_name: the ring's mesh axis (or tuple of axes).
    """

    name = "pallas"

    def __init__(self, axis_name):
        self.axes = _axes.normalize_axes(axis_name)

    def begin(self, payload, step: int):
        return payload, shift(payload, self.axes, step)

    def order(self, pending):
        return 0

    def finish(self, pending, after):
        return pending, after


class _Channel:
    """One direction of a ring in a kernel: the neighbour ``me + step`` receives into
    ``slots[t % 2]`` at step t; before a slot is reused, its reader signals ``ready``.

    Args:
      slots, send_sems, recv_sems, ready: the scratch refs (two slots, two DMA semaphores each,
        one regular semaphore).
      first, last: the first and last step that sends.
    """

    def __init__(self, refs, axes, me, n, step, first, last):
        self.slots, self.send_sems, self.recv_sems, self.ready = refs
        self.axes, self.me, self.n, self.step = axes, me, n, step
        self.first, self.last = first, last

    def send(self, src, t):
        """Start moving ``src`` (a VMEM ref) to the neighbour's slot of step ``t``."""
        if t >= self.first + 2:
            pl.semaphore_wait(self.ready, 1)
        slot = t % 2
        c = pltpu.make_async_remote_copy(
            src, self.slots.at[slot], self.send_sems.at[slot], self.recv_sems.at[slot],
            device_id=peer_id(self.axes, (self.me + self.step) % self.n),
            device_id_type=pl.DeviceIdType.MESH)
        c.start()
        return c

    def release(self, t):
        """The slot received at step ``t`` was read: tell the sender it may write it again."""
        if t + 2 <= self.last:
            pl.semaphore_signal(self.ready, 1,
                                device_id=peer_id(self.axes, (self.me - self.step) % self.n),
                                device_id_type=pl.DeviceIdType.MESH)


def _dot(a, b, dtype):
    """``a @ b`` in ``dtype``; 16-bit operands accumulate in f32 (Mosaic's matmul needs a
    32-bit accumulator), f32 ones are ``jnp.matmul`` itself (the xla ring's dot)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _channel_scratch(shape, dtype):
    dma = pltpu.SemaphoreType.DMA((2,))
    return [pltpu.VMEM((2, *shape), dtype), dma, dma, pltpu.SemaphoreType.REGULAR]


def _check_2d(fn, x, w):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{fn}: the fused pallas kernel takes x (rows, K) and w (K, cols), "
                         f"got x {x.shape} and w {w.shape}")


def _piece_fns(fns: Codec, piece_shape, dtype, quant):
    """``(encode index or None, decode index or None, buffer shape, buffer dtype)`` of the
    pieces a quantized ring moves (the twin's ``pack_tree`` of one payload)."""
    if quant is None:
        return None, None, piece_shape, dtype
    bits, group_size, _, rotation, spikes = quant
    piece = jax.ShapeDtypeStruct(piece_shape, dtype)

    def quantize(a):
        return codec.quantize(a, bits=bits, group_size=group_size, backend="jnp",
                              rotation=rotation, spikes=spikes)

    layout = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype),
                          jax.eval_shape(quantize, piece))
    enc = fns.add(lambda a: wire.pack_tree(quantize(a)), piece)
    nbytes = jax.eval_shape(lambda a: wire.pack_tree(quantize(a)), piece).shape
    dec = fns.add(lambda b: codec.dequantize(wire.unpack_tree(b, layout), dtype=dtype,
                                             backend="jnp"),
                  jax.ShapeDtypeStruct(nbytes, jnp.uint8))
    return enc, dec, nbytes, jnp.uint8


def all_gather_matmul(x, w, axis_name, *, bidirectional: bool = False, quant=None):
    """``lax.all_gather(x, axis_name, tiled=True) @ w`` as one fused ring kernel (x 2-D, rows
    gathered); ``quant``: ``(bits, group_size, backend, rotation, spikes)`` to move each piece
    quantized once (as :func:`jax_flashcomm._rings.ag_ring`), or None (exact)."""
    _check_2d("all_gather_matmul", x, w)
    axes = _axes.normalize_axes(axis_name)
    n, (m, _), cols = _axes.axis_size(axes), x.shape, w.shape[1]
    out_dtype = jnp.result_type(x.dtype, w.dtype)
    halves = bidirectional and m >= 2
    h = m // 2 if halves else m
    sizes = (h, m - h) if halves else (m,)
    fns = Codec()
    pieces = [_piece_fns(fns, (sz, x.shape[1]), x.dtype, quant) for sz in sizes]
    nc = len(fns.consts)

    def kernel(*refs):
        x_ref, w_ref, consts = refs[0], refs[1], refs[2:2 + nc]
        out_ref, xv, wv, pv, *rest = refs[2 + nc:]
        own = rest[:len(sizes)]
        chans = rest[len(sizes):]
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(x_ref, xv)
        pltpu.sync_copy(w_ref, wv)
        steps = [1, -1][:len(sizes)]
        chan = [_Channel(chans[4 * i:4 * i + 4], axes, me, n, steps[i], 0, n - 2)
                for i in range(len(sizes))]
        lo = [0, h]
        for i, (enc, _, _, _) in enumerate(pieces):
            part = xv[lo[i]:lo[i] + sizes[i]]
            own[i][...] = part if enc is None else fns.run(enc, consts, part)

        def chunk(i, held):
            dec = pieces[i][1]
            return held[...] if dec is None else fns.run(dec, consts, held[...])

        def place(prod, row):
            pv[pl.ds(0, prod.shape[0])] = prod.astype(out_dtype)
            pltpu.sync_copy(pv.at[pl.ds(0, prod.shape[0])], out_ref.at[pl.ds(row, prod.shape[0])])

        for k in range(n):
            held = [own[i] if k == 0 else chan[i].slots.at[(k - 1) % 2]
                    for i in range(len(sizes))]
            copies = [c.send(held[i], k) for i, c in enumerate(chan)] if k < n - 1 else []
            if k == 0 and quant is None and halves:  # the whole local chunk: one dot
                place(_dot(xv[...], wv[...], out_dtype), me * m)
            else:
                for i in range(len(sizes)):
                    src = (me - steps[i] * k) % n
                    place(_dot(chunk(i, held[i]), wv[...], out_dtype), src * m + lo[i])
            for c in copies:
                c.wait_send()
                c.wait_recv()
            if k >= 1:
                for c in chan:
                    c.release(k - 1)

    scratch = [pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM(w.shape, w.dtype),
               pltpu.VMEM((m, cols), out_dtype)]
    scratch += [pltpu.VMEM(p[2], p[3]) for p in pieces]
    for p in pieces:
        scratch += _channel_scratch(p[2], p[3])
    out = out_type((n * m, cols), out_dtype, x)
    return call_kernel(kernel, [out], [x, w], scratch, fns, "flashcomm_pallas_all_gather_matmul")[0]


def matmul_reduce_scatter(x, w, axis_name, *, bidirectional: bool = False):
    """``lax.psum_scatter(x @ w, axis_name, tiled=True)`` as one fused ring kernel (x 2-D, rows
    scattered), the ring of :func:`jax_flashcomm._rings.rs_ring`."""
    _check_2d("matmul_reduce_scatter", x, w)
    axes = _axes.normalize_axes(axis_name)
    n, rows, cols = _axes.axis_size(axes), x.shape[0], w.shape[1]
    if rows % n:
        raise ValueError(f"matmul_reduce_scatter: {rows} rows do not split over {n} ranks")
    mo = rows // n
    dtype = jnp.result_type(x.dtype, w.dtype)
    halves = bidirectional and mo >= 2 and n > 1
    h = mo // 2

    def kernel(x_ref, w_ref, out_ref, xv, wv, *rest):
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(x_ref, xv)
        pltpu.sync_copy(w_ref, wv)

        def block(start, size):
            return _dot(xv[pl.ds(start, size)], wv[...], dtype)

        def step(chans_accs, s, parts):
            """Send each accumulator, compute this step's blocks while they move, then add."""
            copies = [c.send(acc.at[(s - 1) % 2], s) for c, acc in chans_accs]
            prods = [block(start, size) for start, size in parts]
            for c in copies:
                c.wait_send()
                c.wait_recv()
            return [c.slots[s % 2] + p for (c, _), p in zip(chans_accs, prods)]

        if not halves:
            acc, chans = rest[0], rest[1:]
            chan = _Channel(chans, axes, me, n, 1, 1, n - 1)
            acc[0] = block(((me - 1) % n) * mo, mo)
            for s in range(1, n):
                (acc[s % 2],) = step([(chan, acc)], s, [(((me - 1 - s) % n) * mo, mo)])
                chan.release(s)
            pltpu.sync_copy(acc.at[(n - 1) % 2], out_ref)
            return
        lo_acc, hi_acc, chans = rest[0], rest[1], rest[2:]
        lo_c = _Channel(chans[:4], axes, me, n, 1, 1, n - 1)
        hi_c = _Channel(chans[4:], axes, me, n, -1, 1, n - 1)
        both = [(lo_c, lo_acc), (hi_c, hi_acc)]
        lo_acc[0] = block(((me - 1) % n) * mo, h)
        hi_acc[0] = block(((me + 1) % n) * mo + h, mo - h)
        for s in range(1, n - 1):
            lo_acc[s % 2], hi_acc[s % 2] = step(
                both, s, [(((me - 1 - s) % n) * mo, h), (((me + 1 + s) % n) * mo + h, mo - h)])
            lo_c.release(s)
            hi_c.release(s)
        s = n - 1
        copies = [c.send(acc.at[(s - 1) % 2], s) for c, acc in both]
        own = block(me * mo, mo)  # the whole own block: one dot, not two
        for c in copies:
            c.wait_send()
            c.wait_recv()
        lo_acc[s % 2] = lo_c.slots[s % 2] + own[:h]
        hi_acc[s % 2] = hi_c.slots[s % 2] + own[h:]
        pltpu.sync_copy(lo_acc.at[s % 2], out_ref.at[pl.ds(0, h)])
        pltpu.sync_copy(hi_acc.at[s % 2], out_ref.at[pl.ds(h, mo - h)])

    scratch = [pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM(w.shape, w.dtype)]
    if halves:
        scratch += [pltpu.VMEM((2, h, cols), dtype), pltpu.VMEM((2, mo - h, cols), dtype)]
        scratch += _channel_scratch((h, cols), dtype) + _channel_scratch((mo - h, cols), dtype)
    else:
        scratch += [pltpu.VMEM((2, mo, cols), dtype)] + _channel_scratch((mo, cols), dtype)
    if n == 1:
        return x @ w
    return call_kernel(kernel, [out_type((mo, cols), dtype, x)], [x, w], scratch, Codec(),
                       "flashcomm_pallas_matmul_reduce_scatter")[0]

