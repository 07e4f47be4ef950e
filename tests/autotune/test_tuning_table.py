"""The tuning table: its cache path, round trip, staleness (invalidation), the environment's
table, the link profile, the CPU build it picks, and the cost model check."""

import dataclasses
import json
import logging

import pytest

from jax_flashcomm import transport
from jax_flashcomm.planner import _choose as selection
from jax_flashcomm import costs
from jax_flashcomm.costs import _table as tuning
from jax_flashcomm.codec import kernels
from jax_flashcomm.costs._model import Link
from jax_flashcomm.tune._measure import model_check


def _table(key=None, **kw):
    rows = (tuning.Measurement("psum", "in-process", 2, "float32", 4096, "lax", None, 1e-4),
            tuning.Measurement("psum", "in-process", 2, "float32", 4096, "quantized/xla",
                               (8, 8), 2e-4))
    return tuning.Table(key=key or tuning.machine_key(), rows=rows, created="t", **kw)


def test_key_names_what_the_speeds_depend_on():
    import jax

    key = tuning.machine_key()
    assert {"cpu", "cores", "features", "library", "kernels", "jax", "jaxlib", "link"} <= set(key)
    assert key["jax"] == jax.__version__ and key["link"] == "in-process"
    assert tuning.key_digest(key) != tuning.key_digest({**key, "jax": "0.0.0"})


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(tuning.CACHE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert tuning.cache_dir() == tmp_path / "xdg" / "jax_flashcomm"
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path / "mine"))
    assert tuning.cache_dir() == tmp_path / "mine"
    assert tuning.table_path().parent == tmp_path / "mine"
    assert tuning.table_path().name == f"tune-{tuning.key_digest(tuning.machine_key())}.json"


def test_round_trip_through_the_cache(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    table = _table(codec={"isa": "x"}, link={"bytes_per_s": 1.0, "latency_s": 0.0})
    path = tuning.save(table)
    assert path == tuning.table_path() and path.exists()
    assert tuning.load() == table
    assert not list(tmp_path.glob(".*tmp"))            # written atomically, nothing left


@pytest.mark.parametrize("field", ["jax", "kernels", "cpu", "library", "link"])
def test_a_changed_key_makes_the_table_stale(monkeypatch, tmp_path, caplog, field):
    monkeypatch.setenv(tuning.CACHE_ENV, str(tmp_path))
    path = tuning.save(_table())
    data = json.loads(path.read_text())
    data["key"][field] = "something else"
    path.write_text(json.dumps(data))
    with caplog.at_level(logging.WARNING, logger="jax_flashcomm"):
        assert tuning.load(path) is None
    assert "stale" in caplog.text and field in caplog.text


def test_malformed_tables_are_clear_errors(tmp_path):
    bad = tmp_path / "t.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="not JSON"):
        tuning.load(bad)
    bad.write_text(json.dumps({"version": 99}))
    with pytest.raises(ValueError, match="version-1"):
        tuning.load(bad)
    bad.write_text(json.dumps({"version": 1, "key": {}, "rows": [{"op": "psum"}]}))
    with pytest.raises(ValueError, match="malformed"):
        tuning.load(bad)
    assert tuning.load(tmp_path / "missing.json") is None


def test_active_reads_the_environment_once(monkeypatch, tmp_path):
    path = tuning.save(_table(), tmp_path / "t.json")
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning.clear()
    try:
        assert tuning.active() == _table()
        with tuning.use_table(None):
            assert tuning.active() is None
        monkeypatch.setenv(tuning.TABLE_ENV, "off")
        assert tuning.active() == _table()                # cached until clear()
        tuning.clear()
        assert tuning.active() is None
    finally:
        tuning.clear()


def test_parse_link():
    link = costs.parse_link("rate=400mbit,latency=0.2ms")
    assert link == Link(50e6, "shared", 0.2e-3, 0.0)
    assert costs.parse_link("rate=2gbps,topology=switched").topology == "switched"
    for bad in ("latency=1ms", "rate=fast", "rate=1mbit,latency=soon", "rate=1mbit,x=1"):
        with pytest.raises(ValueError, match="FLASHCOMM_LINK"):
            costs.parse_link(bad)


def test_link_profile_from_the_environment(monkeypatch):
    monkeypatch.setenv(costs.LINK_ENV, "rate=8mbit,latency=1ms")
    assert costs.link_profile() == Link(1e6, "shared", 1e-3)
    with costs.use_link(Link(5.0)):
        assert costs.link_profile() == Link(5.0)


@pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")
def test_a_table_sets_the_cpu_build_it_measured_fastest(monkeypatch):
    monkeypatch.delenv(kernels.ISA_ENV, raising=False)
    before = kernels.cpu_isa()
    other = kernels.cpu_isas()[-1]
    try:
        tuning.apply_isa(_table(codec={"isa": other}))
        assert kernels.cpu_isa() == other
        monkeypatch.setenv(kernels.ISA_ENV, before)       # the environment wins
        tuning.apply_isa(_table(codec={"isa": kernels.cpu_isas()[0]}))
        assert kernels.cpu_isa() == other
    finally:
        kernels.cpu_module().set_cpu_isa(before)


def test_the_isa_rule():
    rule = kernels.preferred_isa
    assert rule(["avx512", "avx2", "baseline"], "AuthenticAMD", "25") == "avx2"     # Zen 4
    assert rule(["avx2", "baseline"], "AuthenticAMD", "25") is None                 # Zen 3
    assert rule(["avx512", "avx2", "baseline"], "AuthenticAMD", "26") is None       # Zen 5
    assert rule(["avx512", "avx2", "baseline"], "GenuineIntel", "6") is None


def _model_table():
    """A table whose rows are the cost model's own predictions from its codec and link."""
    table = tuning.Table(key={}, codec={"by_n": {"3": {"call_s": 1e-4, "values_per_s": {
        "quantize": 1e9, "dequantize_sum_quantize": 4e9, "dequantize": 5e8}}}},
        link={"bytes_per_s": 2e10, "latency_s": 1e-4, "p2p_latency_s": 2e-4})
    rows = []
    cands = {c.name: c for c in selection.CANDIDATES}
    for op, bits in (("psum", (8, 8)), ("psum_scatter", (8, None)), ("all_gather", (None, 4))):
        for size in (256 * 1024, 4 * 2**20):
            for name in cands:
                b = None if name == "lax" else bits
                # the rows' default formats: a spike per group at 4 bits (as model_check reads)
                spikes = 1 if b is not None and 4 in b else 0
                call = selection.Call(op, size, 4, "float32", 3, "cpu", "in-process", None, b,
                                      spikes=spikes)
                s = cands[name].model_s(call, selection.profile(call, table))
                rows.append(tuning.Measurement(op, "in-process", 3, "float32", size, name, b, s))
    return dataclasses.replace(table, rows=tuple(rows))


def test_model_check_compares_every_row():
    table = _model_table()
    check = model_check(table)
    assert len(check["rows"]) == len(table.rows)
    assert check["max_abs_err"] == pytest.approx(0.0, abs=1e-12) and check["within_tolerance"]
    slow = dataclasses.replace(table.rows[0], seconds=table.rows[0].seconds * 2)
    check = model_check(dataclasses.replace(table, rows=(slow, *table.rows[1:])))
    assert check["max_abs_err"] == pytest.approx(0.5) and not check["within_tolerance"]
    assert model_check(table, min_bytes=2**20)["rows"][0]["nbytes"] == 4 * 2**20


def test_spiked_calls_are_priced_at_the_spiked_codec_speed():
    """A table's "spiked" codec figures (the 4-bit format with a spike per group) price calls
    with spikes; the 8-bit figures the others; a table without them falls back to the latter."""
    rates = {"quantize": 1e9, "dequantize_sum_quantize": 4e9, "dequantize": 5e8}
    slow = {k: v / 4 for k, v in rates.items()}
    link = {"bytes_per_s": 2e10, "latency_s": 1e-4, "p2p_latency_s": 2e-4}
    plain = tuning.Table(key={}, codec={"by_n": {"3": {"call_s": 1e-5, "values_per_s": rates}}},
                         link=link)
    spiked = tuning.Table(key={}, codec={"by_n": {"3": {
        "call_s": 1e-5, "values_per_s": rates,
        "spiked": {"call_s": 1e-5, "values_per_s": slow}}}}, link=link)
    q = selection.Candidate(transport.by_name("xla"), exact=False)

    def seconds(table, spikes):
        call = selection.Call("psum", 4 * 2**20, 4, "float32", 3, "cpu", "in-process", None,
                              (4, 4), spikes=spikes)
        return q.model_s(call, selection.profile(call, table))

    assert seconds(spiked, 0) == pytest.approx(seconds(plain, 0))
    assert seconds(spiked, 1) > 1.5 * seconds(plain, 1)
    assert seconds(plain, 1) > seconds(plain, 0)  # the spikes' wire bytes
