"""benchmarks/evidence.py: the README headline table from the three evidence JSON files."""

import pytest

from benchmarks import evidence


def _acc_row(label, delta, kl, top1, ratio):
    return {"label": label, "tp": 3, "delta_ppl": delta, "kl": kl, "top1": top1,
            "vs_bf16_ring": ratio}


ACC = {"machine": "cpu X", "rows": [_acc_row("int8 default", -0.0009, 6.1e-4, 0.985, 0.516),
                                    _acc_row("int4 default", 0.162, 0.17, 0.79, 0.277)]}
TTFT = {"rows": [{"link": "pcie", "strategy": "exact", "ttft_s": 20.0},
                 {"link": "pcie", "strategy": "exact-bf16", "ttft_s": 10.0},
                 {"link": "pcie", "strategy": "int4", "ttft_s": 4.0},
                 {"link": "pcie", "strategy": "auto", "ttft_s": 5.0},
                 {"link": "nvlink", "strategy": "exact", "ttft_s": 4.0},
                 {"link": "nvlink", "strategy": "exact-bf16", "ttft_s": 3.0},
                 {"link": "nvlink", "strategy": "int8", "ttft_s": 2.0}]}
MODEL = {"predictions": {"paper": [
    {"kind": "ttft", "gpu": "L40", "predicted": {"int4": 1.78, "int8": 1.39}},
    {"kind": "allreduce", "gpu": "L40", "predicted": {"N=4, 64 MiB": 3.39}}]}}


def test_headline_rows_come_from_the_files():
    table = evidence.headline(ACC, TTFT, MODEL)
    lines = {line.split(" | ")[0].strip("| "): line for line in table.splitlines()}
    assert "0.516x | -0.09% | 6.1e-04 | 98.5%" in lines["int8 (default)"]
    # against the bf16 exact baseline first (10 s / 4 s), the f32 exact one second (20 s / 4 s)
    assert "| **2.50x** | **-** | 5.00x / - |" in lines["int4 (default)"]
    assert "| **-** | **1.50x** | - / 2.00x |" in lines["int8 (default)"]     # nvlink only
    assert "| **2.00x** | **-** | 4.00x / - |" in lines["auto (default, int8 budget)"]
    assert "1.78x / -" in lines["int4 (default)"]           # L40 predicted, no A100 entry
    assert "- | - | - | -" in lines["int6 (default)"]        # no accuracy row: dashes
    assert "cpu X" in table


def test_missing_files_give_dashes_not_errors():
    table = evidence.headline(None, None, None)
    assert table.count("| - |") >= 4 and "?" in table


def test_write_headline_replaces_between_markers(tmp_path, monkeypatch):
    monkeypatch.setattr(evidence, "_load", {"accuracy": ACC, "ttft": TTFT, "gpu_model": MODEL}.get)
    readme = tmp_path / "README.md"
    readme.write_text(f"a\n{evidence.BEGIN}\nold\n{evidence.END}\nb\n")
    evidence.write_headline(readme)
    text = readme.read_text()
    assert text.startswith("a\n") and text.endswith("b\n") and "old" not in text
    assert "5.00x" in text
    readme.write_text("no markers")
    with pytest.raises(ValueError, match="markers"):
        evidence.write_headline(readme)


def test_dry_run_lists_every_step(capsys):
    assert evidence.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    for step in ("accuracy", "ttft", "gpu_model", "headline"):
        assert f"] {step}:" in out
