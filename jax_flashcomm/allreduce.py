"""Flash AllReduce: a quantized ``psum`` with the call shape and result type of ``lax.psum``.

The two-step algorithm of Flash Communication (arXiv 2412.04964), for N ranks:

1. quantize the (flattened, zero-padded) operand into N chunks at ``rs_bits``;
2. ``all_to_all``: chunk i of every rank goes to rank i;
3. dequantize the N received chunks, sum them in f32 and quantize the sum at ``ag_bits``
   (one fused codec op);
4. ``all_gather`` the summed chunks (an all-gather whose result is replicated: the type
   ``lax.psum`` gives) and dequantize.

Steps 2 and 4 are the ``xla`` transport's (``jax_flashcomm/transport/xla.py``); in one process
the default ``p2p`` transport runs all four in one fused FFI call per rank that reads its
peers' buffers, with the same bits (``jax_flashcomm/transport/p2p.py``, docs/transport.md).
Exactly two quantizations whatever N is. Every rank decodes the same gathered bytes with the
same kernel, so the result is bit-identical on every rank. Per element, with ``b1_r`` the
phase-1 bound of rank r's chunk and ``b2`` the phase-2 bound (both from the stored scales,
:func:`jax_flashcomm.codec.error_bound`): ``|y - sum_r x_r| <= sum_r b1_r + b2`` plus f32
summation rounding.

Autodiff is straight-through: psum is linear, so the cotangent of ``x`` is that of ``y`` cast
back to varying (what ``lax.psum``'s transpose does). Where ``x`` is not varying over a reduced
axis, lax inserts a ``pvary`` whose transpose all-reduces the cotangent; here that all-reduce is
``lax.psum`` or, with ``grad="quantized"``, this quantized psum.
"""

from __future__ import annotations

import functools

import jax
from jax import lax

from jax_flashcomm import _common
from jax_flashcomm import transport
from jax_flashcomm.policy import DEFAULT_MIN_BYTES, CommConfig, decide, make_config

__all__ = ["psum", "pmean"]


def psum(x, axis_name, *, axis_index_groups=None, bits: int | None = 8,
         rs_bits: int | None = None, ag_bits: int | None = None, group_size: int = 128,
         min_bytes: int = DEFAULT_MIN_BYTES, backend: str = "auto", grad: str = "exact",
         config: CommConfig | None = None, rotation="auto", spikes="auto", transport="auto"):
    """Quantized all-reduce sum over mesh axes ``axis_name``: a drop-in for ``lax.psum``.

    Args:
      x: an array or pytree of arrays (f32, bf16 or f16 for the quantized path), any shape.
      axis_name: a mesh axis name or a tuple of them (reduced over all of them).
      axis_index_groups: not supported (must be None), as with ``lax.psum`` under check_vma.
      bits: bits per value of both phases; ``None`` is the exact setting (``lax.psum``).
      rs_bits, ag_bits: per-phase overrides (reduce-scatter/all-to-all, all-gather).
      group_size: values per quantization group (a multiple of 8).
      min_bytes: the size policy: leaves of fewer bytes per rank use ``lax.psum``.
      backend: codec backend, "auto", "ffi" or "jnp".
      grad: "exact" or "quantized" collectives for cotangents that need an all-reduce.
      config: a :class:`CommConfig`; when given it replaces all the option arguments.
      rotation: 0 (none), 1/"hadamard" or 2/"signed_hadamard": quantize each group's
        orthonormal Walsh-Hadamard transform; the sum is formed and re-quantized in the rotated
        domain and rotated back once, after the all-gather (docs/outliers.md). "auto" (the
        default): Hadamard when both phases have at least 6 bits and ``group_size`` is a power
        of two, else none (docs/accuracy.md).
      spikes: per group, keep the k largest-magnitude values in bf16 with their positions
        (0..16; both phases; after the rotation if any; docs/format.md "Spike reserving").
        "auto" (the default), decided per phase: 1 in a phase of at most 6 bits, else 0
        (CommConfig.phase1_spikes / phase2_spikes; docs/outliers.md measures why).
      transport: how the payloads move: "auto", "xla" (XLA's all_to_all and all_gather) or
        "p2p" (one fused FFI call per rank reading its peers' buffers; the devices of one
        process; same bits as "xla"). docs/transport.md.

    Returns:
      The sum, of ``x``'s structure, shapes and dtypes, invariant over the reduced axes.
    """
    if config is None:
        config = make_config(bits=bits, rs_bits=rs_bits, ag_bits=ag_bits, group_size=group_size,
                             min_bytes=min_bytes, backend=backend, grad=grad, rotation=rotation,
                             spikes=spikes, transport=transport)
    config = make_config(config)
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.psum: axis_index_groups is not supported")
    axes = _common.normalize_axes(axis_name)
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _psum_leaf(leaf, axes, config, _common.leaf_name(path)), x)


def pmean(x, axis_name, **options):
    """``psum(x, axis_name, **options) / N``, like ``lax.pmean``."""
    n = _common.axis_size(_common.normalize_axes(axis_name))
    return jax.tree.map(lambda v: v / n, psum(x, axis_name, **options))


def _psum_leaf(x, axes, config: CommConfig, name: str = "x"):
    if config.exact:
        return lax.psum(x, axes)
    _common.check_float(x, name)
    n = _common.axis_size(axes)
    decision = decide("psum", axes, x.shape, x.dtype, n, config)
    if not decision.quantized:
        return lax.psum(x, axes)
    if x.size == 0:
        return lax.psum(x, axes)
    return _qpsum(vary(x, axes, config), axes, config)


# --- making the operand varying: pvary with an (optionally quantized) psum as transpose -------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _vary(x, axes, config):
    return lax.pcast(x, axes, to="varying")


def _vary_fwd(x, axes, config):
    return _vary(x, axes, config), None


def _vary_bwd(axes, config, _, ct):
    if config.grad == "quantized":
        return (psum(ct, axes, config=config),)
    return (lax.psum(ct, axes),)


_vary.defvjp(_vary_fwd, _vary_bwd)


def vary(x, axes, config: CommConfig):
    """``x`` made varying over ``axes`` (as lax collectives do implicitly).

    The transpose all-reduces the cotangent: exactly, or quantized with ``grad="quantized"``.
    """
    missing = _common.missing_axes(x, axes)
    return _vary(x, missing, config) if missing else x


# --- the two-step all-reduce -------------------------------------------------------------------

def two_step(x, axes, config: CommConfig):
    """Run the two-step all-reduce on a varying ``x``; also return both phases' payloads.

    Returns ``(y, p1, p2)``: ``p1`` is this rank's phase-1 payload of the whole operand
    (varying), ``p2`` the gathered phase-2 payload (replicated) with ``x``'s shape, so
    ``codec.error_bound`` of each gives the per-element bounds of the two quantizations.
    """
    return transport.select(config, axes, x).all_reduce(x, axes, config)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _qpsum(x, axes, config):
    return two_step(x, axes, config)[0]


def _qpsum_fwd(x, axes, config):
    return _qpsum(x, axes, config), None


def _qpsum_bwd(axes, config, _, ct):
    return (_common.to_varying(ct, axes),)


_qpsum.defvjp(_qpsum_fwd, _qpsum_bwd)
