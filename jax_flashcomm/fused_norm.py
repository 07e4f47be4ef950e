"""The all-reduce fused with the residual add and RMSNorm (docs/fused_norm.md).

Every transformer block ends its attention (or MLP) with ``residual + psum(partial)``, then the
next RMSNorm reads that sum again, and in quantized inference a quantize for the next GEMM
reads the norm's output once more. :func:`psum_add_rms_norm` is the three as one op:

* exact path (the plan's ``lax``: ``bits=None``, one rank, below ``min_bytes``): ``lax.psum``,
  ``residual + s`` and the RMSNorm of ``models/llama/modeling.py`` /
  :class:`jax_flashcomm.nn.RMSNorm`
  (``x * rsqrt(mean(x * x) + eps) * weight`` in f32), as lax ops: the same numbers as the
  unfused ops;
* quantized path: the two-step all-reduce up to the all-gather phase's payload, then one codec
  kernel (:func:`jax_flashcomm.codec.norm.add_rms_norm`: C++ per ISA, CUDA, jnp twin, the same
  bits) that decodes the gathered rows, adds the residual, writes the new residual and the
  normalised rows (or quantizes them: ``out_bits``). The all-reduce's own dequantize is never
  run: ``two_step(..., decode=False)`` stops at the gathered payload on both transports (the
  ``p2p`` call gets an empty ``y`` result and skips its decode).

Autodiff: straight through the all-reduce (the cotangent of ``x`` is that of the sum, made
varying, as ``lax.psum``'s transpose), exact math for the add and the norm.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes, codec, jax_compat
from jax_flashcomm.allreduce import exact_psum, two_step, vary
from jax_flashcomm.codec import norm as codec_norm
from jax_flashcomm.config import CommConfig, config_from, takes_options
from jax_flashcomm.planner import plan

__all__ = ["psum_add_rms_norm", "rms_norm"]


def rms_norm(h: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``h * rsqrt(mean(h * h, -1) + eps) * weight`` in f32, cast to ``h``'s dtype.

    The expression of :class:`jax_flashcomm.nn.RMSNorm` (and so of ``models/llama/modeling.py``),
    so the
    exact path gives the unfused numbers.

    Args:
      h: ``(..., hidden)``.
      weight: ``(hidden,)``.
      eps: added to the mean square.

    Returns:
      ``h``'s shape and dtype.
    """
    x32 = h.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * weight.astype(jnp.float32)).astype(h.dtype)


def _check_eps(eps) -> float:
    """``eps`` as a Python float: a real number (not a bool, a string or a traced value),
    finite and >= 0."""
    if isinstance(eps, jax.core.Tracer):
        raise TypeError("psum_add_rms_norm: eps must be a Python or NumPy number known at trace "
                        "time, got a traced value (pass it as a static value)")
    if isinstance(eps, (jax.Array, np.ndarray)) and np.ndim(eps) == 0 and np.issubdtype(
            np.asarray(eps).dtype, np.floating):
        eps = float(eps)                 # a concrete 0-d float array
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.integer,
                                                                   np.floating)):
        raise TypeError(f"psum_add_rms_norm: eps must be a real number, got {eps!r}")
    if not np.isfinite(eps) or eps < 0:
        raise ValueError(f"psum_add_rms_norm: eps must be finite and >= 0, got {eps}")
    return float(eps)


def _check(x, residual, weight, eps, out_bits, out_group_size):
    for name, a in (("x", x), ("residual", residual), ("weight", weight)):
        if not hasattr(a, "shape") or not hasattr(a, "dtype"):
            raise TypeError(f"psum_add_rms_norm: {name} must be an array, got {type(a)}")
    if np.shape(x) != np.shape(residual) or jnp.result_type(x) != jnp.result_type(residual):
        raise ValueError(f"psum_add_rms_norm: x and residual must have the same shape and dtype, "
                         f"got {jax.typeof(x).str_short()} and {jax.typeof(residual).str_short()}")
    if np.ndim(x) < 1 or np.ndim(weight) != 1 or np.shape(weight)[0] != np.shape(x)[-1]:
        raise ValueError(f"psum_add_rms_norm: weight must be (hidden,) with hidden = x's last "
                         f"axis; got x {np.shape(x)}, weight {np.shape(weight)}")
    if np.dtype(jnp.result_type(weight)) not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16)):
        raise TypeError(f"psum_add_rms_norm: weight must be f32 or bf16, got "
                        f"{jnp.result_type(weight)}")
    if out_bits is not None and np.shape(x)[-1] % out_group_size:
        raise ValueError(f"psum_add_rms_norm: out_bits needs hidden ({np.shape(x)[-1]}) to be a "
                         f"multiple of out_group_size ({out_group_size})")


@takes_options
def psum_add_rms_norm(x, residual, weight, axis_name, *, eps: float = 1e-5,
                      out_bits: int | None = None, out_group_size: int | None = None,
                      config: CommConfig | None = None, **options):
    """``h = residual + psum(x)``; return ``(rms_norm(h) * weight, h)`` (one fused op).

    The options are :class:`~jax_flashcomm.CommConfig`'s fields (those of :func:`psum`); the
    path is :func:`jax_flashcomm.planner.plan`'s for op ``"psum_add_rms_norm"``.

    Args:
      x: this rank's partial sum ``(..., hidden)`` (2-D, 3-D or more), f32, bf16 or f16.
      residual: ``x``'s shape and dtype, replicated over ``axis_name`` (or varying).
      weight: the norm's ``(hidden,)`` weight, f32 or bf16.
      axis_name: a mesh axis name or a tuple of them.
      eps: added to the mean square.
      out_bits: None: return the normalised rows as an array; 2..8: return them quantized for
        the next GEMM (a :class:`~jax_flashcomm.codec.Payload`, int groups of the wire format,
        no rotation, no spikes; not differentiable).
      out_group_size: the output's group size (default: the config's ``group_size``); it must
        divide ``hidden``.
      config: a :class:`~jax_flashcomm.CommConfig`.
      **options: :func:`psum`'s options, updating ``config``.

    Returns:
      ``(out, new_residual)``: ``out`` of ``x``'s shape and dtype (or its payload),
      ``new_residual = residual + psum(x)``, both invariant over the reduced axes (varying where
      ``residual`` is).

    Raises:
      TypeError, ValueError: arrays of the wrong kind, shape or dtype; a bad ``eps`` or output
        format (at trace time).
    """
    config = config_from(config, options, "psum_add_rms_norm")
    axes = _axes.normalize_axes(axis_name, "psum_add_rms_norm")
    eps = _check_eps(eps)
    og = config.group_size if out_group_size is None else codec.spec.check_group_size(
        out_group_size, "out_group_size")
    if out_bits is not None:
        codec.spec.check_bits(out_bits, "out_bits")
    _check(x, residual, weight, eps, out_bits, og)
    if not jnp.issubdtype(jnp.result_type(x), jnp.floating):
        raise TypeError(f"psum_add_rms_norm: x must be a float array (an RMS norm of "
                        f"{jnp.result_type(x)} values would be truncated), got "
                        f"{jax.typeof(x).str_short()}")
    if not config.exact:
        _axes.check_float(x, "x")
    p = plan("psum_add_rms_norm", axes, np.shape(x), jnp.result_type(x),
             _axes.axis_size(axes), config)
    if not p.quantized:
        total = (exact_psum(vary(x, axes, config), axes, p) if p.path == "exact"
                 else jax_compat.psum(x, axes))
        h = residual + total
        out = rms_norm(h, weight, eps)
        if out_bits is None:
            return out, h
        return codec.quantize(out, bits=out_bits, group_size=og, backend=p.backend), h
    xv = vary(x, axes, config)
    if out_bits is not None:
        _, _, p2 = two_step(xv, axes, p, decode=False)
        return codec_norm.add_rms_norm(p2, residual, weight, eps=float(eps), out_bits=out_bits,
                                       out_group_size=og, backend=p.backend)
    return _fused(xv, residual, weight, axes, p, float(eps))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _fused(x, residual, weight, axes, p, eps):
    _, _, p2 = two_step(x, axes, p, decode=False)
    return codec_norm.add_rms_norm(p2, residual, weight, eps=eps, backend=p.backend)


def _fused_fwd(x, residual, weight, axes, p, eps):
    out, h = _fused(x, residual, weight, axes, p, eps)
    return (out, h), (h, weight)


def _fused_bwd(axes, p, eps, saved, cts):
    h, weight = saved
    ct_out, ct_h = cts
    _, pullback = jax.vjp(lambda h, w: rms_norm(h, w, eps), h, weight)
    ct_norm_h, ct_w = pullback(ct_out)
    ct_sum = ct_norm_h + ct_h
    return _axes.to_varying(ct_sum, axes), ct_sum, ct_w


_fused.defvjp(_fused_fwd, _fused_bwd)
