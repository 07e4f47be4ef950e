"""Mesh-axis helpers shared by every op: naming, sizes, varying-axes types, operand checks."""

from __future__ import annotations

import math

import jax
import numpy as np
from jax import lax

from jax_flashcomm.codec import spec

__all__ = ["normalize_axes", "axis_size", "leaf_name", "check_float", "varying_axes",
           "missing_axes", "to_varying", "match_varying"]


def normalize_axes(axis_name, where: str = "", name: str = "axis_name") -> tuple[str, ...]:
    """``axis_name`` (a mesh axis name or a tuple/list of them) as a tuple of bound names.

    Args:
      axis_name: a mesh axis name, or a tuple/list of them.
      where: the entry point's name, prefixed to errors.
      name: the argument's name in errors.

    Returns:
      The names, in order.

    Raises:
      ValueError: an empty or repeated tuple, or an axis not bound here (outside
        ``jax.shard_map``).
      TypeError: a positional int axis or a name that is not a string.
    """
    prefix = f"{where}: " if where else ""
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    if not axes:
        raise ValueError(f"{prefix}{name} is empty")
    if len(set(axes)) != len(axes):
        raise ValueError(f"{prefix}{name} repeats an axis: {axis_name!r}")
    for axis in axes:
        if isinstance(axis, (int, np.integer)):
            raise TypeError(f"{prefix}{name} must be a mesh axis name (str) or a tuple of them "
                            f"(positional int axes are not supported), got {axis_name!r}")
        if not isinstance(axis, str):
            raise TypeError(f"{prefix}{name} must be a mesh axis name (str) or a tuple of them, "
                            f"got {axis_name!r}")
        try:
            lax.axis_size(axis)
        except NameError:
            raise ValueError(
                f"{prefix}{name}={axis_name!r}: axis {axis!r} is not bound (not a bound mesh "
                f"axis here); call inside jax.shard_map over a mesh that has it") from None
    return axes


def axis_size(axes: tuple[str, ...]) -> int:
    """The number of ranks over the bound mesh ``axes``.

    Args:
      axes: bound mesh axis names (:func:`normalize_axes`).

    Returns:
      The product of their sizes.
    """
    return math.prod(int(lax.axis_size(a)) for a in axes)


def leaf_name(path) -> str:
    """``x`` plus the pytree path of a leaf (``x['a'][0]``), for error messages.

    Args:
      path: a key path (from ``jax.tree_util.tree_map_with_path``).

    Returns:
      The leaf's name.
    """
    return "x" + jax.tree_util.keystr(path)


def check_float(x, name: str = "x") -> np.dtype:
    """The quantized paths take f32, bf16 or f16 leaves only.

    Args:
      x: the leaf.
      name: its name in errors.

    Returns:
      Its dtype.

    Raises:
      TypeError: ``x`` is not an array or not of a codec dtype.
    """
    dtype = getattr(x, "dtype", None)
    if dtype is None:
        raise TypeError(f"{name} must be an array, got {type(x)}")
    return spec.check_dtype(dtype, name)


def varying_axes(x) -> frozenset[str]:
    """Mesh axes over which ``x`` varies (its check_vma type; empty outside shard_map).

    Args:
      x: an array or tracer.

    Returns:
      The axis names.
    """
    mat = getattr(jax.typeof(x), "manual_axis_type", None)
    return frozenset(getattr(mat, "varying", frozenset()))


def missing_axes(x, axes: tuple[str, ...]) -> tuple[str, ...]:
    """The axes of ``axes`` over which ``x`` is not (yet) varying, in ``axes`` order.

    Args:
      x: an array or tracer.
      axes: mesh axis names.

    Returns:
      A sub-tuple of ``axes``.
    """
    have = varying_axes(x)
    return tuple(a for a in axes if a not in have)


def to_varying(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``x`` cast to varying over ``axes`` (no communication).

    psum's transpose, and the type of a cotangent whose instantiated zeros may not be varying
    yet.

    Args:
      x: an array.
      axes: mesh axis names.

    Returns:
      ``x``, varying over ``axes`` (unchanged where it already is).
    """
    missing = missing_axes(x, axes)
    return lax.pcast(x, missing, to="varying") if missing else x


def match_varying(arrays, axes: tuple[str, ...]) -> list[jax.Array]:
    """The arrays cast to vary over the same axes: the union of theirs and ``axes``.

    Args:
      arrays: a sequence of arrays.
      axes: mesh axis names every result varies over too.

    Returns:
      The arrays, in order.
    """
    want = frozenset(axes).union(*(varying_axes(a) for a in arrays))
    return [to_varying(a, tuple(sorted(want))) for a in arrays]


def invariant_over_unit_axes(x: jax.Array, spec) -> jax.Array:
    """``x`` made invariant over the mesh axes of size 1 it varies over but ``spec`` does not
    name (a psum of one value, no data moved): an operand sharded over such an axis makes
    everything computed from it vary over it, which an ``out_specs`` without it refuses.

    Args:
      x: a value inside ``shard_map``.
      spec: the PartitionSpec (or tuple of entries) of its result.

    Returns:
      ``x``, invariant over those axes.
    """
    named = {a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)}
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    unit = tuple(a for a in sorted(varying_axes(x)) if sizes.get(a) == 1 and a not in named)
    return jax.lax.psum(x, unit) if unit else x



def check_dim(dim, ndim: int, name: str) -> int:
    """``dim`` as a non-negative axis of a rank-``ndim`` operand (a TypeError for a non-int, a
    ValueError out of range; ``name`` names it)."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {dim!r}")
    if not -ndim <= dim < ndim:
        raise ValueError(f"{name}={dim} is out of range for an operand of rank {ndim}")
    return dim % ndim
