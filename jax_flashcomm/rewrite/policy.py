"""Which collectives :func:`jax_flashcomm.rewrite.rewrite` replaces, and with what options.

A :class:`RewritePolicy` is a frozen (hashable) dataclass validated at construction. Its
filters (``ops``, ``axes``, ``sites``, ``skip_sites``) pick the call sites to rewrite; ``config``
is the :class:`~jax_flashcomm.CommConfig` every rewritten collective gets (``None``: the
collectives' own defaults, size policy included); ``fuse_matmul`` turns an all-gather feeding a
matmul, and a matmul feeding a reduce-scatter, into the ring collective matmuls.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from jax_flashcomm.codec import spec
from jax_flashcomm.policy import CommPolicy
from jax_flashcomm.config import CommConfig, config_from, takes_options

__all__ = ["RewritePolicy", "REWRITABLE_OPS"]

#: The lax collectives that have a flashcomm equivalent, by their lax names.
REWRITABLE_OPS = ("psum", "psum_scatter", "all_gather", "all_to_all", "ragged_all_to_all")

#: dtypes the quantized collectives take.
QUANTIZABLE_DTYPES = frozenset(spec.SUPPORTED_DTYPES)


def _as_str_tuple(value, name: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    try:
        items = tuple(value)
    except TypeError:
        raise TypeError(f"RewritePolicy: {name} must be None, a string or a sequence of "
                        f"strings, got {value!r}") from None
    for item in items:
        if not isinstance(item, str) or not item:
            raise TypeError(f"RewritePolicy: {name} must hold non-empty strings, got {item!r}")
    if not items:
        raise ValueError(f"RewritePolicy: {name} is empty (it would match nothing); use None "
                         f"for all")
    return items


@dataclasses.dataclass(frozen=True, init=False)
class RewritePolicy:
    """What to rewrite and how.

    Attributes:
      config: the :class:`~jax_flashcomm.CommConfig` of every rewritten collective (bits,
        per-phase bits, group size, ``min_bytes`` size policy, grad mode, backend, rotation,
        spikes, transport). ``None``: the flashcomm collectives' defaults (``CommConfig()``:
        8 bits, messages under 1 MiB per rank stay exact). The option keywords of every
        jax_flashcomm op (``bits=``, ``min_bytes=``, ...) update it.
      ops: which lax collectives to rewrite, among ``"psum"``, ``"psum_scatter"``,
        ``"all_gather"``, ``"all_to_all"``, ``"ragged_all_to_all"`` (a name or a tuple);
        ``None``: all of them.
      axes: mesh axis names; a collective is rewritten only if every axis it reduces over is
        one of them. ``None``: any axes.
      sites: call-site filter. A collective is rewritten only if one of these strings is a
        substring of its ``jax.named_scope`` name stack or of one of the
        ``"/path/file.py:line (function)"`` frames of the user code that called it, innermost
        to outermost (e.g. ``"mlp"``, ``"model.py:42 "``, ``"nn/comm.py"``,
        ``"(TPComm.all_reduce)"``). ``None``: every site.
      skip_sites: the opposite filter: collectives whose name stack or frames contain one of
        these strings are left alone (applied after ``sites``).
      fuse_matmul: replace ``all_gather(x, tiled=True) -> x_all @ w`` by
        :func:`~jax_flashcomm.all_gather_matmul` and ``psum_scatter(x @ w, tiled=True)`` by
        :func:`~jax_flashcomm.matmul_reduce_scatter` where the pattern matches exactly (the
        report says why it did not elsewhere).
      fuse_norm: replace ``residual + psum(x)`` followed by an RMSNorm of the sum (the
        expression of :class:`~jax_flashcomm.nn.RMSNorm`) by
        :func:`~jax_flashcomm.psum_add_rms_norm`, which returns the normalised rows and the new
        residual in one op (on the quantized path the all-gather's decode, the add and the norm
        are one kernel; on the exact path the same lax ops). The report says why a psum was
        not fused where it was not.
      comm_policy: a per-site :class:`~jax_flashcomm.policy.CommPolicy` (for example
        from :func:`jax_flashcomm.policy.calibrate`): each selected collective gets the
        config of the first of its sites that is a substring of the call's name stack or
        frames, else its ``default``; a site whose config is ``None`` stays exact (not
        rewritten). Excludes ``config``.
    """

    config: CommConfig | None = None
    ops: tuple[str, ...] | None = None
    axes: tuple[str, ...] | None = None
    sites: tuple[str, ...] | None = None
    skip_sites: tuple[str, ...] | None = None
    fuse_matmul: bool = False
    fuse_norm: bool = False
    comm_policy: CommPolicy | None = None

    @takes_options
    def __init__(self, config: CommConfig | None = None, ops=None, axes=None, sites=None,
                 skip_sites=None, fuse_matmul: bool = False, fuse_norm: bool = False,
                 comm_policy: CommPolicy | None = None, **options):
        if config is not None and not isinstance(config, CommConfig):
            raise TypeError(f"RewritePolicy: config must be a jax_flashcomm.CommConfig or None, "
                            f"got {type(config).__name__}")
        if comm_policy is not None:
            if not isinstance(comm_policy, CommPolicy):
                raise TypeError(f"RewritePolicy: comm_policy must be a "
                                f"jax_flashcomm.policy.CommPolicy or None, got "
                                f"{type(comm_policy).__name__}")
            if config is not None or options:
                raise ValueError("RewritePolicy: comm_policy gives every site its config; "
                                 "config= and option keywords cannot be given with it")
        if config is not None or options:
            config = config_from(config, options, "RewritePolicy")
        for name, value in (("config", config), ("ops", ops), ("axes", axes), ("sites", sites),
                            ("skip_sites", skip_sites), ("fuse_matmul", fuse_matmul),
                            ("fuse_norm", fuse_norm), ("comm_policy", comm_policy)):
            object.__setattr__(self, name, value)
        self._validate()

    def _validate(self):
        ops = _as_str_tuple(self.ops, "ops")
        if ops is not None:
            unknown = [op for op in ops if op not in REWRITABLE_OPS]
            if unknown:
                raise ValueError(f"RewritePolicy: unknown ops {unknown}; the rewritable lax "
                                 f"collectives are {REWRITABLE_OPS}")
        object.__setattr__(self, "ops", ops)
        object.__setattr__(self, "axes", _as_str_tuple(self.axes, "axes"))
        object.__setattr__(self, "sites", _as_str_tuple(self.sites, "sites"))
        object.__setattr__(self, "skip_sites", _as_str_tuple(self.skip_sites, "skip_sites"))
        for name in ("fuse_matmul", "fuse_norm"):
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise TypeError(f"RewritePolicy: {name} must be a bool, got "
                                f"{getattr(self, name)!r}")

    @property
    def comm_config(self) -> CommConfig:
        """The config the rewritten collectives get (the defaults when ``config`` is None)."""
        return self.config if self.config is not None else CommConfig()

    def config_at(self, scope: str, frames: tuple[str, ...]) -> CommConfig | None:
        """The config of the collective at this call site (``comm_config`` without a
        ``comm_policy``; with one, the policy's, ``None`` for a site it keeps exact)."""
        if self.comm_policy is None:
            return self.comm_config
        return self.comm_policy.config_at((scope, *frames))

    def select(self, op: str, axes: tuple, dtype, scope: str, frames: tuple[str, ...],
               axis_index_groups=None) -> tuple[bool, str]:
        """Whether to rewrite one collective, and why (or why not)."""
        if self.ops is not None and op not in self.ops:
            return False, f"policy.ops={self.ops} excludes {op}"
        if self.axes is not None and not set(axes) <= set(self.axes):
            return False, f"axes {tuple(axes)} not all in policy.axes={self.axes}"
        if axis_index_groups is not None:
            return False, "axis_index_groups is not supported by flashcomm"
        places = (scope, *frames)
        if self.sites is not None and not any(s in p for s in self.sites for p in places):
            return False, f"call site matches none of policy.sites={self.sites}"
        if self.skip_sites is not None:
            hit = next((s for s in self.skip_sites for p in places if s in p), None)
            if hit is not None:
                return False, f"call site matches policy.skip_sites entry {hit!r}"
        config = self.config_at(scope, frames)
        if config is None:
            return False, "the comm policy keeps this site exact"
        if not config.exact and np.dtype(dtype) not in QUANTIZABLE_DTYPES:
            return False, f"dtype {np.dtype(dtype)} is not quantizable (f32, bf16, f16 only)"
        return True, "selected by the policy"


def as_policy(policy: RewritePolicy | CommConfig | CommPolicy | None) -> RewritePolicy:
    """``policy`` as a :class:`RewritePolicy`.

    Args:
      policy: a :class:`RewritePolicy` (returned as is), a
        :class:`~jax_flashcomm.CommConfig` (the policy with that config), a
        :class:`~jax_flashcomm.policy.CommPolicy` (the policy with those per-site
        configs) or None (defaults).

    Returns:
      The :class:`RewritePolicy`.

    Raises:
      TypeError: anything else.
    """
    if policy is None:
        return RewritePolicy()
    if isinstance(policy, RewritePolicy):
        return policy
    if isinstance(policy, CommConfig):
        return RewritePolicy(config=policy)
    if isinstance(policy, CommPolicy):
        return RewritePolicy(comm_policy=policy)
    raise TypeError(f"rewrite: policy must be a RewritePolicy, a CommConfig, a CommPolicy or "
                    f"None, got {type(policy).__name__}")
