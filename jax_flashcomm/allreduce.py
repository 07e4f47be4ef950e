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
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes, jax_compat, transport
from jax_flashcomm.config import CommConfig, config_from, takes_options
from jax_flashcomm.planner import Plan, as_plan, plan

if TYPE_CHECKING:
    from jax_flashcomm.codec import Payload

__all__ = ["psum", "pmean"]


@takes_options
def psum(x, axis_name, *, axis_index_groups=None, config: CommConfig | None = None, **options):
    """Quantized all-reduce sum over mesh axes ``axis_name``: a drop-in for ``lax.psum``.

    The options are :class:`~jax_flashcomm.CommConfig`'s fields, with its defaults; options
    given beside ``config`` update it. The path of every leaf is
    :func:`jax_flashcomm.planner.plan`'s
    (exact ``lax.psum`` below ``min_bytes`` per rank, for the exact setting and on one rank).

    Args:
      x: an array or pytree of arrays (f32, bf16 or f16 for the quantized path), any shape.
      axis_name: a mesh axis name or a tuple of them (reduced over all of them).
      axis_index_groups: not supported (must be None), as with ``lax.psum`` under check_vma.
      config: a :class:`~jax_flashcomm.CommConfig`.
      bits: bits per value of both phases; ``None`` is the exact setting (``lax.psum``).
      rs_bits, ag_bits: per-phase overrides (reduce-scatter/all-to-all, all-gather).
      group_size: values per quantization group (a multiple of 8).
      min_bytes: the size policy: leaves of fewer bytes per rank use ``lax.psum``.
      backend: codec backend, "auto", "ffi" or "jnp".
      grad: "exact" or "quantized" collectives for cotangents that need an all-reduce.
      rotation: 0 / "none", 1 / "hadamard", 2 / "signed_hadamard": quantize each group's
        Walsh-Hadamard transform (the sum is formed and re-quantized in the rotated domain and
        rotated back once, after the all-gather; docs/outliers.md). "auto": Hadamard when both
        phases have at least 6 bits and ``group_size`` is a power of two, else none.
      spikes: per group, keep the k largest-magnitude values in bf16 with their positions
        (0..16). "auto": 1 in a phase of at most 6 bits, else 0 (docs/outliers.md).
      transport: "auto", "xla" (XLA's all_to_all and all_gather) or "p2p" (one fused FFI call
        per rank reading its peers' buffers; the devices of one process, or processes of one
        host over shared memory). docs/transport.md.
      p2p_timeout_ms: the p2p transport's limit on every wait for a peer.

    Returns:
      The sum, of ``x``'s structure, shapes and dtypes, invariant over the reduced axes.
    """
    config = config_from(config, options, "psum")
    if axis_index_groups is not None:
        raise NotImplementedError("jax_flashcomm.psum: axis_index_groups is not supported")
    axes = _axes.normalize_axes(axis_name, "psum")
    return jax.tree_util.tree_map_with_path(
        lambda path, leaf: _psum_leaf(leaf, axes, config, _axes.leaf_name(path)), x)


@takes_options
def pmean(x, axis_name, *, axis_index_groups=None, config: CommConfig | None = None, **options):
    """``psum(x, axis_name, ...) / N``, like ``lax.pmean`` (the options of :func:`psum`).

    Args:
      x: an array or pytree of arrays, any shape.
      axis_name: a mesh axis name or a tuple of them.
      axis_index_groups: not supported (must be None).
      config: a :class:`~jax_flashcomm.CommConfig`.
      **options: :func:`psum`'s options, updating ``config``.

    Returns:
      The mean over the ranks, of ``x``'s structure, invariant over the reduced axes.
    """
    total = psum(x, axis_name, axis_index_groups=axis_index_groups, config=config, **options)
    n = _axes.axis_size(_axes.normalize_axes(axis_name, "pmean"))
    return jax.tree.map(lambda v: v / n, total)


def _psum_leaf(x, axes, config: CommConfig, name: str = "x"):
    if not config.exact:
        _axes.check_float(x, name)
    p = plan("psum", axes, np.shape(x), jnp.result_type(x), _axes.axis_size(axes), config)
    if p.path == "exact":
        return exact_psum(vary(x, axes, config), axes, p)
    if not p.quantized:
        return jax_compat.psum(x, axes)
    return _qpsum(vary(x, axes, config), axes, p)


# --- making the operand varying: pvary with an (optionally quantized) psum as transpose -------

@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _vary(x, axes, config):
    return lax.pcast(x, axes, to="varying")


def _vary_fwd(x, axes, config):
    return _vary(x, axes, config), None


def _vary_bwd(axes, config, _, ct):
    if config.grad == "quantized":
        return (psum(ct, axes, config=config),)
    return (jax_compat.psum(ct, axes),)


_vary.defvjp(_vary_fwd, _vary_bwd)


def vary(x: jax.Array, axes: tuple[str, ...], config: CommConfig) -> jax.Array:
    """``x`` made varying over ``axes`` (as lax collectives do implicitly).

    The transpose all-reduces the cotangent: exactly, or quantized with ``grad="quantized"``.

    Args:
      x: an array (inside ``shard_map``).
      axes: normalized mesh axes (:func:`jax_flashcomm._axes.normalize_axes`).
      config: whose ``grad`` picks the cotangent's all-reduce.

    Returns:
      ``x``, varying over every axis of ``axes`` (unchanged where it already is).
    """
    missing = _axes.missing_axes(x, axes)
    return _vary(x, missing, config) if missing else x


# --- the two-step all-reduce -------------------------------------------------------------------

def two_step(x: jax.Array, axes: tuple[str, ...], p: Plan | CommConfig,
             decode: bool = True) -> tuple[jax.Array | None, Payload, Payload]:
    """Run the two-step all-reduce on a varying ``x``; also return both phases' payloads.

    Args:
      x: one array (f32, bf16 or f16), varying over ``axes``.
      axes: normalized mesh axes.
      p: a quantized :class:`~jax_flashcomm.planner.Plan` of op ``"psum"``, or a config (its
        quantized plan, :func:`jax_flashcomm.planner.as_plan`).
      decode: False: stop at the gathered phase-2 payload (``y`` is None; no transport
        decodes it), for a caller that decodes it fused with what follows
        (:func:`jax_flashcomm.psum_add_rms_norm`).

    Returns:
      ``(y, p1, p2)``: ``y`` the sum; ``p1`` this rank's phase-1 payload of the whole operand
      (varying), ``p2`` the gathered phase-2 payload (replicated) with ``x``'s shape, so
      ``codec.error_bound`` of each gives the per-element bounds of the two quantizations.
    """
    p = as_plan("psum", x, axes, p)
    return transport.by_name(p.transport).all_reduce(x, axes, p, decode=decode)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _qpsum(x, axes, p):
    return two_step(x, axes, p)[0]


def _qpsum_fwd(x, axes, p):
    return _qpsum(x, axes, p), None


def _qpsum_bwd(axes, p, _, ct):
    return (_axes.to_varying(ct, axes),)


_qpsum.defvjp(_qpsum_fwd, _qpsum_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def exact_psum(x, axes, p):
    """The exact all-reduce of a varying ``x`` over the plan's transport (its path
    ``"exact"``); its transpose makes the cotangent varying, as ``lax.psum``'s."""
    return transport.by_name(p.transport).exact_all_reduce(x, axes, p)


def _exact_psum_fwd(x, axes, p):
    return exact_psum(x, axes, p), None


exact_psum.defvjp(_exact_psum_fwd, _qpsum_bwd)
