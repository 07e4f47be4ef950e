"""The hyper-parameters of a Llama-architecture decoder, read from a checkpoint."""

from __future__ import annotations

import dataclasses

__all__ = ["LlamaConfig"]


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """What the model code needs to know about a Llama-architecture checkpoint.

    Field names follow the model code; :meth:`from_hf` / :meth:`to_hf` map them to the keys of a
    Hugging Face ``config.json`` (``LlamaForCausalLM``).
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    tie_embeddings: bool = True
    max_seq_len: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
                     "ffn_dim", "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name} must be a positive int, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (RoPE)")

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """From the dict of a Hugging Face ``config.json``."""
        try:
            n_heads = d["num_attention_heads"]
            eos = d.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (
                () if eos is None else (eos,))
            return cls(
                vocab_size=d["vocab_size"], d_model=d["hidden_size"],
                n_layers=d["num_hidden_layers"], n_heads=n_heads,
                n_kv_heads=d.get("num_key_value_heads", n_heads),
                head_dim=d.get("head_dim") or d["hidden_size"] // n_heads,
                ffn_dim=d["intermediate_size"], rope_theta=float(d.get("rope_theta", 10000.0)),
                rms_eps=float(d.get("rms_norm_eps", 1e-5)),
                tie_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_seq_len=d.get("max_position_embeddings", 2048),
                bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids)
        except KeyError as e:
            raise ValueError(f"config.json: missing key {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """The Hugging Face ``config.json`` dict of this config."""
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": self.vocab_size, "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps, "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len, "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1
                             else self.eos_token_ids[0]),
            "torch_dtype": "float32",
        }
