"""Ring-decomposed collective matmuls (Flash-Overlap, arXiv 2604.24013).

Both functions are called inside ``jax.shard_map`` on the local shards, like ``jax.lax``
collectives, and return what the unfused pair returns:

* ``all_gather_matmul(x, w, ax)    == lax.all_gather(x, ax, axis=axis, tiled=True) @ w``
* ``matmul_reduce_scatter(x, w, ax) == lax.psum_scatter(x @ w, ax, scatter_dimension=axis,
  tiled=True)``

Instead of one all-gather (or reduce-scatter) followed (preceded) by one big dot, they run N-1
``ppermute`` steps around the ring of ``axis_name`` and, in every step, the partial dot that
needs (or produces) a chunk already here. The permute issued in step k and the dot of step k do
not depend on each other, so a runtime with asynchronous collectives (XLA:GPU/TPU) can run them
concurrently. All-gather computes on the local chunk first; reduce-scatter computes the slice
that stays on this rank last, so no step waits on the network with nothing to do ("no tail").

What XLA does with it: each step lowers to one ``collective-permute`` (gloo on CPU processes,
NCCL send/recv on GPU) and one ``dot`` (a YNNPACK/Eigen custom fusion on CPU, cuBLAS on GPU); the
placement of a product into the output is a ``dynamic-update-slice`` that buffer assignment does
in place, and the accumulate of the reduce-scatter ring is an elementwise add fused into a loop
fusion. None of that needs an FFI kernel in the exact variant. XLA:CPU executes a
``collective-permute`` synchronously on the thread that runs the module, so on CPU the permute and
the dot of a step run one after the other (see ``docs/overlap.md``).

The custom VJPs use each other: the transpose of all-gather-matmul is matmul-reduce-scatter (for
dx) plus a local product with the gathered chunks kept from the forward ring (for dw); the
transpose of matmul-reduce-scatter is an all-gather-matmul ring of the cotangent whose gathered
chunks also give dw.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


# ---------------------------------------------------------------------------------------------
# Validation and varying-axes bookkeeping
# ---------------------------------------------------------------------------------------------


def _vma(a) -> frozenset:
    """The mesh axes ``a`` varies over inside shard_map (empty outside)."""
    aval = jax.typeof(a)
    vma = getattr(aval, "vma", None)
    if vma is None:
        mat = getattr(aval, "manual_axis_type", None)
        vma = getattr(mat, "varying", frozenset())
    return frozenset(vma)


def _axis_names(axis_name) -> tuple:
    return tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)


def _axis_size(axis_name, fn: str) -> int:
    names = _axis_names(axis_name)
    if not names or not all(isinstance(a, str) for a in names):
        raise TypeError(f"{fn}: axis_name must be a mesh axis name (str) or a tuple of them, "
                        f"got {axis_name!r}")
    try:
        return lax.axis_size(names if len(names) > 1 else names[0])
    except NameError:
        raise ValueError(f"{fn}: axis_name {axis_name!r} is not a bound mesh axis; call it inside "
                         "jax.shard_map over a mesh that has this axis") from None


def _check_operands(fn: str, x, w, axis: int) -> int:
    """Checks dtypes and shapes; returns ``axis`` normalized to a non-negative index."""
    for name, a in (("x", x), ("w", w)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"{fn}: {name} must be an array, got {type(a).__name__}")
        if not jnp.issubdtype(a.dtype, jnp.floating):
            raise TypeError(f"{fn}: {name} must have a floating dtype, got {a.dtype}")
    if w.ndim != 2:
        raise ValueError(f"{fn}: w must be 2-D (contraction, columns), got shape {w.shape}")
    if x.ndim < 2:
        raise ValueError(f"{fn}: x must have at least 2 dims (rows, contraction), got {x.shape}")
    if x.shape[-1] != w.shape[0]:
        raise ValueError(f"{fn}: shapes do not contract: x.shape[-1]={x.shape[-1]} (of x "
                         f"{x.shape}) != w.shape[0]={w.shape[0]} (of w {w.shape})")
    if not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis={axis!r} is not a dimension of x (ndim {x.ndim})")
    axis %= x.ndim
    if axis == x.ndim - 1:
        raise ValueError(f"{fn}: axis={axis} is the contraction dimension of x; the row axis "
                         "must be another one")
    return axis


def _match_vma(x, w, axis_name):
    """Makes x and w vary over the same axes (theirs plus ``axis_name``).

    The custom VJPs then return cotangents of the right type; where an operand was invariant
    over an axis, autodiff of the ``pcast`` sums its cotangent over that axis.
    """
    want = _vma(x) | _vma(w) | frozenset(_axis_names(axis_name))

    def cast(a):
        missing = tuple(sorted(want - _vma(a)))
        return lax.pcast(a, missing, to="varying") if missing else a

    return cast(x), cast(w)


def _resolve_ring(transport, axis_name, fn, timeout_ms):
    from jax_flashcomm.transport import ring as ring_steps

    return ring_steps.resolve(transport, axis_name, fn, timeout_ms)


def _codec_fns():
    try:
        from jax_flashcomm import codec

        return codec.quantize, codec.dequantize
    except (ImportError, AttributeError):
        raise ValueError("quantized all_gather_matmul needs the codec: "
                         "jax_flashcomm.codec.quantize/dequantize are not available") from None


# ---------------------------------------------------------------------------------------------
# The two rings
# ---------------------------------------------------------------------------------------------


def _ring_ids(axis_name) -> np.ndarray:
    """``ids[r]``: the ``ppermute`` number of the rank that ``lax.axis_index(axis_name)``
    numbers ``r``. ``lax.all_gather`` and ``axis_index`` number the ranks of a tuple of axes in
    the tuple's order, ``ppermute`` in mesh order whatever the tuple's order: the ring must walk
    ranks in lax's order (rank r's chunk is rows r of the gathered array) but name them in
    ppermute's."""
    names = _axis_names(axis_name)
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
    """The ring steps' link (jax_flashcomm.transport.ring) of a resolved transport spec."""
    from jax_flashcomm.transport import ring as ring_steps

    fwd, bwd = _perms(axis_name)
    return ring_steps.make_link(ring, axis_name, {1: fwd, -1: bwd})


def _pack(tree):
    """The leaves of a pytree of arrays as one flat uint8 buffer (see ``_unpack``)."""
    leaves = jax.tree.leaves(tree)
    return jnp.concatenate([lax.bitcast_convert_type(a, jnp.uint8).reshape(-1) for a in leaves])


def _unpack(buf, like):
    """Inverse of ``_pack``, given the pytree of ShapeDtypeStructs ``like``."""
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for leaf in leaves:
        width = jnp.dtype(leaf.dtype).itemsize
        seg = buf[offset : offset + leaf.size * width]
        offset += leaf.size * width
        seg = seg.reshape(leaf.shape + ((width,) if width > 1 else ()))
        out.append(lax.bitcast_convert_type(seg, leaf.dtype))
    return treedef.unflatten(out)


def _ag_ring(x, axis_name, axis, bidirectional, product, place, state, quant, ring):
    """Ring all-gather of ``x`` along ``axis``, with ``product(chunk)`` of every piece.

    ``place(state, chunk, prod, start)`` stores a piece and its product; ``start`` is the
    piece's row offset in the gathered array. The local chunk comes first. Every step begins the
    move of the piece already here, computes that piece's product, and finishes the move with
    the product passed through (``ring``: the transport spec, :mod:`jax_flashcomm.transport.ring`),
    so the move and the dot do not depend on each other and the p2p transport runs them at once.
    ``quant=(bits, group_size, codec_backend, rotation, spikes)``: pieces travel as codec payloads,
    quantized once on this rank and never re-quantized; every piece (the local one too) is
    consumed dequantized, so the result is that of gathering ``dequantize(quantize(x))``.
    """
    n = _axis_size(axis_name, "all_gather_matmul")
    idx = lax.axis_index(axis_name)
    m = x.shape[axis]
    link = _link(ring, axis_name)
    if quant is None:
        enc, dec = (lambda a: a), (lambda p, like: p)
    else:
        quantize, dequantize = _codec_fns()
        bits, group_size, backend, rotation, spikes = quant
        layouts = {}

        def enc(a):  # quantize once, then one uint8 buffer: one move per step, not three
            payload = quantize(a, bits=bits, group_size=group_size, backend=backend,
                               rotation=rotation, spikes=spikes)
            layouts[a.shape] = jax.tree.map(lambda b: jax.ShapeDtypeStruct(b.shape, b.dtype),
                                            payload)
            return _pack(payload)

        def dec(buf, like):  # the payload knows its operand's shape
            return dequantize(_unpack(buf, layouts[like.shape]), dtype=like.dtype,
                              backend=backend)

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


def _rs_ring(block_fn, axis_name, n, m_out, axis, bidirectional, ring):
    """Ring reduce-scatter of partial products computed block by block.

    ``block_fn(start, size)`` returns this rank's partial product for rows
    ``[start, start + size)`` (along ``axis``) of the unscattered result. The accumulator of
    block b starts on rank b+1 and travels r -> r+1, so each rank computes its own block last; the
    move of step s carries the sum of steps < s and runs while step s's product is computed
    (``ring``: the transport spec). Bidirectional: the lower half of every block travels
    r -> r+1, the upper half (a row longer if the block has an odd number of rows) r -> r-1; a
    one-row block travels one way.
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


def _agmm_impl(x, w, axis_name, axis, bidirectional, quant, keep_gathered, ring):
    """Ring all-gather-matmul; also returns the gathered x when ``keep_gathered``."""
    n = _axis_size(axis_name, "all_gather_matmul")
    rows = x.shape[axis] * n
    out_shape = x.shape[:axis] + (rows,) + x.shape[axis + 1 : -1] + (w.shape[1],)
    out = jnp.zeros(out_shape, jnp.result_type(x.dtype, w.dtype))
    gathered = None
    if keep_gathered:
        gathered = jnp.zeros(x.shape[:axis] + (rows,) + x.shape[axis + 1 :], x.dtype)

    def place(state, chunk, prod, start):
        out, gathered = state
        out = lax.dynamic_update_slice_in_dim(out, prod, start, axis)
        if gathered is not None:
            gathered = lax.dynamic_update_slice_in_dim(gathered, chunk, start, axis)
        return out, gathered

    return _ag_ring(x, axis_name, axis, bidirectional, lambda c: jnp.matmul(c, w), place,
                    (out, gathered), quant, ring)


def _mrs_impl(x, w, axis_name, axis, bidirectional, ring):
    n = _axis_size(axis_name, "matmul_reduce_scatter")
    m_out = x.shape[axis] // n

    def block_fn(start, size):
        return jnp.matmul(lax.dynamic_slice_in_dim(x, start, size, axis), w)

    return _rs_ring(block_fn, axis_name, n, m_out, axis, bidirectional, ring)


def _contract_rows(a, b):
    """``a^T b`` over every dim but the last: the weight gradient of ``a @ w``."""
    dims = tuple(range(a.ndim - 1))
    return jnp.tensordot(a, b, axes=(dims, dims))


# ---------------------------------------------------------------------------------------------
# Custom VJPs: each uses the other
# ---------------------------------------------------------------------------------------------


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6))
def _agmm(x, w, axis_name, axis, bidirectional, quant, ring):
    return _agmm_impl(x, w, axis_name, axis, bidirectional, quant, False, ring)[0]


def _agmm_fwd(x, w, axis_name, axis, bidirectional, quant, ring):
    out, gathered = _agmm_impl(x, w, axis_name, axis, bidirectional, quant, True, ring)
    return out, (gathered, w)


def _agmm_bwd(axis_name, axis, bidirectional, quant, ring, res, dy):
    gathered, w = res
    # dx = psum_scatter(dy @ w^T): a matmul-reduce-scatter ring. Quantized: straight-through.
    dx = _mrs(dy, w.T, axis_name, axis, bidirectional, ring)
    dw = _contract_rows(gathered, dy)  # the chunks the forward ring already brought here
    return dx.astype(gathered.dtype), dw.astype(w.dtype)


_agmm.defvjp(_agmm_fwd, _agmm_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5))
def _mrs(x, w, axis_name, axis, bidirectional, ring):
    return _mrs_impl(x, w, axis_name, axis, bidirectional, ring)


def _mrs_fwd(x, w, axis_name, axis, bidirectional, ring):
    return _mrs_impl(x, w, axis_name, axis, bidirectional, ring), (x, w)


def _mrs_bwd(axis_name, axis, bidirectional, ring, res, dy):
    x, w = res
    # dx = all_gather(dy) @ w^T: an all-gather-matmul ring, whose gathered dy also gives dw.
    dx, dy_gathered = _agmm_impl(dy, w.T, axis_name, axis, bidirectional, None, True, ring)
    dw = _contract_rows(x, dy_gathered)
    return dx.astype(x.dtype), dw.astype(w.dtype)


_mrs.defvjp(_mrs_fwd, _mrs_bwd)


# ---------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------


def all_gather_matmul(x, w, axis_name, *, axis=0, bidirectional=False, bits=None,
                      group_size=128, codec_backend="jnp", rotation=0, spikes=0,
                      transport="auto", p2p_timeout_ms=60_000):
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True) @ w`` as an overlapped ring.

    Call inside ``jax.shard_map``. ``x``: this rank's rows (``x.shape[axis]`` of them) with the
    contraction dimension last; ``w``: ``(K, n_local)``, this rank's columns. Returns the
    ``(..., N * x.shape[axis], ..., n_local)`` product: N-1 ``ppermute`` steps, each overlapped
    with the dot of the chunk already here, the local chunk first.

    ``bidirectional``: half of every chunk (split along ``axis``; with an odd number of rows the
    upper half is a row longer, a one-row chunk goes one way) travels each way round the ring:
    2(N-1) permutes of half the bytes each, so both directions of a full-duplex link carry half
    the traffic.
    ``bits``: quantized variant (needs ``jax_flashcomm.codec``). Each chunk is quantized once,
    with groups of ``group_size``, and travels unchanged; every chunk, the local one included, is
    dequantized before its dot, so the result is ``all_gather(dequantize(quantize(x))) @ w`` and
    its error is one quantization whatever N is. Gradients pass straight through the quantizer.
    The payload (codes, scales, zeros) travels as one uint8 buffer: one permute per step.
    ``codec_backend``: the codec's ``backend`` ("jnp", "ffi" or "auto"). The default is the jnp
    twin: its dequantize is elementwise, so XLA fuses it into the loop fusion that feeds the
    chunk's dot instead of materializing it through an opaque FFI call.
    ``rotation``: the codec's group rotation (0 none, 1 Hadamard, 2 signed Hadamard; needs a
    power-of-two ``group_size``), docs/format.md "Rotation". ``spikes``: values per group kept in
    bf16 with their positions (0..16), docs/format.md "Spike reserving".
    ``transport``: how a chunk moves ("xla": ``lax.ppermute``; "p2p": start / done FFI calls
    between the devices of one process, the dot running while the transport copies; "auto":
    docs/transport.md "Ring steps"). ``p2p_timeout_ms``: a p2p step whose peer never comes
    fails with an error after this. The VJP's rings use the same transport.
    """
    fn = "all_gather_matmul"
    axis = _check_operands(fn, x, w, axis)
    _axis_size(axis_name, fn)
    quant = None
    if bits is not None:
        if not isinstance(bits, int) or isinstance(bits, bool) or not 2 <= bits <= 8:
            raise ValueError(f"{fn}: bits must be an int in 2..8 or None, got {bits!r}")
        if not isinstance(group_size, int) or group_size <= 0 or group_size % 8:
            raise ValueError(f"{fn}: group_size must be a positive multiple of 8, "
                             f"got {group_size!r}")
        _codec_fns()
        from jax_flashcomm.codec import spec

        spec.check_dtype(x.dtype, f"{fn}: x (quantized with bits={bits})")
        spec.check_backend(codec_backend)
        # An empty chunk has nothing to quantize: the exact ring of nothing is the result.
        rotation = spec.check_rotation(rotation, group_size)
        spikes = spec.check_spikes(spikes, group_size)
        quant = (bits, group_size, codec_backend, rotation, spikes) if x.size else None
    ring = _resolve_ring(transport, axis_name, fn, p2p_timeout_ms)
    x, w = _match_vma(x, w, axis_name)
    return _agmm(x, w, axis_name, axis, bool(bidirectional), quant, ring)


def matmul_reduce_scatter(x, w, axis_name, *, axis=0, bidirectional=False, transport="auto",
                          p2p_timeout_ms=60_000):
    """``lax.psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)`` as a ring.

    Call inside ``jax.shard_map``. ``x``: ``(..., M, ..., K_local)``, this rank's slice of the
    contraction dimension; ``w``: ``(K_local, n)``. Returns this rank's ``M / N`` rows of the sum
    over ranks. Partial products travel the ring and are accumulated (in the result dtype, like
    ``psum_scatter``); the block that stays here is computed last. Exact: nothing is quantized.

    ``bidirectional``: the two halves of every block (the upper one a row longer when ``M / N``
    is odd) travel opposite ways round the ring. ``transport``, ``p2p_timeout_ms``: as for
    :func:`all_gather_matmul`.
    """
    fn = "matmul_reduce_scatter"
    axis = _check_operands(fn, x, w, axis)
    n = _axis_size(axis_name, fn)
    if x.shape[axis] % n:
        raise ValueError(f"{fn}: rows not divisible: x.shape[{axis}]={x.shape[axis]} is not a "
                         f"multiple of the size {n} of axis {axis_name!r}")
    ring = _resolve_ring(transport, axis_name, fn, p2p_timeout_ms)
    x, w = _match_vma(x, w, axis_name)
    return _mrs(x, w, axis_name, axis, bool(bidirectional), ring)
