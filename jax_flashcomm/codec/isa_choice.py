"""Which CPU build the codec kernels run, chosen at load (``FLASHCOMM_CPU_ISA`` and a tuning
table's measured build override it, :mod:`jax_flashcomm.codec.kernels`).

A CPU kind (``/proc/cpuinfo``'s vendor, family, model and model name) the project measured has a
rule (:data:`MEASURED_KINDS`); any other kind is measured on first load: the all-reduce's three
codec passes (bf16, 8 bits, G = 128, Hadamard; 256 Ki values) timed natively with every build
this CPU runs, interleaved over 5 rounds (about 50 ms), and the widest build kept unless
another is at least 5% faster. The result is cached per kind in the user's cache folder
(``cpu-isa.json``), so each kind is measured once.
"""

from __future__ import annotations

import json
import logging

from jax_flashcomm import _files

__all__ = ["MEASURED_KINDS", "cpuinfo", "cpu_kind", "choose", "measure", "cache_path", "MARGIN"]

logger = logging.getLogger("jax_flashcomm")

#: The builds the loader picks without measuring, per (vendor, family) as ``python -m
#: jax_flashcomm.tune`` measured them (docs/autotune.md, "The CPU build"): AMD family 25 (Zen 3,
#: Zen 4) runs AVX-512 on 256-bit units, where the AVX2 build does the passes faster.
MEASURED_KINDS = {("AuthenticAMD", "25"): "avx2"}
#: Another build replaces the widest only when it is at least this much faster.
MARGIN = 0.95
_GROUPS, _REPS, _ROUNDS = 2048, 3, 5


def cpuinfo(field: str) -> str:
    """A field of ``/proc/cpuinfo``'s first processor (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == field:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_kind() -> dict:
    """This CPU's kind: ``vendor``, ``family``, ``model``, ``name`` (empty where unknown)."""
    return {"vendor": cpuinfo("vendor_id"), "family": cpuinfo("cpu family"),
            "model": cpuinfo("model"), "name": cpuinfo("model name")}


def _kind_key(kind: dict) -> str:
    return f"{kind['vendor']}/{kind['family']}/{kind['model']}/{kind['name']}"


def cache_path():
    """The file the measured builds are cached in."""
    return _files.cache_dir() / "cpu-isa.json"


def measure(module, isas: list[str]) -> dict:
    """Seconds of the three passes per build (the fastest of the rounds' medians)."""
    best = {isa: float("inf") for isa in isas}
    for _ in range(_ROUNDS):
        for isa in isas:
            t = module.isa_pass_seconds(isa, _GROUPS, _REPS)
            if t > 0:
                best[isa] = min(best[isa], t)
    return best


def _cached(key: str) -> str | None:
    try:
        entry = json.loads(cache_path().read_text()).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return entry.get("isa") if isinstance(entry, dict) else None


def _save(key: str, entry: dict) -> None:
    path = cache_path()
    try:
        data = json.loads(path.read_text()) if path.exists() else {}
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = entry
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".tmp{id(data)}")
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(path)
    except OSError as err:  # a read-only home: measured again next time
        logger.debug("jax_flashcomm: cannot cache the CPU build in %s: %s", path, err)


def choose(module, kind: dict | None = None) -> tuple[str, str]:
    """The build to run on this CPU, and how it was chosen.

    Args:
      module: the CPU kernel module (``supported_isas``, ``isa_pass_seconds``).
      kind: the CPU kind (default: :func:`cpu_kind`).

    Returns:
      ``(isa, how)``: ``how`` is ``"rule"`` (:data:`MEASURED_KINDS`), ``"only build"``,
      ``"measured before (cache)"`` or ``"measured now"`` (with the seconds per build).
    """
    kind = cpu_kind() if kind is None else kind
    isas = list(module.supported_isas())
    rule = MEASURED_KINDS.get((kind["vendor"], kind["family"]))
    if rule is not None and rule in isas:
        return rule, "rule"
    if len(isas) == 1:
        return isas[0], "only build"
    key = _kind_key(kind)
    cached = _cached(key)
    if cached in isas:
        return cached, "measured before (cache)"
    seconds = measure(module, isas)
    choice = isas[0]
    fastest = min(seconds, key=seconds.get)
    if seconds[fastest] < MARGIN * seconds[choice]:
        choice = fastest
    _save(key, {"isa": choice, "seconds": seconds})
    return choice, "measured now (" + ", ".join(
        f"{isa} {s * 1e3:.2f} ms" for isa, s in seconds.items()) + ")"
