"""The loader's choice of CPU build (jax_flashcomm/codec/isa_choice.py): a kind with a rule is
not measured; any other kind is measured once, natively, and the result cached per kind."""

import json

import pytest

from jax_flashcomm.codec import isa_choice, kernels

XEON = {"vendor": "GenuineIntel", "family": "6", "model": "143", "name": "Some Xeon"}
ZEN4 = {"vendor": "AuthenticAMD", "family": "25", "model": "17", "name": "AMD EPYC 9R14"}
ZEN1 = {"vendor": "AuthenticAMD", "family": "23", "model": "1", "name": "AMD EPYC 7551"}


class FakeModule:
    """The two functions the choice calls, with scripted seconds per build."""

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, 0

    def supported_isas(self):
        return list(self.seconds)

    def isa_pass_seconds(self, isa, groups, reps):
        self.calls += 1
        return self.seconds[isa]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FLASHCOMM_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_a_kind_with_a_rule_is_not_measured():
    m = FakeModule({"avx512": 1.0, "avx2": 2.0, "baseline": 3.0})
    assert isa_choice.choose(m, ZEN4) == ("avx2", "rule")
    assert m.calls == 0


def test_an_unknown_kind_is_measured_once_and_cached(cache):
    m = FakeModule({"avx2": 1.0, "baseline": 0.5})  # Zen 1: AVX2 on 128-bit units, slower here
    isa, how = isa_choice.choose(m, ZEN1)
    assert isa == "baseline" and how.startswith("measured now") and m.calls > 0
    saved = json.loads((cache / "cpu-isa.json").read_text())
    assert [e["isa"] for e in saved.values()] == ["baseline"]
    again = FakeModule({"avx2": 1.0, "baseline": 0.5})
    assert isa_choice.choose(again, ZEN1) == ("baseline", "measured before (cache)")
    assert again.calls == 0
    # another kind is measured on its own
    other = FakeModule({"avx512": 1.0, "avx2": 1.0, "baseline": 2.0})
    assert isa_choice.choose(other, XEON)[0] == "avx512" and other.calls > 0


def test_the_widest_is_kept_within_the_margin():
    near = FakeModule({"avx512": 1.0, "avx2": 0.97, "baseline": 2.0})
    assert isa_choice.choose(near, XEON)[0] == "avx512"


def test_an_unwritable_cache_measures_and_does_not_fail(cache):
    (cache / "cpu-isa.json").mkdir()  # a directory where the file should be
    m = FakeModule({"avx512": 2.0, "avx2": 1.0, "baseline": 3.0})
    assert isa_choice.choose(m, XEON)[0] == "avx2"


def test_the_native_timing_of_each_build():
    module = kernels.cpu_module()
    for isa in module.supported_isas():
        assert module.isa_pass_seconds(isa, 64, 2) > 0
    assert module.isa_pass_seconds("no-such-build", 64, 2) == -1.0
    assert kernels.isa_choice_made()["isa"] in module.supported_isas()
