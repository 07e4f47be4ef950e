"""How a tensor-parallel layer communicates: one object, chosen by the user, used by every layer.

:class:`TPComm` holds a mesh axis, a :class:`~jax_flashcomm.CommConfig` and whether the
sequence-parallel ring matmuls are used; the path of every call is
:func:`jax_flashcomm.planner.plan`'s. The kinds (``TPComm.kind``) name the combinations:

* ``"exact"``: ``bits=None``, all-reduce after each row-parallel matmul (Megatron-style TP).
* ``"flash"``: the quantized all-reduce (Flash Communication) under the size policy.
* ``"overlap"``: ``bits=None``, sequence-parallel in and out: column-parallel matmuls gather the
  sequence with :func:`jax_flashcomm.all_gather_matmul`, row-parallel ones scatter it with
  :func:`jax_flashcomm.matmul_reduce_scatter` (ring steps next to partial matmuls,
  Flash-Overlap).
* ``"auto"``: every all-reduce takes the fastest path its config allows, per call site
  (``min_bytes="auto"``: exact ``lax`` or the quantized one at the config's bits, over the
  transport that runs here, chosen from the tuning table or the cost model; docs/autotune.md).
  The config's bits are the accuracy budget (default 8). Sequence parallelism is a choice of
  layout for the whole model, not of one call: ``auto`` keeps the all-reduce layout.
* ``"auto+overlap"``: the sequence-parallel layout of ``overlap``, each ring matmul taking the
  fastest path its config allows (the exact ring or, within the budget, the quantized one).
  Which layout is faster is a property of the whole step: measure it
  (:func:`jax_flashcomm.tune_step.measure_steps`; benchmarks/ttft.py times both per link).
* ``"flash+overlap"``: the same ring matmuls with a quantized config: the all-gather ring
  carries chunks quantized once (``ag_bits``), the reduce-scatter is the local matmul then the
  quantized ``psum_scatter`` (``rs_bits``; a quantized reduce-scatter ring would add N-1
  quantization errors).

``fuse_norm=True`` (any kind) ends each block's all-reduce with
:func:`jax_flashcomm.psum_add_rms_norm`: the all-reduce, the residual add and the next RMSNorm as
one op (:meth:`TPComm.all_reduce_add_norm`; one codec kernel after the all-gather on the
quantized path, the same lax ops on the exact path; docs/fused_norm.md). The model decides
where (``models/llama.py``: both all-reduces of every block, outside sequence parallelism).

Sequence parallelism needs the sequence length to be a multiple of the TP size, so the overlap
kinds use it where the caller says so (prefill); a one-token decode step all-reduces instead.
"""

from __future__ import annotations

import dataclasses

from jax_flashcomm.allreduce import psum
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.comm_policy import CommPolicy
from jax_flashcomm.config import COMM_KINDS, CommConfig, config_from, takes_options
from jax_flashcomm.fused_norm import psum_add_rms_norm, rms_norm

__all__ = ["TPComm", "COMM_KINDS"]

@dataclasses.dataclass(frozen=True, init=False)
class TPComm:
    """A communication strategy over the mesh axis ``axis_name`` (hashable: a static argument).

    Args:
      kind: one of :data:`COMM_KINDS`.
      axis_name: the TP mesh axis.
      config: a :class:`~jax_flashcomm.CommConfig`; the exact kinds need ``bits=None`` (their
        default), the quantized ones a quantized config (default ``CommConfig()``).
      bidirectional: split every ring chunk over both directions (overlap kinds).
      fuse_norm: end the all-reduces with the residual add and RMSNorm fused
        (:meth:`all_reduce_add_norm`); off by default (docs/fused_norm.md says why).
      bits, ...: the options of every jax_flashcomm op, updating ``config``.
    """

    kind: str
    axis_name: str
    config: CommConfig
    bidirectional: bool
    fuse_norm: bool

    @takes_options
    def __init__(self, kind: str = "exact", axis_name: str = "tp",
                 config: CommConfig | None = None, bidirectional: bool = False,
                 fuse_norm: bool = False, **options):
        if kind not in COMM_KINDS:
            raise ValueError(f"TPComm: unknown communication kind {kind!r}; expected one of "
                             f"{COMM_KINDS}")
        if not isinstance(axis_name, str):
            raise TypeError(f"TPComm: axis_name must be a mesh axis name (str), got "
                            f"{axis_name!r}")
        quantized = kind.startswith(("flash", "auto"))
        if config is None and not quantized:
            config = CommConfig(bits=None)
        config = config_from(config, options, "TPComm")
        if kind.startswith("auto") and not config.auto:
            raise ValueError(f"TPComm: kind={kind!r} chooses per call; min_bytes="
                             f"{config.min_bytes} pins the size policy (use kind="
                             f"{kind.replace('auto', 'flash')!r})")
        if quantized and config.exact:
            raise ValueError(f"TPComm: kind={kind!r} quantizes; its config has bits=None (use "
                             f"kind='exact' or 'overlap')")
        if not quantized and not config.exact:
            raise ValueError(f"TPComm: kind={kind!r} does not quantize; a config with "
                             f"bits={config.bits} would be ignored (use 'flash' or "
                             f"'flash+overlap')")
        for name, value in (("kind", kind), ("axis_name", axis_name), ("config", config),
                            ("bidirectional", bool(bidirectional)),
                            ("fuse_norm", bool(fuse_norm))):
            object.__setattr__(self, name, value)

    @classmethod
    def for_site(cls, policy, site: str | None, axis_name: str = "tp", *, fuse_norm: bool = False,
                 bidirectional: bool = False) -> TPComm:
        """The strategy of one call site of a per-site policy.

        Args:
          policy: a :class:`~jax_flashcomm.comm_policy.CommPolicy` (for example from
            :func:`jax_flashcomm.calibrate`).
          site: the site's name in the policy (:meth:`CommPolicy.config_for`); ``None``: the
            policy's ``default``.
          axis_name, fuse_norm, bidirectional: as for the constructor.

        Returns:
          ``"exact"`` where the site's config is ``None`` or exact, ``"auto"`` where it chooses
          per call (``min_bytes="auto"``), else ``"flash"`` with the site's config.
        """
        if not isinstance(policy, CommPolicy):
            raise TypeError(f"TPComm.for_site: policy must be a jax_flashcomm.CommPolicy, got "
                            f"{type(policy).__name__}")
        config = policy.default if site is None else policy.config_for(site)
        if config is None or config.exact:
            return cls("exact", axis_name, bidirectional=bidirectional, fuse_norm=fuse_norm)
        return cls("auto" if config.auto else "flash", axis_name, config=config,
                   bidirectional=bidirectional, fuse_norm=fuse_norm)

    @property
    def quantized(self) -> bool:
        """Whether the config may quantize (the ``flash`` kinds; the ``auto`` kinds where a
        call is predicted faster quantized)."""
        return not self.config.exact

    @property
    def overlap(self) -> bool:
        """Whether the sequence-parallel ring matmuls are used (where the caller allows)."""
        return self.kind.endswith("overlap")

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
