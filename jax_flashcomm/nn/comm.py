"""How a tensor-parallel layer communicates: one object, chosen by the user, used by every layer.

:class:`TPComm` holds a mesh axis, a :class:`~jax_flashcomm.CommConfig` and two choices; the
path of every call is :func:`jax_flashcomm.planner.plan`'s.

``quantization`` (:data:`QUANTIZATIONS`), what each all-reduce may do to the values:

* ``"exact"``: ``bits=None``; ``lax`` collectives (Megatron-style TP).
* ``"quantized"``: the quantized all-reduce (Flash Communication) under the config's size
  policy.
* ``"auto"``: every all-reduce takes the fastest path its config allows, per call site
  (``min_bytes="auto"``: exact ``lax`` or the quantized one at the config's bits, over the
  transport that runs here, chosen from the tuning table or the cost model; docs/autotune.md).
  The config's bits are the accuracy budget (default 8).

``layout`` (:data:`LAYOUTS`), where the activations live between the matmuls:

* ``"all_reduce"``: replicated; an all-reduce after each row-parallel matmul.
* ``"sequence_parallel"``: sharded over the sequence: column-parallel matmuls gather it with
  :func:`jax_flashcomm.all_gather_matmul`, row-parallel ones scatter it with
  :func:`jax_flashcomm.matmul_reduce_scatter` (ring steps next to partial matmuls,
  Flash-Overlap). Quantized, the all-gather ring carries chunks quantized once (``ag_bits``)
  and the reduce-scatter is the local matmul then the quantized ``psum_scatter`` (``rs_bits``;
  a quantized reduce-scatter ring would add N-1 quantization errors); ``auto``, each ring
  matmul takes the fastest path its config allows. Which layout is faster is a property of the
  whole step, not of one call: measure it (:func:`jax_flashcomm.tune.measure_steps`;
  benchmarks/llm/ttft/links.py times both per link).

The kind strings of :data:`jax_flashcomm.config.COMM_KINDS` name the six combinations
(``exact``, ``flash``, ``overlap``, ``flash+overlap``, ``auto``, ``auto+overlap``):
:meth:`TPComm.from_kind` reads one, :attr:`TPComm.kind` writes one.

``fuse_norm=True`` (any choice) ends each block's all-reduce with
:func:`jax_flashcomm.psum_add_rms_norm`: the all-reduce, the residual add and the next RMSNorm as
one op (:meth:`TPComm.all_reduce_add_norm`; one codec kernel after the all-gather on the
quantized path, the same lax ops on the exact path; docs/fused_norm.md). The model decides
where (``models/llama/modeling.py``: both all-reduces of every block, outside sequence
parallelism).

Sequence parallelism needs the sequence length to be a multiple of the TP size, so the
sequence-parallel layout is used where the caller says so (prefill); a one-token decode step
all-reduces instead.
"""

from __future__ import annotations

import dataclasses

from jax_flashcomm.allreduce import psum
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.policy import CommPolicy
from jax_flashcomm.config import COMM_KINDS, CommConfig, config_from, takes_options
from jax_flashcomm.fused_norm import psum_add_rms_norm, rms_norm

__all__ = ["TPComm", "COMM_KINDS", "QUANTIZATIONS", "LAYOUTS"]

#: What an all-reduce may do to the values.
QUANTIZATIONS = ("exact", "quantized", "auto")
#: Where the activations live between the matmuls.
LAYOUTS = ("all_reduce", "sequence_parallel")
#: ``kind -> (quantization, layout)``, for every kind of :data:`COMM_KINDS`.
_KIND_FIELDS = {"exact": ("exact", "all_reduce"), "flash": ("quantized", "all_reduce"),
                "overlap": ("exact", "sequence_parallel"),
                "flash+overlap": ("quantized", "sequence_parallel"),
                "auto": ("auto", "all_reduce"), "auto+overlap": ("auto", "sequence_parallel")}
assert set(_KIND_FIELDS) == set(COMM_KINDS)


def _quantization_fields(config: CommConfig) -> str:
    """The fields of ``config`` that quantize (``bits``, a format other than ``"int"``), as
    ``name=value`` text; empty for an exact config."""
    given = [("bits", config.bits)] if not config.exact else []
    given += [(name, getattr(config, name)) for name, unset in (
        ("format", "int"), ("rs_format", None), ("ag_format", None))
        if getattr(config, name) != unset]
    return ", ".join(f"{name}={value!r}" for name, value in given)


@dataclasses.dataclass(frozen=True, init=False)
class TPComm:
    """A communication strategy over the mesh axis ``axis_name`` (hashable: a static argument).

    Args:
      quantization: one of :data:`QUANTIZATIONS`.
      axis_name: the TP mesh axis.
      layout: one of :data:`LAYOUTS`.
      config: a :class:`~jax_flashcomm.CommConfig`; ``"exact"`` needs ``bits=None`` (its
        default), the others a quantized config (default ``CommConfig()``), ``"auto"`` one with
        ``min_bytes="auto"``.
      bidirectional: split every ring chunk over both directions (sequence-parallel layout).
      fuse_norm: end the all-reduces with the residual add and RMSNorm fused
        (:meth:`all_reduce_add_norm`); off by default (docs/fused_norm.md says why).
      bits, ...: the options of every jax_flashcomm op, updating ``config``.

    Raises:
      ValueError: an unknown quantization or layout, or a config the quantization contradicts.
    """

    quantization: str
    layout: str
    axis_name: str
    config: CommConfig
    bidirectional: bool
    fuse_norm: bool

    @takes_options
    def __init__(self, quantization: str = "exact", axis_name: str = "tp", *,
                 layout: str = "all_reduce", config: CommConfig | None = None,
                 bidirectional: bool = False, fuse_norm: bool = False, **options):
        if quantization not in QUANTIZATIONS:
            raise ValueError(f"TPComm: unknown quantization {quantization!r}; expected one of "
                             f"{QUANTIZATIONS} (a kind string such as 'flash+overlap': "
                             f"TPComm.from_kind)")
        if layout not in LAYOUTS:
            raise ValueError(f"TPComm: unknown layout {layout!r}; expected one of {LAYOUTS}")
        if not isinstance(axis_name, str):
            raise TypeError(f"TPComm: axis_name must be a mesh axis name (str), got "
                            f"{axis_name!r}")
        if config is None and quantization == "exact":
            config = CommConfig(bits=None)
        config = config_from(config, options, "TPComm")
        if quantization == "auto" and not config.auto:
            raise ValueError(f"TPComm: quantization='auto' chooses per call; min_bytes="
                             f"{config.min_bytes} pins the size policy (use "
                             f"quantization='quantized')")
        if quantization != "exact" and config.exact:
            raise ValueError(f"TPComm: quantization={quantization!r} quantizes; its config has "
                             f"bits=None (use quantization='exact')")
        ignored = _quantization_fields(config)
        if quantization == "exact" and ignored:
            raise ValueError(f"TPComm: quantization='exact' does not quantize; a config with "
                             f"{ignored} would be ignored (use quantization='quantized')")
        for name, value in (("quantization", quantization), ("layout", layout),
                            ("axis_name", axis_name), ("config", config),
                            ("bidirectional", bool(bidirectional)),
                            ("fuse_norm", bool(fuse_norm))):
            object.__setattr__(self, name, value)

    @classmethod
    def from_kind(cls, kind: str, axis_name: str = "tp", **kwargs) -> TPComm:
        """The strategy a kind string of :data:`COMM_KINDS` names.

        Args:
          kind: ``exact``, ``flash``, ``overlap``, ``flash+overlap``, ``auto`` or
            ``auto+overlap``.
          axis_name, **kwargs: as for the constructor (not ``quantization`` or ``layout``).

        Returns:
          ``TPComm(quantization, axis_name, layout=layout, **kwargs)``.

        Raises:
          ValueError: an unknown kind, or what the constructor raises.
        """
        quantization, layout = cls.parse_kind(kind)
        return cls(quantization, axis_name, layout=layout, **kwargs)

    @staticmethod
    def parse_kind(kind: str) -> tuple[str, str]:
        """``(quantization, layout)`` of a kind string of :data:`COMM_KINDS`.

        Raises:
          ValueError: an unknown kind.
        """
        if kind not in _KIND_FIELDS:
            raise ValueError(f"TPComm: unknown communication kind {kind!r}; expected one of "
                             f"{COMM_KINDS}")
        return _KIND_FIELDS[kind]

    @classmethod
    def for_site(cls, policy, site: str | None, axis_name: str = "tp", *, fuse_norm: bool = False,
                 bidirectional: bool = False) -> TPComm:
        """The strategy of one call site of a per-site policy.

        Args:
          policy: a :class:`~jax_flashcomm.policy.CommPolicy` (for example from
            :func:`jax_flashcomm.calibrate`).
          site: the site's name in the policy (:meth:`CommPolicy.config_for`); ``None``: the
            policy's ``default``.
          axis_name, fuse_norm, bidirectional: as for the constructor.

        Returns:
          ``"exact"`` where the site's config is ``None`` or exact, ``"auto"`` where it chooses
          per call (``min_bytes="auto"``), else ``"quantized"`` with the site's config; the
          all-reduce layout.
        """
        if not isinstance(policy, CommPolicy):
            raise TypeError(f"TPComm.for_site: policy must be a jax_flashcomm.CommPolicy, got "
                            f"{type(policy).__name__}")
        config = policy.default if site is None else policy.config_for(site)
        if config is None or config.exact:
            return cls("exact", axis_name, bidirectional=bidirectional, fuse_norm=fuse_norm)
        return cls("auto" if config.auto else "quantized", axis_name, config=config,
                   bidirectional=bidirectional, fuse_norm=fuse_norm)

    @property
    def kind(self) -> str:
        """The kind string of :data:`COMM_KINDS` that names ``(quantization, layout)``."""
        return next(k for k, fields in _KIND_FIELDS.items()
                    if fields == (self.quantization, self.layout))

    @property
    def quantized(self) -> bool:
        """Whether the config may quantize (``"quantized"``; ``"auto"`` where a call is
        predicted faster quantized)."""
        return not self.config.exact

    @property
    def overlap(self) -> bool:
        """Whether the layout is sequence-parallel: the ring matmuls are used where the caller
        allows."""
        return self.layout == "sequence_parallel"

    def all_reduce(self, x):
        """Sum of the ranks' partial results, replicated (after a row-parallel matmul)."""
        return psum(x, self.axis_name, config=self.config)

    def all_reduce_add_norm(self, x, residual, weight, eps: float):
        """``h = residual + all_reduce(x)``; ``(rms_norm(h) * weight, h)``.

        With ``fuse_norm``: :func:`jax_flashcomm.psum_add_rms_norm` (one op); without: the
        all-reduce of :meth:`all_reduce`, then the add and the norm as lax ops.
        """
        if self.fuse_norm:
            return psum_add_rms_norm(x, residual, weight, self.axis_name, eps=eps,
                                     config=self.config)
        h = residual + self.all_reduce(x)
        return rms_norm(h, weight, eps), h

    def gather_matmul(self, x, w, axis: int):
        """``all_gather(x, axis) @ w``: the sequence-parallel input of a column-parallel matmul."""
        return all_gather_matmul(x, w, self.axis_name, axis=axis,
                                 bidirectional=self.bidirectional, config=self.config)

    def matmul_scatter(self, x, w, axis: int):
        """``psum_scatter(x @ w, axis)``: the sequence-parallel output of a row-parallel matmul."""
        return matmul_reduce_scatter(x, w, self.axis_name, axis=axis,
                                     bidirectional=self.bidirectional, config=self.config)
