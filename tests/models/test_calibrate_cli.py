"""``models.calibrate`` and ``--comm-policy``: the per-site policy on a Llama (its site names,
the overrides it sets, the numbers it gives), the calibration run end to end on a tiny model
(in process, its loader patched), and the command-line errors."""

import argparse
import json

import jax
import numpy as np
import pytest

import jax_flashcomm as fc
from jax_flashcomm.nn import TPComm
from models import calibrate, cli
from models.engine import Engine
from models.llama import policy_comms, set_comm, site_names
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint

FP8 = fc.CommConfig(format="fp8", min_bytes=0)
NV = fc.CommConfig(format="nvfp4", min_bytes=0)
TP = 2


class ByteTokenizer:
    """Each UTF-8 byte a token id below TINY's vocabulary."""

    eos_ids = (2,)

    def encode(self, text):
        return [3 + b % (TINY.vocab_size - 3) for b in text.encode()]


def _tiny(comm=None):
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    ckpt = DictCheckpoint()
    ckpt.tokenizer = ByteTokenizer()
    model, ckpt = load_model(None, tp=TP, mesh=mesh, comm=comm, ckpt=ckpt)
    return model, ckpt, mesh


def _logits(model, mesh, tokens):
    return np.asarray(Engine(model, mesh, cache_len=64).score(tokens))


def test_site_names_and_policy_comms():
    assert site_names(2) == ["0.attn", "0.mlp", "1.attn", "1.mlp"]
    comm, overrides = policy_comms(fc.CommPolicy(default=NV, sites={"0.mlp": FP8,
                                                                    "1.attn": None}), 2)
    assert comm == TPComm("quantized", config=NV)
    assert overrides == {(0, "mlp"): TPComm("quantized", config=FP8), (1, "attn"): TPComm("exact")}
    with pytest.raises(ValueError, match="does not have: \\['2.mlp'\\]"):
        policy_comms(fc.CommPolicy(sites={"2.mlp": FP8}), 2)
    with pytest.raises(ValueError, match="does not have"):
        policy_comms(fc.CommPolicy(sites={"mlp": FP8}), 2)


def test_a_policy_gives_the_logits_of_the_same_overrides_set_by_hand():
    model, _, mesh = _tiny()
    tokens = np.asarray([np.arange(3, 35) % TINY.vocab_size], np.int32)
    policy = fc.CommPolicy(sites={"0.mlp": FP8, "1.attn": NV})
    comm, overrides = policy_comms(policy, TINY.n_layers)
    set_comm(model, comm, overrides=overrides)
    via_policy = _logits(model, mesh, tokens)
    set_comm(model, TPComm("exact"), overrides={(0, "mlp"): TPComm("quantized", config=FP8),
                                                (1, "attn"): TPComm("quantized", config=NV)})
    by_hand = _logits(model, mesh, tokens)
    set_comm(model, TPComm("exact"))
    exact = _logits(model, mesh, tokens)
    np.testing.assert_array_equal(via_policy, by_hand)
    assert not np.array_equal(via_policy, exact)      # the quantized sites changed something


@pytest.fixture
def patched_loader(monkeypatch):
    """models.calibrate.run on TINY: no device-count change, the tiny model for any name."""
    monkeypatch.setattr(cli, "set_devices", lambda n: None)           # the CLIs' own calls
    monkeypatch.setattr("models.cli.running.set_devices", lambda n: None)  # cli.setup's

    def fake_load(name, *, tp, mesh, comm=None, dtype=None, ckpt=None):
        model, ckpt, _ = _tiny(comm)
        return model, ckpt

    monkeypatch.setattr("models.llama.params.load_model", fake_load)


def _args(tmp_path, *extra):
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 40)
    parser = calibrate.build_parser()
    return parser.parse_args(["--tp", str(TP), "--budget-ppl", "0.5", "--out",
                              str(tmp_path / "p.json"), "--text", str(text), "--window", "32",
                              "--calib-first", "1", "--calib-windows", "2",
                              "--candidates", "nvfp4,fp8", *extra])


def test_calibration_end_to_end_on_a_tiny_model(tmp_path, patched_loader):
    args = _args(tmp_path)
    policy = calibrate.run(args, log=open("/dev/null", "w"))
    back = fc.CommPolicy.load(args.out)
    assert back == policy and [n for n, _ in back.sites] == site_names(TINY.n_layers)
    info = back.info
    assert set(info["sensitivity"]) == set(site_names(TINY.n_layers))
    assert all(len(v) == 2 for v in info["sensitivity"].values())
    assert info["met"] == (info["measured"] <= 0.5)
    # the recorded perplexity is the policy's own on the calibration windows
    assert info["measured"] == pytest.approx(
        100 * (info["perplexity"] / info["exact_perplexity"] - 1), rel=1e-6, abs=1e-9)
    assert info["mean_wire"] == pytest.approx(back.mean_wire_vs_bf16(site_names(2)))
    assert "sites:" in calibrate.summary(back)


def test_a_wire_cap_binds(tmp_path, patched_loader):
    args = _args(tmp_path, "--max-wire", "0.3", "--budget-ppl", "0")
    policy = calibrate.run(args, log=open("/dev/null", "w"))
    assert policy.mean_wire_vs_bf16(site_names(2)) <= 0.3
    assert all(c == NV for _, c in policy.sites)      # nvfp4 (0.297x) is all that fits


def _common(*argv):
    parser = argparse.ArgumentParser(prog="python -m models.eval")
    cli.add_common(parser)
    return parser, parser.parse_args(list(argv))


def test_comm_policy_flag_errors(tmp_path, capsys):
    good = fc.CommPolicy(sites={"0.mlp": FP8}).save(tmp_path / "good.json")
    parser, args = _common("--comm-policy", str(good))
    cli.check(parser, args)
    assert "comm policy" in cli.describe(args)
    for argv, message in ((("--comm", "flash"), "drop --comm"), (("--bits", "4"), "drop --bits"),
                          ((), "not a jax_flashcomm policy")):
        path = good
        if not argv:
            path = tmp_path / "bad.json"
            path.write_text(json.dumps({"sites": {}}))
        parser, args = _common("--comm-policy", str(path), *argv)
        with pytest.raises(SystemExit):
            cli.check(parser, args)
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--out", "p.json"], "--budget-ppl"),
    (["--budget-ppl", "-1", "--out", "p.json"], "--budget-ppl must be >= 0"),
    (["--budget-ppl", "1", "--out", "p.json", "--max-wire", "0"], "--max-wire must be > 0"),
    (["--budget-ppl", "1", "--out", "p.json", "--candidates", "exact"], "not a quantized"),
    (["--budget-ppl", "1", "--out", "p.json", "--candidates", "int9x"], "unknown setting"),
    (["--budget-ppl", "1", "--out", "/nonexistent/p.json"], "no such folder"),
])
def test_calibrate_cli_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--tp", "3", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_sensitivity_from_another_setup_is_refused(tmp_path, capsys):
    other = fc.CommPolicy(info={"model": "smollm2", "tp": 9, "sensitivity": {}}).save(
        tmp_path / "other.json")
    with pytest.raises(SystemExit):
        calibrate.main(["--tp", "3", "--budget-ppl", "1", "--out", str(tmp_path / "p.json"),
                        "--sensitivity-from", str(other)])
    err = capsys.readouterr().err
    assert "measured under other options" in err and "tp: 9 there, 3 here" in err
