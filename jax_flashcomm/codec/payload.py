"""The quantized payload: a pytree of the wire arrays plus static metadata."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jax_flashcomm.codec.group_format import GroupFormat


@dataclasses.dataclass(frozen=True)
class Payload:
    """Codes and per-group parameters of a quantized operand (docs/format.md).

    ``codes`` is uint8 ``(..., groups, group_size * bits / 8 + spike bytes)``; ``scale`` and
    ``zero`` are bf16
    ``(..., groups)``. The leading ``...`` axes are chunk or batch axes that collectives move
    around. ``shape`` and ``dtype`` describe the operand that :func:`dequantize` rebuilds.
    A payload is a pytree whose leaves are the three arrays, so it passes through ``jit``,
    ``vmap``, ``lax.all_to_all``, ``lax.ppermute`` and ``lax.all_gather`` unchanged.

    A floating-point payload (``format`` "fp8", "mxfp4" or "nvfp4") keeps each whole group,
    scales included, in its codes record; its ``scale`` and ``zero`` are None.

    Attributes:
      codes: uint8 ``(..., groups, record bytes)``: packed codes (a floating-point format's
        element codes and scales), then the spike record.
      scale: bf16 ``(..., groups)``: each group's step (None in a floating-point format).
      zero: bf16 ``(..., groups)``: each group's offset, the value of code 0 (None likewise).
      bits: bits per code, 2..8 (static).
      group_size: values per group (static).
      shape: the operand's shape (static).
      dtype: the operand's dtype (static).
      rotation: 0 (none), 1 (Hadamard) or 2 (signed Hadamard) (static).
      spikes: values per group kept in bf16 (static).
      format: "int" or a floating-point format (static; docs/format.md).
    """

    codes: jax.Array
    scale: jax.Array
    zero: jax.Array
    bits: int = dataclasses.field(metadata=dict(static=True))
    group_size: int = dataclasses.field(metadata=dict(static=True))
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    dtype: np.dtype = dataclasses.field(metadata=dict(static=True))
    #: 0: the codes are of the values; 1 or 2: of the group's (signed) Hadamard rotation
    #: (docs/format.md, "Rotation"); decoding applies the inverse.
    rotation: int = dataclasses.field(default=0, metadata=dict(static=True))
    #: k > 0: each group's k largest-magnitude values travel as bf16 with their positions after
    #: its codes, in the codes array (docs/format.md, "Spike reserving").
    spikes: int = dataclasses.field(default=0, metadata=dict(static=True))
    #: "int": integer groups with the scale and zero arrays; "fp8", "mxfp4", "nvfp4": floating-
    #: point groups, everything in the codes record (docs/format.md, "Floating-point formats").
    format: str = dataclasses.field(default="int", metadata=dict(static=True))

    @property
    def group_format(self) -> GroupFormat:
        """The payload's :class:`~jax_flashcomm.codec.GroupFormat` (format, bits, group size,
        rotation, spikes): what the kernels decode it with."""
        return GroupFormat(self.format, self.bits, self.group_size, self.rotation, self.spikes)

    @property
    def num_groups(self) -> int:
        """Groups per chunk (the group axis of ``codes``)."""
        return self.codes.shape[-2]

    @property
    def nbytes(self) -> int:
        """Bytes on the wire: codes (and spike records) plus scale and zero."""
        return self.codes.size + sum(2 * a.size for a in (self.scale, self.zero) if a is not None)

    def map_arrays(self, fn, **meta) -> "Payload":
        """Apply ``fn`` to codes, scale and zero (e.g. a reshape or a collective).

        Args:
          fn: ``array -> array``, applied to each of the three arrays.
          **meta: static fields to replace (e.g. ``shape=``).

        Returns:
          The new :class:`Payload`.
        """
        return dataclasses.replace(self, codes=fn(self.codes), scale=_maybe(fn, self.scale),
                                   zero=_maybe(fn, self.zero), **meta)

    def split_groups(self, chunks: int) -> "Payload":
        """View the group axis as ``(chunks, groups // chunks)``, for all_to_all and sums.

        Args:
          chunks: how many chunks; it divides the group count.

        Returns:
          The payload with scale ``(..., chunks, groups // chunks)``.
        """
        def split(a, trailing):
            lead = a.shape[: a.ndim - 1 - trailing]
            return a.reshape(*lead, chunks, a.shape[a.ndim - 1 - trailing] // chunks,
                             *a.shape[a.ndim - trailing:])
        return dataclasses.replace(self, codes=split(self.codes, 1),
                                   scale=_maybe(split, self.scale, 0),
                                   zero=_maybe(split, self.zero, 0))

    def merge_groups(self) -> "Payload":
        """Inverse of :meth:`split_groups`: fold ``(chunks, groups)`` back into one axis."""
        def merge(a, trailing):
            lead = a.shape[: a.ndim - 2 - trailing]
            return a.reshape(*lead, -1, *a.shape[a.ndim - trailing:])
        return dataclasses.replace(self, codes=merge(self.codes, 1),
                                   scale=_maybe(merge, self.scale, 0),
                                   zero=_maybe(merge, self.zero, 0))


def _maybe(fn, a, *args):
    """``fn(a, *args)``, or None where a floating-point payload has no such array."""
    return None if a is None else fn(a, *args)


jax.tree_util.register_dataclass(
    Payload,
    data_fields=["codes", "scale", "zero"],
    meta_fields=["bits", "group_size", "shape", "dtype", "rotation", "spikes", "format"],
)
