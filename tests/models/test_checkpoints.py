"""The checkpoint + tokenizer layer of ``models/``: GGUF and safetensors checkpoints read in HF
layout, llama.cpp's Q/K permutation undone, conversion, error reporting, the tokenizer.

Tests marked ``model`` use the real SmolLM2-135M-Instruct GGUF
(``models.checkpoints.fetch.model_path``, fetched once per machine into the model cache); the
others build tiny checkpoints.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from models.checkpoints import CheckpointError, expected_shapes, open_checkpoint
from models.checkpoints.llama_config import LlamaConfig
from models.checkpoints.gguf import llama_cpp_permute, unpermute_qk
from tests.support.checkpoint_files import save_hf_dir, write_gguf
from tests.support.tiny_llama import TINY, tiny_tensors

# -- helpers ---------------------------------------------------------------------------------


def write_hf(directory, cfg=TINY, tensors=None, shards=None):
    """A Hugging Face directory of ``tensors`` (default: the tiny random ones), in one file or,
    with ``shards`` (a number), in that many files plus an index."""
    tensors = tiny_tensors(cfg) if tensors is None else tensors
    return save_hf_dir(directory, cfg, tensors, shards)


def write_tiny_gguf(path, cfg=TINY, tensors=None):
    """A float32 GGUF of the tiny tensors, laid out as llama.cpp's converter writes them
    (llama.cpp names, Q and K rows permuted)."""
    write_gguf(path, cfg, tensors, types=lambda _: "F32", key_length=True, extra=False)
    return path


def rope_rotate_half(x, pos, theta):
    """HF Llama RoPE on (..., heads, dh): pairs (i, i + dh/2)."""
    dh = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, dh, 2) / dh)
    cos, sin = np.concatenate([np.cos(ang)] * 2), np.concatenate([np.sin(ang)] * 2)
    rot = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], axis=-1)
    return x * cos + rot * sin


def rope_interleaved(x, pos, theta):
    """llama.cpp's normal RoPE on (..., heads, dh): pairs (2i, 2i + 1)."""
    dh = x.shape[-1]
    ang = pos * theta ** (-np.arange(0, dh, 2) / dh)
    x0, x1 = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * np.cos(ang) - x1 * np.sin(ang)
    out[..., 1::2] = x0 * np.sin(ang) + x1 * np.cos(ang)
    return out


@pytest.fixture(scope="module")
def smollm2():
    from models.checkpoints.fetch import model_path

    return model_path("smollm2")


@pytest.fixture(scope="module")
def smol(smollm2):
    return open_checkpoint(str(smollm2))


# -- Q/K permutation ---------------------------------------------------------------------------


@pytest.mark.parametrize("n_heads,n_kv,dh", [(9, 3, 64), (8, 2, 16), (4, 4, 8)])
def test_unpermute_inverts_llama_cpp_permute(n_heads, n_kv, dh):
    rs = np.random.RandomState(0)
    wq = rs.randn(n_heads * dh, 12)
    wk = rs.randn(n_kv * dh, 12)
    assert not np.array_equal(llama_cpp_permute(wq, n_heads, n_heads), wq)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(wq, n_heads, n_heads), n_heads),
                                  wq)
    np.testing.assert_array_equal(unpermute_qk(llama_cpp_permute(wk, n_heads, n_kv), n_kv), wk)
    np.testing.assert_array_equal(llama_cpp_permute(unpermute_qk(wk, n_kv), n_heads, n_kv), wk)


@pytest.mark.parametrize("n_heads,n_kv,dh", [(9, 3, 64), (8, 2, 16)])
def test_rope_rotate_half_equals_interleaved_on_permuted_rows(n_heads, n_kv, dh):
    """HF's rotate-half RoPE of W x equals, after un-permuting, llama.cpp's interleaved RoPE of
    permute(W) x; and the attention scores agree."""
    rs = np.random.RandomState(1)
    d, theta = 32, 1e5
    wq, wk = rs.randn(n_heads * dh, d), rs.randn(n_kv * dh, d)
    x, y = rs.randn(d), rs.randn(d)
    pq, pk = llama_cpp_permute(wq, n_heads, n_heads), llama_cpp_permute(wk, n_heads, n_kv)
    for pos in (0, 1, 7, 300):
        hf_q = rope_rotate_half((wq @ x).reshape(n_heads, dh), pos, theta)
        gg_q = rope_interleaved((pq @ x).reshape(n_heads, dh), pos, theta)
        np.testing.assert_allclose(unpermute_qk(gg_q.reshape(-1), n_heads), hf_q.reshape(-1),
                                   rtol=1e-12, atol=1e-12)
        hf_k = rope_rotate_half((wk @ y).reshape(n_kv, dh), pos + 3, theta)
        gg_k = rope_interleaved((pk @ y).reshape(n_kv, dh), pos + 3, theta)
        np.testing.assert_allclose(unpermute_qk(gg_k.reshape(-1), n_kv), hf_k.reshape(-1),
                                   rtol=1e-12, atol=1e-12)
        g = n_heads // n_kv
        hf_s = np.einsum("hd,hd->h", hf_q, np.repeat(hf_k, g, axis=0))
        gg_s = np.einsum("hd,hd->h", gg_q, np.repeat(gg_k, g, axis=0))
        np.testing.assert_allclose(hf_s, gg_s, rtol=1e-10)
    # without the un-permutation, the two RoPEs differ: the permutation matters
    hf_q = rope_rotate_half((wq @ x).reshape(n_heads, dh), 5, theta)
    assert not np.allclose(rope_interleaved((wq @ x).reshape(n_heads, dh), 5, theta), hf_q)


def test_tiny_gguf_reads_hf_layout(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    ckpt = open_checkpoint(str(path))
    assert ckpt.config == TINY
    assert ckpt.tokenizer is None
    want = tiny_tensors()
    assert set(ckpt.names()) == set(want)
    for name, arr in want.items():
        assert ckpt.shape(name) == arr.shape
        np.testing.assert_array_equal(ckpt.read(name), arr, err_msg=name)
    q = "model.layers.1.self_attn.q_proj.weight"
    np.testing.assert_array_equal(ckpt.read(q, (slice(16, 48), slice(3, 9))), want[q][16:48, 3:9])


# -- safetensors ------------------------------------------------------------------------------


@pytest.mark.parametrize("shards,half", [(None, False), (3, False), (None, True)])
def test_tiny_safetensors(tmp_path, shards, half):
    """One file or sharded with an index; float32, or float32 and float16 mixed."""
    want = tiny_tensors()
    if half:
        want = {n: (a.astype(np.float16) if i % 2 else a) for i, (n, a) in enumerate(want.items())}
    ckpt = open_checkpoint(str(write_hf(tmp_path / "hf", tensors=want, shards=shards)))
    assert ckpt.config == TINY and ckpt.tokenizer is None
    assert set(ckpt.names()) == set(want)
    for name, arr in want.items():
        assert ckpt.shape(name) == arr.shape
        got = ckpt.read(name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, arr.astype(np.float32), err_msg=name)
    name = "model.layers.0.mlp.down_proj.weight"  # float32 in both cases
    idx = (slice(None), slice(25, 50))
    np.testing.assert_array_equal(ckpt.read(name, idx), want[name][idx])
    np.testing.assert_array_equal(ckpt.read(name, (slice(10, 20),)), want[name][10:20])


# -- errors -----------------------------------------------------------------------------------


def test_missing_path():
    with pytest.raises(FileNotFoundError, match=r"no/such/model\.gguf.*smollm2"):
        open_checkpoint("/no/such/model.gguf")


def test_truncated_tiny_gguf(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    for cut in (len(data) - 100, len(data) // 2, 1000, 10):
        bad = tmp_path / f"cut{cut}.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=r"cut\d+\.gguf.*truncated or corrupt"):
            open_checkpoint(str(bad))


@pytest.mark.parametrize("shards", [None, 2])
def test_truncated_safetensors(tmp_path, shards):
    d = write_hf(tmp_path / "hf", shards=shards)
    victim = sorted(d.glob("*.safetensors"))[-1]
    data = victim.read_bytes()
    for cut in (len(data) - 4, len(data) // 2, 100, 4):
        victim.write_bytes(data[:cut])
        with pytest.raises(CheckpointError, match=rf"{victim.name}.*truncated or corrupt"):
            open_checkpoint(str(d))


def test_wrong_shape_tensor(tmp_path):
    t = tiny_tensors()
    name = "model.layers.1.self_attn.k_proj.weight"
    t[name] = np.zeros((16, 64), np.float32)
    d = write_hf(tmp_path / "hf", tensors=t)
    with pytest.raises(CheckpointError,
                       match=r"model\.layers\.1\.self_attn\.k_proj\.weight.*\(16, 64\).*"
                             r"expected \(32, 64\)"):
        open_checkpoint(str(d))


@pytest.mark.parametrize("fmt", ["safetensors", "gguf"])
def test_missing_tensor(tmp_path, fmt):
    t = tiny_tensors()
    del t["model.layers.1.mlp.gate_proj.weight"]
    if fmt == "gguf":
        path = write_tiny_gguf(tmp_path / "tiny.gguf", tensors=t)
    else:
        path = write_hf(tmp_path / "hf", tensors=t)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.gate_proj"):
        open_checkpoint(str(path))


def test_untied_needs_lm_head(tmp_path):
    cfg = LlamaConfig(**{**TINY.__dict__, "tie_embeddings": False})
    assert "lm_head.weight" in expected_shapes(cfg)
    t = tiny_tensors(cfg)
    ckpt = open_checkpoint(str(write_tiny_gguf(tmp_path / "untied.gguf", cfg, t)))
    assert ckpt.config.tie_embeddings is False
    np.testing.assert_array_equal(ckpt.read("lm_head.weight"), t["lm_head.weight"])
    del t["lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"missing tensor lm_head\.weight"):
        open_checkpoint(str(write_hf(tmp_path / "hf", cfg, t)))


# -- the real model ---------------------------------------------------------------------------


@pytest.mark.model
def test_smollm2_config(smol):
    c = smol.config
    assert (c.n_layers, c.d_model, c.n_heads, c.n_kv_heads, c.head_dim, c.ffn_dim,
            c.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert c.rope_theta == 1e5 and c.rms_eps == 1e-5 and c.tie_embeddings
    assert c.bos_token_id == 1 and c.eos_token_ids == (2,) and c.max_seq_len == 8192
    assert "lm_head.weight" not in smol.names()
    emb = smol.read("model.embed_tokens.weight", (slice(100, 104),))
    assert emb.shape == (4, 576) and emb.dtype == np.float32 and np.isfinite(emb).all()


@pytest.mark.model
def test_smollm2_truncated(smollm2, tmp_path):
    bad = tmp_path / "smollm2-cut.gguf"
    with open(smollm2, "rb") as f:
        bad.write_bytes(f.read(1 << 20))  # the first MB
    with pytest.raises(CheckpointError, match=r"smollm2-cut\.gguf.*truncated or corrupt"):
        open_checkpoint(str(bad))


@pytest.mark.model
def test_convert_gguf_round_trip(smol, smollm2, tmp_path):
    from models.convert import main

    out = tmp_path / "hf"
    assert main([str(smollm2), str(out), "--max-shard-mb", "100"]) == 0
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert not (out / "model.safetensors").exists()
    hf = open_checkpoint(str(out))
    assert hf.config == smol.config
    assert set(hf.names()) == set(expected_shapes(smol.config))
    for name in expected_shapes(smol.config):
        np.testing.assert_array_equal(hf.read(name), smol.read(name), err_msg=name)
    k = "model.layers.7.self_attn.k_proj.weight"
    idx = (slice(64, 128), slice(100, 300))
    np.testing.assert_array_equal(hf.read(k, idx), smol.read(k, idx))
    # the tokenizer survives the trip
    text = "Hi there 42!\n<|im_start|>user"
    assert hf.tokenizer.encode(text) == smol.tokenizer.encode(text)
    msgs = [{"role": "user", "content": "Hi"}]
    assert hf.tokenizer.apply_chat_template(msgs) == smol.tokenizer.apply_chat_template(msgs)
    assert (hf.tokenizer.bos_id, hf.tokenizer.eos_ids) == (1, (2,))
    shutil.rmtree(out)


TEXTS = [  # digits, punctuation, newlines / tabs / runs of spaces, unicode, code, chat markup
    "  leading spaces, math ∑∫√ x**2, emoji 😀👍🏽 and trailing   ",
    "In 1969, Apollo 11 landed on the Moon; 600 million people (about 1/5 of the world's 3.6 "
    "billion) watched. Armstrong's words: \"That's one small step for [a] man...\"\n\n"
    "Costs: $25.4B (~$152,000,000,000 in 2019 dollars), i.e. 0.57% of GDP!",
    "Résumé of naïve coöperation: the café's crème brûlée cost €4,50 — or £3.99? "
    "Ελληνικά, русский текст, 中文分词测试，日本語のテキスト、한국어 문장. "
    "🚀✨👩‍💻 ok.\r\n"
    "\ttab\tseparated\tvalues\n   indented by three\n\n\n",
    "def fib(n: int) -> int:\n    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b"
    "\n    return a  # fib(10) == 55\n\nprint(f\"{fib(30):,}\")  # 832,040\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 17*23? "
    "Answer in 1 line.<|im_end|>\n<|im_start|>assistant\n17*23 = 391.<|im_end|>\n",
    "I'm sure they'll've DONE it, isn't it?? ... --- '''quoted''' <tag attr=\"1\"/> a_b-c.d "
    "URL: https://example.com/path?q=1&r=2#frag  email@host.org   trailing  ",
]


@pytest.mark.model
def test_tokenizer_round_trip_and_special_tokens(smol):
    tok = smol.tokenizer
    assert tok.bos_id == 1 and tok.eos_ids == (2,) and tok.vocab_size == 49152
    for text in TEXTS:
        ids = tok.encode(text)
        assert all(0 <= i < tok.vocab_size for i in ids)
        assert tok.decode(ids) == text
    assert tok.encode("hi", add_bos=True)[0] == 1
    # digits are split one by one (the smollm pre-tokenizer)
    assert len(tok.encode("12345")) == 5
    # control tokens are special: one id each, skippable on decode
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    ids = tok.encode("<|im_start|>assistant\nOK<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\nOK"


@pytest.mark.model
def test_chat_template(smol):
    tok = smol.tokenizer
    assert tok.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n")


@pytest.mark.model
def test_tokenizer_matches_transformers(smol, smollm2, tmp_path):
    """Token for token against transformers' GGUF tokenizer (built by the converter that
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` uses; metadata read with ``gguf``, as
    transformers 5's GGUF reader imports torch). Where the two differ (non-ASCII numerals:
    transformers has no ``smollm`` split) ours splits like llama.cpp's ``\\p{N}``."""
    pytest.importorskip("transformers")
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    except ImportError as e:  # transformers < 5 keeps these elsewhere
        pytest.skip(f"transformers has no gguf_tokenizer_mapping: {e}")
    import gguf

    fields = gguf.GGUFReader(smollm2).fields
    ref = convert_gguf_tokenizer("llama", {
        name: fields[f"tokenizer.{key}"].contents()
        for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items()
        if f"tokenizer.{key}" in fields})[0]
    tok = smol.tokenizer
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=False) == text
    # what Tokenizer.save writes (models.convert's tokenizer files) loads in transformers as is
    from transformers import AutoTokenizer

    tok.save(tmp_path)
    saved = AutoTokenizer.from_pretrained(str(tmp_path))
    for text in [*TEXTS, " ²³ ٣٤ Ⅻ"]:
        assert saved.encode(text, add_special_tokens=False) == tok.encode(text), text
    # non-ASCII numerals: each its own pre-token (llama.cpp smollm / HF Digits), never merged
    # with the space before it (transformers' GGUF converter, falling back to GPT-2's split, does)
    assert tok.encode(" ²³") == tok.encode(" ") + tok.encode("²") + tok.encode("³")
    # the chat template renders as transformers renders it
    for msgs in ([{"role": "user", "content": "Hi"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
                  {"role": "assistant", "content": "4"}, {"role": "user", "content": "Why?"}]):
        for gen in (True, False):
            assert tok.apply_chat_template(msgs, add_generation_prompt=gen) == \
                saved.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)


def test_convert_bfloat16(tmp_path):
    import ml_dtypes

    from models.convert import main

    src = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "hf"
    assert main([str(src), str(out), "--dtype", "bfloat16", "--max-shard-mb", "0.05"]) == 0
    assert len(list(out.glob("model-*-of-*.safetensors"))) > 1
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    hf = open_checkpoint(str(out))
    assert hf.config == TINY
    for name, arr in tiny_tensors().items():
        want = arr.astype(ml_dtypes.bfloat16).astype(np.float32)
        np.testing.assert_array_equal(hf.read(name), want, err_msg=name)
    name = "model.layers.1.mlp.down_proj.weight"
    np.testing.assert_array_equal(hf.read(name, (slice(5, 9), slice(40, 80))),
                                  tiny_tensors()[name].astype(ml_dtypes.bfloat16)
                                  .astype(np.float32)[5:9, 40:80])
