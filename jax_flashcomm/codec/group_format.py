"""One phase's group format: what each group of values becomes on the wire (docs/format.md).

A :class:`GroupFormat` is the one value that carries a phase's format from the config through
the plan and the payload to the kernels, where it is one FFI dictionary attribute decoded into
one C++ struct (``flashcomm::GroupFormat``, ffi/include/flashcomm/group_format.h).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_flashcomm.codec import spec


@dataclasses.dataclass(frozen=True)
class GroupFormat:
    """A phase's group format.

    Attributes:
      format: ``"int"`` (integer codes with a bf16 scale and zero per group) or a
        floating-point format (``"fp8"``, ``"mxfp4"``, ``"nvfp4"``).
      bits: bits per code, 2..8 (the floating-point formats: 8 or 4).
      group_size: values per group, a positive multiple of 8.
      rotation: 0 none, 1 Hadamard, 2 signed Hadamard (before quantizing each group).
      spikes: values per group kept in bf16 beside the codes.
    """

    format: str = "int"
    bits: int = 8
    group_size: int = spec.DEFAULT_GROUP_SIZE
    rotation: int = 0
    spikes: int = 0

    def __post_init__(self):
        if self.format not in spec.FORMATS:
            raise ValueError(f"format must be one of {spec.FORMATS}, got {self.format!r}")
        spec.check_bits(self.bits)
        spec.check_group_size(self.group_size)
        if self.rotation not in (0, 1, 2):
            raise ValueError(f"rotation must be 0, 1 or 2, got {self.rotation!r}")
        if isinstance(self.spikes, bool) or not isinstance(self.spikes, (int, np.integer)) \
                or self.spikes < 0:
            raise ValueError(f"spikes must be a non-negative int, got {self.spikes!r}")

    @property
    def floating_point(self) -> bool:
        """Whether the groups are floating-point records (scales inside the codes)."""
        return self.format != "int"

    def record_bytes(self) -> int:
        """Bytes of one group's codes record (codes, in-record scales, spikes)."""
        if self.floating_point:
            return spec.fp_record_bytes(self.format, self.group_size, self.spikes)
        return spec.record_bytes(self.group_size, self.bits, self.spikes)

    def wire_bytes_per_element(self) -> float:
        """Bytes a payload of this format carries per operand element (whole groups)."""
        return spec.wire_bytes_per_element(self.bits, self.group_size, self.spikes, self.format)

    def ffi_attribute(self) -> dict:
        """The FFI dictionary attribute the kernels decode into ``flashcomm::GroupFormat``."""
        return {"format": np.int32(spec.FORMATS.index(self.format)), "bits": np.int32(self.bits),
                "group_size": np.int64(self.group_size), "rotation": np.int32(self.rotation),
                "spikes": np.int32(self.spikes)}
