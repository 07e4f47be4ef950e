"""A tiny random Llama checkpoint in Hugging Face layout, in memory or written as safetensors,
for the model tests (8 query heads, 2 KV heads: TP 4 and 8 replicate KV heads; an MLP width
and a vocabulary that TP 8 does not divide, so both are padded)."""

from __future__ import annotations

import numpy as np

from models.checkpoints.llama_config import LlamaConfig

TINY = LlamaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=8, n_kv_heads=2,
                   head_dim=16, ffn_dim=100, rope_theta=10000.0, rms_eps=1e-5,
                   tie_embeddings=True, max_seq_len=256, bos_token_id=1, eos_token_ids=(2,))


def tiny_tensors(cfg: LlamaConfig = TINY, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of ``cfg`` in HF names and (out, in) layout, float32, random."""
    rs = np.random.RandomState(seed)
    d, dh, f, v = cfg.d_model, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    hq, hkv = cfg.n_heads * dh, cfg.n_kv_heads * dh
    t = {"model.embed_tokens.weight": rs.randn(v, d), "model.norm.weight": 1 + 0.1 * rs.randn(d)}
    if not cfg.tie_embeddings:
        t["lm_head.weight"] = rs.randn(v, d) / np.sqrt(d)
    for i in range(cfg.n_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = 1 + 0.1 * rs.randn(d)
        t[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rs.randn(d)
        t[p + "self_attn.q_proj.weight"] = rs.randn(hq, d) / np.sqrt(d)
        t[p + "self_attn.k_proj.weight"] = rs.randn(hkv, d) / np.sqrt(d)
        t[p + "self_attn.v_proj.weight"] = rs.randn(hkv, d) / np.sqrt(d)
        t[p + "self_attn.o_proj.weight"] = rs.randn(d, hq) / np.sqrt(hq)
        t[p + "mlp.gate_proj.weight"] = rs.randn(f, d) / np.sqrt(d)
        t[p + "mlp.up_proj.weight"] = rs.randn(f, d) / np.sqrt(d)
        t[p + "mlp.down_proj.weight"] = rs.randn(d, f) / np.sqrt(f)
    return {k: np.ascontiguousarray(a, np.float32) for k, a in t.items()}


class DictCheckpoint:
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
