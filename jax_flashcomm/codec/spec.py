"""The codec's parameters and their validation (the wire format is docs/format.md).

Every public entry point validates here, at trace time, so bad input gets a clear Python
exception that names the argument instead of reaching a kernel.
"""

from __future__ import annotations

import numpy as np
import jax.numpy as jnp

MIN_BITS = 2
MAX_BITS = 8
BLOCK = 8  # codes are packed per block of 8 values: 8 * bits bits = bits bytes
DEFAULT_GROUP_SIZE = 128
#: The largest group (values): the kernels' scratch and record sizes stay far from overflow.
MAX_GROUP_SIZE = 1 << 24
FLT_MIN = np.float32(np.finfo(np.float32).tiny)
BF16_NAN_BITS = 0x7FC0
BF16_NEG_INF_BITS = 0xFF80
BF16_LOWEST_BITS = 0xFF7F
#: f32's lowest value lies this far below bf16's lowest (the zero's clamp): 1.33e36.
FLT_MAX_MINUS_BF16_LOWEST = np.float32(np.float64(np.finfo(np.float32).max) - 3.3895313892515355e38)

#: Operand dtypes the codec accepts. Accumulation is always f32.
SUPPORTED_DTYPES = (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
BACKENDS = ("auto", "ffi", "jnp")


def _as_int(value, name: str, expected: str) -> int:
    """``value`` as a Python int; a TypeError naming ``name`` and ``expected`` for a bool or a
    non-integer."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be {expected}, got {value!r}")
    return int(value)


def check_bits(bits, name: str = "bits") -> int:
    """``bits`` as a Python int, which must be an int in 2..8 (else a TypeError or ValueError
    naming ``name``)."""
    bits = _as_int(bits, name, f"an int in {MIN_BITS}..{MAX_BITS}")
    if not MIN_BITS <= bits <= MAX_BITS:
        raise ValueError(f"{name} must be in {MIN_BITS}..{MAX_BITS}, got {bits}")
    return bits


def check_group_size(group_size, name: str = "group_size") -> int:
    """``group_size`` as a Python int, which must be a positive multiple of 8 and at most
    ``MAX_GROUP_SIZE`` (2**24) (else a TypeError or ValueError naming ``name``)."""
    group_size = _as_int(group_size, name, f"a positive multiple of {BLOCK}")
    if group_size <= 0 or group_size % BLOCK:
        raise ValueError(f"{name} must be a positive multiple of {BLOCK}, got {group_size}")
    if group_size > MAX_GROUP_SIZE:
        raise ValueError(f"{name} must be at most {MAX_GROUP_SIZE} (2**24, docs/format.md), got "
                         f"{group_size}")
    return group_size


def check_dtype(dtype, name: str = "x") -> np.dtype:
    """The operand dtype must be f32, bf16 or f16.

    Args:
      dtype: anything ``np.dtype`` takes.
      name: the argument's name in errors.

    Returns:
      The ``np.dtype``.

    Raises:
      TypeError: another dtype.
    """
    dtype = np.dtype(dtype)
    if dtype not in SUPPORTED_DTYPES:
        names = ", ".join(str(d) for d in SUPPORTED_DTYPES)
        raise TypeError(f"{name} must have dtype {names}; got {dtype}")
    return dtype


#: Rotations of a group before quantization (docs/format.md, "Rotation"): none, the
#: orthonormal Walsh-Hadamard transform, or the transform after a fixed +-1 sign vector.
ROTATIONS = (0, 1, 2)
ROTATION_NAMES = {None: 0, "none": 0, "hadamard": 1, "signed_hadamard": 2}


def check_rotation(rotation, group_size: int | None = None, name: str = "rotation") -> int:
    """``rotation`` is 0/None/"none", 1/"hadamard" or 2/"signed_hadamard".

    Args:
      rotation: the value to check (an int or a name).
      group_size: if given, a rotation needs it to be a power of two.
      name: the argument's name in errors.

    Returns:
      The rotation as an int in 0..2.

    Raises:
      TypeError, ValueError: an unknown rotation, or a group size it cannot rotate.
    """
    if isinstance(rotation, str) or rotation is None:
        if rotation not in ROTATION_NAMES:
            raise ValueError(f"{name} must be one of {tuple(k for k in ROTATION_NAMES if k)} or "
                             f"{ROTATIONS}, got {rotation!r}")
        rotation = ROTATION_NAMES[rotation]
    if isinstance(rotation, (bool, np.bool_)) or not isinstance(rotation, (int, np.integer)):
        raise TypeError(f"{name} must be an int in {ROTATIONS} or a name, got {rotation!r}")
    if int(rotation) not in ROTATIONS:
        raise ValueError(f"{name} must be in {ROTATIONS}, got {rotation}")
    rotation = int(rotation)
    if rotation and group_size is not None and group_size & (group_size - 1):
        raise ValueError(f"{name}={rotation} needs a power-of-two group_size, got {group_size}")
    return rotation


#: Spike reserving (docs/format.md, "Spike reserving"): at most this many values per group
#: travel as bf16 beside the codes.
MAX_SPIKES = 16
#: Spikes need groups of at most this many values: a position is stored in 2 bytes.
MAX_SPIKE_GROUP_SIZE = 1 << 16


def check_spikes(spikes, group_size: int | None = None, name: str = "spikes") -> int:
    """``spikes`` (values kept in bf16 per group) is an int in 0..16, below ``group_size``.

    Args:
      spikes: the value to check; None means 0.
      group_size: if given, ``spikes`` must be below it, and spikes need it at most
        ``MAX_SPIKE_GROUP_SIZE`` (65536).
      name: the argument's name in errors.

    Returns:
      ``spikes`` as a Python int.

    Raises:
      TypeError, ValueError: not an int, or not allowed.
    """
    if spikes is None:
        return 0
    if isinstance(spikes, (bool, np.bool_)) or not isinstance(spikes, (int, np.integer)):
        raise TypeError(f"{name} must be an int in 0..{MAX_SPIKES}, got {spikes!r}")
    if not 0 <= int(spikes) <= MAX_SPIKES:
        raise ValueError(f"{name} must be in 0..{MAX_SPIKES}, got {spikes}")
    if group_size is not None and int(spikes) >= group_size:
        raise ValueError(f"{name}={spikes} must be below group_size={group_size}")
    if group_size is not None and int(spikes) and group_size > MAX_SPIKE_GROUP_SIZE:
        raise ValueError(f"{name}={spikes} needs group_size <= {MAX_SPIKE_GROUP_SIZE} (a spike's "
                         f"position is stored in 2 bytes, docs/format.md), got {group_size}")
    return int(spikes)


def check_backend(backend) -> str:
    """``backend`` is one of :data:`BACKENDS` (``"auto"``, ``"ffi"``, ``"jnp"``).

    Args:
      backend: the value to check.

    Returns:
      ``backend``.

    Raises:
      ValueError: another value.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def group_bytes(group_size: int, bits: int) -> int:
    """Bytes of packed codes per group.

    Args:
      group_size, bits: the codec parameters.
    """
    return group_size * bits // 8


def position_bytes(group_size: int) -> int:
    """Bytes of one spike position: 1 for G <= 256, else 2.

    Args:
      group_size: G.
    """
    return 1 if group_size <= 256 else 2


def spike_bytes(group_size: int, spikes: int) -> int:
    """Bytes of a group's spike record: k bf16 values and k positions.

    Args:
      group_size: G.
      spikes: k.
    """
    return spikes * (2 + position_bytes(group_size))


def record_bytes(group_size: int, bits: int, spikes: int = 0) -> int:
    """Bytes per group of a payload's codes array: packed codes, then the spike record.

    Args:
      group_size, bits, spikes: the codec parameters.
    """
    return group_bytes(group_size, bits) + spike_bytes(group_size, spikes)


def padded_size(size: int, group_size: int, multiple: int = 1) -> int:
    """``size`` rounded up to a multiple of ``multiple * group_size`` (at least one unit).

    Args:
      size: values.
      group_size: values per group.
      multiple: groups per unit (e.g. the chunk count).
    """
    unit = multiple * group_size
    return max(unit, -(-size // unit) * unit)


def wire_bytes_per_element(bits: int, group_size: int, spikes: int = 0,
                           format: str = "int") -> float:
    """Bytes one payload carries per operand element: codes, spike record, and the scales (a
    bf16 scale and zero per group in ``"int"``, in the record in a floating-point format).

    Args:
      bits, group_size, spikes: the codec parameters (``bits`` only for ``"int"``).
      format: one of :data:`FORMATS`.

    Returns:
      Bytes per element: e.g. 1.03125 for 8 bits, groups of 128, no spikes; 0.5703 for nvfp4 at
      G = 128 (0.2852x of a bf16 ring).
    """
    if format == "int":
        return (record_bytes(group_size, bits, spikes) + 4) / group_size
    return fp_record_bytes(format, group_size, spikes) / group_size


# ---- floating-point group formats (docs/format.md, "Floating-point formats") ----

#: The codec's formats: integer groups (``bits`` 2..8, a bf16 scale and zero per group) and the
#: floating-point ones: FP8 E4M3 values with a bf16 scale per group; E2M1 (FP4) values with an
#: E8M0 scale per 32 (MXFP4) or an E4M3 scale per 16 under an E8M0 scale per group (NVFP4).
FORMATS = ("int", "fp8", "mxfp4", "nvfp4")
FP_FORMATS = FORMATS[1:]
#: Values per block scale (fp8: one scale per group).
FP_BLOCK = {"mxfp4": 32, "nvfp4": 16}
#: Bits per value of each floating-point format.
FP_BITS = {"fp8": 8, "mxfp4": 4, "nvfp4": 4}


def check_format(fmt, group_size: int | None = None, name: str = "format") -> str:
    """``fmt`` is one of :data:`FORMATS`; a block format needs ``group_size`` a multiple of its
    block (32 for mxfp4, 16 for nvfp4).

    Args:
      fmt: the value to check.
      group_size: if given, checked against the format's block.
      name: the argument's name in errors.

    Returns:
      ``fmt``.

    Raises:
      ValueError: another value, or a group size the format cannot split into blocks.
    """
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ValueError(f"{name} must be one of {FORMATS}, got {fmt!r}")
    block = FP_BLOCK.get(fmt)
    if block and group_size is not None and group_size % block:
        raise ValueError(f"{name}={fmt!r} needs group_size a multiple of {block} (its block), "
                         f"got {group_size}")
    return fmt


def fp_code_bytes(fmt: str, group_size: int) -> int:
    """Bytes of a floating-point group's element codes: 1 per value (fp8) or 1 per 2 (FP4)."""
    return group_size if fmt == "fp8" else group_size // 2


def fp_scale_bytes(fmt: str, group_size: int) -> int:
    """Bytes of a floating-point group's scales: fp8 a bf16; mxfp4 one E8M0 per 32; nvfp4 one
    E4M3 per 16 and one E8M0 per group."""
    if fmt == "fp8":
        return 2
    if fmt == "mxfp4":
        return group_size // FP_BLOCK["mxfp4"]
    return group_size // FP_BLOCK["nvfp4"] + 1


def fp_record_bytes(fmt: str, group_size: int, spikes: int = 0) -> int:
    """Bytes per group of a floating-point payload's codes array, which holds the whole group:
    element codes, scales, then the spike record (no separate scale or zero array).

    Args:
      fmt, group_size, spikes: the codec parameters.
    """
    return (fp_code_bytes(fmt, group_size) + fp_scale_bytes(fmt, group_size)
            + spike_bytes(group_size, spikes))
