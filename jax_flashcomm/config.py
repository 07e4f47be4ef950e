# long file: CommConfig, its auto rules, the keyword options every entry point shares and their
# table
"""The one set of options every jax_flashcomm entry point takes: :class:`CommConfig`.

Every collective (``psum``, ``pmean``, ``psum_scatter``, ``all_gather``), ring matmul
(``all_gather_matmul``, ``matmul_reduce_scatter``), :class:`jax_flashcomm.nn.TPComm`,
:class:`jax_flashcomm.RewritePolicy` and the model CLIs take ``config=`` and the same keyword
options, named and defaulted as the fields of :class:`CommConfig` (:data:`OPTION_NAMES`).
Options given beside a config **update** it (``dataclasses.replace``); options not given keep
the config's values; an option is never silently ignored.

A config keeps what the user wrote: ``rotation="auto"`` and ``spikes="auto"`` stay ``"auto"``
and are resolved where the op and its bits are known (:mod:`jax_flashcomm.planner`), by the rules
of this module (:func:`auto_rotation`, :func:`auto_spikes`), so ``dataclasses.replace`` of a
config never carries a resolution made for other bits.
"""

from __future__ import annotations

import dataclasses
import inspect
import operator

import numpy as np

from jax_flashcomm.codec import spec
from jax_flashcomm.codec.group_format import GroupFormat

__all__ = ["CommConfig", "OPTION_NAMES", "COMM_KINDS", "TRANSPORTS", "GRAD_MODES", "BACKENDS",
           "DEFAULT_MIN_BYTES", "AUTO", "auto_rotation", "auto_spikes", "config_from", "option",
           "is_default", "takes_options"]

#: ``min_bytes="auto"`` (the default): per call, the fastest path the config allows, from the
#: measured tuning table or the cost model (:mod:`jax_flashcomm.planner`, docs/autotune.md).
AUTO = "auto"
#: The fixed size policy docs/allreduce.md measured its crossover for (``min_bytes=1 << 20``).
DEFAULT_MIN_BYTES = 1 << 20
#: ``"exact"``: cotangent collectives are the lax ones; ``"quantized"``: they use the config.
GRAD_MODES = ("exact", "quantized")
#: The communication kinds of :class:`jax_flashcomm.nn.TPComm` (and the model CLIs' --comm).
COMM_KINDS = ("exact", "flash", "overlap", "flash+overlap", "auto", "auto+overlap")
#: How a call's bytes move between ranks (:mod:`jax_flashcomm.transport`).
TRANSPORTS = ("auto", "xla", "p2p", "pallas")
#: The codec implementation: its FFI kernels, its pure-jnp twin, or the plan's choice.
BACKENDS = spec.BACKENDS
#: ``bits``' default: what a config that names only a floating-point format carries.
DEFAULT_BITS = 8
#: The largest wait on a peer (about 24 days, in ms): larger values would overflow deadlines.
MAX_TIMEOUT_MS = 2**31 - 1

#: spikes="auto": one spike per group in each quantized phase of at most this many bits
#: (docs/outliers.md, "Default").
AUTO_SPIKES = 1
AUTO_SPIKES_MAX_BITS = 6
#: rotation="auto": Hadamard when every quantized phase has at least this many bits and the
#: group size is a power of two, else none (docs/accuracy.md, "Defaults").
AUTO_ROTATION = 1
AUTO_ROTATION_MIN_BITS = 6


def auto_rotation(bits: tuple, group_size: int) -> int:
    """The rotation ``"auto"`` means for quantized phases of ``bits`` and this group size.

    Args:
      bits: the bits of every quantized phase (e.g. ``(rs_bits, ag_bits)``).
      group_size: values per quantization group.

    Returns:
      1 (Hadamard) when every phase has at least 6 bits and ``group_size`` is a power of two,
      else 0.
    """
    pow2 = group_size & (group_size - 1) == 0
    wide = bool(bits) and min(bits) >= AUTO_ROTATION_MIN_BITS
    return AUTO_ROTATION if pow2 and wide else 0


def auto_spikes(bits: int | None, group_size: int = spec.DEFAULT_GROUP_SIZE) -> int:
    """The spikes per group ``"auto"`` means for a phase of ``bits``.

    Args:
      bits: the phase's bits per value; None: not quantized.
      group_size: values per group.

    Returns:
      1 for a phase of at most 6 bits, else 0; 0 for groups too large to hold a spike's
      position (``spec.MAX_SPIKE_GROUP_SIZE``).
    """
    if group_size > spec.MAX_SPIKE_GROUP_SIZE:
        return 0
    return AUTO_SPIKES if bits is not None and bits <= AUTO_SPIKES_MAX_BITS else 0


def _as_int(value, name: str, *, none_ok: bool = False):
    """``value`` as a Python int (any NumPy integer width accepted), or a clear error."""
    if value is None and none_ok:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {value!r}") from None


def _choice(value, choices, name: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {choices}, got {value!r}")
    return value


@dataclasses.dataclass(frozen=True)
class CommConfig:
    """How a jax_flashcomm call communicates (frozen and hashable: a static argument).

    Attributes:
      bits: bits per value of both quantized phases (2..8); ``None`` is the exact setting
        (the lax collective, or the exact ring of a ring matmul).
      rs_bits, ag_bits: per-phase overrides: the reduce-scatter (all-to-all) phase and the
        all-gather phase of the two-step all-reduce (e.g. ``rs_bits=4, ag_bits=8``).
      group_size: values per quantization group (a multiple of 8).
      min_bytes: ``"auto"`` (default): per call, the exact path or the quantized one, whichever
        the tuning table (measured by ``jax_flashcomm.tune``) or the cost model predicts faster
        (docs/autotune.md); an int pins the size policy: operands of fewer bytes per rank take
        the exact path, the others are quantized.
      backend: the codec implementation: ``"auto"``, ``"ffi"`` (the C++/CUDA kernels) or
        ``"jnp"`` (the pure-JAX twin, runs anywhere).
      grad: ``"exact"`` or ``"quantized"`` collectives for the cotangents.
      rotation: 0 / ``"none"``, 1 / ``"hadamard"``, 2 / ``"signed_hadamard"``: quantize each
        group's Walsh-Hadamard transform; ``"auto"``: Hadamard when every quantized phase has
        at least 6 bits and ``group_size`` is a power of two, else none.
      spikes: values per group kept in bf16 beside the codes (0..16); ``"auto"``: 1 in each
        phase of at most 6 bits, else 0.
      transport: how the bytes move: ``"xla"`` (XLA's collectives), ``"p2p"`` (FFI calls
        reading the peers' buffers: one process, or processes of one host over shared memory),
        ``"pallas"`` (Pallas TPU kernels; off a TPU in Pallas's TPU interpret mode,
        docs/tpu.md) or ``"auto"`` (the plan's choice per op).
      p2p_timeout_ms: the p2p transport's limit on every wait for a peer.
      format: the group format of both quantized phases: ``"int"`` (``bits`` per value, a
        bf16 scale and zero per group), ``"fp8"``, ``"mxfp4"`` or ``"nvfp4"`` (docs/format.md,
        "Floating-point formats"; ``bits`` is then the format's, and other ``bits`` /
        ``rs_bits`` / ``ag_bits`` for such a phase are a ValueError). Floating-point phases move
        over the ``xla`` transport; the ring matmuls stay exact under them.
      rs_format, ag_format: per-phase overrides (e.g. ``rs_format="nvfp4", ag_format="fp8"``).
    """

    bits: int | None = DEFAULT_BITS
    rs_bits: int | None = None
    ag_bits: int | None = None
    group_size: int = spec.DEFAULT_GROUP_SIZE
    min_bytes: int | str = AUTO
    backend: str = "auto"
    grad: str = "exact"
    rotation: int | str = "auto"
    spikes: int | str = "auto"
    transport: str = "auto"
    p2p_timeout_ms: int = 60_000
    format: str = "int"
    rs_format: str | None = None
    ag_format: str | None = None

    def __post_init__(self):
        put = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        for name in ("bits", "rs_bits", "ag_bits"):
            value = getattr(self, name)
            put(name, None if value is None else spec.check_bits(value, name))
        if self.bits is None and (self.rs_bits is not None or self.ag_bits is not None):
            raise ValueError("bits=None is the exact setting; rs_bits/ag_bits need bits set "
                             f"(got rs_bits={self.rs_bits}, ag_bits={self.ag_bits})")
        put("group_size", spec.check_group_size(self.group_size, "group_size"))
        if self.rotation != "auto":
            rotation = self.rotation
            if isinstance(rotation, (int, np.integer)) and not isinstance(rotation, bool):
                rotation = _as_int(rotation, "rotation")
            put("rotation", spec.check_rotation(rotation, self.group_size, "rotation"))
        if self.spikes != "auto":
            spikes = self.spikes
            if isinstance(spikes, (int, np.integer)) and not isinstance(spikes, bool):
                spikes = _as_int(spikes, "spikes")
            put("spikes", spec.check_spikes(spikes, self.group_size, "spikes"))
        if isinstance(self.min_bytes, str) and self.min_bytes != AUTO:
            raise ValueError(f"min_bytes must be 'auto' or a non-negative int, got "
                             f"{self.min_bytes!r}")
        if self.min_bytes != AUTO:
            min_bytes = _as_int(self.min_bytes, "min_bytes")
            if min_bytes < 0:
                raise ValueError(f"min_bytes must be a non-negative int or 'auto', got "
                                 f"{min_bytes}")
            put("min_bytes", min_bytes)
        put("backend", spec.check_backend(self.backend))
        _choice(self.grad, GRAD_MODES, "grad")
        _choice(self.transport, TRANSPORTS, "transport")
        timeout = _as_int(self.p2p_timeout_ms, "p2p_timeout_ms")
        if not 0 < timeout <= MAX_TIMEOUT_MS:
            raise ValueError(f"p2p_timeout_ms must be a positive int of at most {MAX_TIMEOUT_MS} "
                             f"(ms), got {timeout}")
        put("p2p_timeout_ms", timeout)
        spec.check_format(self.format, self.group_size, "format")
        for name in ("rs_format", "ag_format"):
            if getattr(self, name) is not None:
                spec.check_format(getattr(self, name), self.group_size, name)
        self._check_fp_bits()

    def _check_fp_bits(self):
        """Bits that a floating-point phase would ignore are an error, not ignored: a phase's
        ``rs_bits`` / ``ag_bits``, or ``bits`` when every phase is floating-point (``bits``
        left at its default 8, or equal to the format's own, is no conflict)."""
        if self.bits is None:
            return
        formats = (self.phase1_format, self.phase2_format)
        for phase, fmt, given in (("rs", formats[0], self.rs_bits),
                                  ("ag", formats[1], self.ag_bits)):
            if fmt != "int" and given is not None and given != spec.FP_BITS[fmt]:
                raise ValueError(f"{phase}_bits={given} with the {fmt!r} format in that phase: a "
                                 f"floating-point format has its own bits "
                                 f"({spec.FP_BITS[fmt]}); drop {phase}_bits")
        if "int" not in formats and self.bits not in (
                DEFAULT_BITS, *(spec.FP_BITS[f] for f in formats)):
            raise ValueError(f"bits={self.bits} with floating-point formats {formats}: they "
                             f"have their own bits; drop bits (or use format='int')")

    @property
    def auto(self) -> bool:
        """Whether the path of each call is chosen from measurements (``min_bytes="auto"``)."""
        return self.min_bytes == AUTO

    @property
    def exact(self) -> bool:
        """Whether this is the exact setting (``bits=None``)."""
        return self.bits is None

    @property
    def phase1_format(self) -> str:
        """The reduce-scatter phase's group format."""
        return self.format if self.rs_format is None else self.rs_format

    @property
    def phase2_format(self) -> str:
        """The all-gather phase's group format."""
        return self.format if self.ag_format is None else self.ag_format

    @property
    def floating_point(self) -> bool:
        """Whether a quantized phase uses a floating-point format."""
        return not self.exact and (self.phase1_format, self.phase2_format) != ("int", "int")

    @property
    def phase1_bits(self) -> int | None:
        """Bits of the reduce-scatter (all-to-all) phase (None: exact; a floating-point
        format's own)."""
        if self.exact or self.phase1_format == "int":
            return self.bits if self.rs_bits is None else self.rs_bits
        return spec.FP_BITS[self.phase1_format]

    @property
    def phase2_bits(self) -> int | None:
        """Bits of the all-gather phase (None: exact; a floating-point format's own)."""
        if self.exact or self.phase2_format == "int":
            return self.bits if self.ag_bits is None else self.ag_bits
        return spec.FP_BITS[self.phase2_format]

    def _spikes_at(self, bits: int | None) -> int:
        return auto_spikes(bits, self.group_size) if self.spikes == "auto" else self.spikes

    @property
    def phase1_spikes(self) -> int:
        """Spikes per group of the reduce-scatter phase (``"auto"`` resolved for its bits)."""
        return self._spikes_at(self.phase1_bits)

    @property
    def phase2_spikes(self) -> int:
        """Spikes per group of the all-gather phase (``"auto"`` resolved for its bits)."""
        return self._spikes_at(self.phase2_bits)

    @property
    def resolved_rotation(self) -> int:
        """The rotation of this config's quantized phases (``"auto"`` resolved from both
        phases' bits and the group size; 0 for the exact setting)."""
        if self.rotation != "auto":
            return self.rotation
        if self.exact or self.floating_point:  # rotation did not help them (docs/format_probe.md)
            return 0
        return auto_rotation((self.phase1_bits, self.phase2_bits), self.group_size)

    @property
    def group_formats(self) -> tuple[GroupFormat, GroupFormat] | None:
        """The two phases' :class:`~jax_flashcomm.codec.GroupFormat` (reduce-scatter, then
        all-gather), every ``"auto"`` resolved; None for the exact setting. The one value that
        carries a phase's format from here through the plan and the payload to the kernels."""
        if self.exact:
            return None
        return (GroupFormat(self.phase1_format, self.phase1_bits, self.group_size,
                            self.resolved_rotation, self.phase1_spikes),
                GroupFormat(self.phase2_format, self.phase2_bits, self.group_size,
                            self.resolved_rotation, self.phase2_spikes))


#: The options every entry point takes, in CommConfig's field order.
OPTION_NAMES = tuple(f.name for f in dataclasses.fields(CommConfig))
_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CommConfig)}


class _Default:
    """The default of an option keyword: "not given". Shows as the CommConfig default in
    signatures and help, and lets :func:`config_from` tell a given option from a default."""

    __slots__ = ("name", "value")

    def __init__(self, name: str):
        self.name, self.value = name, _DEFAULTS[name]

    def __repr__(self):
        return repr(self.value)


def option(name: str) -> _Default:
    """The default of option ``name`` in a signature (``bits=option("bits")``).

    Args:
      name: one of :data:`OPTION_NAMES`.

    Returns:
      A marker that shows as the CommConfig default and that :func:`is_default` recognizes.
    """
    return _Default(name)


def is_default(value) -> bool:
    """Whether an option keyword was left at its default (not given by the caller).

    Args:
      value: the keyword's value in a call.

    Returns:
      True for an :func:`option` marker.
    """
    return isinstance(value, _Default)


_OPTION_TYPES = {"min_bytes": "int | str", "bits": "int | None", "rs_bits": "int | None",
                 "ag_bits": "int | None", "rotation": "int | str", "spikes": "int | str"}


def takes_options(fn):
    """Give ``fn(..., config=None, **options)`` the option keywords in its signature.

    Every entry point is written ``def op(..., *, config=None, **options)`` and calls
    :func:`config_from`; this decorator makes ``inspect.signature`` (and ``help``) show each
    option of :data:`OPTION_NAMES` as a keyword-only parameter with its CommConfig default, the
    one place those keywords are listed.

    Args:
      fn: a function whose last parameter is ``**options``.

    Returns:
      ``fn`` itself, with ``__signature__`` set.
    """
    sig = inspect.signature(fn)
    params = list(sig.parameters.values())
    if not params or params[-1].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TypeError(f"takes_options: {fn.__qualname__} must end with **options")
    params = params[:-1] + [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=option(name),
                          annotation=_OPTION_TYPES.get(name, type(_DEFAULTS[name]).__name__))
        for name in OPTION_NAMES]
    fn.__signature__ = sig.replace(parameters=params)
    return fn


def config_from(config: CommConfig | None, options: dict, where: str) -> CommConfig:
    """The config of one call: ``config`` (or the defaults) updated with the options given.

    Args:
      config: the caller's :class:`CommConfig`, or None.
      options: ``{name: value}`` of the option keywords (defaults included: they are skipped).
      where: the entry point's name, for errors.

    Returns:
      A validated :class:`CommConfig`.
    """
    if config is not None and not isinstance(config, CommConfig):
        raise TypeError(f"{where}: config must be a jax_flashcomm.CommConfig, got "
                        f"{type(config).__name__}")
    unknown = set(options) - set(OPTION_NAMES)
    if unknown:
        raise TypeError(f"{where}: unknown options {sorted(unknown)}; the options are "
                        f"{OPTION_NAMES}")
    given = {k: v for k, v in options.items() if not is_default(v)}
    if config is None:
        return CommConfig(**given)
    return dataclasses.replace(config, **given) if given else config


def options_table() -> str:
    """The options as a Markdown table (docs/layout.md holds it; tests/docs checks it is this).

    One row per entry of :class:`CommConfig`'s ``Attributes`` (names that share an entry share a
    row), with each field's default and type from the dataclass.

    Returns:
      The table, a line per row, ending in a newline.
    """
    doc = inspect.getdoc(CommConfig).split("Attributes:", 1)[1]
    entries, names = [], None
    for line in doc.splitlines():
        head, sep, text = line.strip().partition(": ")
        fields = [n.strip() for n in head.split(",")] if sep else []
        if fields and all(n in _DEFAULTS for n in fields) and not line.startswith("    "):
            names = fields
            entries.append((names, [text]))
        elif names and line.strip():
            entries[-1][1].append(line.strip())
    types = {f.name: str(f.type).replace(" | ", " or ") for f in dataclasses.fields(CommConfig)}
    rows = ["| option | default | type | meaning |", "|---|---|---|---|"]
    for names, text in entries:
        default = _DEFAULTS[names[0]]
        shown = f'"{default}"' if isinstance(default, str) else repr(default)
        rows.append(f"| {', '.join(f'`{n}`' for n in names)} | `{shown}` | {types[names[0]]} "
                    f"| {' '.join(text).replace('``', '`')} |")
    return "\n".join(rows) + "\n"
