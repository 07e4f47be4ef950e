"""Options of the quantized collectives and the size policy that picks exact or quantized.

:class:`CommConfig` is a frozen (hashable) dataclass, so it can be a static argument of
``jax.custom_vjp`` and ``jax.jit``. :func:`decide` makes the per-leaf choice at trace time:
below ``min_bytes`` (per-rank operand bytes) the exact ``lax`` collective is used, because small
messages are latency-bound and quantizing costs more than it saves (published crossovers sit
near 1 MB; ``docs/allreduce.md`` has the crossover measured here). Every decision is logged at
DEBUG level on the ``jax_flashcomm`` logger and, inside :func:`record`, collected as
:class:`Decision` objects, so a user can see which path each collective took.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import numpy as np

from jax_flashcomm.codec import spec

__all__ = ["CommConfig", "Decision", "decide", "record", "DEFAULT_MIN_BYTES", "GRAD_MODES"]

logger = logging.getLogger("jax_flashcomm")

#: Below this many bytes per rank the exact lax collective is used (published crossovers ~1 MB).
DEFAULT_MIN_BYTES = 1 << 20
#: ``"exact"``: cotangent collectives are the lax ones; ``"quantized"``: they use this config.
GRAD_MODES = ("exact", "quantized")
#: How payloads move between ranks (jax_flashcomm.transport).
TRANSPORTS = ("auto", "xla", "p2p")

#: spikes="auto": one spike per group in each quantized phase of at most 6 bits, decided per
#: phase. Measured (docs/outliers.md): never worse than none, 3-13x lower error on outlier
#: channels, for 3 B per group; at 8 bits the bytes would cross the int8 wire target (0.527x >
#: 0.52x of a bf16 ring), so 8-bit phases keep none (rs_bits=4, ag_bits=8: 1 and 0).
AUTO_SPIKES = 1
AUTO_SPIKES_MAX_BITS = 6
#: rotation="auto": Hadamard when every quantized phase has at least 6 bits and the group size
#: is a power of two, else none. Measured on SmolLM2 (docs/accuracy.md, "Defaults"): at no wire
#: cost it cuts int8's KL vs exact 6x (perplexity change +0.17% -> -0.08%) and int6's
#: perplexity change 3x; with a 4-bit phase it is worse than the spike alone (rs4/ag8: +12.2%
#: vs +6.2%): a spike picked after the rotation no longer holds the outlier.
AUTO_ROTATION = 1
AUTO_ROTATION_MIN_BITS = 6

_recorders: list[list["Decision"]] = []


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How a quantized collective runs.

    ``bits=None`` is the exact setting: the collective *is* the lax one. ``rs_bits`` and
    ``ag_bits`` override ``bits`` for the reduce-scatter (all-to-all) and all-gather phases of
    the two-step all-reduce (e.g. ``rs_bits=4, ag_bits=8``). ``min_bytes`` is the size policy's
    threshold on the per-rank operand bytes; ``grad`` picks exact or quantized collectives for
    cotangents; ``backend`` is the codec backend ("auto", "ffi", "jnp"). ``rotation``
    quantizes each group's (signed) Walsh-Hadamard transform (needs a power-of-two
    ``group_size``): outlier channels then no longer set the step of their groups; the default
    ``"auto"`` is Hadamard when both phases have at least 6 bits and the group size is a power
    of two, else none (docs/accuracy.md measured it).
    ``transport`` picks how payloads move ("auto", "xla", "p2p"; docs/transport.md).
    ``spikes`` keeps each group's k largest-magnitude values in bf16 beside the codes; the
    default ``"auto"`` is the rule docs/outliers.md measured, decided per phase: 1 in a phase
    of at most 6 bits, else 0 (:attr:`phase1_spikes`, :attr:`phase2_spikes` are the resolved
    counts; an int applies to both phases).
    """

    bits: int | None = 8
    rs_bits: int | None = None
    ag_bits: int | None = None
    group_size: int = spec.DEFAULT_GROUP_SIZE
    min_bytes: int = DEFAULT_MIN_BYTES
    backend: str = "auto"
    grad: str = "exact"
    #: Rotation of every group before quantization (docs/format.md, "Rotation"; docs/outliers.md
    #: and docs/accuracy.md measure it): 0 none, 1 Hadamard, 2 signed Hadamard, their names, or
    #: "auto" (the default): Hadamard when both phases have >= 6 bits and ``group_size`` is a
    #: power of two, else none (:data:`AUTO_ROTATION_MIN_BITS`).
    rotation: int | str = "auto"
    #: Values per group kept in bf16 with their positions (docs/format.md, "Spike reserving";
    #: docs/outliers.md measures it): "auto" (the default, decided per phase, see
    #: :attr:`phase1_spikes`) or 0..16 below group_size for both phases.
    spikes: int | str = "auto"
    #: How payloads move (jax_flashcomm.transport, docs/transport.md): "auto" (the default:
    #: "p2p" where it runs and is measured faster, else "xla"), "xla" (XLA's collectives) or
    #: "p2p" (one fused FFI call per rank reading its peers' buffers; one process only).
    transport: str = "auto"
    #: The p2p transport's limit on every wait for a peer: a missing peer raises after it.
    p2p_timeout_ms: int = 60_000

    def __post_init__(self):
        if self.bits is not None:
            spec.check_bits(self.bits, "bits")
        for name in ("rs_bits", "ag_bits"):
            value = getattr(self, name)
            if value is not None:
                spec.check_bits(value, name)
        if self.bits is None and (self.rs_bits is not None or self.ag_bits is not None):
            raise ValueError("bits=None is the exact setting; rs_bits/ag_bits need bits set "
                             f"(got rs_bits={self.rs_bits}, ag_bits={self.ag_bits})")
        spec.check_group_size(self.group_size, "group_size")
        if isinstance(self.rotation, str) and self.rotation == "auto":
            pow2 = self.group_size & (self.group_size - 1) == 0
            wide = not self.exact and min(self.phase1_bits,
                                          self.phase2_bits) >= AUTO_ROTATION_MIN_BITS
            object.__setattr__(self, "rotation", AUTO_ROTATION if pow2 and wide else 0)
        object.__setattr__(self, "rotation",
                           spec.check_rotation(self.rotation, self.group_size, "rotation"))
        if self.spikes != "auto":
            object.__setattr__(self, "spikes",
                               spec.check_spikes(self.spikes, self.group_size, "spikes"))
        if (isinstance(self.min_bytes, (bool, np.bool_))
                or not isinstance(self.min_bytes, (int, np.integer)) or self.min_bytes < 0):
            raise ValueError(f"min_bytes must be a non-negative int, got {self.min_bytes!r}")
        spec.check_backend(self.backend)
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if (isinstance(self.p2p_timeout_ms, (bool, np.bool_))
                or not isinstance(self.p2p_timeout_ms, (int, np.integer))
                or self.p2p_timeout_ms <= 0):
            raise ValueError(f"p2p_timeout_ms must be a positive int, got "
                             f"{self.p2p_timeout_ms!r}")
        if self.grad not in GRAD_MODES:
            raise ValueError(f"grad must be one of {GRAD_MODES}, got {self.grad!r}")

    @property
    def exact(self) -> bool:
        return self.bits is None

    def _spikes_at(self, bits: int | None) -> int:
        if self.spikes != "auto":
            return self.spikes
        if bits is None or bits > AUTO_SPIKES_MAX_BITS:
            return 0
        return AUTO_SPIKES

    @property
    def phase1_spikes(self) -> int:
        """Spikes per group of the reduce-scatter (all-to-all) phase's payloads: ``spikes``,
        or for ``"auto"`` :data:`AUTO_SPIKES` when that phase has at most
        :data:`AUTO_SPIKES_MAX_BITS` bits, else 0 (docs/outliers.md, "Default")."""
        return self._spikes_at(None if self.exact else self.phase1_bits)

    @property
    def phase2_spikes(self) -> int:
        """Spikes per group of the all-gather phase's payloads (the rule of
        :attr:`phase1_spikes`, applied to ``phase2_bits``)."""
        return self._spikes_at(None if self.exact else self.phase2_bits)

    @property
    def phase1_bits(self) -> int:
        """Bits of the reduce-scatter (all-to-all) phase."""
        return self.bits if self.rs_bits is None else self.rs_bits

    @property
    def phase2_bits(self) -> int:
        """Bits of the all-gather phase."""
        return self.bits if self.ag_bits is None else self.ag_bits


def make_config(config: CommConfig | None = None, **options) -> CommConfig:
    """A :class:`CommConfig` from keyword options, or ``config`` updated with them."""
    if config is None:
        return CommConfig(**options)
    if not isinstance(config, CommConfig):
        raise TypeError(f"config must be a jax_flashcomm.CommConfig, got {type(config)}")
    return dataclasses.replace(config, **options) if options else config


@dataclasses.dataclass(frozen=True)
class Decision:
    """Which path one collective (one pytree leaf) took, and why."""

    op: str
    axes: tuple
    shape: tuple
    dtype: str
    nbytes: int
    axis_size: int
    quantized: bool
    reason: str
    rs_bits: int | None = None
    ag_bits: int | None = None

    def __str__(self):
        path = (f"quantized rs_bits={self.rs_bits} ag_bits={self.ag_bits}" if self.quantized
                else "exact lax")
        return (f"jax_flashcomm.{self.op}{self.axes} {self.dtype}{list(self.shape)} "
                f"({self.nbytes} B/rank, N={self.axis_size}): {path} ({self.reason})")


def decide(op: str, axes: tuple, shape, dtype, axis_size: int, config: CommConfig,
           phases: tuple[str, ...] = ("rs", "ag")) -> Decision:
    """The size policy: exact below ``config.min_bytes`` per rank, quantized at or above it."""
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    if config.exact:
        quantized, reason = False, "bits=None (exact setting)"
    elif axis_size == 1:
        quantized, reason = False, "axis size 1: nothing to communicate"
    elif nbytes == 0:
        quantized, reason = False, "empty operand: nothing to communicate"
    elif nbytes < config.min_bytes:
        quantized, reason = False, f"{nbytes} B < min_bytes={config.min_bytes} (latency-bound)"
    else:
        quantized, reason = True, f"{nbytes} B >= min_bytes={config.min_bytes}"
    decision = Decision(
        op=op, axes=tuple(axes), shape=tuple(shape), dtype=str(np.dtype(dtype)), nbytes=nbytes,
        axis_size=int(axis_size), quantized=quantized, reason=reason,
        rs_bits=config.phase1_bits if quantized and "rs" in phases else None,
        ag_bits=config.phase2_bits if quantized and "ag" in phases else None)
    logger.debug("%s", decision)
    for sink in _recorders:
        sink.append(decision)
    return decision


@contextlib.contextmanager
def record():
    """Collect the :class:`Decision` of every collective traced inside the block.

    >>> with record() as decisions:
    ...     jax.jit(f).lower(x)          # doctest: +SKIP
    >>> print(*decisions, sep="\\n")     # doctest: +SKIP
    """
    sink: list[Decision] = []
    _recorders.append(sink)
    try:
        yield sink
    finally:
        _recorders.remove(sink)
