"""The collective matmuls as one fused Pallas kernel each (:func:`all_gather_matmul`,
:func:`matmul_reduce_scatter`): step k starts the DMA of a chunk, computes the dot of the chunk
in hand while it moves, then waits.

The kernels walk the rings of :mod:`jax_flashcomm._rings` (the same chunks, the same dots of the
same shapes, the same placement and accumulation order), so their results are the ``xla``
rings' bit for bit. Each direction of a ring has two receive slots per wire part on the
neighbour; a sender waits for the neighbour's "slot free" signal before reusing one
(:class:`_Channel`). A quantized chunk travels as its payload's arrays, each in its own buffer
by its own DMA (the codes, and in the integer formats the bf16 scale and zero: no bitcast
between widths, which Mosaic does not lower). :func:`vmem_bytes` is what their buffers take.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_flashcomm import _axes, codec
from jax_flashcomm.transport.pallas_base import (Codec, barrier, call_kernel, out_type, peer_id,
                                                 vmem_bytes_of)

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "vmem_bytes"]


class _Channel:
    """One direction of a ring in a kernel: the neighbour ``me + step`` receives wire part j
    into ``slots[j][t % 2]`` at step t; before a slot is reused, its reader signals ``ready``.

    Args:
      refs: the scratch refs of :func:`_channel_scratch`: one double slot per wire part, the
        send and receive DMA semaphores ``(parts, 2)``, one regular semaphore.
      first, last: the first and last step that sends.
    """

    def __init__(self, refs, axes, me, n, step, first, last):
        *self.slots, self.send_sems, self.recv_sems, self.ready = refs
        self.axes, self.me, self.n, self.step = axes, me, n, step
        self.first, self.last = first, last

    def held(self, t):
        """The slots (one per wire part) received at step ``t``."""
        return [s.at[t % 2] for s in self.slots]

    def send(self, srcs, t):
        """Start moving ``srcs`` (VMEM refs, one per wire part) to the neighbour's slots of
        step ``t``; returns the copies."""
        if t >= self.first + 2:
            pl.semaphore_wait(self.ready, 1)
        slot = t % 2
        copies = [pltpu.make_async_remote_copy(
            src, dst.at[slot], self.send_sems.at[j, slot], self.recv_sems.at[j, slot],
            device_id=peer_id(self.axes, (self.me + self.step) % self.n),
            device_id_type=pl.DeviceIdType.MESH)
            for j, (src, dst) in enumerate(zip(srcs, self.slots))]
        for c in copies:
            c.start()
        return copies

    def release(self, t):
        """The slots received at step ``t`` were read: tell the sender it may write them."""
        if t + 2 <= self.last:
            pl.semaphore_signal(self.ready, 1,
                                device_id=peer_id(self.axes, (self.me - self.step) % self.n),
                                device_id_type=pl.DeviceIdType.MESH)


def _wait(copies):
    for c in copies:
        c.wait_send()
        c.wait_recv()


def _dot(a, b, dtype):
    """``a @ b`` in ``dtype``; 16-bit operands accumulate in f32 (Mosaic's matmul needs a
    32-bit accumulator), f32 ones are ``jnp.matmul`` itself (the xla ring's dot)."""
    if jnp.dtype(dtype) == jnp.float32:
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, preferred_element_type=jnp.float32).astype(dtype)


def _channel_scratch(parts):
    """A channel's scratch (:class:`_Channel`) for wire ``parts`` (ShapeDtypeStructs)."""
    dma = pltpu.SemaphoreType.DMA((len(parts), 2))
    return [*(pltpu.VMEM((2, *p.shape), p.dtype) for p in parts), dma, dma,
            pltpu.SemaphoreType.REGULAR]


def _split(refs, counts):
    """``refs`` in consecutive groups of ``counts``."""
    out, i = [], 0
    for c in counts:
        out.append(list(refs[i:i + c]))
        i += c
    return out


def _check_2d(fn, x, w):
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
        raise ValueError(f"{fn}: the fused pallas kernel takes x (rows, K) and w (K, cols), "
                         f"got x {x.shape} and w {w.shape}")


def _as_part(a):
    return a if a.ndim >= 2 else a[..., None]


def _wire(fns: Codec, piece_shape, dtype, quant):
    """How one piece of a chunk travels: ``(encode index or None, decode index or None, wire
    parts)``; quantized, the parts are the payload's arrays (a 1-D one as ``(groups, 1)``), as
    :func:`jax_flashcomm._rings.ag_ring` quantizes and decodes them."""
    piece = jax.ShapeDtypeStruct(piece_shape, dtype)
    if quant is None:
        return None, None, [piece]
    bits, group_size, _, rotation, spikes = quant

    def quantize(a):
        return codec.quantize(a, bits=bits, group_size=group_size, backend="jnp",
                              rotation=rotation, spikes=spikes)

    layout, treedef = jax.tree.flatten(jax.eval_shape(quantize, piece))

    def encode(a):
        return tuple(_as_part(leaf) for leaf in jax.tree.leaves(quantize(a)))

    def decode(*parts):
        leaves = [p if p.ndim == like.ndim else p[..., 0] for p, like in zip(parts, layout)]
        return codec.dequantize(treedef.unflatten(leaves), dtype=dtype, backend="jnp")

    parts = list(jax.eval_shape(encode, piece))
    return fns.add(encode, piece), fns.add(decode, *parts), parts


class _AgmmLayout:
    """The fused all-gather-matmul's pieces and scratch for one call.

    Attributes:
      out_dtype: the product's dtype.
      sizes, lo: the rows of each piece (one, or the two halves) and its first row.
      fns, pieces: the kernel's codec and each piece's :func:`_wire`.
      scratch, counts: the scratch shapes and how many refs each group of them takes.
    """

    def __init__(self, x, w, bidirectional, quant, keep_gathered):
        m, k = x.shape
        self.out_dtype = jnp.result_type(x.dtype, w.dtype)
        halves = bidirectional and m >= 2
        h = m // 2 if halves else m
        self.sizes, self.lo = ((h, m - h), (0, h)) if halves else ((m,), (0,))
        self.fns = Codec()
        self.pieces = [_wire(self.fns, (sz, k), x.dtype, quant) for sz in self.sizes]
        decoded = quant is not None and keep_gathered
        self.scratch = [pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM(w.shape, w.dtype),
                        pltpu.VMEM((m, w.shape[1]), self.out_dtype)]
        self.scratch += [pltpu.VMEM(x.shape, x.dtype)] if decoded else []
        self.counts = [3 + decoded]
        for _, _, parts in self.pieces:
            self.scratch += [pltpu.VMEM(p.shape, p.dtype) for p in parts]
            self.counts.append(len(parts))
        for _, _, parts in self.pieces:
            self.scratch += _channel_scratch(parts)
            self.counts.append(len(parts) + 3)


def vmem_bytes(op: str, x, w, n: int, *, bidirectional: bool = False, quant=None) -> int:
    """The VMEM the fused kernel of ``op`` takes for its buffers and codec tables, each padded to
    Mosaic's tiles (``all_gather_matmul``: the variant that keeps the gathered chunks).

    Args:
      op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
      x, w: the 2-D operands (arrays or ShapeDtypeStructs).
      n: the number of ranks.
      bidirectional, quant: as for :func:`all_gather_matmul`.

    Returns:
      The bytes.
    """
    if op == "all_gather_matmul":
        layout = _AgmmLayout(x, w, bidirectional, quant, keep_gathered=True)
        scratch, consts = layout.scratch, layout.fns.consts
    else:
        scratch, consts = _mrs_scratch(x, w, n, bidirectional), []
    return vmem_bytes_of(scratch, consts)


def all_gather_matmul(x, w, axis_name, *, bidirectional: bool = False, quant=None,
                      keep_gathered: bool = False):
    """``lax.all_gather(x, axis_name, tiled=True) @ w`` as one fused ring kernel (x 2-D, rows
    gathered), the ring of :func:`jax_flashcomm._rings.ag_ring`.

    Args:
      x: this rank's rows ``(m, K)``.
      w: ``(K, cols)``.
      axis_name: the ring's mesh axis (or tuple of axes).
      bidirectional: half of every chunk travels each way.
      quant: ``(bits, group_size, backend, rotation, spikes)``: each piece moves quantized once
        (decoded by the jnp twin whatever ``backend`` says), or None (exact).
      keep_gathered: also return the gathered chunks as the dots read them (decoded).

    Returns:
      The ``(N * m, cols)`` product; with ``keep_gathered``, ``(product, gathered x)``.
    """
    _check_2d("all_gather_matmul", x, w)
    axes = _axes.normalize_axes(axis_name)
    n, m = _axes.axis_size(axes), x.shape[0]
    lay = _AgmmLayout(x, w, bidirectional, quant, keep_gathered)
    fns, sizes, lo, pieces = lay.fns, lay.sizes, lay.lo, lay.pieces
    nc, n_out = len(fns.consts), 1 + keep_gathered
    steps = (1, -1)[:len(sizes)]

    def kernel(*refs):
        x_ref, w_ref, consts = refs[0], refs[1], refs[2:2 + nc]
        outs = refs[2 + nc:2 + nc + n_out]
        bufs, *groups = _split(refs[2 + nc + n_out:], lay.counts)
        xv, wv, pv, *cv = bufs
        own, chan_refs = groups[:len(sizes)], groups[len(sizes):]
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(x_ref, xv)
        pltpu.sync_copy(w_ref, wv)
        chan = [_Channel(chan_refs[i], axes, me, n, steps[i], 0, n - 2)
                for i in range(len(sizes))]
        for i, (enc, _, _) in enumerate(pieces):
            part = xv[lo[i]:lo[i] + sizes[i]]
            encoded = (part,) if enc is None else fns.run(enc, consts, part)
            for buf, value in zip(own[i], encoded if isinstance(encoded, tuple) else (encoded,)):
                buf[...] = value

        def place(prod, chunk, row):
            """Store a piece's product and, with keep_gathered, the piece (a ref if exact,
            a decoded value if quantized)."""
            rows = prod.shape[0]
            pv[pl.ds(0, rows)] = prod.astype(lay.out_dtype)
            pltpu.sync_copy(pv.at[pl.ds(0, rows)], outs[0].at[pl.ds(row, rows)])
            if keep_gathered:
                if cv:
                    cv[0][pl.ds(0, rows)] = chunk
                    chunk = cv[0].at[pl.ds(0, rows)]
                pltpu.sync_copy(chunk, outs[1].at[pl.ds(row, rows)])

        for k in range(n):
            held = [own[i] if k == 0 else chan[i].held(k - 1) for i in range(len(sizes))]
            copies = [c.send(held[i], k) for i, c in enumerate(chan)] if k < n - 1 else []
            if k == 0 and quant is None and len(sizes) == 2:  # the whole local chunk: one dot
                place(_dot(xv[...], wv[...], lay.out_dtype), xv, me * m)
            else:
                for i, (_, dec, _) in enumerate(pieces):
                    src = (me - steps[i] * k) % n
                    chunk = (held[i][0] if dec is None
                             else fns.run(dec, consts, *[p[...] for p in held[i]]))
                    value = chunk[...] if dec is None else chunk
                    place(_dot(value, wv[...], lay.out_dtype), chunk, src * m + lo[i])
            for c in copies:
                _wait(c)
            if k >= 1:
                for c in chan:
                    c.release(k - 1)

    out = [out_type((n * m, w.shape[1]), lay.out_dtype, x)]
    out += [out_type((n * m, x.shape[1]), x.dtype, x)] if keep_gathered else []
    results = call_kernel(kernel, out, [x, w], lay.scratch, fns,
                          "flashcomm_pallas_all_gather_matmul")
    return tuple(results) if keep_gathered else results[0]


def _mrs_scratch(x, w, n, bidirectional):
    mo, cols = x.shape[0] // n, w.shape[1]
    dtype = jnp.result_type(x.dtype, w.dtype)
    scratch = [pltpu.VMEM(x.shape, x.dtype), pltpu.VMEM(w.shape, w.dtype)]
    if bidirectional and mo >= 2:
        h = mo // 2
        scratch += [pltpu.VMEM((2, h, cols), dtype), pltpu.VMEM((2, mo - h, cols), dtype)]
        return scratch + _channel_scratch([jax.ShapeDtypeStruct((h, cols), dtype)]) + \
            _channel_scratch([jax.ShapeDtypeStruct((mo - h, cols), dtype)])
    return scratch + [pltpu.VMEM((2, mo, cols), dtype)] + \
        _channel_scratch([jax.ShapeDtypeStruct((mo, cols), dtype)])


def matmul_reduce_scatter(x, w, axis_name, *, bidirectional: bool = False):
    """``lax.psum_scatter(x @ w, axis_name, tiled=True)`` as one fused ring kernel, the ring of
    :func:`jax_flashcomm._rings.rs_ring`.

    Args:
      x: ``(rows, K)``, rows a multiple of N (rows scattered).
      w: ``(K, cols)``.
      axis_name: the ring's mesh axis (or tuple of axes).
      bidirectional: the two halves of every block travel opposite ways.

    Returns:
      This rank's ``(rows / N, cols)`` block of the sum.
    """
    _check_2d("matmul_reduce_scatter", x, w)
    axes = _axes.normalize_axes(axis_name)
    n, rows, cols = _axes.axis_size(axes), x.shape[0], w.shape[1]
    if rows % n:
        raise ValueError(f"matmul_reduce_scatter: {rows} rows do not split over {n} ranks")
    if n == 1:
        return x @ w
    mo = rows // n
    dtype = jnp.result_type(x.dtype, w.dtype)
    halves = bidirectional and mo >= 2
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
            copies = [c.send([acc.at[(s - 1) % 2]], s) for c, acc in chans_accs]
            prods = [block(start, size) for start, size in parts]
            for c in copies:
                _wait(c)
            return [c.slots[0][s % 2] + p for (c, _), p in zip(chans_accs, prods)]

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
        copies = [c.send([acc.at[(s - 1) % 2]], s) for c, acc in both]
        own = block(me * mo, mo)  # the whole own block: one dot, not two
        for c in copies:
            _wait(c)
        lo_acc[s % 2] = lo_c.slots[0][s % 2] + own[:h]
        hi_acc[s % 2] = hi_c.slots[0][s % 2] + own[h:]
        pltpu.sync_copy(lo_acc.at[s % 2], out_ref.at[pl.ds(0, h)])
        pltpu.sync_copy(hi_acc.at[s % 2], out_ref.at[pl.ds(h, mo - h)])

    return call_kernel(kernel, [out_type((mo, cols), dtype, x)], [x, w],
                       _mrs_scratch(x, w, n, bidirectional), Codec(),
                       "flashcomm_pallas_matmul_reduce_scatter")[0]
