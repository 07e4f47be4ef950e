"""``models.eval`` evaluates the setting it is given: a quantized ``--comm`` without
``--min-bytes`` quantizes every all-reduce (the library's ``min_bytes="auto"`` would keep exact
``lax`` at sites it predicts faster, and the perplexity printed would be exact's), and the wire
ratio it reports comes from the plans of the calls that ran (``fc.record()``), not from the
options."""

import io

import pytest

from models import cli
from models import eval as eval_cli
from tests.models.test_calibrate_cli import _tiny


@pytest.fixture
def patched_loader(monkeypatch):
    monkeypatch.setattr(cli, "set_devices", lambda n: None)

    def fake_load(name, *, tp, mesh, comm=None, dtype=None, ckpt=None):
        model, ckpt, _ = _tiny(comm)
        return model, ckpt

    monkeypatch.setattr("models.weights.load_model", fake_load)


def _eval(tmp_path, *extra):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    parser = eval_cli.build_parser()
    args = parser.parse_args(["--tp", "2", "--text", str(text), "--window", "32",
                              "--max-windows", "1", *extra])
    log = io.StringIO()
    cli.quantize_every_call(args, log)
    return eval_cli.run(args, log=log), log.getvalue()


def test_a_quantized_setting_quantizes_every_all_reduce(tmp_path, patched_loader):
    exact, _ = _eval(tmp_path, "--comm", "exact")
    int4, note = _eval(tmp_path, "--comm", "flash", "--bits", "4")
    assert "quantizing every all-reduce" in note
    assert int4["options"]["min_bytes"] == "0"
    assert set(int4["all_reduce_paths"]) == {"quantized"}, int4["all_reduce_paths"]
    assert int4["perplexity"] != exact["perplexity"]
    assert int4["wire_vs_bf16"] < 0.4  # int4 codes + bf16 scales: about 0.28 of bf16's bytes
    assert exact["wire_vs_bf16"] == 1.0 and set(exact["all_reduce_paths"]) == {"lax"}


def test_min_bytes_auto_is_kept_and_reported_from_the_plans(tmp_path, patched_loader):
    auto, note = _eval(tmp_path, "--comm", "flash", "--bits", "4", "--min-bytes", "auto")
    assert "quantizing every" not in note
    paths = auto["all_reduce_paths"]
    quantized = paths.get("quantized", 0) / sum(paths.values())
    # the reported wire ratio follows the calls that ran: 1.0 where all stayed exact
    assert (auto["wire_vs_bf16"] == 1.0) == (quantized == 0), auto
