"""A tiny random Llama checkpoint in Hugging Face layout, in memory or written as safetensors,
for the model tests (8 query heads, 2 KV heads: TP 4 and 8 replicate KV heads; an MLP width
and a vocabulary that TP 8 does not divide, so both are padded).

Tiny configs of the other architectures (tests/models/test_families.py):

* :data:`QWEN2`: 12 query / 2 KV heads (TP 1, 2, 3, 4, 6: at TP 3 the middle rank holds both KV
  heads), an MLP width (70) and a vocabulary (101) that TP 4 and 6 do not divide, an untied LM
  head; :func:`tiny_tensors` adds the q/k/v biases.
* :data:`GEMMA3`: 4 query / 1 KV head of 16 (``head_dim`` independent of ``d_model / n_heads``),
  a window of 4 with every 3rd layer global over 4 layers (sliding, sliding, global, sliding),
  a query scalar (24) that is not ``head_dim``; :func:`tiny_tensors` adds QK-norms and the
  pre/post feed-forward norms, all Gemma norm weights near 0 (HF scales by ``1 + w``), the
  embedding rows of norm ~1 (the model scales them by ``sqrt(d_model)``).
* :data:`GEMMA3_GGUF`: the Gemma 3 a GGUF can describe (llama.cpp fixes the sliding pattern at
  6, the local RoPE base at 10000 and the query scalar at ``head_dim``): 7 layers, layer 5 global.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from models.checkpoints.base import Checkpoint
from models.checkpoints.llama_config import LlamaConfig

TINY = LlamaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2,
                   head_dim=16, ffn_dim=100, rope_theta=10000.0, rms_eps=1e-5,
                   tie_embeddings=True, max_seq_len=256, bos_token_id=1, eos_token_ids=(2,))

QWEN2 = LlamaConfig.for_arch("qwen2", vocab_size=101, d_model=96, n_layers=2, n_heads=12,
                             n_kv_heads=2, head_dim=8, ffn_dim=70, rope_theta=1e6, rms_eps=1e-6,
                             tie_embeddings=False, max_seq_len=64, bos_token_id=1,
                             eos_token_ids=(2,))
GEMMA3 = LlamaConfig.for_arch("gemma3", vocab_size=61, d_model=32, n_layers=4, n_heads=4,
                              n_kv_heads=1, head_dim=16, ffn_dim=50, rope_theta=1e6,
                              rms_eps=1e-6, tie_embeddings=True, max_seq_len=64, bos_token_id=1,
                              eos_token_ids=(2,), sliding_window=4, sliding_pattern=3,
                              rope_local_theta=10000.0, query_pre_attn_scalar=24.0)
GEMMA3_GGUF = dataclasses.replace(GEMMA3, n_layers=7, sliding_pattern=6,
                                  query_pre_attn_scalar=16.0)


def tiny_tensors(cfg: LlamaConfig = TINY, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of ``cfg`` in HF names and (out, in) layout, float32, random: with the
    architecture's extra tensors (``qkv_bias``: q/k/v biases; ``qk_norm``: ``self_attn.q_norm`` /
    ``k_norm``; ``sandwich_norms``: ``pre_feedforward_layernorm`` and
    ``post_feedforward_layernorm``, ``post_attention_layernorm`` then being the attention output's
    norm). Norm weights are ``1 + 0.1 N(0, 1)``, but ``0.1 N(0, 1)`` for Gemma 3, whose HF norms
    scale by ``1 + w``; with ``embed_scale`` the embedding is ``N(0, 1) / sqrt(d_model)``. A Llama
    config draws exactly the tensors it always did."""
    rs = np.random.RandomState(seed)
    d, dh, f, v = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    hq, hkv = cfg.n_heads * dh, cfg.n_kv_heads * dh
    base = 0.0 if cfg.arch == "gemma3" else 1.0
    # Gemma 3 multiplies the embeddings by sqrt(d_model): rows of norm ~1 give a first residual
    # of rms ~1, as large as each sub-block's normalised output (so the context steers the
    # continuation), and the tied head logits of order 1.
    embed_std = 1 / np.sqrt(d) if cfg.embed_scale else 1.0
    t = {"model.embed_tokens.weight": embed_std * rs.randn(v, d),
         "model.norm.weight": base + 0.1 * rs.randn(d)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rs.randn(v, d) / np.sqrt(d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = base + 0.1 * rs.randn(d)
        t[p + "post_attention_layernorm.weight"] = base + 0.1 * rs.randn(d)
        t[p + "self_attn.q_proj.weight"] = rs.randn(hq, d) / np.sqrt(d)
        t[p + "self_attn.k_proj.weight"] = rs.randn(hkv, d) / np.sqrt(d)
        t[p + "self_attn.v_proj.weight"] = rs.randn(hkv, d) / np.sqrt(d)
        t[p + "self_attn.o_proj.weight"] = rs.randn(d, hq) / np.sqrt(hq)
        t[p + "mlp.gate_proj.weight"] = rs.randn(f, d) / np.sqrt(d)
        t[p + "mlp.up_proj.weight"] = rs.randn(f, d) / np.sqrt(d)
        t[p + "mlp.down_proj.weight"] = rs.randn(d, f) / np.sqrt(f)
        if cfg.qkv_bias:
            for proj, n in (("q", hq), ("k", hkv), ("v", hkv)):
                t[p + f"self_attn.{proj}_proj.bias"] = 0.5 * rs.randn(n)
        if cfg.qk_norm:
            t[p + "self_attn.q_norm.weight"] = base + 0.1 * rs.randn(dh)
            t[p + "self_attn.k_norm.weight"] = base + 0.1 * rs.randn(dh)
        if cfg.sandwich_norms:
            t[p + "pre_feedforward_layernorm.weight"] = base + 0.1 * rs.randn(d)
            t[p + "post_feedforward_layernorm.weight"] = base + 0.1 * rs.randn(d)
    return {k: np.ascontiguousarray(a, np.float32) for k, a in t.items()}


class DictCheckpoint(Checkpoint):
    """The checkpoint interface over a dict of arrays (no file, no tokenizer)."""

    def __init__(self, cfg: LlamaConfig = TINY, tensors=None):
        self.config, self.tokenizer = cfg, None
        self.tensors = tensors if tensors is not None else tiny_tensors(cfg)

    def names(self):
        return list(self.tensors)

    def shape(self, name):
        return tuple(self.tensors[name].shape)

    def read(self, name, index=()):
        return np.asarray(self.tensors[name][index], np.float32)
