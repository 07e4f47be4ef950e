"""The hyper-parameters of a Llama-architecture decoder, read from a checkpoint."""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["FLOAT_LIMITS", "LIMITS", "LlamaConfig", "check_float", "check_int"]

#: The inclusive range of every integer field: wide enough for any real Llama-architecture
#: model, narrow enough that a corrupt value is refused before anything is allocated from it
#: (``n_layers = 10**9`` would build a billion-layer table of expected shapes).
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "d_model": (1, 1 << 20), "n_layers": (1, 10_000),
    "n_heads": (1, 1 << 20), "n_kv_heads": (1, 1 << 20), "head_dim": (1, 1 << 20),
    "ffn_dim": (1, 1 << 20), "max_seq_len": (1, 1 << 24),
}
#: The open / closed ranges of the float fields: finite, and RoPE's base above 1 (below it the
#: "frequencies" grow with the dimension), the RMSNorm epsilon in (0, 1).
FLOAT_LIMITS: dict[str, tuple[float, float]] = {"rope_theta": (1.0, 1e12), "rms_eps": (0.0, 1.0)}


def check_int(label: str, value, lo: int, hi: int) -> int:
    """``value`` as an int if it is an integer (not a bool, not a float) in ``[lo, hi]``; else a
    ``ValueError`` naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{label} must be an integer, got {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{label} = {int(value)} is out of range [{lo}, {hi}]")
    return int(value)


def check_float(label: str, value, lo: float, hi: float) -> float:
    """``value`` as a float if it is a finite real number in ``(lo, hi]``; else a ``ValueError``
    naming ``label``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{label} must be a number, got {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{label} = {value} is not finite")
    if not lo < value <= hi:
        raise ValueError(f"{label} = {value} is out of range ({lo}, {hi}]")
    return value


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
        for name, (lo, hi) in LIMITS.items():
            check_int(f"LlamaConfig.{name}", getattr(self, name), lo, hi)
        for name, (lo, hi) in FLOAT_LIMITS.items():
            check_float(f"LlamaConfig.{name}", getattr(self, name), lo, hi)
        if not isinstance(self.tie_embeddings, bool):
            raise ValueError(f"LlamaConfig.tie_embeddings must be a bool, got "
                             f"{self.tie_embeddings!r}")
        if self.bos_token_id is not None:
            check_int("LlamaConfig.bos_token_id", self.bos_token_id, 0, self.vocab_size - 1)
        if not isinstance(self.eos_token_ids, tuple):
            raise ValueError(f"LlamaConfig.eos_token_ids must be a tuple, got "
                             f"{self.eos_token_ids!r}")
        for eos in self.eos_token_ids:
            check_int("LlamaConfig.eos_token_ids", eos, 0, self.vocab_size - 1)
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig: n_heads={self.n_heads} is not a multiple of "
                             f"n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig: head_dim={self.head_dim} must be even (RoPE)")

    @classmethod
    def from_hf(cls, d: dict) -> "LlamaConfig":
        """From the dict of a Hugging Face ``config.json``; a ``ValueError`` naming the key for
        a missing, mistyped, non-finite or out-of-range value."""
        if not isinstance(d, dict):
            raise ValueError(f"config.json must hold a JSON object, got {type(d).__name__}")

        def get(key, field, default=KeyError):
            if key not in d or (d[key] is None and default is not KeyError):
                if default is KeyError:
                    raise ValueError(f"config.json: missing key {key!r}")
                return default
            return check_int(key, d[key], *LIMITS[field])

        def get_float(key, field, default):
            return check_float(key, d.get(key, default), *FLOAT_LIMITS[field])

        d_model = get("hidden_size", "d_model")
        n_heads = get("num_attention_heads", "n_heads")
        head_dim = get("head_dim", "head_dim", None)
        if head_dim is None:
            if d_model % n_heads:
                raise ValueError(f"hidden_size = {d_model} is not a multiple of "
                                 f"num_attention_heads = {n_heads} (and no head_dim is given)")
            head_dim = d_model // n_heads
        vocab = get("vocab_size", "vocab_size")
        tie = d.get("tie_word_embeddings", False)
        if not isinstance(tie, bool):
            raise ValueError(f"tie_word_embeddings must be true or false, got "
                             f"{tie!r}")
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else (
            () if eos is None else (eos,))
        for e in eos_ids:
            check_int("eos_token_id", e, 0, vocab - 1)
        bos = d.get("bos_token_id")
        if bos is not None:
            check_int("bos_token_id", bos, 0, vocab - 1)
        n_kv = get("num_key_value_heads", "n_kv_heads", n_heads)
        if n_heads % n_kv:
            raise ValueError(f"num_attention_heads = {n_heads} is not a multiple of "
                             f"num_key_value_heads = {n_kv}")
        return cls(
            vocab_size=vocab, d_model=d_model, n_layers=get("num_hidden_layers", "n_layers"),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=get("intermediate_size", "ffn_dim"),
            rope_theta=get_float("rope_theta", "rope_theta", 10000.0),
            rms_eps=get_float("rms_norm_eps", "rms_eps", 1e-5), tie_embeddings=tie,
            max_seq_len=get("max_position_embeddings", "max_seq_len", 2048),
            bos_token_id=bos, eos_token_ids=eos_ids)

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
