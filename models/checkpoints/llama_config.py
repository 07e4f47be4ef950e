"""The hyper-parameters of a decoder of the Llama family, read from a checkpoint.

One config describes the three architectures the model code runs (:data:`ARCHITECTURES`):
``llama`` (SmolLM2, Llama 2/3), ``qwen2`` (Llama plus q/k/v biases) and ``gemma3`` (QK-norm,
norms before and after each sub-block, GeGLU, embeddings scaled by ``sqrt(d_model)``, sliding-
window layers with their own RoPE base between global ones). The architecture sets the feature
fields (:data:`FEATURES`); :meth:`LlamaConfig.from_hf` and :meth:`LlamaConfig.to_hf` map the
config to and from a Hugging Face ``config.json``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers

__all__ = ["ARCHITECTURES", "FEATURES", "FLOAT_LIMITS", "LIMITS", "LlamaConfig", "check_float",
           "check_int"]

#: The architectures the model code runs (GGUF ``general.architecture``).
ARCHITECTURES = ("llama", "qwen2", "gemma3")
#: The feature fields each architecture sets (the others keep their defaults).
FEATURES: dict[str, dict] = {
    "llama": {},
    "qwen2": {"qkv_bias": True},
    "gemma3": {"qk_norm": True, "sandwich_norms": True, "activation": "gelu_tanh",
               "embed_scale": True, "sliding_pattern": 6, "rope_local_theta": 10000.0},
}
_HF_TYPES = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
             "gemma3": ("gemma3_text", "Gemma3ForCausalLM")}

#: The inclusive range of every integer field: wide enough for any real Llama-architecture
#: model, narrow enough that a corrupt value is refused before anything is allocated from it
#: (``n_layers = 10**9`` would build a billion-layer table of expected shapes).
LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 24), "d_model": (1, 1 << 20), "n_layers": (1, 10_000),
    "n_heads": (1, 1 << 20), "n_kv_heads": (1, 1 << 20), "head_dim": (1, 1 << 20),
    "ffn_dim": (1, 1 << 20), "max_seq_len": (1, 1 << 24), "sliding_window": (0, 1 << 24),
    "sliding_pattern": (0, 10_000),
}
#: The open / closed ranges of the float fields: finite, and RoPE's base above 1 (below it the
#: "frequencies" grow with the dimension), the RMSNorm epsilon in (0, 1).
FLOAT_LIMITS: dict[str, tuple[float, float]] = {"rope_theta": (1.0, 1e12), "rms_eps": (0.0, 1.0),
                                                "rope_local_theta": (1.0, 1e12),
                                                "query_pre_attn_scalar": (-1.0, 1e12)}


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
    """What the model code needs to know about a checkpoint of one of :data:`ARCHITECTURES`.

    Field names follow the model code; :meth:`from_hf` / :meth:`to_hf` map them to the keys of a
    Hugging Face ``config.json`` (``LlamaForCausalLM``, ``Qwen2ForCausalLM``,
    ``Gemma3ForCausalLM``). The feature fields after ``eos_token_ids``:

    * ``qkv_bias``: biases on the q, k and v projections.
    * ``qk_norm``: an RMSNorm over each query and key head before RoPE.
    * ``sandwich_norms``: an RMSNorm on each sub-block's output too, before the residual add.
    * ``activation``: the gated MLP's (``"silu"``: SwiGLU, ``"gelu_tanh"``: GeGLU).
    * ``embed_scale``: embeddings multiplied by ``sqrt(d_model)``.
    * ``sliding_window``, ``sliding_pattern``, ``rope_local_theta``: with a window > 0 and a
      pattern ``p`` > 0, layer ``i`` is global when ``(i + 1) % p == 0`` and otherwise attends
      to the ``sliding_window`` latest positions with RoPE base ``rope_local_theta``.
    * ``query_pre_attn_scalar``: scores are scaled by its inverse square root (0: ``head_dim``).
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
    arch: str = "llama"
    qkv_bias: bool = False
    qk_norm: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"
    embed_scale: bool = False
    sliding_window: int = 0
    sliding_pattern: int = 0
    rope_local_theta: float = 10000.0
    query_pre_attn_scalar: float = 0.0

    @classmethod
    def for_arch(cls, arch: str, **fields) -> "LlamaConfig":
        """A config of ``arch`` with its :data:`FEATURES` (``fields`` may override them)."""
        if arch not in FEATURES:
            raise ValueError(f"architecture {arch!r} is not one of {ARCHITECTURES}")
        return cls(arch=arch, **{**FEATURES[arch], **fields})

    def is_sliding(self, layer: int) -> bool:
        """Whether ``layer`` attends over a sliding window (else over every position)."""
        return (self.sliding_window > 0 and self.sliding_pattern > 0
                and (layer + 1) % self.sliding_pattern != 0)

    @property
    def norm_offset(self) -> float:
        """What the model adds to a checkpoint's RMSNorm weight to get the scale it multiplies
        by: 1 for Gemma 3 (HF's ``x * (1 + w)``), else 0."""
        return 1.0 if self.arch == "gemma3" else 0.0

    @property
    def query_scale(self) -> float:
        """The attention score scale."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def __post_init__(self):
        if self.arch not in ARCHITECTURES:
            raise ValueError(f"LlamaConfig.arch must be one of {ARCHITECTURES}, got "
                             f"{self.arch!r}")
        for name in ("qkv_bias", "qk_norm", "sandwich_norms", "embed_scale"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"LlamaConfig.{name} must be a bool, got "
                                 f"{getattr(self, name)!r}")
        if self.activation not in ("silu", "gelu_tanh"):
            raise ValueError(f"LlamaConfig.activation must be 'silu' or 'gelu_tanh', got "
                             f"{self.activation!r}")
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
        return cls.for_arch(
            _hf_arch(d), vocab_size=vocab, d_model=d_model,
            n_layers=get("num_hidden_layers", "n_layers"),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=get("intermediate_size", "ffn_dim"),
            rope_theta=get_float("rope_theta", "rope_theta", 10000.0),
            rms_eps=get_float("rms_norm_eps", "rms_eps", 1e-5), tie_embeddings=tie,
            max_seq_len=get("max_position_embeddings", "max_seq_len", 2048),
            bos_token_id=bos, eos_token_ids=eos_ids, **_hf_features(d, get, get_float))

    def to_hf(self) -> dict:
        """The Hugging Face ``config.json`` dict of this config."""
        model_type, cls_name = _HF_TYPES[self.arch]
        out = {
            "architectures": [cls_name], "model_type": model_type,
            "vocab_size": self.vocab_size, "hidden_size": self.d_model,
            "num_hidden_layers": self.n_layers, "num_attention_heads": self.n_heads,
            "num_key_value_heads": self.n_kv_heads, "head_dim": self.head_dim,
            "intermediate_size": self.ffn_dim, "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_eps, "tie_word_embeddings": self.tie_embeddings,
            "max_position_embeddings": self.max_seq_len,
            "hidden_act": "silu" if self.activation == "silu" else "gelu_pytorch_tanh",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": (list(self.eos_token_ids) if len(self.eos_token_ids) != 1
                             else self.eos_token_ids[0]),
            "torch_dtype": "float32",
        }
        if self.arch == "qwen2":
            out["use_sliding_window"] = False
        if self.arch == "gemma3":
            out["hidden_activation"] = out.pop("hidden_act")
            out.update({
                "sliding_window_pattern": self.sliding_pattern,
                "sliding_window": self.sliding_window, "rope_local_base_freq":
                self.rope_local_theta, "query_pre_attn_scalar":
                self.query_pre_attn_scalar or self.head_dim,
                "layer_types": ["sliding_attention" if self.is_sliding(i) else
                                "full_attention" for i in range(self.n_layers)],
                "rope_scaling": None, "final_logit_softcapping": None,
                "attn_logit_softcapping": None})
        return out


def _hf_arch(d: dict) -> str:
    """The architecture of a ``config.json`` (by ``model_type``; none means Llama)."""
    model_type = d.get("model_type", "llama")
    for arch, (hf_type, _) in _HF_TYPES.items():
        if model_type == hf_type:
            return arch
    raise ValueError(f"config.json: model_type {model_type!r} is not one of "
                     f"{sorted(t for t, _ in _HF_TYPES.values())}")


def _hf_features(d: dict, get, get_float) -> dict:
    """The feature fields of a ``config.json``, refusing the options the model code lacks."""
    arch = _hf_arch(d)
    act = d.get("hidden_activation", d.get("hidden_act", "silu"))
    want = "silu" if arch != "gemma3" else "gelu_pytorch_tanh"
    if act != want:
        raise ValueError(f"config.json: activation {act!r}; a {arch} model here uses {want!r}")
    for key in ("rope_scaling", "final_logit_softcapping", "attn_logit_softcapping"):
        if d.get(key) is not None:
            raise ValueError(f"config.json: {key} = {d[key]!r} is not supported")
    if arch == "qwen2" and d.get("use_sliding_window"):
        raise ValueError("config.json: use_sliding_window = true is not supported for qwen2")
    if arch != "gemma3":
        return {}
    n_layers = get("num_hidden_layers", "n_layers")
    window = get("sliding_window", "sliding_window", 0)
    pattern = get("sliding_window_pattern", "sliding_pattern", 6)
    types = d.get("layer_types")
    if types is not None:
        expect = ["sliding_attention" if (i + 1) % pattern else "full_attention"
                  for i in range(n_layers)]
        if list(types) != expect:
            raise ValueError(f"config.json: layer_types is not every {pattern}th layer global "
                             f"(the only Gemma 3 pattern supported)")
    return {"sliding_window": window, "sliding_pattern": pattern,
            "rope_local_theta": get_float("rope_local_base_freq", "rope_local_theta", 10000.0),
            "query_pre_attn_scalar": get_float("query_pre_attn_scalar",
                                               "query_pre_attn_scalar", 0.0)}
