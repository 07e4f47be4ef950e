"""benchmarks/autotune/table_repeat.py: two tables compared row by row, and the best latency + bandwidth
line per series (a series on a line is fitted exactly; one off any line is not)."""

import json

import numpy as np
import pytest

from benchmarks.autotune import table_repeat as tune_repeat
from jax_flashcomm.costs import _table as tuning

SIZES = (256 * 1024, 1 << 20, 4 << 20, 16 << 20)


def _table(lax_s, quantized_s, created="t"):
    rows = [tuning.Measurement("psum", "in-process", 3, "float32", size, "lax", None, s)
            for size, s in zip(SIZES, lax_s)]
    rows += [tuning.Measurement("psum", "in-process", 3, "float32", size, "quantized/xla",
                                (8, 8), s) for size, s in zip(SIZES, quantized_s)]
    rows.append(tuning.Measurement("psum", "in-process", 3, "float32", 4096, "lax", None, 1.0))
    return tuning.Table(key={"synthetic": True}, rows=tuple(rows), created=created)


def test_best_line_fits_a_line_and_bounds_a_curve():
    x = np.array(SIZES, float)
    a, b, err = tune_repeat.best_line(x, 1e-4 + x / 2e9)
    assert err.max() < 0.01 and b == pytest.approx(2e9, rel=0.02)
    _, _, err = tune_repeat.best_line(x, 1e-4 + x / 2e9 * np.array([1, 1, 1, 4]))
    assert err.max() > 0.25   # 4x the time at 16 MiB: no line within 25% at every size


def test_fit_counts_series_and_rows():
    x = np.array(SIZES, float)
    table = _table(1e-4 + x / 2e9 * np.array([1, 1, 1, 4]), 2e-4 + x / 4e9)
    got = tune_repeat.fit(table, 256 * 1024)
    assert got["lax"]["series"] == 1 and got["lax"]["series_within"] == 0
    assert got["quantized/xla"] == {"series": 1, "series_within": 1, "rows": 4, "within": 4,
                                    "worst_series_err": pytest.approx(0, abs=0.01)}


def test_repeat_compares_rows_present_in_both():
    a = _table([1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 1.0, 1.0])
    b = _table([1.1, 1.3, 0.5, 1.0], [1.0, 1.0, 1.0, 1.2])
    got = tune_repeat.repeat(a, b, 256 * 1024)
    assert got["lax"]["rows"] == 4 and got["lax"]["within"] == 2   # 1.1 and 1.0
    assert got["lax"]["max_diff"] == pytest.approx(0.5)
    assert got["quantized/xla"]["within"] == 4


def test_command_prints_and_writes_json(tmp_path, capsys):
    x = np.array(SIZES, float)
    paths = []
    for i, scale in enumerate((1.0, 1.5)):
        p = tmp_path / f"t{i}.json"
        p.write_text(json.dumps(_table(scale * (1e-4 + x / 2e9), 2e-4 + x / 4e9).to_json()))
        paths.append(str(p))
    assert tune_repeat.main([*paths, "--json", str(tmp_path / "out.json")]) == 0
    out = json.loads((tmp_path / "out.json").read_text())
    assert out["repeat"]["lax"]["within"] == 0 and out["repeat"]["quantized/xla"]["within"] == 4
    assert "the two tables row by row" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        tune_repeat.main([str(tmp_path / "missing.json")])
