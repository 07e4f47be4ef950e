"""benchmarks/llm/accuracy.py: the rows it runs, the bytes it reports, and the metrics it computes
(on the tiny random checkpoint; the SmolLM2 sweep itself is docs/accuracy.md)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks.llm import accuracy

from benchmarks.llm import accuracy_page as accuracy_report
from jax_flashcomm.codec import spec
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint


SENSITIVITY = {"tp": 3, "bits": 4, "ag_bits": 8, "upgrade_bits": 8,
               "sites": [{"layer": 0, "site": "attn", "kl": 1e-3},
                         {"layer": 1, "site": "mlp", "kl": 5e-2},
                         {"layer": 0, "site": "mlp", "kl": 2e-3}],
               "greedy": [{"k": 0}, {"k": 2}]}


def test_rows_cover_the_grid_once_per_tp():
    rows = accuracy.settings([3, 9], accuracy.SECTIONS, SENSITIVITY)
    keys = [s.key for s in rows]
    assert len(keys) == len(set(keys))
    for tp in (3, 9):
        grid = {(s.rs_bits, s.group_size) for s in rows if s.section == "grid" and s.tp == tp}
        assert grid == {(b, g) for b in accuracy.GRID_BITS for g in accuracy.GRID_GROUPS}
        assert [s for s in rows if s.tp == tp][0].kind == "exact"
    # the per-setting sections run at the first TP only; coarse and grid at every TP
    assert {s.tp for s in rows if s.section in ("options", "mixes", "overlap")} == {3}
    assert {s.tp for s in rows if s.section == "coarse"} == {3, 9}
    assert {s.tp for s in rows if s.default} == {3, 9}
    # the policies chosen at the sensitivity's TP are scored at every TP asked for
    layers = [s for s in rows if s.section == "layers"]
    assert [(s.tp, s.upgraded, s.rs_bits, s.ag_bits) for s in layers] == [
        (3, 0, 4, 8), (3, 2, 4, 8), (9, 0, 4, 8), (9, 2, 4, 8)]
    only = accuracy.settings([3], ["layers"], SENSITIVITY, layer_ks=[2])
    assert [(s.tp, s.upgraded) for s in only if s.section == "layers"] == [(3, 2)]
    with pytest.raises(ValueError, match="sensitivity"):
        accuracy.settings([3], ["layers"])


def test_layer_rows_with_codec_options_have_distinct_labels():
    """A sensitivity record with its own base options (group size, spikes, rotation) gives rows
    of those options, one label per k."""
    record = {**SENSITIVITY, "bits": 4, "ag_bits": 4, "group_size": 128, "spikes": 2,
              "rotation": 1}
    layers = [s for s in accuracy.settings([2], ["layers"], record) if s.section == "layers"]
    assert [(s.group_size, s.spikes, s.rotation, s.default) for s in layers] == [
        (128, 2, 1, False)] * 2
    assert len({s.label for s in layers}) == 2


def test_layer_policy_upgrades_the_most_sensitive_sites():
    from benchmarks.llm import layer_sensitivity
    from jax_flashcomm import CommConfig

    assert layer_sensitivity.ranked_sites(SENSITIVITY) == [(1, "mlp"), (0, "mlp"), (0, "attn")]
    policy = layer_sensitivity.policy_overrides(SENSITIVITY, 2)
    assert set(policy) == {(1, "mlp"), (0, "mlp")}
    assert all(c.config.phase1_bits == 8 and c.config.phase2_bits == 8 for c in policy.values())
    base, up = CommConfig(bits=4, ag_bits=8, min_bytes=0), CommConfig(bits=8, min_bytes=0)
    b, u = (accuracy.wire(c)["bytes_per_element"] for c in (base, up))
    w = layer_sensitivity.mean_wire(base, up, 60, 15)
    assert w["bytes_per_element"] == pytest.approx(0.75 * b + 0.25 * u, rel=1e-12)
    assert w["vs_bf16_ring"] == pytest.approx(w["bytes_per_element"] / 2, rel=1e-12)


@pytest.mark.parametrize("window,d,tp", [(512, 576, 3), (512, 576, 9), (16, 64, 2), (7, 12, 5)])
def test_coarse_group_is_one_group_per_rank_chunk(window, d, tp):
    g = accuracy.coarse_group(window, d, tp)
    assert g % 8 == 0 and 0 <= g * tp - window * d < 8 * tp
    assert spec.padded_size(window * d, g, tp) == g * tp


def _independent_bytes(bits, g, spikes):
    # codes packed to whole bytes, bf16 scale and zero, and per spike a bf16 value and a
    # one-byte position (docs/format.md)
    return (math.ceil(bits * g / 8) + 4 + 3 * spikes) / g


@pytest.mark.parametrize("bits,ag,g,spikes", [(8, 8, 128, 0), (4, 4, 128, 1), (4, 8, 64, 2),
                                               (8, 8, 256, 1), (3, 3, 1024, 0)])
def test_wire_bytes_per_element(bits, ag, g, spikes):
    from jax_flashcomm import CommConfig

    cfg = CommConfig(bits=bits, ag_bits=ag, group_size=g, spikes=spikes, min_bytes=0)
    w = accuracy.wire(cfg)
    want = (_independent_bytes(bits, g, spikes) + _independent_bytes(ag, g, spikes)) / 2
    assert w["bytes_per_element"] == pytest.approx(want, rel=1e-12)
    assert w["vs_bf16_ring"] == pytest.approx(want / 2, rel=1e-12)
    assert accuracy.wire(None) == {"bytes_per_element": 2.0, "vs_bf16_ring": 1.0}


@pytest.fixture(scope="module")
def tiny():
    mesh = jax.make_mesh((2,), ("tp",), devices=jax.devices()[:2])
    model, _ = load_model(None, tp=2, mesh=mesh, ckpt=DictCheckpoint())
    rs = np.random.RandomState(3)
    windows = [list(rs.randint(0, TINY.vocab_size, 16)) for _ in range(2)]
    exact, reference = accuracy.evaluate(model, mesh, accuracy.Setting("exact", 2, kind="exact"),
                                         windows, None, TINY.d_model)
    return model, mesh, windows, exact, reference


def test_exact_row_is_its_own_reference(tiny):
    model, mesh, windows, exact, reference = tiny
    assert exact["kl"] == 0 and exact["top1"] == 1 and exact["tokens"] == 2 * 15
    assert len(reference) == 2 and reference[0].shape == (15, TINY.vocab_size)
    np.testing.assert_allclose(np.exp(reference[0]).sum(-1), 1, rtol=1e-5)


def test_quantized_row_metrics_match_a_direct_computation(tiny):
    """Perplexity, KL(exact || setting) and top-1 agreement of a 2-bit row, recomputed here
    from the engine's logits with numpy."""
    from models.engine import Engine
    from models.llama import set_comm

    model, mesh, windows, exact, reference = tiny
    s = accuracy.Setting("grid", 2, rs_bits=2, ag_bits=2, group_size=32)
    row, _ = accuracy.evaluate(model, mesh, s, windows, reference, TINY.d_model)
    comm, _ = accuracy.comm_config(s, 16, TINY.d_model)
    set_comm(model, comm)
    engine = Engine(model, mesh, cache_len=64)
    nll, kl, top1 = [], [], []
    for w, ref in zip(windows, reference):
        logits = np.asarray(engine.score(np.asarray([w], np.int32)), np.float64)[0, :-1]
        logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1,
                                keepdims=True)) - logits.max(-1, keepdims=True)
        nll.append(-logp[np.arange(15), w[1:]])
        kl.append((np.exp(ref) * (ref - logp)).sum(-1))
        top1.append(logp.argmax(-1) == ref.argmax(-1))
    nll, kl, top1 = map(np.concatenate, (nll, kl, top1))
    assert row["perplexity"] == pytest.approx(math.exp(nll.mean()), rel=1e-5)
    assert row["kl"] == pytest.approx(kl.mean(), rel=1e-3, abs=1e-6)
    assert row["top1"] == pytest.approx(top1.mean())
    assert row["kl"] > 0 and row["top1"] < 1     # 2 bits do change the model
    assert row["vs_bf16_ring"] < 0.2


def _fake_data():
    rows = [{"section": "exact", "tp": 3, "label": "exact", "perplexity": 10.0, "tokens": 100,
             "delta_ppl": 0.0, "kl": 0.0, "top1": 1.0, "bytes_per_element": 2.0,
             "vs_bf16_ring": 1.0}]
    for b in (8, 4):
        for g in (32, 128):
            rows.append({"section": "grid", "tp": 3, "label": f"int{b} G={g}", "rs_bits": b,
                         "group_size": g, "perplexity": 10 + 8 / b, "delta_ppl": 0.8 / b,
                         "kl": 1e-3 / b, "top1": 1 - 0.01 * b, "tokens": 100,
                         "bytes_per_element": b / 8, "vs_bf16_ring": b / 16})
    rows.append(dict(rows[1], section="coarse", label="int8 per-tensor"))
    return {"rows": rows, "machine": "test", "model": "m", "window": 8, "max_windows": 1}


def test_report_tables_markdown_and_plot(tmp_path):
    data = _fake_data()
    text = accuracy_report.tables(data)
    assert "int8 per-tensor" in text and "+10.000%" in text and "+20.000%" in text
    accuracy_report.plot(data, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = accuracy_report.write_markdown(data, tmp_path / "accuracy.json")
    assert page == tmp_path / "accuracy.md"
    out = page.read_text()
    assert out.startswith("# Accuracy") and "Machine: test" in out and "int8 per-tensor" in out
    assert "(accuracy.png)" in out and "[accuracy.json](accuracy.json)" in out
