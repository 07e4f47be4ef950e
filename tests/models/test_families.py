"""long file: a float64 reference of two architectures and the tests that hold the model to it.

Qwen2 and Gemma 3 in the Llama-family decoder, on tiny random checkpoints (no real files):
the model against an independent float64 NumPy forward written from Hugging Face's definitions
(Qwen2ForCausalLM, Gemma3ForCausalLM), from a synthetic GGUF and a synthetic HF directory; TP
sizes against TP=1 (scoring, and prefill + decode through the KV cache past the sliding window);
the fused all-reduce + RMSNorm path; the loader's errors for these architectures.

Configs (tests/support/tiny_llama.py): ``QWEN2`` (12 query / 2 KV heads: TP 1, 2, 3, 4, 6, at 3
the middle rank holds both KV heads; padded MLP and vocabulary; untied head), ``GEMMA3`` (4 / 1
heads of 16 with d_model 32; window 4, every 3rd of 4 layers global; query scalar 24) and
``GEMMA3_GGUF`` (what a GGUF can say: pattern 6 over 7 layers, query scalar = head_dim).

Tolerance. The model runs in f32, the reference in f64; both evaluate the same function, so their
difference is the f32 rounding of the model: a few f32 ulps of the logits' scale per layer over
these 2-7 layer networks (measured: 1e-7 to 1.1e-6 of max |logit|, TP=1 to 6, scoring and
decode). ``TOL = 2e-5 * max |logit|`` leaves a margin of over 15x above that, and
:func:`test_tiny_configs_exercise_every_feature` shows that leaving out any one feature of an
architecture (a bias, the ``1 + w`` of the norms, the window, the local RoPE base, ...) moves the
logits by over 100x ``TOL``, so a model missing one cannot pass. Exact TP runs reassociate f32
sums across ranks: they are held to the same ``TOL`` against the reference and against TP=1.
"""

from __future__ import annotations

import dataclasses
import json
import math

import jax
import numpy as np
import pytest

import jax_flashcomm as fc
from jax_flashcomm import CommConfig
from jax_flashcomm.nn import TPComm
from models.checkpoints import CheckpointError, open_checkpoint
from models.checkpoints.llama_config import LlamaConfig
from models.engine import Engine
from models.llama.params import load_model
from tests.support.checkpoint_files import gguf_names, write_gguf, write_hf
from tests.support.tiny_llama import GEMMA3, GEMMA3_GGUF, QWEN2, DictCheckpoint, tiny_tensors

CONFIGS = {"qwen2": QWEN2, "gemma3": GEMMA3, "gemma3_gguf": GEMMA3_GGUF}
TENSORS = {name: tiny_tensors(cfg) for name, cfg in CONFIGS.items()}
# 14 positions: the window of 4 cuts every sliding layer's attention many times over.
TOKENS = {name: np.random.RandomState(7).randint(0, cfg.vocab_size, size=(2, 14)).astype(np.int32)
          for name, cfg in CONFIGS.items()}
REL_TOL = 2e-5
F32 = dict(types=lambda _: "F32", extra=False)


# --- the reference: float64 NumPy, from the Hugging Face definitions ------------------------

def _rms_norm(x, w, eps, gemma):
    """HF LlamaRMSNorm / Qwen2RMSNorm: ``x / sqrt(mean(x^2) + eps) * w``; Gemma3RMSNorm:
    ``* (1 + w)``."""
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * ((1.0 + w) if gemma else w)


def _rope(x, positions, theta):
    """Rotate-half RoPE of ``x (S, heads, dh)`` with ``inv_freq = 1 / theta^(2i / dh)``."""
    dh = x.shape[-1]
    inv_freq = 1.0 / theta ** (np.arange(0, dh, 2, dtype=np.float64) / dh)
    angles = positions[:, None].astype(np.float64) * inv_freq[None, :]
    cos = np.cos(np.concatenate([angles, angles], -1))[:, None, :]
    sin = np.sin(np.concatenate([angles, angles], -1))[:, None, :]
    rotated = np.concatenate([-x[..., dh // 2:], x[..., :dh // 2]], axis=-1)
    return x * cos + rotated * sin


def _act(x, name):
    if name == "silu":
        return x / (1.0 + np.exp(-x))
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@dataclasses.dataclass(frozen=True)
class Spec:
    """The architecture the reference computes: each feature can be switched off alone (the
    knock-outs of :func:`test_tiny_configs_exercise_every_feature`)."""

    gemma: bool
    bias: bool
    qk_norm: bool
    sandwich: bool
    embed_scale: bool
    window: int
    pattern: int
    local_theta: float
    scale: float
    activation: str

    @classmethod
    def of(cls, cfg: LlamaConfig) -> "Spec":
        """The HF semantics of the family ``cfg.arch`` names, from the hyper-parameters alone
        (none of the config's feature helpers)."""
        if cfg.arch == "qwen2":
            return cls(False, True, False, False, False, 0, 0, cfg.rope_theta,
                       cfg.head_dim ** -0.5, "silu")
        assert cfg.arch == "gemma3"
        return cls(True, False, True, True, True, cfg.sliding_window, cfg.sliding_pattern,
                   cfg.rope_local_theta, (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5,
                   "gelu_tanh")


def reference_logits(cfg: LlamaConfig, t: dict, tokens, spec: Spec | None = None):
    """Logits ``(S, V)`` (f64) of one sequence ``tokens (S,)`` of HF's Qwen2ForCausalLM /
    Gemma3ForCausalLM with the HF-layout tensors ``t``."""
    s = spec or Spec.of(cfg)
    t = {k: np.asarray(v, np.float64) for k, v in t.items()}
    eps, dh, hq, hkv = cfg.rms_eps, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads
    n = len(tokens)
    pos = np.arange(n)
    x = t["model.embed_tokens.weight"][np.asarray(tokens)]
    if s.embed_scale:
        x = x * math.sqrt(cfg.d_model)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."

        def lin(name, a, bias=False):
            out = a @ t[p + name + ".weight"].T
            return out + t[p + name + ".bias"] if bias else out

        def norm(name, a):
            return _rms_norm(a, t[p + name + ".weight"], eps, s.gemma)

        sliding = s.window > 0 and s.pattern > 0 and (i + 1) % s.pattern != 0
        theta = s.local_theta if sliding else cfg.rope_theta
        residual, h = x, norm("input_layernorm", x)
        q = lin("self_attn.q_proj", h, s.bias).reshape(n, hq, dh)
        k = lin("self_attn.k_proj", h, s.bias).reshape(n, hkv, dh)
        v = lin("self_attn.v_proj", h, s.bias).reshape(n, hkv, dh)
        if s.qk_norm:
            q, k = norm("self_attn.q_norm", q), norm("self_attn.k_norm", k)
        q, k = _rope(q, pos, theta), _rope(k, pos, theta)
        group = hq // hkv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)   # head j: KV j // group
        scores = np.einsum("qhd,khd->hqk", q, k) * s.scale
        seen = pos[None, :] <= pos[:, None]
        if sliding:
            seen &= pos[:, None] - pos[None, :] < s.window
        scores = np.where(seen[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = lin("self_attn.o_proj", np.einsum("hqk,khd->qhd", probs, v).reshape(n, hq * dh))
        if s.sandwich:
            attn = norm("post_attention_layernorm", attn)
        x = residual + attn
        residual = x
        h = norm("pre_feedforward_layernorm" if s.sandwich else "post_attention_layernorm", x)
        m = lin("mlp.down_proj", _act(lin("mlp.gate_proj", h), s.activation)
                * lin("mlp.up_proj", h))
        if s.sandwich:
            m = norm("post_feedforward_layernorm", m)
        x = residual + m
    x = _rms_norm(x, t["model.norm.weight"], eps, s.gemma)
    head = t["lm_head.weight"] if "lm_head.weight" in t else t["model.embed_tokens.weight"]
    return x @ head.T


def reference_batch(name, tokens=None):
    tokens = TOKENS[name] if tokens is None else tokens
    return np.stack([reference_logits(CONFIGS[name], TENSORS[name], row) for row in tokens])


def reference_greedy(name, prompt, steps):
    """The reference's greedy continuation of ``prompt`` (recomputing the whole sequence each
    step), and the smallest top-1 / top-2 logit gap along it."""
    seq, gaps = list(prompt), []
    for _ in range(steps):
        last = reference_logits(CONFIGS[name], TENSORS[name], seq)[-1]
        top2 = np.sort(last)[-2:]
        gaps.append(top2[1] - top2[0])
        seq.append(int(np.argmax(last)))
    return seq[len(prompt):], min(gaps)


def reference_greedy_without_window(name, prompt, steps):
    cfg, seq = CONFIGS[name], list(prompt)
    spec = dataclasses.replace(Spec.of(cfg), window=0)
    for _ in range(steps):
        seq.append(int(np.argmax(reference_logits(cfg, TENSORS[name], seq, spec)[-1])))
    return seq[len(prompt):]


def tol(ref):
    return REL_TOL * np.abs(ref).max()


# --- engines (cached per worker: each compiles its steps once) ------------------------------

_ENGINES: dict = {}


def engine(name, tp, comm=None, ckpt=None, cache_len=32):
    key = (name, tp, comm, None if ckpt is None else id(ckpt))
    if key not in _ENGINES:
        mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
        ckpt = ckpt or DictCheckpoint(CONFIGS[name], TENSORS[name])
        model, _ = load_model(None, tp=tp, mesh=mesh, comm=comm, ckpt=ckpt)
        _ENGINES[key] = Engine(model, mesh, cache_len=cache_len)
    return _ENGINES[key]


def score(name, tp, comm=None):
    return np.asarray(engine(name, tp, comm).score(TOKENS[name]), np.float64)


def same_config(a: LlamaConfig, b: LlamaConfig) -> bool:
    """Equal configs up to how the query scale is spelled (0 or head_dim: the same scale)."""
    return (dataclasses.replace(a, query_pre_attn_scalar=a.query_scale)
            == dataclasses.replace(b, query_pre_attn_scalar=b.query_scale))


# --- the tiny configs and the reference ----------------------------------------------------

KNOCKOUTS = {
    "qwen2": {"no q/k/v bias": dict(bias=False)},
    "gemma3": {"norms scale by w, not 1 + w": dict(gemma=False),
               "no QK-norm": dict(qk_norm=False),
               "no post-sub-block norms": dict(sandwich=False),
               "no embedding scale": dict(embed_scale=False),
               "no sliding window": dict(window=0),
               "window one wider": dict(window=GEMMA3.sliding_window + 1),
               "every layer sliding": dict(pattern=GEMMA3.n_layers + 1),
               "local RoPE base = global": dict(local_theta=GEMMA3.rope_theta),
               "scale 1 / sqrt(head_dim)": dict(scale=GEMMA3.head_dim ** -0.5),
               "SwiGLU, not GeGLU": dict(activation="silu")},
}


@pytest.mark.parametrize("name", ["qwen2", "gemma3"])
def test_tiny_configs_exercise_every_feature(name):
    """Each feature of the family changes the reference logits by far more than ``TOL`` on these
    configs and tokens (so a model that lacks it fails the comparisons below), and the HF config
    round trip keeps every field."""
    cfg = CONFIGS[name]
    full = reference_batch(name)
    for label, change in KNOCKOUTS[name].items():
        spec = dataclasses.replace(Spec.of(cfg), **change)
        other = np.stack([reference_logits(cfg, TENSORS[name], row, spec)
                          for row in TOKENS[name]])
        assert np.abs(other - full).max() > 100 * tol(full), label
    assert LlamaConfig.from_hf(json.loads(json.dumps(cfg.to_hf()))) == cfg


# --- GGUF and HF files ---------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2", "gemma3_gguf"])
def test_gguf_holds_what_was_written(tmp_path, name):
    """The file, read with gguf-py alone, holds llama.cpp's layout of the tensors (names of the
    architecture, Gemma norms as ``1 + w``, Q / K rows not permuted, biases F32); the reader gives
    back the HF tensors (the ``- 1`` within one f32 rounding of 1) and the config."""
    import gguf

    cfg, want = CONFIGS[name], TENSORS[name]
    path = tmp_path / "m.gguf"
    stored = write_gguf(path, cfg, want, **F32)
    raw = gguf.GGUFReader(path)
    field = raw.fields["general.architecture"]
    assert bytes(field.parts[field.data[0]]).decode() == cfg.arch
    tensors = {t.name: t for t in raw.tensors}
    names = {f"{g}.{kind}": f"{h}.{kind}" for g, h in gguf_names(cfg).items()
             for kind in ("weight", "bias") if f"{h}.{kind}" in want}
    assert set(tensors) == set(names) and set(names.values()) == set(want)
    gemma = cfg.arch == "gemma3"
    for g, h in names.items():
        data = np.asarray(tensors[g].data, np.float32).reshape(want[h].shape)
        shift = 1.0 if gemma and h.endswith("norm.weight") else 0.0
        np.testing.assert_array_equal(data, want[h] + np.float32(shift), err_msg=g)
        if h.endswith(".bias"):
            assert tensors[g].tensor_type == gguf.GGMLQuantizationType.F32
    if gemma:
        for key, value in [("attention.key_length", cfg.head_dim),
                           ("attention.value_length", cfg.head_dim),
                           ("attention.sliding_window", cfg.sliding_window)]:
            assert int(raw.fields[f"gemma3.{key}"].parts[-1][0]) == value, key
        assert "blk.0.post_ffw_norm.weight" in tensors and "blk.0.attn_k_norm.weight" in tensors
    else:
        assert "blk.1.attn_k.bias" in tensors and "output.weight" in tensors
    ckpt = open_checkpoint(str(path))
    assert same_config(ckpt.config, cfg), (ckpt.config, cfg)
    assert set(ckpt.names()) == set(want)
    for h, arr in want.items():
        got = ckpt.read(h)
        np.testing.assert_array_equal(got, stored[h], err_msg=h)
        np.testing.assert_allclose(got, arr, rtol=0, atol=2 ** -23 if gemma else 0, err_msg=h)


SOURCES = [("qwen2", "gguf"), ("qwen2", "hf"), ("gemma3", "hf"), ("gemma3_gguf", "gguf"),
           ("gemma3_gguf", "hf")]


@pytest.mark.parametrize("name,source", SOURCES, ids=[f"{n}-{s}" for n, s in SOURCES])
def test_logits_match_the_reference(tmp_path, name, source):
    """TP=1, f32, loaded from a GGUF / an HF directory: the logits of every position of two
    sequences are the f64 reference's within ``TOL``."""
    cfg = CONFIGS[name]
    if source == "gguf":
        path = tmp_path / "m.gguf"
        write_gguf(path, cfg, TENSORS[name], **F32)
    else:
        path = tmp_path / "hf"
        write_hf(path, cfg, TENSORS[name])
    ckpt = open_checkpoint(str(path))
    assert same_config(ckpt.config, cfg)
    got = np.asarray(engine(name, 1, ckpt=ckpt).score(TOKENS[name]), np.float64)
    ref = reference_batch(name)
    assert got.shape == ref.shape == (2, 14, cfg.vocab_size)
    err = np.abs(got - ref).max()
    assert err <= tol(ref), (err, tol(ref))


# --- TP sizes ------------------------------------------------------------------------------

TP_ROWS = [("qwen2", n) for n in (1, 2, 3, 4, 6)] + [("gemma3", n) for n in (1, 2, 4)]
PROMPT, STEPS = 5, 9   # positions 0 .. 13: decode steps past the window of 4


@pytest.mark.parametrize("name,tp", TP_ROWS, ids=[f"{n}-tp{t}" for n, t in TP_ROWS])
def test_tp_scores_and_generation(name, tp):
    """At each valid TP size: scoring equals TP=1 and the reference within ``TOL``; greedy
    generation (prefill, then decode steps through the KV cache) gives the reference's greedy
    tokens (so the same tokens at every TP size); and teacher-forced prefill + decode logits at
    each position are the reference's within ``TOL``."""
    ref = reference_batch(name)
    got = score(name, tp)
    assert np.abs(got - ref).max() <= tol(ref)
    if tp > 1:
        assert np.abs(got - score(name, 1)).max() <= tol(ref)

    eng = engine(name, tp)
    prompt = TOKENS[name][0, :PROMPT]
    want, gap = reference_greedy(name, prompt, STEPS)
    assert gap > 10 * tol(ref)   # no near-tie: f32 rounding cannot flip a token
    if CONFIGS[name].sliding_window:   # the window decides these tokens
        assert want != reference_greedy_without_window(name, prompt, STEPS)
    assert list(eng.generate(prompt, STEPS)) == want

    seq = np.concatenate([prompt, want])
    ref_seq = reference_logits(CONFIGS[name], TENSORS[name], seq)
    logits, cache = eng.prefill(seq[None, :PROMPT], eng.new_cache(1))
    rows = [np.asarray(logits)[0]]
    for pos in range(PROMPT, len(seq) - 1):
        _, logits, cache = eng.decode(seq[pos:pos + 1], pos, cache, jax.random.key(0))
        rows.append(np.asarray(logits)[0])
    err = np.abs(np.asarray(rows, np.float64) - ref_seq[PROMPT - 1:-1]).max()
    assert err <= tol(ref_seq), (err, tol(ref_seq))


# --- the fused all-reduce + RMSNorm ---------------------------------------------------------

FUSED_ROWS = [("qwen2", 3), ("gemma3", 4)]


@pytest.mark.parametrize("name,tp", FUSED_ROWS, ids=[f"{n}-tp{t}" for n, t in FUSED_ROWS])
def test_fused_norm_path(name, tp):
    """``TPComm(fuse_norm=True)``: exact, it runs the fused op at both sites of every block and
    gives TP=1's logits (scoring and decode; Qwen2's the unfused TP=N logits bit for bit);
    int8-quantized, it runs the quantized fused op and stays as close to the exact logits as
    the unfused quantized all-reduce does."""
    ref = reference_batch(name)
    with fc.record() as plans:
        fused = np.asarray(engine(name, tp, TPComm("exact", fuse_norm=True))
                           .score(TOKENS[name]), np.float64)
    assert sum(p.op == "psum_add_rms_norm" for p in plans) == 2
    assert np.abs(fused - score(name, 1)).max() <= tol(ref)
    assert np.abs(fused - ref).max() <= tol(ref)
    if name == "qwen2":
        # Gemma 3's differ in the last bits: XLA contracts the embedding's sqrt(d_model) scale
        # into the first RMSNorm, which the fused path runs outside the layer scan.
        np.testing.assert_array_equal(fused, score(name, tp))

    eng = engine(name, tp, TPComm("exact", fuse_norm=True))
    seq = TOKENS[name][0]
    logits, cache = eng.prefill(seq[None, :9], eng.new_cache(1))
    for pos in range(9, 12):
        _, logits, cache = eng.decode(seq[pos:pos + 1], pos, cache, jax.random.key(0))
    np.testing.assert_allclose(np.asarray(logits)[0], ref[0, 11], rtol=0, atol=tol(ref))

    config = CommConfig(bits=8, min_bytes=0)
    exact = score(name, tp)
    plain = score(name, tp, TPComm("quantized", config=config))
    with fc.record() as plans:
        quant = score(name, tp, TPComm("quantized", config=config, fuse_norm=True))
    assert any(p.op == "psum_add_rms_norm" and p.quantized for p in plans)
    err_plain, err_fused = np.abs(plain - exact).max(), np.abs(quant - exact).max()
    assert 0 < err_fused <= 2 * err_plain, (err_fused, err_plain)
    assert err_fused < 0.1 * np.abs(exact).max()


# --- the loader's errors -------------------------------------------------------------------

def test_qwen2_gguf_missing_a_bias(tmp_path):
    t = dict(TENSORS["qwen2"])
    del t["model.layers.1.self_attn.k_proj.bias"]
    write_gguf(tmp_path / "m.gguf", QWEN2, t, **F32)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.self_attn"
                                              r"\.k_proj\.bias \(expected shape \(16,\)\)"):
        open_checkpoint(str(tmp_path / "m.gguf"))


def test_unknown_gguf_architecture(tmp_path):
    write_gguf(tmp_path / "m.gguf", QWEN2, TENSORS["qwen2"], arch="mamba", **F32)
    with pytest.raises(CheckpointError, match="general.architecture is 'mamba', not one of "
                                              "'llama', 'qwen2', 'gemma3'"):
        open_checkpoint(str(tmp_path / "m.gguf"))


def test_gemma3_config_with_rope_scaling(tmp_path):
    d = write_hf(tmp_path / "hf", GEMMA3, TENSORS["gemma3"]) and tmp_path / "hf"
    config = json.loads((d / "config.json").read_text())
    config["rope_scaling"] = {"rope_type": "linear", "factor": 8.0}
    (d / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="rope_scaling = .* is not supported"):
        open_checkpoint(str(d))


def test_tp_size_not_dividing_the_query_heads():
    with pytest.raises(ValueError, match=r"TP size 5 does not divide the 12 query heads \(2 KV "
                                         r"heads\): use one of \[1, 2, 3, 4, 6, 12\]"):
        engine("qwen2", 5)
