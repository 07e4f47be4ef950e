"""What travels: codec payloads and pytrees of arrays as one uint8 buffer per move.

A codec :class:`~jax_flashcomm.codec.Payload` has three arrays (codes, scale, zero). Sending
them as three collectives triples the per-collective latency, so a phase moves one uint8 buffer
``(..., groups, record + 4)``: the codes (and spike record), then the bf16 scale and zero as two
bytes each (:func:`pack` / :func:`unpack`). The ring matmuls move a whole pytree (a payload's
arrays, or plain chunks) as one flat buffer (:func:`pack_tree` / :func:`unpack_tree`). The bytes
are the payload's, unchanged.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm.codec import Payload, spec

__all__ = ["pack", "unpack", "with_meta", "pack_tree", "unpack_tree"]


def pack(p: Payload) -> jax.Array:
    """Payload -> one uint8 buffer ``(..., groups, codes_bytes + 4)``.

    Args:
      p: a payload (any leading axes).

    Returns:
      uint8: each group's codes (and spike record), then its bf16 scale and zero's bytes.
    """
    if p.format != "int":  # the record holds its scales
        return p.codes
    scale = lax.bitcast_convert_type(p.scale, jnp.uint8)
    zero = lax.bitcast_convert_type(p.zero, jnp.uint8)
    return jnp.concatenate([p.codes, scale, zero], axis=-1)


def unpack(buf: jax.Array, *, bits: int, group_size: int, shape: tuple[int, ...], dtype,
           rotation: int = 0, spikes: int = 0, format: str = "int") -> Payload:
    """Inverse of :func:`pack`.

    Args:
      buf: uint8 ``(..., groups, record bytes + 4)``.
      bits, group_size: the payload's codec parameters.
      shape, dtype: the operand to rebuild.
      rotation, spikes: its codec options, which the wire record does not carry.
      format: "int", or a floating-point format (the buffer is then the codes records).

    Returns:
      The :class:`~jax_flashcomm.codec.Payload`.
    """
    if format != "int":
        return Payload(buf, None, None, bits=spec.FP_BITS[format], group_size=group_size,
                       shape=tuple(shape), dtype=np.dtype(dtype), rotation=rotation,
                       spikes=spikes, format=format)
    nb = spec.record_bytes(group_size, bits, spikes)
    codes = buf[..., :nb]
    scale = lax.bitcast_convert_type(buf[..., nb:nb + 2], jnp.bfloat16)
    zero = lax.bitcast_convert_type(buf[..., nb + 2:nb + 4], jnp.bfloat16)
    return Payload(codes, scale, zero, bits=bits, group_size=group_size, shape=tuple(shape),
                   dtype=np.dtype(dtype), rotation=rotation, spikes=spikes)


def with_meta(p: Payload, **meta) -> Payload:
    """``p`` with some of its static fields (shape, dtype, ...) replaced.

    Args:
      p: a payload.
      **meta: the static fields to replace.

    Returns:
      The new payload (same arrays).
    """
    return dataclasses.replace(p, **meta)


def pack_tree(tree) -> jax.Array:
    """The leaves of a pytree of arrays as one flat uint8 buffer (see :func:`unpack_tree`).

    Args:
      tree: a pytree of arrays (e.g. a payload).

    Returns:
      uint8 ``(total bytes,)``: the leaves' bytes in leaf order.
    """
    leaves = jax.tree.leaves(tree)
    return jnp.concatenate([lax.bitcast_convert_type(a, jnp.uint8).reshape(-1) for a in leaves])


def unpack_tree(buf: jax.Array, like):
    """Inverse of :func:`pack_tree`.

    Args:
      buf: the flat uint8 buffer.
      like: a pytree of ``ShapeDtypeStruct`` objects, one per leaf.

    Returns:
      The pytree, of ``like``'s structure.
    """
    leaves, treedef = jax.tree.flatten(like)
    out, offset = [], 0
    for leaf in leaves:
        width = jnp.dtype(leaf.dtype).itemsize
        seg = buf[offset : offset + leaf.size * width]
        offset += leaf.size * width
        seg = seg.reshape(leaf.shape + ((width,) if width > 1 else ()))
        out.append(lax.bitcast_convert_type(seg, leaf.dtype))
    return treedef.unflatten(out)
