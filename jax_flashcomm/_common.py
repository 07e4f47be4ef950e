"""Helpers shared by the quantized collectives: axis names, validation, the wire buffer.

A codec :class:`~jax_flashcomm.codec.Payload` has three arrays (codes, scale, zero). Sending
them as three collectives triples the per-collective latency, so the collectives here move one
uint8 buffer per phase: ``(..., groups, record + 4)`` = codes (and spike record), then the bf16 scale and zero
as two bytes each (:func:`pack` / :func:`unpack`). The bytes are the payload's, unchanged.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import Payload, spec

try:  # Varying -> Invariant all-gather (what psum's result type needs); not re-exported by lax.
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - older/newer JAX without it
    _all_gather_invariant = None


def normalize_axes(axis_name, name: str = "axis_name") -> tuple:
    """``axis_name`` (a name or a tuple/list of names) as a tuple of bound mesh axis names."""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError(f"{name} is empty")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{name} repeats an axis: {axis_name!r}")
    for axis in axes:
        if isinstance(axis, (int, np.integer)):
            raise TypeError(f"{name} must name mesh axes (positional int axes are not "
                            f"supported), got {axis_name!r}")
        try:
            lax.axis_size(axis)
        except NameError as err:
            raise ValueError(
                f"{name}={axis_name!r}: axis {axis!r} is not bound; call inside jax.shard_map "
                f"over a mesh that has it ({err})") from None
    return axes


def axis_size(axes: tuple) -> int:
    return math.prod(int(lax.axis_size(a)) for a in axes)


def leaf_name(path) -> str:
    """``x`` plus the pytree path of a leaf (``x['a'][0]``), for error messages."""
    return "x" + jax.tree_util.keystr(path)


def check_float(x, name: str = "x"):
    """The quantized paths take f32, bf16 or f16 leaves only."""
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an array, got {type(x)}")
    return spec.check_dtype(dtype, name)


def varying_axes(x) -> frozenset:
    """Mesh axes over which ``x`` varies (its check_vma type)."""
    return frozenset(jax.typeof(x).mat.varying)


def missing_axes(x, axes: tuple) -> tuple:
    """The axes of ``axes`` over which ``x`` is not (yet) varying, in ``axes`` order."""
    have = varying_axes(x)
    return tuple(a for a in axes if a not in have)


def to_varying(ct, axes: tuple):
    """Cast ``ct`` to varying over ``axes`` (no communication): psum's transpose, and the type of
    a cotangent whose instantiated zeros may not be varying yet."""
    missing = missing_axes(ct, axes)
    return lax.pcast(ct, missing, to="varying") if missing else ct


def pack(p: Payload):
    """Payload -> one uint8 buffer ``(..., groups, codes_bytes + 4)``."""
    scale = lax.bitcast_convert_type(p.scale, jnp.uint8)
    zero = lax.bitcast_convert_type(p.zero, jnp.uint8)
    return jnp.concatenate([p.codes, scale, zero], axis=-1)


def unpack(buf, *, bits: int, group_size: int, shape, dtype, rotation: int = 0,
           spikes: int = 0) -> Payload:
    """Inverse of :func:`pack`; ``shape``/``dtype`` describe the operand to rebuild (and
    ``rotation``/``spikes`` its codec options, which the wire record does not carry)."""
    nb = spec.record_bytes(group_size, bits, spikes)
    codes = buf[..., :nb]
    scale = lax.bitcast_convert_type(buf[..., nb:nb + 2], jnp.bfloat16)
    zero = lax.bitcast_convert_type(buf[..., nb + 2:nb + 4], jnp.bfloat16)
    return Payload(codes, scale, zero, bits=bits, group_size=group_size, shape=tuple(shape),
                   dtype=np.dtype(dtype), rotation=rotation, spikes=spikes)


def with_meta(p: Payload, **meta) -> Payload:
    return dataclasses.replace(p, **meta)


def all_gather_invariant(x, axes: tuple, *, axis: int = 0, tiled: bool = False):
    """All-gather whose result is invariant over ``axes`` (replicated), as psum's result is."""
    if _all_gather_invariant is None:  # pragma: no cover
        raise RuntimeError("this JAX has no all_gather_invariant; jax_flashcomm.psum needs it "
                           "to give its result psum's replicated type")
    return _all_gather_invariant(x, axes, axis=axis, tiled=tiled)
