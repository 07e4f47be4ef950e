"""The per-machine tuning table the automatic choice reads, and its cache.

``python -m jax_flashcomm.tune`` measures a :class:`Table` once per machine (collective times
per op, size, axis size, dtype and candidate path; the codec's speed per CPU build; the
in-process link) and saves it in the user's cache directory, keyed by :func:`machine_key`: the
CPU, the library (its version and a hash of its compiled kernels), JAX and jaxlib versions, and
the link. A key that no longer matches (a new JAX, a rebuilt kernel library, another CPU) makes
the table stale: :func:`active` ignores it and the choice falls back to the cost model until the
command is run again.

Where the table is:

* ``FLASHCOMM_TUNING_TABLE=FILE``: that file (``off``: no table at all);
* else ``<cache>/tune-<key digest>.json``, ``<cache>`` being ``FLASHCOMM_CACHE_DIR``, else
  ``$XDG_CACHE_HOME/jax_flashcomm``, else ``~/.cache/jax_flashcomm``.

The link between processes cannot be read off the machine: :mod:`jax_flashcomm.costs._link`
gives it.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import hashlib
import json
import logging
import math
import numbers
import os
import pathlib
import platform
import time

from jax_flashcomm import _files
from jax_flashcomm._files import read_json

__all__ = ["TABLE_VERSION", "TABLE_ENV", "CACHE_ENV", "LAYOUTS", "SCOPES",
           "Measurement", "Table", "cpu_name", "machine_key", "key_digest", "cache_dir",
           "table_path", "save", "check_destination", "load", "apply_isa", "active", "clear",
           "use_table", "now"]

logger = logging.getLogger("jax_flashcomm")

TABLE_VERSION = 1
TABLE_ENV = "FLASHCOMM_TUNING_TABLE"
CACHE_ENV = _files.CACHE_ENV
#: Where a call's peers are: devices of this process, or other processes.
LAYOUTS = ("in-process", "processes")
#: What a measured time covers: one call, or a model step (:class:`Measurement`).
SCOPES = ("call", "step")


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured time: ``op`` over ``n`` ranks of a ``dtype`` operand of ``nbytes`` per rank,
    by ``candidate`` (``"lax"``, ``"exact/p2p"``, ``"quantized/xla"``, ``"quantized/p2p"``) at
    ``bits`` (``(rs_bits, ag_bits)`` of the quantized candidates, ``None`` for the exact ones).

    ``scope``: ``"call"``, the collective timed in a chain of its own calls; ``"step"``, a
    model step's time, the step run with ``candidate`` at every call of this kind
    (:func:`jax_flashcomm.tune.measure_in_step`): compute and the other calls are in it,
    so step rows rank candidates only against each other, at their exact size.
    """
    op: str
    layout: str
    n: int
    dtype: str
    nbytes: int
    candidate: str
    bits: tuple | None
    seconds: float
    scope: str = "call"

    def __post_init__(self):
        if self.scope not in SCOPES:
            raise ValueError(f"Measurement: scope must be one of {SCOPES}, got {self.scope!r}")
        for name in ("op", "layout", "dtype", "candidate"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"Measurement: {name} must be a string, got "
                                 f"{getattr(self, name)!r}")
        for name in ("n", "nbytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
                raise ValueError(f"Measurement: {name} must be a positive int, got {value!r}")
        seconds = self.seconds
        if (isinstance(seconds, bool) or not isinstance(seconds, numbers.Real)
                or not math.isfinite(seconds) or seconds <= 0):
            raise ValueError(f"Measurement: seconds must be a finite positive number, got "
                             f"{seconds!r}")
        if self.bits is not None and not (
                isinstance(self.bits, tuple) and len(self.bits) == 2 and all(
                    b is None or (isinstance(b, numbers.Integral) and not isinstance(b, bool))
                    for b in self.bits)):
            raise ValueError(f"Measurement: bits must be None or (rs_bits, ag_bits), got "
                             f"{self.bits!r}")


@dataclasses.dataclass(frozen=True)
class Table:
    """A machine's measurements (``python -m jax_flashcomm.tune`` writes one).

    Attributes:
      key: the :func:`machine_key` it was measured under.
      rows: the :class:`Measurement` s.
      codec: ``{"values_per_s": {pass: values/s}, "call_s": s, "isa": the fastest build,
        "isa_seconds": {build: seconds of the all-reduce's three passes}}`` (CPU).
      link: ``{"bytes_per_s", "latency_s"}`` of the in-process link (a ``ppermute``).
      created: when (ISO 8601, UTC).
    """
    key: dict
    rows: tuple = ()
    codec: dict = dataclasses.field(default_factory=dict)
    link: dict = dataclasses.field(default_factory=dict)
    created: str = ""

    def seconds(self, op: str, layout: str, n: int, dtype: str, candidate: str, bits,
                nbytes: int) -> float | None:
        """The time of a call, interpolated in log-log between the two nearest measured sizes;
        below the smallest, the smallest's time (latency-bound); above the largest, scaled with
        the bytes (bandwidth-bound). None when no row matches.

        Args:
          op, layout, n, dtype, candidate, bits: as :class:`Measurement`.
          nbytes: the operand's bytes per rank.
        """
        bits = None if bits is None else tuple(bits)
        pts = sorted((r.nbytes, r.seconds) for r in self.rows
                     if (r.op, r.layout, r.n, r.dtype, r.candidate, r.bits, r.scope)
                     == (op, layout, n, dtype, candidate, bits, "call"))
        if not pts:
            return None
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0]
        for (s0, t0), (s1, t1) in zip(pts, pts[1:]):
            if s0 <= nbytes <= s1:
                f = math.log(nbytes / s0) / math.log(s1 / s0)
                return math.exp(math.log(t0) + f * math.log(t1 / t0))
        return None  # unreachable: the sizes bracket nbytes

    def step_seconds(self, op: str, layout: str, n: int, dtype: str, nbytes: int) -> dict:
        """The step-scoped rows (``scope="step"``) of calls exactly like this one:
        ``{(candidate, bits): seconds}`` (empty when none was measured).

        Args:
          op, layout, n, dtype, nbytes: as :class:`Measurement`.
        """
        return {(r.candidate, r.bits): r.seconds for r in self.rows
                if r.scope == "step" and (r.op, r.layout, r.n, r.dtype, r.nbytes)
                == (op, layout, n, dtype, nbytes)}

    def to_json(self) -> dict:
        return {"version": TABLE_VERSION, "key": self.key, "created": self.created,
                "codec": self.codec, "link": self.link,
                "rows": [dataclasses.asdict(r) for r in self.rows]}

    @classmethod
    def from_json(cls, data: dict) -> Table:
        """A table from :meth:`to_json`'s dict.

        Raises:
          ValueError: another version, or a malformed table.
        """
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            raise ValueError(f"not a version-{TABLE_VERSION} tuning table")
        rows = data.get("rows")
        if not isinstance(rows, list):
            raise ValueError("malformed tuning table (rows must be a list)")
        parsed = []
        for i, r in enumerate(rows):
            try:
                bits = r["bits"]
                parsed.append(Measurement(**{**r, "bits": None if bits is None
                                             else tuple(bits)}))
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"malformed tuning table (row {i}: {e})") from None
        try:
            return cls(key=dict(data["key"]), rows=tuple(parsed),
                       codec=dict(data.get("codec", {})), link=dict(data.get("link", {})),
                       created=str(data.get("created", "")))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"malformed tuning table ({e})") from None


def _kernel_hash() -> str:
    """A hash of the compiled kernel library (a rebuild changes the speeds)."""
    from jax_flashcomm.codec import kernels

    try:
        path = pathlib.Path(kernels.cpu_module().__file__)
    except Exception:  # noqa: BLE001 - not built: the jnp twin only
        return "none"
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else the platform's processor string."""
    from jax_flashcomm.codec.kernels import cpuinfo

    return cpuinfo("model name") or platform.processor() or platform.machine()


@functools.cache
def machine_key(link: str = "in-process") -> dict:
    """What a table's measurements depend on: the CPU (model, features, cores), the library
    (version, kernel hash), JAX and jaxlib versions, and the link.

    Args:
      link: the link the table measured (``"in-process"`` for ``python -m
        jax_flashcomm.tune``).
    """
    import importlib.metadata

    import jax
    import jaxlib

    from jax_flashcomm.codec import kernels

    try:
        features = kernels.cpu_features()
    except Exception:  # noqa: BLE001
        features = ""
    return {"cpu": cpu_name(), "features": features, "cores": os.cpu_count(),
            "machine": platform.machine(),
            "library": importlib.metadata.version("jax_flashcomm"),
            "kernels": _kernel_hash(), "jax": jax.__version__, "jaxlib": jaxlib.__version__,
            "link": link}


def key_digest(key: dict) -> str:
    """A short hash of a :func:`machine_key` (the table's file name)."""
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir() -> pathlib.Path:
    """The folder tables are cached in (module docstring)."""
    return _files.cache_dir()


def table_path(key: dict | None = None) -> pathlib.Path:
    """Where the table of ``key`` (default: this machine's) is cached."""
    return cache_dir() / f"tune-{key_digest(key or machine_key())}.json"


def save(table: Table, path: pathlib.Path | str | None = None) -> pathlib.Path:
    """Write ``table`` (atomically) to ``path`` (default: the cache path of its key).

    Returns:
      The path written.
    """
    path = pathlib.Path(path) if path is not None else table_path(table.key)
    check_destination(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(json.dumps(table.to_json(), indent=1) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    clear()
    return path


def check_destination(path: pathlib.Path | str) -> pathlib.Path:
    """``path`` as a place a table can be written: not a folder, not a special file, in a
    folder that exists or can be made (no regular file on the way) and is writable.

    Raises:
      ValueError: naming the path and what is wrong with it.
    """
    path = pathlib.Path(path).expanduser()
    if path.is_dir():
        raise ValueError(f"{path}: is a folder (name a file, e.g. {path / 'table.json'})")
    if path.exists() and not path.is_file():
        raise ValueError(f"{path}: not a regular file")
    parent = path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{path}: the folder {parent} is not writable")
    return path


def load(path: pathlib.Path | str | None = None, *, key: dict | None = None) -> Table | None:
    """The table at ``path`` (default: this machine's cache path), or None when there is none
    or it is stale (its key is not ``key``, default: this machine's).

    Raises:
      ValueError: the file is not a tuning table.
    """
    path = pathlib.Path(path) if path is not None else table_path(key)
    if not path.is_file():
        return None
    data = read_json(path, "tuning table")
    try:
        table = Table.from_json(data)
    except RecursionError:
        raise ValueError(f"{path}: not a tuning table (nested too deep)") from None
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    want = key or machine_key()
    if table.key != want:
        changed = sorted(k for k in set(want) | set(table.key) if want.get(k) != table.key.get(k))
        logger.warning("jax_flashcomm: the tuning table %s is stale (%s changed); re-run "
                       "`python -m jax_flashcomm.tune`", path, ", ".join(changed))
        return None
    return table


@contextlib.contextmanager
def _scoped(var: contextvars.ContextVar, value):
    token = var.set(value)
    try:
        yield value
    finally:
        var.reset(token)


_override: contextvars.ContextVar = contextvars.ContextVar("jax_flashcomm_table", default=False)


@functools.cache
def _cached_active() -> Table | None:
    env = os.environ.get(TABLE_ENV, "").strip()
    if env.lower() == "off":
        return None
    try:
        table = load(env or None)
    except ValueError as e:
        logger.warning("jax_flashcomm: ignoring the tuning table: %s", e)
        return None
    apply_isa(table)
    return table


def apply_isa(table: Table | None) -> None:
    """Run the CPU codec with the build ``table`` measured fastest (``FLASHCOMM_CPU_ISA``
    still wins)."""
    from jax_flashcomm.codec import kernels

    isa = None if table is None else table.codec.get("isa")
    if isa and kernels.available("cpu") and isa in kernels.cpu_isas():
        kernels.set_cpu_isa(isa)


def active() -> Table | None:
    """The table the automatic choice reads now (:func:`use_table`'s, else the environment's or
    the cache's; loaded once per process), or None."""
    table = _override.get()
    return _cached_active() if table is False else table


def clear() -> None:
    """Forget the loaded table (the next :func:`active` reads the file again)."""
    _cached_active.cache_clear()


def use_table(table: Table | None):
    """Inside the block (``with use_table(t):``), :func:`active` is ``table`` (None: no table;
    the cost model decides)."""
    return _scoped(_override, table)


def now() -> str:
    """The current time for :attr:`Table.created`."""
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
