"""``models.eval`` evaluates the setting it is given: a quantized ``--comm`` without
``--min-bytes`` quantizes every all-reduce (the library's ``min_bytes="auto"`` would keep exact
``lax`` at sites it predicts faster, and the perplexity printed would be exact's), and the wire
ratio it reports comes from the plans of the calls that ran (``fc.record()``), not from the
options."""

import io

import pytest

import jax_flashcomm as fc
from models import cli
from models import eval as eval_cli
from tests.models.test_calibrate_cli import FP8
from tests.models.test_calibrate_cli import patched_loader  # noqa: F401  (the fixture)


def _eval(tmp_path, *extra):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    parser = eval_cli.build_parser()
    args = parser.parse_args(["--tp", "2", "--text", str(text), "--window", "32",
                              "--max-windows", "1", *extra])
    log = io.StringIO()
    cli.quantize_every_call(args, log)
    return eval_cli.run(args, log=log), log.getvalue()


def test_a_quantized_setting_quantizes_every_all_reduce(tmp_path, patched_loader):  # noqa: F811
    exact, _ = _eval(tmp_path, "--comm", "exact")
    int4, note = _eval(tmp_path, "--comm", "flash", "--bits", "4")
    assert "quantizing every all-reduce" in note
    assert int4["options"]["min_bytes"] == "0"
    assert set(int4["all_reduce_paths"]) == {"quantized"}, int4["all_reduce_paths"]
    assert int4["perplexity"] != exact["perplexity"]
    assert int4["wire_vs_bf16"] < 0.4  # int4 codes + bf16 scales: about 0.28 of bf16's bytes
    assert exact["wire_vs_bf16"] == 1.0 and set(exact["all_reduce_paths"]) == {"lax"}


def test_min_bytes_auto_is_kept_and_reported_from_the_plans(tmp_path, patched_loader):  # noqa: F811, E501
    auto, note = _eval(tmp_path, "--comm", "flash", "--bits", "4", "--min-bytes", "auto")
    assert "quantizing every" not in note
    paths = auto["all_reduce_paths"]
    quantized = paths.get("quantized", 0) / sum(paths.values())
    # the reported wire ratio follows the calls that ran: 1.0 where all stayed exact
    assert (auto["wire_vs_bf16"] == 1.0) == (quantized == 0), auto


def test_a_policy_reports_the_wire_of_its_sites(tmp_path, patched_loader):  # noqa: F811
    policy = fc.CommPolicy(sites={"0.mlp": FP8}).save(tmp_path / "policy.json")
    result, _ = _eval(tmp_path, "--comm-policy", str(policy))
    assert result["all_reduce_paths"] == {"lax": 3, "quantized": 1}
    assert result["wire_vs_bf16"] == pytest.approx((3 + fc.policy.wire_vs_bf16(FP8)) / 4)
