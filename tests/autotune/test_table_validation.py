"""A tuning table that is valid JSON with bad values is refused row by row, with the file and
the row named, and the default collectives then run on the cost model: never a traceback."""

import json
import logging

import pytest

from jax_flashcomm import costs
from jax_flashcomm.costs import _table as tuning

ROW = dict(op="psum", layout="tp", n=4, dtype="float32", nbytes=4096, candidate="lax",
           bits=None, seconds=1e-5)


def _table(tmp_path, rows, key=None):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"version": tuning.TABLE_VERSION,
                                "key": key or tuning.machine_key(), "rows": rows}))
    return path


@pytest.mark.parametrize("bad", [
    dict(nbytes=0), dict(nbytes=-1), dict(seconds=0), dict(seconds=-1.0),
    dict(seconds="fast"), dict(seconds=float("nan")), dict(seconds=float("inf")),
    dict(n=True), dict(bits=[8]), dict(bits="8"), dict(op=3), dict(scope="week"),
])
def test_a_bad_row_is_refused_naming_the_file_and_row(tmp_path, bad):
    path = _table(tmp_path, [ROW, {**ROW, **bad}])
    with pytest.raises(ValueError, match=r"table.json: malformed tuning table \(row 1: "):
        tuning.load(path)


def test_a_good_table_loads(tmp_path):
    table = tuning.load(_table(tmp_path, [ROW, {**ROW, "nbytes": 8192, "seconds": 2e-5}]))
    assert table.seconds("psum", "tp", 4, "float32", "lax", None, 6000) > 1e-5


def test_the_active_table_ignores_a_bad_file_with_a_warning(tmp_path, monkeypatch, caplog):
    path = _table(tmp_path, [{**ROW, "nbytes": 0}])
    monkeypatch.setenv(tuning.TABLE_ENV, str(path))
    tuning._cached_active.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="jax_flashcomm"):
            assert tuning._cached_active() is None
        assert "row 0" in caplog.text and "table.json" in caplog.text
    finally:
        tuning._cached_active.cache_clear()


@pytest.mark.parametrize("text, match", [
    ("rate=1.2.3mbit", "FLASHCOMM_LINK: not a positive rate: '1.2.3mbit'"),
    ("rate=400mbit,rate=1gbit", "'rate' given twice"),
    ("rate=0mbit", "not a positive rate"),
    ("rate", "'rate' has no '='"),
    ("rate=400mbit,latency=1.2.3ms", "FLASHCOMM_LINK: not a latency"),
    ("speed=400mbit", "expected rate="),
])
def test_a_bad_link_profile_names_the_variable_and_the_part(text, match):
    with pytest.raises(ValueError, match=match):
        costs.parse_link(text)


def test_a_link_profile_parses():
    link = costs.parse_link(" rate = 400mbit , latency=0.2ms,topology=switched")
    assert (link.bytes_per_s, link.base_latency_s, link.topology) == (5e7, 2e-4, "switched")
