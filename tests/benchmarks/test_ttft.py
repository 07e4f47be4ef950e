"""benchmarks/llm/ttft/links.py: the pure parts (bytes per step against the compiled HLO of a tiny TP=3
model, FLOPs against the checkpoint's weight shapes, link calibration, strategy and argument
parsing, the doc's table block); the whole benchmark is a slow test (root, iproute2, model)."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from benchmarks.llm.ttft import links, settings
from jax_flashcomm.nn import TPComm
from models.checkpoints.llama_config import LlamaConfig
from models.engine import Engine, Sampling
from models.traffic import allreduce_bytes_per_token
from models.llama.params import load_model
from tests.support.wire_bytes import _OP, _runs_per_call, wire_bytes
from tests.support.tiny_llama import DictCheckpoint, tiny_tensors

REPO = Path(__file__).resolve().parents[2]
# heads TP=3 splits (6 query, 3 KV); d, MLP and vocabulary not multiples of 3 or of G=128
TINY3 = LlamaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=6, n_kv_heads=3,
                    head_dim=16, ffn_dim=100, max_seq_len=256, eos_token_ids=(2,))
SMOL = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                   head_dim=64, ffn_dim=1536)
STRATEGIES = "exact,int8,int4,int4/8,overlap,overlap+int8"


def _xla(comm: TPComm) -> TPComm:
    """The same strategy with the quantized collectives on XLA's collectives (in one process
    the default transport is p2p, FFI calls that the HLO does not show as collectives)."""
    if not comm.quantized:
        return comm
    return dataclasses.replace(comm, config=dataclasses.replace(comm.config, transport="xla"))


def _collectives(hlo: str) -> int:
    return sum(runs for body, runs in _runs_per_call(hlo).values()
               for line in body if _OP.search(line))


@pytest.fixture(scope="module")
def compiled_steps():
    """Compiled HLO of the prefill (33 positions) and of a decode step per strategy."""
    mesh = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
    ckpt = DictCheckpoint(TINY3, tiny_tensors(TINY3))
    out = {}
    for name, comm in settings.parse_strategies(STRATEGIES):
        model, _ = load_model(None, tp=3, mesh=mesh, comm=_xla(comm), ckpt=ckpt)
        eng = Engine(model, mesh, cache_len=64)
        seq = eng.bucket(30)
        tokens = eng._put(np.zeros((1, seq), np.int32))
        pre = eng._prefill.lower(eng.state, tokens, eng._put(np.int32(30)), eng.new_cache(1))
        entry = {"comm": comm, "seq": seq, "prefill": pre.compile().as_text()}
        if name in ("exact", "int4/8"):  # the two decode paths (overlap kinds all-reduce too)
            dec = eng._decode.lower(eng.state, eng._put(np.zeros(1, np.int32)),
                                    eng._put(np.int32(30)), eng.new_cache(1),
                                    eng._put(jax.random.key(0)), Sampling())
            entry["decode"] = dec.compile().as_text()
        out[name] = entry
    return out


@pytest.mark.parametrize("name", STRATEGIES.split(","))
def test_prefill_bytes_and_collectives_match_compiled_hlo(compiled_steps, name):
    e = compiled_steps[name]
    assert e["seq"] == 33
    got = settings.step_traffic(TINY3, 3, e["comm"], e["seq"], decode=False)
    sent = wire_bytes(e["prefill"], 3)
    assert got["bytes"] == pytest.approx(sum(sent.values()), rel=1e-12), sent
    assert got["collectives"] == _collectives(e["prefill"])


@pytest.mark.parametrize("name", ["exact", "int4/8"])
def test_decode_bytes_match_compiled_hlo(compiled_steps, name):
    e = compiled_steps[name]
    got = settings.step_traffic(TINY3, 3, e["comm"], e["seq"], decode=True)
    assert got["bytes"] == pytest.approx(sum(wire_bytes(e["decode"], 3).values()), rel=1e-12)
    assert got["collectives"] == _collectives(e["decode"])


@pytest.mark.parametrize("name", STRATEGIES.split(","))
def test_decode_blocks_equal_models_traffic(name):
    """The per-layer part of a decode step is models/traffic.py's figure; the rest is the
    embedding psum and the logits all-gather (f32), the same for every strategy."""
    comm = dict(settings.parse_strategies(STRATEGIES))[name]
    got = settings.step_traffic(SMOL, 3, comm, 1, decode=True)
    assert got["blocks"] == pytest.approx(allreduce_bytes_per_token(SMOL, 3, comm)["sent"])
    fixed = 2 * 2 / 3 * 576 * 4 + 2 * 49152 // 3 * 4
    assert got["bytes"] - got["blocks"] == pytest.approx(fixed)
    assert settings.step_traffic(SMOL, 1, comm, 1, decode=True)["bytes"] == 0


def test_prefill_bytes_smollm2_by_hand():
    """exact: 61 f32 ring all-reduces of S x 576 values plus the logits' all-gather; int4
    (G=128, 1 spike per group in each phase): (4 * 128 / 8 + 4 + 3) / 128 bytes per value."""
    comms = dict(settings.parse_strategies(STRATEGIES))
    s = 258
    exact = settings.step_traffic(SMOL, 3, comms["exact"], s, decode=False)
    logits = 2 * 16384 * 4
    assert exact["bytes"] == pytest.approx(61 * 4 / 3 * s * 576 * 4 + logits)
    int4 = settings.step_traffic(SMOL, 3, TPComm("quantized", config=dataclasses.replace(
        comms["int8"].config, bits=4)), s, decode=False)
    padded = -(-s * 576 // 384) * 384
    assert int4["blocks"] == pytest.approx(60 * 2 * 2 / 3 * padded * 71 / 128)
    overlap = settings.step_traffic(SMOL, 3, comms["overlap"], s, decode=False)
    assert overlap["blocks"] == pytest.approx(exact["blocks"])  # same bytes, 4x the permutes
    assert overlap["collectives"] == 1 + 60 * 4 + 1 + 1
    with pytest.raises(ValueError, match="seq % 3"):
        settings.step_traffic(SMOL, 3, comms["overlap"], 256, decode=False)


def test_prefill_flops_from_weight_shapes():
    """2 FLOPs per weight per position for the layers' matmuls (every weight of the tiny
    checkpoint but the norms and the embedding), 4 S^2 q per layer for attention, the tied
    LM head once."""
    tensors = tiny_tensors(TINY3)
    weights = sum(a.size for k, a in tensors.items() if k.endswith("proj.weight"))
    s, q = 33, TINY3.n_heads * TINY3.head_dim
    expect = 2 * weights * s + TINY3.n_layers * 4 * s * s * q + 2 * TINY3.d_model * 101
    assert settings.prefill_flops(TINY3, s) == expect


def test_link_rate_calibration():
    pcie, nvlink = settings.SYSTEMS["pcie"], settings.SYSTEMS["nvlink"]
    assert settings.link_rate(20e9, pcie) == pytest.approx(20e9 * 25e9 / 181e12)  # 2.76 MB/s
    assert settings.link_rate(20e9, nvlink) / settings.link_rate(20e9, pcie) == pytest.approx(
        (230 / 312) / (25 / 181))
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(ValueError):
            settings.link_rate(bad, pcie)


def test_strategy_and_link_parsing():
    got = settings.parse_strategies("int4, overlap+int8,int4/8")
    assert [n for n, _ in got] == ["exact", "int4", "overlap+int8", "int4/8"]
    fields = [settings.strategy_fields(n, c) for n, c in got]
    assert [(f["kind"], f["rs_bits"], f["ag_bits"]) for f in fields] == [
        ("exact", None, None), ("flash", 4, 4), ("flash+overlap", 8, 8), ("flash", 4, 8)]
    assert fields[1]["group_size"] == 128 and fields[1]["spikes"] == [1, 1]
    for bad in ("", "int4,int4", "bogus", "overlap+", "int9"):
        with pytest.raises(ValueError):
            settings.parse_strategies(bad)
    assert settings.parse_links("nvlink,pcie") == ["nvlink", "pcie"]
    for bad in ("", "pcie,pcie", "unlimited", "ethernet"):
        with pytest.raises(ValueError):
            settings.parse_links(bad)


@pytest.mark.parametrize("argv", [["--links", "ib"], ["--strategies", "int4,bogus"],
                                  ["--reps", "0"], ["--prompt-tokens", "0"],
                                  ["--decode-steps", "0"], ["--decode-tokens", "-1"]])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        links.main(argv)
    assert e.value.code == 2
    assert "error" in capsys.readouterr().err


def test_the_page_of_a_run(tmp_path):
    """The page a run writes beside its record: title, command, machine, its tables, the plot
    where there is one, a link to the record and to the guide page; rewritten whole."""
    from benchmarks.shared.results import write_page

    record = {"command": "python -m benchmarks.llm.ttft.links --quick", "machine": "CPU X",
              "rows": [{"link": "pcie", "strategy": "exact", "ttft_s": 1.5}]}
    (tmp_path / "ttft.png").write_bytes(b"png")
    page = write_page(tmp_path / "ttft.json", record, tables="| a |\n|---|\n| 1 |\n")
    text = page.read_text()
    assert page == tmp_path / "ttft.md"
    assert text.splitlines()[0] == "# TTFT and decode of SmolLM2 at TP=3 on emulated links"
    for part in ("Command: `.venv/bin/python -m benchmarks.llm.ttft.links --quick`",
                 "Machine: CPU X",
                 "| a |\n|---|\n| 1 |", "(ttft.png)", "[ttft.json](ttft.json)", "(../ttft.md)"):
        assert part in text, part
    page = write_page(tmp_path / "ttft.json", record)  # no tables given: the record's rows
    assert "| link | strategy | ttft_s |\n|---|---|---|\n| pcie | exact | 1.5 |" in page.read_text()


def _can_run() -> str | None:
    from benchmarks.shared.netns import available

    reason = available()
    if reason:
        return reason
    cache = Path(os.environ.get("FLASHCOMM_MODEL_CACHE",
                                Path.home() / ".cache" / "jax_flashcomm" / "models"))
    if not list(cache.glob("SmolLM2-135M-Instruct*.gguf")):
        return "the SmolLM2 GGUF is not cached (any model CLI fetches it on first use, e.g. .venv/bin/python -m models.demo)"
    return None


@pytest.mark.slow
@pytest.mark.skipif(_can_run() is not None, reason=str(_can_run()))
def test_quick_run_end_to_end(tmp_path):
    """3 processes in a namespace, exact and int4, 32 tokens, the NVLink-class link (the
    faster one: CI time): every row present, the calibrated rate set, int4 sending fewer bytes
    and faster than exact on the limited link."""
    out = tmp_path / "ttft"
    subprocess.run([sys.executable, "-m", "benchmarks.llm.ttft.links", "--strategies", "exact,int4",
                    "--links", "nvlink", "--prompt-tokens", "32", "--decode-tokens", "2",
                    "--reps", "1", "--out", str(out)], cwd=REPO, check=True, timeout=900)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["tp"] == 3 and data["machine"]
    assert {(r["link"], r["strategy"]) for r in data["rows"]} == {
        (ln, s) for ln in ("unlimited", "nvlink") for s in ("exact", "int4")}
    assert data["links"]["unlimited"]["rate_bytes_per_s"] is None
    assert data["links"]["nvlink"]["rate_bytes_per_s"] > 0
    rows = {(r["link"], r["strategy"]): r for r in data["rows"]}
    assert rows["nvlink", "int4"]["prefill_bytes_per_rank"] < rows["nvlink", "exact"][
        "prefill_bytes_per_rank"] / 4
    assert rows["nvlink", "int4"]["ttft_s"] < rows["nvlink", "exact"]["ttft_s"]
    assert out.with_suffix(".png").stat().st_size > 0
    assert shutil.which("ip")


@pytest.mark.parametrize("quantized", [{"ag": True, "rs": False}, {"ag": False, "rs": True}])
def test_auto_overlap_prefill_bytes_match_compiled_hlo(quantized):
    """auto+overlap's prefill with its ring matmuls' collectives chosen apart (a synthetic
    table: the quantized candidate 10x faster for one, 10x slower for the other)."""
    import jax_flashcomm as fc
    from jax_flashcomm.planner import _plan as planner
    from jax_flashcomm.costs import _table as tuning

    rows = []
    for op, part in (("all_gather", "ag"), ("psum_scatter", "rs")):
        for size in (1024, 1 << 20):
            rows += [tuning.Measurement(op, "in-process", 3, "float32", size, "lax", None, 1e-3),
                     tuning.Measurement(op, "in-process", 3, "float32", size, "quantized/xla",
                                        planner.choice_bits(op, fc.CommConfig()),
                                        1e-4 if quantized[part] else 1e-2)]
    mesh = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
    comm = TPComm("auto", layout="sequence_parallel", transport="xla")
    with tuning.use_table(tuning.Table(key={"synthetic": True}, rows=tuple(rows))), \
            fc.record() as plans:
        model, _ = load_model(None, tp=3, mesh=mesh, comm=comm,
                              ckpt=DictCheckpoint(TINY3, tiny_tensors(TINY3)))
        eng = Engine(model, mesh, cache_len=64)
        seq = eng.bucket(30)
        hlo = eng._prefill.lower(eng.state, eng._put(np.zeros((1, seq), np.int32)),
                                 eng._put(np.int32(30)), eng.new_cache(1)).compile().as_text()
    ran = {part: {p.quantized for p in plans if p.op == op}
           for part, op in (("ag", "all_gather_matmul"), ("rs", "matmul_reduce_scatter"))}
    assert ran == {part: {q} for part, q in quantized.items()}
    got = settings.step_traffic(TINY3, 3, comm, seq, decode=False, auto_quantizes=quantized)
    assert got["bytes"] == pytest.approx(sum(wire_bytes(hlo, 3).values()), rel=1e-12)
    assert got["collectives"] == _collectives(hlo)
