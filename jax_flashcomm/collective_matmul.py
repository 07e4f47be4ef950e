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
the dot of a step run one after the other (see ``docs/overlap.md``). Over ``transport="pallas"``
a ring that fits one kernel (:func:`jax_flashcomm.transport.pallas_rings.fused_reason`) runs as
that fused Pallas kernel, its DMAs and dots inside; any other runs a DMA kernel per step.

The custom VJPs use each other: the transpose of all-gather-matmul is matmul-reduce-scatter (for
dx) plus a local product with the gathered chunks kept from the forward ring (for dw); the
transpose of matmul-reduce-scatter is an all-gather-matmul ring of the cotangent whose gathered
chunks also give dw.

Both take the options of every jax_flashcomm op (:class:`~jax_flashcomm.CommConfig`), and
:func:`jax_flashcomm.planner.plan` picks the path: the exact ring, the ring of chunks quantized once
(``all_gather_matmul``), or the local matmul then the quantized ``psum_scatter``
(``matmul_reduce_scatter``: a quantized reduce-scatter ring would re-quantize the running sum at
every step). ``bits=None`` asks for the exact ring whatever the size.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.config import CommConfig, config_from, takes_options
from jax_flashcomm.planner import Plan, plan, record_plan
from jax_flashcomm._rings import ag_ring, rs_ring
from jax_flashcomm.scatter_gather import psum_scatter
from jax_flashcomm.transport import pallas_rings, ring_steps

__all__ = ["all_gather_matmul", "matmul_reduce_scatter", "ring_spec"]


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
    if isinstance(axis, bool) or not isinstance(axis, int) or not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{fn}: axis={axis!r} is not a dimension of x (ndim {x.ndim})")
    axis %= x.ndim
    if axis == x.ndim - 1:
        raise ValueError(f"{fn}: axis={axis} is the contraction dimension of x; the row axis "
                         "must be another one")
    return axis


def ring_spec(p: Plan) -> tuple:
    """The ring-step spec (:func:`jax_flashcomm.transport.ring_steps.spec`) of a ring plan.

    Args:
      p: a plan of a ring path (its ``transport`` and ``timeout_ms``).

    Returns:
      ``(name, timeout_ms, link_bytes_per_s)``, hashable.
    """
    return ring_steps.spec(p.transport, p.timeout_ms)


def _fused(op, x, w, axis_name, bidirectional, quant, ring) -> bool:
    """Whether the ring runs as the pallas transport's fused kernel of ``op``."""
    return ring[0] == "pallas" and pallas_rings.fused_reason(
        op, x, w, axis_name, bidirectional=bidirectional, quant=quant) is None


def _with_kernel(p: Plan, x, w, axis_name, bidirectional, quant) -> Plan:
    """``p`` with its reason naming the pallas kernels that run its ring (no change over
    another transport)."""
    if p.transport != "pallas":
        return p
    if p.axis_size == 1:
        return dataclasses.replace(p, reason=f"{p.reason}; one rank: the local matmul")
    why = pallas_rings.fused_reason(p.op, x, w, axis_name, bidirectional=bidirectional,
                                    quant=quant)
    how = (f"the fused ring kernel flashcomm_pallas_{p.op}" if why is None
           else f"a Pallas DMA kernel per ring step, not the fused kernel: {why}")
    return dataclasses.replace(p, reason=f"{p.reason}; {how}")


def _agmm_impl(x, w, axis_name, axis, bidirectional, quant, keep_gathered, ring):
    """Ring all-gather-matmul; also returns the gathered x when ``keep_gathered``."""
    if _fused("all_gather_matmul", x, w, axis_name, bidirectional, quant, ring):
        got = pallas_rings.all_gather_matmul(x, w, axis_name, bidirectional=bidirectional,
                                             quant=quant, keep_gathered=keep_gathered)
        return got if keep_gathered else (got, None)
    n = _axes.axis_size(_axes.normalize_axes(axis_name))
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

    return ag_ring(x, axis_name, axis, bidirectional, lambda c: jnp.matmul(c, w), place,
                   (out, gathered), quant, ring)


def _mrs_impl(x, w, axis_name, axis, bidirectional, ring):
    if _fused("matmul_reduce_scatter", x, w, axis_name, bidirectional, None, ring):
        return pallas_rings.matmul_reduce_scatter(x, w, axis_name, bidirectional=bidirectional)
    n = _axes.axis_size(_axes.normalize_axes(axis_name))
    m_out = x.shape[axis] // n

    def block_fn(start, size):
        return jnp.matmul(lax.dynamic_slice_in_dim(x, start, size, axis), w)

    return rs_ring(block_fn, axis_name, n, m_out, axis, bidirectional, ring)


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


@takes_options
def all_gather_matmul(x, w, axis_name, *, axis: int = 0, bidirectional: bool = False,
                      config: CommConfig | None = None, **options):
    """``lax.all_gather(x, axis_name, axis=axis, tiled=True) @ w`` as an overlapped ring.

    Call inside ``jax.shard_map``. N-1 ring steps, each next to the dot of the chunk already
    here, the local chunk first. At or above ``min_bytes`` of ``x`` per rank (and unless
    ``bits=None``) every chunk is quantized once, at ``ag_bits`` (default ``bits``), travels
    unchanged and is dequantized before its dot (the local one too): the result is
    ``all_gather(dequantize(quantize(x))) @ w``, one quantization whatever N is; gradients
    pass straight through the quantizer. ``backend="auto"`` quantizes and decodes with the FFI
    kernels where built.

    Args:
      x: this rank's rows (``x.shape[axis]`` of them), the contraction dimension last.
      w: ``(K, n_local)``, this rank's columns.
      axis_name: a mesh axis name or a tuple of them.
      axis: the row dimension of ``x``.
      bidirectional: half of every chunk (the upper half a row longer when odd) travels each
        way round the ring: 2(N-1) moves of half the bytes each.
      config, bits, ...: :class:`~jax_flashcomm.CommConfig` and its fields (options given
        beside ``config`` update it). ``transport``: how a chunk moves ("xla":
        ``lax.ppermute``; "p2p": start / done FFI calls between the devices of one process;
        "pallas": the fused Pallas ring kernel where the call fits it (x 2-D, its buffers in
        VMEM: :func:`jax_flashcomm.transport.pallas_rings.fused_reason`), else a Pallas DMA
        kernel per step, the plan's reason says which; "auto": "xla", docs/transport.md
        "Ring steps"); the VJP's rings use the same.

    Returns:
      The ``(..., N * x.shape[axis], ..., n_local)`` product.
    """
    fn = "all_gather_matmul"
    config = config_from(config, options, fn)
    axis = _check_operands(fn, x, w, axis)
    axes = _axes.normalize_axes(axis_name, fn)
    if not config.exact:  # whatever the size: the dtype is checked like the collectives'
        _axes.check_float(x, f"{fn}: x (quantized with bits={config.phase2_bits})")
    p = plan(fn, axes, x.shape, x.dtype, _axes.axis_size(axes), config, record=False)
    quant = None
    if p.quantized:
        quant = (p.ag_bits, p.group_size, p.backend, p.rotation, p.ag_spikes)
    record_plan(_with_kernel(p, x, w, axes, bool(bidirectional), quant))
    x, w = _axes.match_varying((x, w), axes)
    return _agmm(x, w, axis_name, axis, bool(bidirectional), quant, ring_spec(p))


@takes_options
def matmul_reduce_scatter(x, w, axis_name, *, axis: int = 0, bidirectional: bool = False,
                          config: CommConfig | None = None, **options):
    """``lax.psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True)`` as a ring.

    Call inside ``jax.shard_map``. The exact path: partial products travel the ring and are
    accumulated (in the result dtype, like ``psum_scatter``); the block that stays here is
    computed last. At or above ``min_bytes`` of ``x @ w`` per rank (and unless ``bits=None``):
    the local product, then :func:`jax_flashcomm.psum_scatter` quantized at ``rs_bits``
    (default ``bits``) over ``transport``.

    Args:
      x: ``(..., M, ..., K_local)``, this rank's slice of the contraction dimension.
      w: ``(K_local, n)``.
      axis_name: a mesh axis name or a tuple of them.
      axis: the row dimension of ``x`` (``M``, a multiple of N).
      bidirectional: the two halves of every block (the upper one a row longer when ``M / N``
        is odd) travel opposite ways round the ring.
      config, bits, ...: as for :func:`all_gather_matmul`.

    Returns:
      This rank's ``M / N`` rows of the sum over ranks.
    """
    fn = "matmul_reduce_scatter"
    config = config_from(config, options, fn)
    axis = _check_operands(fn, x, w, axis)
    axes = _axes.normalize_axes(axis_name, fn)
    n = _axes.axis_size(axes)
    if x.shape[axis] % n:
        raise ValueError(f"{fn}: rows not divisible: x.shape[{axis}]={x.shape[axis]} is not a "
                         f"multiple of the size {n} of axis {axis_name!r}")
    out_shape = x.shape[:-1] + (w.shape[1],)
    p = plan(fn, axes, out_shape, jnp.result_type(x.dtype, w.dtype), n, config, record=False)
    if p.quantized:
        record_plan(p)
        return psum_scatter(x @ w, axis_name, scatter_dimension=axis, tiled=True,
                            config=config, min_bytes=0)
    record_plan(_with_kernel(p, x, w, axes, bool(bidirectional), None))
    x, w = _axes.match_varying((x, w), axes)
    return _mrs(x, w, axis_name, axis, bool(bidirectional), ring_spec(p))
