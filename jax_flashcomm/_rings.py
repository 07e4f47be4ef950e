"""The two rings of the collective matmuls (jax_flashcomm/collective_matmul.py): an all-gather
ring that computes on every chunk as it arrives and a reduce-scatter ring whose partial sums
travel while the next block is computed, over either transport's ring steps
(jax_flashcomm/transport/ring_steps.py). docs/overlap.md has the algorithm."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes, codec, transport
from jax_flashcomm.transport import wire

__all__ = ["ag_ring", "rs_ring"]


def _ring_ids(axis_name) -> np.ndarray:
    """``ids[r]``: the ``ppermute`` number of the rank that ``lax.axis_index(axis_name)``
    numbers ``r``. ``lax.all_gather`` and ``axis_index`` number the ranks of a tuple of axes in
    the tuple's order, ``ppermute`` in mesh order whatever the tuple's order: the ring must walk
    ranks in lax's order (rank r's chunk is rows r of the gathered array) but name them in
    ppermute's."""
    names = _axes.normalize_axes(axis_name)
    sizes = [int(lax.axis_size(a)) for a in names]
    n = int(np.prod(sizes))
    if len(names) == 1:
        return np.arange(n)
    mesh_names = tuple(jax.sharding.get_abstract_mesh().axis_names)
    ring_axes = [a for a in mesh_names if a in names]
    if len(ring_axes) != len(names):  # pragma: no cover - the axes always belong to the mesh
        return np.arange(n)
    coords = np.unravel_index(np.arange(n), sizes)              # lax number -> coordinates
    return np.ravel_multi_index(tuple(coords[names.index(a)] for a in ring_axes),
                                [sizes[names.index(a)] for a in ring_axes])


def _perms(axis_name):
    """The ring's permutations, forward (lax rank r sends to r+1) and backward (to r-1), in
    ppermute's numbering (:func:`_ring_ids`)."""
    ids = _ring_ids(axis_name)
    n = len(ids)
    fwd = [(int(ids[i]), int(ids[(i + 1) % n])) for i in range(n)]
    bwd = [(int(ids[i]), int(ids[(i - 1) % n])) for i in range(n)]
    return fwd, bwd


def _link(ring, axis_name):
    """The ring steps' link of a transport spec
    (:func:`jax_flashcomm.transport.ring_steps.spec`): its transport's
    (:meth:`jax_flashcomm.transport.Transport.ring_link`)."""
    fwd, bwd = _perms(axis_name)
    return transport.by_name(ring[0]).ring_link(ring, axis_name, {1: fwd, -1: bwd})


def _piece_codec(quant: tuple | None):
    """``(encode, decode)`` of the pieces a ring moves: identities when ``quant`` is None, else
    quantize once into one uint8 buffer (one move per step, not three) and decode by the
    operand's shape. The decode too runs the codec's choice of backend (the FFI kernels where
    built): the twin's fused decode (with the 8-bit default's Hadamard rotation) cost more than
    the kernel's pass (docs/ttft_shm.md, 512-token prefill)."""
    if quant is None:
        return (lambda a: a), (lambda p, like: p)
    bits, group_size, backend, rotation, spikes = quant
    layouts = {}

    def enc(a):
        payload = codec.quantize(a, bits=bits, group_size=group_size, backend=backend,
                                 rotation=rotation, spikes=spikes)
        layouts[a.shape] = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype),
                                        payload)
        return wire.pack_tree(payload)

    def dec(buf, like):
        return codec.dequantize(wire.unpack_tree(buf, layouts[like.shape]), dtype=like.dtype,
                                backend=backend)

    return enc, dec


def ag_ring(x: jax.Array, axis_name, axis: int, bidirectional: bool, product, place, state,
            quant: tuple | None, ring: tuple):
    """Ring all-gather of ``x`` along ``axis``, with ``product(chunk)`` of every piece.

    ``place(state, chunk, prod, start)`` stores a piece and its product; ``start`` is the
    piece's row offset in the gathered array. The local chunk comes first. Every step begins the
    move of the piece already here, computes that piece's product, and finishes the move with
    the product passed through (``ring``: the transport spec,
    :mod:`jax_flashcomm.transport.ring_steps`), so the move and the dot do not depend on each
    other and the p2p transport runs them at once.
    ``quant=(bits, group_size, codec_backend, rotation, spikes)``: pieces travel as codec payloads,
    quantized once on this rank and never re-quantized; every piece (the local one too) is
    consumed dequantized, so the result is that of gathering ``dequantize(quantize(x))``.

    Args:
      x: this rank's chunk.
      axis_name: the ring's mesh axis (or tuple of axes).
      axis: the dimension of ``x`` gathered.
      bidirectional: split each chunk in halves that travel both ways (chunks of 2+ rows).
      product: ``chunk -> prod``, computed on every piece.
      place: ``(state, chunk, prod, start) -> state``.
      state: the initial state (e.g. zero outputs).
      quant: ``(bits, group_size, codec_backend, rotation, spikes)``, or None (exact).
      ring: the transport spec (:func:`jax_flashcomm.transport.ring_steps.spec`).

    Returns:
      The final ``state``, after every rank's pieces were placed.
    """
    n = _axes.axis_size(_axes.normalize_axes(axis_name))
    idx = lax.axis_index(axis_name)
    m = x.shape[axis]
    link = _link(ring, axis_name)
    enc, dec = _piece_codec(quant)
    if not bidirectional or m < 2:  # a one-row chunk has no two halves: one direction
        payload = enc(x)
        for k in range(n):
            last = k == n - 1
            if not last:
                payload, pending = link.begin(payload, 1)
            chunk = dec(payload, x)
            prod = product(chunk)
            if not last:
                nxt, prod = link.finish(pending, prod)
            state = place(state, chunk, prod, ((idx - k) % n) * m)
            if not last:
                payload = nxt
        return state

    h = m // 2  # lower half travels r -> r+1, upper half (a row longer if m is odd) r -> r-1
    lo, hi = jnp.split(x, [h], axis=axis)
    plo, phi = enc(lo), enc(hi)
    for k in range(n):
        last = k == n - 1
        if not last:
            plo, pend_lo = link.begin(plo, 1)
            phi, pend_hi = link.begin(phi, -1)
        if k == 0 and quant is None:  # whole local chunk: one dot, not two, of the halves
            # the starts passed through (the dot then follows them by data)
            prods = [product(x if last else jnp.concatenate([plo, phi], axis=axis))]
        else:
            clo, chi = dec(plo, lo), dec(phi, hi)
            prods = [product(clo), product(chi)]
        if not last:
            plo, prods[0] = link.finish(pend_lo, prods[0])
            phi, prods[-1] = link.finish(pend_hi, prods[-1])
        if len(prods) == 1:
            state = place(state, x, prods[0], idx * m)
        else:
            state = place(state, clo, prods[0], ((idx - k) % n) * m)
            state = place(state, chi, prods[1], ((idx + k) % n) * m + h)
    return state


def rs_ring(block_fn, axis_name, n: int, m_out: int, axis: int, bidirectional: bool,
            ring: tuple) -> jax.Array:
    """Ring reduce-scatter of partial products computed block by block.

    ``block_fn(start, size)`` returns this rank's partial product for rows
    ``[start, start + size)`` (along ``axis``) of the unscattered result. The accumulator of
    block b starts on rank b+1 and travels r -> r+1, so each rank computes its own block last; the
    move of step s carries the sum of steps < s and runs while step s's product is computed
    (``ring``: the transport spec). Bidirectional: the lower half of every block travels
    r -> r+1, the upper half (a row longer if the block has an odd number of rows) r -> r-1; a
    one-row block travels one way.

    Args:
      block_fn: ``(start, size) -> partial product`` (``start`` may be traced).
      axis_name: the ring's mesh axis (or tuple of axes).
      n: the number of ranks.
      m_out: rows per block (this rank's share of the result along ``axis``).
      axis: the scattered dimension of the products.
      bidirectional: send the halves of every block both ways.
      ring: the transport spec (:func:`jax_flashcomm.transport.ring_steps.spec`).

    Returns:
      This rank's block of the summed result (``m_out`` rows along ``axis``).
    """
    idx = lax.axis_index(axis_name)
    link = _link(ring, axis_name)
    if not bidirectional or m_out < 2:
        acc = None
        for s in range(n):
            offset = ((idx - 1 - s) % n) * m_out  # s = n-1: this rank's block
            if acc is not None:
                acc, pending = link.begin(acc, 1)
                offset = offset + link.order(pending)
            p = block_fn(offset, m_out)
            if acc is None:
                acc = p
            else:
                recv, p = link.finish(pending, p)
                acc = recv + p
        return acc

    h = m_out // 2
    lo = hi = None
    for s in range(n - 1):
        gate = 0
        if lo is not None:
            lo, pend_lo = link.begin(lo, 1)
            hi, pend_hi = link.begin(hi, -1)
            gate = link.order(pend_lo) + link.order(pend_hi)
        plo = block_fn(((idx - 1 - s) % n) * m_out + gate, h)
        phi = block_fn(((idx + 1 + s) % n) * m_out + h + gate, m_out - h)
        if lo is None:
            lo, hi = plo, phi
        else:
            rlo, plo = link.finish(pend_lo, plo)
            rhi, phi = link.finish(pend_hi, phi)
            lo, hi = rlo + plo, rhi + phi
    if n == 1:
        return block_fn(idx * m_out, m_out)
    lo, pend_lo = link.begin(lo, 1)
    hi, pend_hi = link.begin(hi, -1)
    gate = link.order(pend_lo) + link.order(pend_hi)
    own = block_fn(idx * m_out + gate, m_out)  # whole own block: one dot, not two
    rlo, own = link.finish(pend_lo, own)
    rhi, own = link.finish(pend_hi, own)
    own_lo, own_hi = jnp.split(own, [h], axis=axis)
    return jnp.concatenate([rlo + own_lo, rhi + own_hi], axis=axis)
