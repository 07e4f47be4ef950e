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
from jax import lax

from jax_flashcomm.rings import _ag_ring, _axis_names, _axis_size, _codec_fns, _rs_ring

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
