"""A per-call-site communication policy: which :class:`~jax_flashcomm.CommConfig` each
all-reduce of a model gets, saved as JSON.

A :class:`CommPolicy` maps call-site names to configs (``None``: that site stays exact) and
gives every other site its ``default``. :func:`jax_flashcomm.policy.calibrate` chooses one
from measurements; the model command lines take it as ``--comm-policy FILE``
(docs/calibration.md). Two ways to name a site:

* a model's own names (``models.llama``: ``"<layer>.attn"``, ``"<layer>.mlp"``), looked up
  exactly with :meth:`CommPolicy.config_for`;
* a rewrite's places (a ``jax.named_scope`` stack or a ``"file.py:line (function)"`` frame):
  :meth:`CommPolicy.config_at` takes the first entry that is a substring of one of them, as
  :class:`~jax_flashcomm.RewritePolicy`'s ``sites`` filter does.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from jax_flashcomm._files import read_json
from jax_flashcomm.config import CommConfig

__all__ = ["CommPolicy", "wire_vs_bf16", "wire_per_element", "config_to_dict",
           "config_from_dict"]

#: The ``"kind"`` field of a policy file.
FILE_KIND = "jax_flashcomm.CommPolicy"
FILE_VERSION = 1
#: The largest policy file read (one config per site: a few KiB for a real model).
MAX_FILE_BYTES = 16 << 20

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(CommConfig)}


def wire_vs_bf16(config: CommConfig | None) -> float:
    """Wire bytes per element of a quantized all-reduce under ``config`` (the mean of its two
    phases, whole groups) over a bf16 ring's 2 bytes per element and phase; 1.0 for ``None`` or
    an exact config.

    Args:
      config: a :class:`~jax_flashcomm.CommConfig` or ``None``.

    Returns:
      The ratio (for example 0.508 for ``format="fp8"`` at G = 128).
    """
    if config is None or config.exact:
        return 1.0
    return sum(wire_per_element(config)) / 2 / 2.0


def wire_per_element(config: CommConfig) -> tuple[float, float]:
    """Bytes per element of the two phases' payloads of a quantized ``config`` (codes, scales,
    spikes; whole groups)."""
    rs, ag = config.group_formats
    return rs.wire_bytes_per_element(), ag.wire_bytes_per_element()


def config_to_dict(config: CommConfig | None) -> dict | None:
    """The options of ``config`` that differ from :class:`~jax_flashcomm.CommConfig`'s
    defaults (JSON-ready); ``None`` for ``None`` (an exact site)."""
    if config is None:
        return None
    if not isinstance(config, CommConfig):
        raise TypeError(f"CommPolicy: a site's config must be a CommConfig or None, got "
                        f"{type(config).__name__}")
    return {name: getattr(config, name) for name in _DEFAULTS
            if getattr(config, name) != _DEFAULTS[name]}


def config_from_dict(options: dict | None, where: str = "CommPolicy") -> CommConfig | None:
    """The :class:`~jax_flashcomm.CommConfig` of :func:`config_to_dict`'s output (validated:
    an unknown option or a bad value is a ``ValueError`` naming ``where``)."""
    if options is None:
        return None
    if not isinstance(options, dict):
        raise ValueError(f"{where}: a config must be an object of CommConfig options or null, "
                         f"got {options!r}")
    unknown = sorted(set(options) - set(_DEFAULTS))
    if unknown:
        raise ValueError(f"{where}: unknown CommConfig options {unknown}; the options are "
                         f"{sorted(_DEFAULTS)}")
    try:
        return CommConfig(**options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: {err}") from None


@dataclasses.dataclass(frozen=True)
class CommPolicy:
    """Per-site configs (frozen and hashable: usable as a static argument).

    Attributes:
      default: the config of every site not in ``sites`` (``None``: exact).
      sites: ``((name, config), ...)``, in priority order (a mapping is accepted and kept in
        its order); a ``None`` config keeps that site exact.
      info: what produced the policy (budget, measurements, model): free JSON data, left out
        of equality and hashing.
    """

    default: CommConfig | None = None
    sites: tuple = ()
    info: dict = dataclasses.field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        if self.default is not None and not isinstance(self.default, CommConfig):
            raise TypeError(f"CommPolicy: default must be a CommConfig or None, got "
                            f"{type(self.default).__name__}")
        items = self.sites.items() if isinstance(self.sites, dict) else self.sites
        pairs = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise TypeError(f"CommPolicy: sites must be (name, config) pairs, got {item!r}")
            name, config = item
            if not isinstance(name, str) or not name:
                raise TypeError(f"CommPolicy: a site name must be a non-empty string, got "
                                f"{name!r}")
            if config is not None and not isinstance(config, CommConfig):
                raise TypeError(f"CommPolicy: site {name!r}: config must be a CommConfig or "
                                f"None, got {type(config).__name__}")
            pairs.append((name, config))
        names = [n for n, _ in pairs]
        if len(set(names)) != len(names):
            raise ValueError(f"CommPolicy: a site is named twice: "
                             f"{sorted(n for n in set(names) if names.count(n) > 1)}")
        if not isinstance(self.info, dict):
            raise TypeError(f"CommPolicy: info must be a dict, got {type(self.info).__name__}")
        object.__setattr__(self, "sites", tuple(pairs))

    def config_for(self, site: str) -> CommConfig | None:
        """The config of the site named exactly ``site`` (``default`` if it is not listed)."""
        for name, config in self.sites:
            if name == site:
                return config
        return self.default

    def config_at(self, places) -> CommConfig | None:
        """The config of the first listed site that is a substring of one of ``places`` (name
        stacks, frames), else ``default``."""
        places = tuple(places)
        for name, config in self.sites:
            if any(name in p for p in places):
                return config
        return self.default

    def mean_wire_vs_bf16(self, site_names) -> float:
        """The mean of :func:`wire_vs_bf16` over ``site_names`` (sites of equal message size,
        as a model's all-reduces of one step are)."""
        names = list(site_names)
        if not names:
            raise ValueError("CommPolicy.mean_wire_vs_bf16: no sites")
        return math.fsum(wire_vs_bf16(self.config_for(n)) for n in names) / len(names)

    # --- JSON --------------------------------------------------------------------------------

    def to_json(self) -> dict:
        """The policy as JSON data (:meth:`from_json` reads it back)."""
        return {"kind": FILE_KIND, "version": FILE_VERSION,
                "default": config_to_dict(self.default),
                "sites": {name: config_to_dict(c) for name, c in self.sites},
                "info": self.info}

    @classmethod
    def from_json(cls, data, where: str = "CommPolicy") -> CommPolicy:
        """A policy from :meth:`to_json`'s data; a clear ``ValueError`` on anything else."""
        if not isinstance(data, dict) or data.get("kind") != FILE_KIND:
            raise ValueError(f"{where}: not a jax_flashcomm policy (no \"kind\": "
                             f"\"{FILE_KIND}\")")
        if data.get("version") != FILE_VERSION:
            raise ValueError(f"{where}: policy version {data.get('version')!r}; this "
                             f"jax_flashcomm reads version {FILE_VERSION}")
        sites = data.get("sites", {})
        if not isinstance(sites, dict):
            raise ValueError(f"{where}: \"sites\" must map site names to configs")
        if any(not name for name in sites):
            raise ValueError(f"{where}: \"sites\": a site name must be a non-empty string "
                             f"(an empty one would match every call)")
        info = data.get("info") or {}
        if not isinstance(info, dict):
            raise ValueError(f"{where}: \"info\" must be a JSON object, got "
                             f"{type(info).__name__} {info!r:.80}")
        try:
            return cls(default=config_from_dict(data.get("default"), f"{where}: default"),
                       sites=tuple((str(n), config_from_dict(c, f"{where}: site {n!r}"))
                                   for n, c in sites.items()),
                       info=dict(info))
        except TypeError as e:
            raise ValueError(f"{where}: {e}") from None

    def save(self, path) -> Path:
        """Writes the policy to ``path`` as JSON; returns the path."""
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path) -> CommPolicy:
        """Reads a policy file written by :meth:`save` (``ValueError`` naming the file if it is
        not one)."""
        path = Path(path)
        if not path.is_file():      # a FIFO or a device would block or read forever
            what = "not a regular file" if path.exists() else "no such file"
            raise ValueError(f"{path}: {what}")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"{path}: {path.stat().st_size} bytes, more than a policy's "
                             f"{MAX_FILE_BYTES}")
        return cls.from_json(read_json(path, "jax_flashcomm policy"), where=str(path))
