# long file: the one decision of a call's path: the Plan, its rules and the size policy together
"""The path of one call, decided in one place: :func:`plan` returns a :class:`Plan`.

Every op (``psum``, ``psum_scatter``, ``all_gather``, ``all_gather_matmul``, ``psum_add_rms_norm``,
``matmul_reduce_scatter``), :class:`jax_flashcomm.nn.TPComm` (through them) and
:func:`jax_flashcomm.rewrite` ask :func:`plan` which path a call takes, from the config, the op,
the operand's bytes per rank, the axis size, the platform and the process layout:

============================  ==============================================================
path                          when
============================  ==============================================================
``"lax"``                     collectives: exact setting, axis of size 1, empty operand, the
                              automatic choice's pick, or fewer than an int ``min_bytes`` per
                              rank: the ``lax`` collective itself
``"quantized"``               collectives the automatic choice quantizes (or at or above an int
                              ``min_bytes``): the codec, per-phase bits, spikes and rotation
                              resolved, over the ``transport``
``"exact"``                   ``psum`` between processes of one host that the automatic
                              choice sends over shared memory, or that asks for it
                              (``bits=None, transport="p2p"``): the exact sum over the ``p2p``
                              transport (:func:`jax_flashcomm.transport.p2p.exact_all_reduce`)
``"ring"``                    ring matmuls, exact: ring steps over the ``transport``
``"quantized ring"``          ``all_gather_matmul`` at or above ``min_bytes``: chunks travel
                              quantized once
``"matmul, quantized"``       ``matmul_reduce_scatter`` at or above ``min_bytes``: the local
                              matmul, then the quantized ``psum_scatter`` (a quantized
                              reduce-scatter ring would add N-1 quantization errors)
============================  ==============================================================

``min_bytes="auto"`` (the default) asks :func:`jax_flashcomm.planner.choose` for the fastest of
exact ``lax`` and the quantized candidates (per transport) the config and the process allow, from
the tuning table or the cost model; the plan's ``reason`` names the choice, ``predicted_s`` its
predicted time. A ring matmul weighs its collective (``all_gather`` of ``x``, ``psum_scatter`` of
the product) the same way. An int ``min_bytes`` is the fixed size policy.

``transport="auto"`` resolves per op (under an int ``min_bytes``): the collectives' payloads take
``p2p`` where every peer
is a device of this process and the p2p kernels are built (docs/transport.md measured it
faster at every size), else ``xla``; ring steps take ``xla`` (docs/transport.md, "Ring
steps"). An explicit ``"p2p"`` that cannot run is an error naming why. ``backend="auto"``
is the codec's own choice (the FFI kernels where built), except that a quantized ring decodes
with the jnp twin, whose elementwise dequantize XLA fuses into the dot's input.

Inside :func:`record`, every plan made while tracing is collected (context-local: threads and
tasks each see their own); every plan is also logged at DEBUG on the ``jax_flashcomm`` logger.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
from typing import TYPE_CHECKING

import numpy as np

from jax_flashcomm import _axes
from jax_flashcomm.planner import _choose as auto_choice
from jax_flashcomm.config import CommConfig
from jax_flashcomm import transport
from jax_flashcomm.transport import exchange as exchange_transport
from jax_flashcomm.transport import p2p as p2p_transport
from jax_flashcomm.transport import shm as shm_transport

if TYPE_CHECKING:
    import jax

__all__ = ["Plan", "plan", "quantized_plan", "as_plan", "record", "record_plan", "size_policy",
           "quantizes", "choice_bits", "OPS", "PATHS", "WEIGHED"]

logger = logging.getLogger("jax_flashcomm")

#: The ops a plan is made for.
OPS = ("psum", "psum_scatter", "all_gather", "all_gather_matmul", "matmul_reduce_scatter",
       "psum_add_rms_norm", "all_to_all", "ragged_all_to_all")
#: The paths a call can take (see the module docstring).
PATHS = ("lax", "quantized", "exact", "ring", "quantized ring", "matmul, quantized")
_PHASES = {"psum": ("rs", "ag"), "psum_scatter": ("rs",), "all_gather": ("ag",),
           "all_gather_matmul": ("ag",), "matmul_reduce_scatter": ("rs",),
           "psum_add_rms_norm": ("rs", "ag"), "all_to_all": ("ag",),
           "ragged_all_to_all": ("ag",)}
_RINGS = ("all_gather_matmul", "matmul_reduce_scatter")
#: The all-to-alls: their codes move over lax's all-to-all or the p2p exchange.
EXCHANGES = ("all_to_all", "ragged_all_to_all")

_recorders: contextvars.ContextVar[tuple] = contextvars.ContextVar("jax_flashcomm_recorders",
                                                                   default=())


@dataclasses.dataclass(frozen=True)
class Plan:
    """The path one call (one pytree leaf) takes, every option resolved, and why.

    Attributes:
      op: the op (:data:`OPS`).
      axes: the mesh axes it communicates over.
      shape, dtype, nbytes: the operand whose bytes per rank the size policy weighs.
      axis_size: the number of ranks.
      path: one of :data:`PATHS`.
      reason: why this path.
      transport: ``"xla"`` or ``"p2p"`` for the quantized and ring paths, None for ``"lax"``.
      group_formats: ``(reduce-scatter, all-gather)``: the
        :class:`~jax_flashcomm.codec.GroupFormat` of each phase this op quantizes (None: a
        phase it does not have, or not quantized). ``rs_bits``, ``ag_bits``, ``rs_spikes``,
        ``ag_spikes``, ``rs_format``, ``ag_format`` and ``rotation`` read them.
      group_size: values per group.
      backend: the codec backend the quantized path calls.
      timeout_ms: the p2p transport's limit on a wait for a peer.
      predicted_s: the automatic choice's predicted seconds of this call (None under a fixed
        size policy).
      choice_source: where those seconds came from: ``"table"``, ``"table, in the step"`` or
        the cost model's profile (None under a fixed size policy).
      config: the config the plan was made from (the cotangents' collectives use it).
    """

    op: str
    axes: tuple
    shape: tuple
    dtype: str
    nbytes: int
    axis_size: int
    path: str
    reason: str
    transport: str | None = None
    group_formats: tuple = (None, None)
    group_size: int = 128
    backend: str = "auto"
    timeout_ms: int = 60_000
    predicted_s: float | None = None
    choice_source: str | None = None
    config: CommConfig = dataclasses.field(default_factory=CommConfig, repr=False)

    @property
    def rs_bits(self) -> int | None:
        return None if self.group_formats[0] is None else self.group_formats[0].bits

    @property
    def ag_bits(self) -> int | None:
        return None if self.group_formats[1] is None else self.group_formats[1].bits

    @property
    def rs_spikes(self) -> int:
        return 0 if self.group_formats[0] is None else self.group_formats[0].spikes

    @property
    def ag_spikes(self) -> int:
        return 0 if self.group_formats[1] is None else self.group_formats[1].spikes

    @property
    def rs_format(self) -> str:
        return "int" if self.group_formats[0] is None else self.group_formats[0].format

    @property
    def ag_format(self) -> str:
        return "int" if self.group_formats[1] is None else self.group_formats[1].format

    @property
    def rotation(self) -> int:
        """The group rotation of the quantized phases (0 none, 1 Hadamard, 2 signed)."""
        return next((f.rotation for f in self.group_formats if f is not None), 0)

    @property
    def quantized(self) -> bool:
        """Whether the codec runs on this call's bytes."""
        return self.path in ("quantized", "quantized ring", "matmul, quantized")

    def __str__(self):
        if self.quantized:
            formats = ("" if (self.rs_format, self.ag_format) == ("int", "int")
                       else f"formats={self.rs_format}/{self.ag_format} ")
            how = (f"{self.path} {formats}rs_bits={self.rs_bits} ag_bits={self.ag_bits} "
                   f"rotation={self.rotation} spikes={self.rs_spikes}/{self.ag_spikes} "
                   f"over {self.transport}")
        elif self.path in ("ring", "exact"):
            how = f"exact {'ring ' if self.path == 'ring' else ''}over {self.transport}"
        else:
            how = "exact lax"
        return (f"jax_flashcomm.{self.op}{self.axes} {self.dtype}{list(self.shape)} "
                f"({self.nbytes} B/rank, N={self.axis_size}): {how} ({self.reason})")



def size_policy(config: CommConfig, nbytes: int, axis_size: int) -> tuple[bool, str]:
    """``(quantized, reason)``: the size policy alone (what :func:`plan` decides first).

    Args:
      config: the call's :class:`~jax_flashcomm.CommConfig` (its ``bits`` and ``min_bytes``).
      nbytes: the operand's bytes per rank.
      axis_size: the number of ranks.

    Returns:
      ``(quantized, reason)``: whether the quantized path may run, and why (for the plan);
      under ``min_bytes="auto"`` True means the automatic choice weighs it.
    """
    if config.exact:
        return False, "bits=None (exact setting)"
    if axis_size == 1:
        return False, "axis size 1: nothing to communicate"
    if nbytes == 0:
        return False, "empty operand: nothing to communicate"
    if config.auto:
        return True, "min_bytes='auto' (the automatic choice decides)"
    if nbytes < config.min_bytes:
        return False, f"{nbytes} B < min_bytes={config.min_bytes} (latency-bound)"
    return True, f"{nbytes} B >= min_bytes={config.min_bytes}"


def _transport(config: CommConfig, axes: tuple, where: str, ring: bool) -> str:
    """The transport of a quantized collective (``ring=False``) or of ring steps: the config's
    pinned one, which must be able to run (else a ValueError naming why not), or the first of
    ``p2p`` and ``xla`` that can (ring steps take ``p2p`` only when pinned)."""
    if config.transport == "pallas":
        return "pallas"
    if config.transport == "xla" or (ring and config.transport != "p2p"):
        return "xla"
    if config.transport == "auto" and _platform() == "tpu":
        return "pallas"
    p2p = transport.by_name("p2p")
    reason = p2p.ring_reason(axes) if ring else p2p.collective_reason(config, axes)
    if config.transport == "p2p":
        if reason is not None:
            raise ValueError(f"{where}: transport='p2p' cannot run here: {reason}")
        return "p2p"
    return "xla" if reason is not None else "p2p"


#: The collective whose time decides an op's path under the automatic choice.
WEIGHED = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "psum_scatter",
            "psum_add_rms_norm": "psum"}


def _auto_choice(op: str, axes: tuple, fields: dict, config: CommConfig, where: str):
    """The automatic choice for a call (``min_bytes="auto"``; module docstring)."""
    if config.transport in ("xla", "pallas"):
        p2p_reason = f"transport={config.transport!r}"
    elif op in _RINGS:
        p2p_reason = "ring matmul (its transport follows the ring rule)"
    else:
        p2p_reason = transport.by_name("p2p").collective_reason(config, axes)
        if config.transport == "p2p" and p2p_reason is not None:
            raise ValueError(f"{where}: transport='p2p' cannot run here: {p2p_reason}")
    return _choose(op, fields["nbytes"], fields["axis_size"], fields["dtype"], config,
                   p2p_reason, exact_p2p_reason(config, axes, fields["dtype"]))


def exact_p2p_reason(config: CommConfig, axes: tuple | None, dtype) -> str | None:
    """Why the automatic choice cannot take the exact all-reduce over ``p2p`` for a ``dtype``
    operand over the bound ``axes`` (None: outside a trace, the process and platform only), or
    None when it can."""
    import jax

    if config.transport == "xla":
        return "transport='xla'"
    if jax.process_count() != 1:
        reason = shm_transport.setup()
    elif p2p_transport.kernel_platform(_platform()) is None:
        reason = "no p2p kernels here"
    else:
        reason = None if axes is None else p2p_transport.unsupported_reason(axes)
    if reason is None and np.dtype(dtype) not in p2p_transport.exact_dtypes(_platform()):
        reason = f"a {np.dtype(dtype)} operand (the exact p2p sum does not take it here)"
    return reason


def _platform() -> str:
    import jax

    return jax.default_backend()


def choice_bits(op: str, config: CommConfig) -> tuple:
    """``(rs_bits, ag_bits)`` the automatic choice weighs ``op``'s quantized candidates at (a
    phase ``op`` does not have: None)."""
    phases = _PHASES[op]
    return (config.phase1_bits if "rs" in phases else None,
            config.phase2_bits if "ag" in phases else None)


def _choose(op, nbytes, axis_size, dtype, config, p2p_reason, exact_reason, candidates=None):
    import jax

    bits = choice_bits(op, config)
    given = candidates is not None
    candidates = auto_choice.CANDIDATES if candidates is None else candidates
    if config.transport == "p2p" and op not in _RINGS and not given:
        candidates = tuple(c for c in candidates if c.name not in ("quantized/xla",
                                                                   "quantized/pallas"))
    elif config.transport == "pallas" and op not in _RINGS and not given:
        candidates = (candidates[0],
                      auto_choice.Candidate(transport.by_name("pallas").as_pinned(), False))
    elif config.transport == "xla" or given:
        candidates = tuple(c for c in candidates if c.name != "quantized/pallas")
    dtype = np.dtype(dtype)
    call = auto_choice.Call(
        op=WEIGHED.get(op, op), nbytes=int(nbytes), itemsize=dtype.itemsize, dtype=dtype.name,
        n=int(axis_size), platform=jax.default_backend(),
        layout="in-process" if jax.process_count() == 1 else "processes",
        p2p_reason=p2p_reason, bits=bits, group_size=config.group_size,
        spikes=max(config.phase1_spikes, config.phase2_spikes), exact_p2p_reason=exact_reason)
    return auto_choice.choose(call, candidates=candidates)


def quantizes(op: str, nbytes: int, axis_size: int, dtype, config: CommConfig) -> bool:
    """Whether :func:`plan` quantizes a call of ``op``, asked outside a trace (by callers that
    choose a structure from it: the rewrite's fusions, byte counts). The p2p transport is
    assumed where this process's devices are the peers and the platform has its kernels.

    Args:
      op: one of :data:`OPS`.
      nbytes: the operand's bytes per rank (the product's for ``matmul_reduce_scatter``).
      axis_size: the number of ranks.
      dtype: the operand's dtype.
      config: the call's :class:`~jax_flashcomm.CommConfig`.
    """
    import jax

    quantized, _ = size_policy(config, int(nbytes), int(axis_size))
    if op in _RINGS and config.floating_point:
        return False
    if not (quantized and config.auto):
        return quantized
    p2p_reason = None
    if (op in _RINGS or config.transport == "xla" or config.backend == "jnp"
            or config.floating_point):
        p2p_reason = "not the p2p transport"
    elif jax.process_count() != 1:
        p2p_reason = shm_transport.setup()
    elif p2p_transport.kernel_platform(jax.default_backend()) is None:
        p2p_reason = "no p2p transport here"
    return _choose(op, nbytes, axis_size, dtype, config, p2p_reason,
                   exact_p2p_reason(config, None, dtype)).candidate.startswith("quantized")


def plan(op: str, axes: tuple, shape, dtype, axis_size: int, config: CommConfig, *,
         record: bool = True, where: str | None = None) -> Plan:
    """Decide the path of one call.

    Args:
      op: one of :data:`OPS`.
      axes: the mesh axes (a tuple of names; bound, when the transport is to be resolved).
      shape, dtype: the operand the size policy weighs (for ``matmul_reduce_scatter``: the
        product ``x @ w`` of this rank).
      axis_size: the number of ranks over ``axes``.
      config: the call's :class:`~jax_flashcomm.CommConfig`.
      record: whether the plan goes to the active :func:`record` blocks and the log.
      where: the entry point's name for errors (default: ``op``).

    Returns:
      The :class:`Plan`.
    """
    if op not in OPS:
        raise ValueError(f"plan: op must be one of {OPS}, got {op!r}")
    where = where or op
    axes = tuple(axes)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    quantized, reason = size_policy(config, nbytes, int(axis_size))
    if quantized and op in _RINGS and config.floating_point:
        quantized, reason = False, "a floating-point format: the ring matmuls stay exact"
    phases = _PHASES[op]
    fields = dict(op=op, axes=axes, shape=tuple(shape), dtype=str(np.dtype(dtype)),
                  nbytes=nbytes, axis_size=int(axis_size), reason=reason,
                  group_size=config.group_size, timeout_ms=config.p2p_timeout_ms,
                  backend=config.backend, config=config)
    if op in EXCHANGES:
        return _recorded(_exchange_plan(op, axes, fields, quantized, config, where), record)
    chosen = None
    if (config.exact and config.transport == "p2p" and op in ("psum", "psum_add_rms_norm")
            and axis_size > 1 and nbytes > 0):
        reason = p2p_transport.unsupported_reason(axes)
        if reason is not None:
            raise ValueError(f"{where}: transport='p2p' cannot run here: {reason}")
        where_peers = ("between processes: the exact sum over shared memory"
                       if p2p_transport.across_processes()
                       else "in one process: the exact sum over the in-process rendezvous")
        if np.dtype(dtype) not in p2p_transport.exact_dtypes(_platform()):
            fields["reason"] = (f"bits=None over transport='p2p', a {np.dtype(dtype)} operand: "
                                f"the exact p2p sum does not take it here; lax.psum")
        else:
            return _recorded(Plan(path="exact", transport="p2p", **{
                **fields, "reason": f"bits=None over transport='p2p' {where_peers}"}), record)
    if quantized and config.auto:
        chosen = _auto_choice(op, axes, fields, config, where)
        quantized = chosen.candidate.startswith("quantized")
        fields.update(reason=str(chosen), predicted_s=chosen.predicted_s,
                      choice_source=chosen.source)
    if op in _RINGS and (not quantized or op == "all_gather_matmul"):
        transport = _transport(config, axes, where, ring=True)
        path = "quantized ring" if quantized else "ring"
    elif chosen is not None and chosen.candidate == "exact/p2p":
        transport, path = "p2p", "exact"
    elif quantized:
        transport = (chosen.transport if chosen is not None and op not in _RINGS
                     else _transport(config, axes, where, ring=False))
        path = "matmul, quantized" if op == "matmul_reduce_scatter" else "quantized"
    else:
        transport, path = None, "lax"
    if quantized:
        rs_format, ag_format = config.group_formats
        fields.update(group_formats=(rs_format if "rs" in phases else None,
                                     ag_format if "ag" in phases else None))
    return _recorded(Plan(path=path, transport=transport, **fields), record)


def _exchange_plan(op, axes, fields, quantized, config, where) -> Plan:
    """The plan of an all-to-all (module docstring of :mod:`jax_flashcomm.alltoall`).

    Its codes move over the p2p exchange where one can run on CPU (or it is pinned), else over
    lax's collective. XLA:CPU has no ``ragged-all-to-all``: there the ragged op, exact too, runs
    over the exchange, and a config that rules it out is an error."""
    if config.transport == "pallas":
        raise ValueError(f"{where}: transport='pallas' carries psum, psum_scatter, all_gather "
                         "and the ring matmuls; an all-to-all moves over 'xla' or 'p2p'")
    cpu = _platform() == "cpu"
    no_lax = op == "ragged_all_to_all" and cpu
    p2p_reason = ("transport='xla'" if config.transport == "xla"
                  else exchange_transport.unavailable(axes))
    if config.transport == "p2p" and p2p_reason is not None:
        raise ValueError(f"{where}: transport='p2p' cannot run here: {p2p_reason}")
    if no_lax and p2p_reason is not None and fields["nbytes"] > 0:
        raise ValueError(f"{where}: XLA:CPU does not implement ragged-all-to-all, and the p2p "
                         f"exchange that runs it on CPU cannot run here: {p2p_reason}")
    use_p2p = p2p_reason is None and (cpu or config.transport == "p2p")
    if quantized and config.auto:
        candidates = tuple(c for c in auto_choice.CANDIDATES
                           if c.name not in ("exact/p2p", "quantized/pallas")
                           and not (c.name == "quantized/xla" and (no_lax or use_p2p))
                           and not (c.name == "quantized/p2p" and not use_p2p))
        chosen = _choose(op, fields["nbytes"], fields["axis_size"], fields["dtype"], config,
                         p2p_reason, "an all-to-all (no exact p2p candidate)",
                         candidates=candidates)
        quantized = chosen.candidate.startswith("quantized")
        fields.update(reason=str(chosen), predicted_s=chosen.predicted_s,
                      choice_source=chosen.source)
    if quantized:
        return Plan(path="quantized", transport="p2p" if use_p2p else "xla",
                    **{**fields, "group_formats": (None, config.group_formats[1])})
    if fields["nbytes"] == 0 or fields["axis_size"] == 1:
        return Plan(path="lax", **fields)
    if no_lax:
        why = "XLA:CPU has no ragged-all-to-all"
    elif config.transport == "p2p":
        why = "transport='p2p'"
    elif config.auto and not config.exact and use_p2p:
        why = "on CPU the exchange is faster than XLA's all-to-all (docs/alltoall.md)"
    else:
        return Plan(path="lax", **fields)
    return Plan(path="exact", transport="p2p", **{**fields, "reason": (
        f"{fields['reason']}; {why}: the rows as they are over the p2p exchange")})


def _recorded(result: Plan, record: bool) -> Plan:
    if record:
        logger.debug("%s", result)
        for sink in _recorders.get():
            sink.append(result)
    return result


def record_plan(p: Plan) -> Plan:
    """Send a plan made with ``record=False`` (and completed by its op, e.g. the kernel that
    runs it) to the active :func:`record` blocks and the log.

    Args:
      p: the :class:`Plan`.

    Returns:
      ``p``.
    """
    return _recorded(p, True)


def quantized_plan(op: str, axes: tuple, shape, dtype, axis_size: int, config: CommConfig, *,
                   where: str | None = None) -> Plan:
    """The quantized plan of ``op`` whatever ``config.min_bytes`` says (not recorded).

    For callers that run the quantized path on purpose (error-bound oracles, benchmarks).

    Args:
      op, axes, shape, dtype, axis_size, config, where: as for :func:`plan`.

    Returns:
      A quantized :class:`Plan` whose ``config`` is ``config`` itself.

    Raises:
      ValueError: the config is exact, the axis has one rank or the operand is empty.
    """
    forced = dataclasses.replace(config, min_bytes=0)  # also overrides min_bytes="auto"
    p = plan(op, axes, shape, dtype, axis_size, forced, record=False, where=where)
    if not p.quantized:
        raise ValueError(f"{where or op}: nothing to quantize ({p.reason})")
    return dataclasses.replace(p, config=config)


def as_plan(op: str, x: jax.Array, axes: tuple, config_or_plan: Plan | CommConfig) -> Plan:
    """``config_or_plan`` if it is a :class:`Plan`, else the :func:`quantized_plan` of ``x``.

    Args:
      op: one of :data:`OPS`.
      x: the operand (its shape and dtype).
      axes: the mesh axes, bound (inside ``shard_map``: their sizes are read).
      config_or_plan: a :class:`Plan` (returned as is) or a
        :class:`~jax_flashcomm.CommConfig`.

    Returns:
      The :class:`Plan`.

    Raises:
      ValueError: as :func:`quantized_plan`.
    """
    if isinstance(config_or_plan, Plan):
        return config_or_plan
    return quantized_plan(op, axes, x.shape, x.dtype, _axes.axis_size(axes), config_or_plan)


@contextlib.contextmanager
def record():
    """Collect the :class:`Plan` of every call traced inside the block (this thread or task).

    >>> with record() as plans:
    ...     jax.jit(f).lower(x)          # doctest: +SKIP
    >>> print(*plans, sep="\\n")         # doctest: +SKIP

    Yields:
      A list that each :class:`Plan` is appended to, in trace order.
    """
    sink: list[Plan] = []
    token = _recorders.set(_recorders.get() + (sink,))
    try:
        yield sink
    finally:
        _recorders.reset(token)
