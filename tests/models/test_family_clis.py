"""Every model CLI and the rewrite examples on Qwen2 and Gemma 3: tiny synthetic GGUFs with a
tokenizer, run in process through each CLI's ``main(argv)``.

The checkpoints: ``QWEN2`` (12 query / 2 KV heads, q/k/v biases, untied head) with a byte-level
BPE tokenizer (``gpt2`` model, ``qwen2`` pre-tokenizer) and a chat template, and
``GEMMA3_GGUF`` (4 / 1 heads, QK-norm, sandwich norms, GeGLU, sliding windows) with a
SentencePiece tokenizer (``llama`` model, scores, byte fallback) and, like Gemma 3 270M's GGUF,
no chat template; both with a ``general.name``. The vocabularies are the tokenizers' of
tests/models/test_tokenizer_families.py, the context 1024 positions (``models.compare`` keeps a
cache of 512), the tensors F32. The suite's 8 CPU devices stand in for each CLI's own device
count (``set_devices`` is a no-op here).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from examples import rewrite_llama
from models import calibrate, check_rewrite, compare, convert, demo, eval as eval_cli, generate
from models.chat_template import NO_TEMPLATE_NOTE
from tests.models.test_tokenizer_families import (NORMAL, QWEN_EXTRA, QWEN_MERGES,
                                                  QWEN_SPECIAL, QWEN_TEMPLATE, SPM, byte_chars)
from tests.support.checkpoint_files import write_gguf
from tests.support.tiny_llama import GEMMA3_GGUF, QWEN2

NAMES = {"qwen2": "Tiny Qwen2 Test", "gemma3": "Tiny Gemma 3 Test"}
QWEN_TOKENS = byte_chars() + QWEN_EXTRA + [t for t, _ in QWEN_SPECIAL]
CONFIGS = {
    "qwen2": dataclasses.replace(QWEN2, vocab_size=len(QWEN_TOKENS), max_seq_len=1024,
                                 bos_token_id=264, eos_token_ids=(266,)),
    "gemma3": dataclasses.replace(GEMMA3_GGUF, vocab_size=len(SPM), max_seq_len=1024,
                                  bos_token_id=2, eos_token_ids=(1,)),
}
# a TP size > 1 the heads allow (qwen2 at 3: the middle rank holds both KV heads)
TP = {"qwen2": 3, "gemma3": 2}
TEXT = "The quick brown fox jumps over the lazy dog; hello abc, hello bc. " * 6
PROMPT = "hello"


def _tokenizer_metadata(w, family: str) -> None:
    """The tokenizer keys of ``family`` (bos / eos ids come from the config) and its name."""
    w.add_name(NAMES[family])
    if family == "qwen2":
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(QWEN_TOKENS)
        w.add_token_types([NORMAL] * (256 + len(QWEN_EXTRA)) + [k for _, k in QWEN_SPECIAL])
        w.add_token_merges(QWEN_MERGES)
        w.add_add_bos_token(False)
        w.add_chat_template(QWEN_TEMPLATE)
    else:
        w.add_tokenizer_model("llama")
        w.add_tokenizer_pre("default")
        w.add_token_list([t for t, _, _ in SPM])
        w.add_token_types([k for _, k, _ in SPM])
        w.add_token_scores([s for _, _, s in SPM])
        w.add_unk_token_id(3)
        w.add_add_bos_token(True)
        w.add_add_space_prefix(False)


def _write(path, family: str):
    """:func:`write_gguf` of the family's config, F32, with its tokenizer metadata (the writer
    adds them as it starts)."""
    import gguf

    class Writer(gguf.GGUFWriter):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            _tokenizer_metadata(self, family)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFWriter", Writer)
        write_gguf(path, CONFIGS[family], types=lambda _: "F32", extra=False)
    return path


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("family_clis")
    (d / "text.txt").write_text(TEXT, encoding="utf-8")
    (d / "prompts.json").write_text(json.dumps([PROMPT]), encoding="utf-8")
    for family in CONFIGS:
        _write(d / f"{family}.gguf", family)
    return d


@pytest.fixture(autouse=True)
def suite_devices(monkeypatch):
    """The CLIs' device count is the suite's (8 CPU devices, set before jax started)."""
    monkeypatch.setattr("models.cli.set_devices", lambda n: None)
    monkeypatch.setattr("models.cli.running.set_devices", lambda n: None)


FAMILIES = pytest.mark.parametrize("family", sorted(CONFIGS))


def _model(files, family):
    return str(files / f"{family}.gguf")


def test_the_files_hold_the_families(files):
    """The synthetic files read back as written: architecture, tokenizer, template or none."""
    from models.checkpoints import open_checkpoint

    qwen, gemma = (open_checkpoint(_model(files, f)) for f in ("qwen2", "gemma3"))
    assert (qwen.config.arch, qwen.config.vocab_size, qwen.config.qkv_bias) == ("qwen2", 269, True)
    assert (gemma.config.arch, gemma.config.vocab_size, gemma.config.qk_norm) == ("gemma3", 279,
                                                                                  True)
    assert qwen.tokenizer.chat_template == QWEN_TEMPLATE and gemma.tokenizer.chat_template is None
    assert gemma.tokenizer.encode(PROMPT, add_bos=True) == [2, 276]  # BOS, "hello"
    assert (qwen.title, gemma.title) == (NAMES["qwen2"], NAMES["gemma3"])


def _prompt_tokens(files, family) -> int:
    from models.checkpoints import open_checkpoint

    tok = open_checkpoint(_model(files, family)).tokenizer
    if family == "gemma3":
        return len(tok.encode(PROMPT, add_bos=True))
    return len(tok.encode(tok.apply_chat_template([{"role": "user", "content": PROMPT}])))


@FAMILIES
def test_generate_greedy_at_tp1_and_tp(files, family, capsys):
    """Greedy ``models.generate`` at TP 1 and at the family's TP > 1: the same text; the prompt
    in the chat template (qwen2) or, without one (gemma3), itself after BOS with one note."""
    texts = []
    for tp in (1, TP[family]):
        rc = generate.main(["--model", _model(files, family), "--tp", str(tp), "--prompt",
                            PROMPT, "--max-new-tokens", "3", "--greedy", "--cache-len", "64"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        lines = out.splitlines()
        summary = next(line for line in lines if f"TP={tp}] prompt" in line)
        assert f"prompt {_prompt_tokens(files, family)} tokens" in summary
        assert err.count(NO_TEMPLATE_NOTE) == (family == "gemma3")
        texts.append(lines[0])
    assert texts[0] == texts[1]


@FAMILIES
def test_eval_perplexity_equal_across_tp(files, family, tmp_path):
    results = []
    for tp in (1, TP[family]):
        out = tmp_path / f"tp{tp}.json"
        assert eval_cli.main(["--model", _model(files, family), "--tp", str(tp), "--text",
                              str(files / "text.txt"), "--window", "8", "--max-windows", "3",
                              "--json", str(out)]) == 0
        results.append(json.loads(out.read_text()))
    assert results[0]["tokens"] == results[1]["tokens"] == 3 * 7
    assert np.isfinite(results[0]["perplexity"]) and results[0]["perplexity"] > 1
    assert results[1]["perplexity"] == pytest.approx(results[0]["perplexity"], rel=1e-4)


@FAMILIES
def test_compare_exact_and_int8(files, family, tmp_path, capsys):
    out = tmp_path / "compare.json"
    assert compare.main(["--model", _model(files, family), "--tp", str(TP[family]),
                         "--settings", "exact,int8", "--text", str(files / "text.txt"),
                         "--window", "8", "--max-windows", "2", "--prompts",
                         str(files / "prompts.json"), "--max-new-tokens", "3", "--json",
                         str(out)]) == 0
    err = capsys.readouterr().err
    rows = json.loads(out.read_text())["rows"]
    assert [r["setting"] for r in rows] == ["exact", "int8"]
    exact, int8 = rows
    assert exact["tokens"] == int8["tokens"] == 2 * 7
    assert int8["perplexity"] == pytest.approx(exact["perplexity"], rel=0.05)
    assert int8["perplexity"] != exact["perplexity"]            # int8 codes on the wire
    assert exact["wire_vs_bf16"] == 1.0 and int8["wire_vs_bf16"] < 0.6  # int8 codes + scales
    assert all("quantized" in k for k in int8["plans"]) and int8["plans"]
    assert all(len(r["continuations"]) == 1 and 1 <= len(r["continuations"][0]) <= 3
               for r in rows)
    assert exact["match_prefix"] == [len(exact["continuations"][0])]
    # warm-up, two settings' generations: the note once (gemma3), never with a template
    assert err.count(NO_TEMPLATE_NOTE) == (family == "gemma3")


@FAMILIES
def test_demo_names_the_checkpoint(files, family, capsys):
    tp = TP[family]
    assert demo.main(["--model", _model(files, family), "--tp", str(tp), "--settings", "exact",
                      "--max-new-tokens", "2", "--rounds", "1", "--window", "8"]) == 0
    out = capsys.readouterr().out
    assert f"\n{NAMES[family]}, TP={tp} on {tp} CPU devices; perplexity on 8 tokens" in out
    assert "SmolLM2" not in out
    row = next(line for line in out.splitlines() if line.startswith("exact "))
    assert np.isfinite(float(row.split()[3]))                   # the perplexity column


def test_demo_title_without_a_name(tmp_path):
    class Checkpoint:  # an HF directory's checkpoint: no GGUF metadata
        title = None

    assert demo.model_title(Checkpoint(), str(tmp_path / "my-model")) == "my-model"
    assert demo.model_title(Checkpoint(), "/x/tiny.gguf") == "tiny"
    assert demo.model_title(Checkpoint(), "smollm2") == "smollm2"


@FAMILIES
def test_calibrate_writes_a_policy_of_every_site(files, family, tmp_path, capsys):
    from jax_flashcomm import CommPolicy
    from models.llama import site_names

    out = tmp_path / "policy.json"
    assert calibrate.main(["--model", _model(files, family), "--tp", str(TP[family]),
                           "--budget-ppl", "5", "--out", str(out), "--text",
                           str(files / "text.txt"), "--window", "8", "--calib-first", "1",
                           "--calib-windows", "2", "--candidates", "int8",
                           "--rounds", "1"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    policy = CommPolicy.load(out)
    sites = site_names(CONFIGS[family].n_layers)
    assert [name for name, _ in policy.sites] == sites
    assert set(policy.info["sensitivity"]) == set(sites)
    assert policy.info["model"] == _model(files, family) and policy.info["tp"] == TP[family]


@FAMILIES
def test_convert_round_trip(files, family, tmp_path, capsys):
    """GGUF -> HF directory: the config, every tensor and the tokenizer read back the same, and
    the logits at TP 1 and at the family's TP equal the GGUF's within f32 rounding."""
    import jax

    from models.checkpoints import expected_shapes, open_checkpoint
    from models.engine import Engine
    from models.llama.params import load_model

    outdir = tmp_path / "hf"
    assert convert.main([_model(files, family), str(outdir)]) == 0
    assert capsys.readouterr().out.strip() == str(outdir)
    src, back = open_checkpoint(_model(files, family)), open_checkpoint(str(outdir))
    # a GGUF says no query scalar (it is head_dim); config.json writes head_dim
    fields = {f.name for f in dataclasses.fields(src.config)} - {"query_pre_attn_scalar"}
    assert {f: getattr(back.config, f) for f in fields} == {f: getattr(src.config, f)
                                                            for f in fields}
    assert back.config.query_scale == src.config.query_scale
    assert sorted(back.names()) == sorted(expected_shapes(src.config))
    for name in back.names():
        np.testing.assert_array_equal(back.read(name), src.read(name), err_msg=name)
    for text in (TEXT, "<|im_start|>hello€", "hello hello"):
        assert back.tokenizer.encode(text) == src.tokenizer.encode(text)
    assert back.tokenizer.chat_template == src.tokenizer.chat_template
    assert (back.tokenizer.bos_id, back.tokenizer.eos_ids) == (src.tokenizer.bos_id,
                                                               src.tokenizer.eos_ids)
    tokens = np.asarray([src.tokenizer.encode(TEXT)[:16]], np.int32)
    for tp in (1, TP[family]):
        mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
        logits = [np.asarray(Engine(load_model(None, tp=tp, mesh=mesh, ckpt=c)[0], mesh,
                                    cache_len=16 * tp).score(tokens)) for c in (src, back)]
        np.testing.assert_allclose(logits[1], logits[0], rtol=0,
                                   atol=1e-6 * np.abs(logits[0]).max())


def test_rewrite_example_on_qwen2(files, tmp_path, capsys):
    """examples/rewrite_llama.py (the Explicit-sharding model, q/k/v biases) on qwen2 at TP 2:
    its exact perplexity is models.eval's on the same windows, the rewrite's exact islands
    change nothing, and the report lists the two all-reduces of every block."""
    _check_rewrite_example(files, tmp_path, capsys, "qwen2", 2, "explicit")


def test_rewrite_example_gspmd_on_gemma3(files, tmp_path, capsys):
    """The GSPMD variant on gemma3 at TP 2 (QK-norm, sandwich norms, GeGLU, sliding windows,
    its one KV head on both ranks)."""
    _check_rewrite_example(files, tmp_path, capsys, "gemma3", 2, "gspmd")


def _check_rewrite_example(files, tmp_path, capsys, family, tp, style):
    out, ref = tmp_path / "rewrite.json", tmp_path / "eval.json"
    text = ["--text", str(files / "text.txt"), "--window", "8", "--max-windows", "2"]
    assert rewrite_llama.main(["--model", _model(files, family), "--tp", str(tp), *text,
                               "--settings", "exact,rewritten-exact,int8-norm", "--style", style,
                               "--quiet-report", "--json", str(out)]) == 0
    capsys.readouterr()
    results = json.loads(out.read_text())["results"]
    assert eval_cli.main(["--model", _model(files, family), "--tp", str(tp), *text,
                          "--json", str(ref)]) == 0
    expected = json.loads(ref.read_text())["perplexity"]
    assert results["exact"]["perplexity"] == pytest.approx(expected, rel=1e-5)
    assert results["rewritten-exact"]["perplexity"] == pytest.approx(
        results["exact"]["perplexity"], rel=1e-6)
    assert results["int8-norm"]["perplexity"] == pytest.approx(expected, rel=1e-3)
    n_layers = CONFIGS[family].n_layers
    assert results["rewritten-exact"]["report_rows"] >= 2 * n_layers


def test_check_rewrite_on_gemma3(files, capsys):
    """models.check_rewrite on gemma3 at TP 2: comm="exact" rewritten at int8 gives
    comm="flash"'s int8 logits bit for bit."""
    rc = check_rewrite.main(["--model", _model(files, "gemma3"), "--tp", "2", "--bits", "8",
                             "--min-bytes", "0", "--text", str(files / "text.txt"),
                             "--window", "8", "--max-windows", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "equal: True; logits bit-equal per window: [True, True]" in out


def test_check_tp_default_sizes_follow_the_heads(files, capsys):
    """models.check_tp without --tp: every size from 2 to 9 dividing the query heads (gemma3's
    4: TP 2 and 4), each within the f32 tolerance of TP=1."""
    from models import check_tp

    assert [check_tp.default_sizes(h) for h in (9, 12, 4)] == [[3, 9], [2, 3, 4, 6], [2, 4]]
    rc = check_tp.main(["--model", _model(files, "gemma3"), "--tokens", "16", "--kinds",
                        "exact"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert [line.split()[0] for line in out.splitlines() if line.endswith(": ok")] == [
        "TP=2", "TP=4"]
