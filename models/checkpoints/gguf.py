"""A GGUF checkpoint (llama.cpp) of a ``llama``, ``qwen2`` or ``gemma3`` model, read as the
Hugging Face checkpoint of that architecture.

The file is memory-mapped with ``gguf.GGUFReader``; each tensor is dequantized
(``gguf.quants.dequantize``: F32, F16, BF16, Q4_0 ... Q8_0, the K-quants) to float32 on first
read and cached. Names map from llama.cpp's (``blk.{i}.attn_q.weight`` ...) to HF's
(``model.layers.{i}.self_attn.q_proj.weight`` ...), per architecture (:func:`gguf_to_hf_name`).

Gemma 3: llama.cpp's converter stores every RMSNorm weight ``w`` of HF's ``x * (1 + w)`` norms as
``1 + w``; the reader subtracts 1 in float32 (as transformers' GGUF loader does), so the tensors
are HF's.

Q and K of ``llama`` only: llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of each head
of ``q_proj`` /
``k_proj`` so that llama.cpp's interleaved-pair RoPE (pairs ``(2i, 2i+1)``) computes what HF's
rotate-half RoPE (pairs ``(i, i + dh/2)``) computes on the original rows::

    permute(w, n) = w.reshape(n, 2, dh // 2, in).swapaxes(1, 2).reshape(w.shape)

with ``n`` = query heads for Q and KV heads for K. :func:`unpermute_qk` inverts it on read, so
every tensor comes out in HF layout. ``qwen2`` and ``gemma3`` use rotate-half RoPE in llama.cpp
too (NEOX), so their rows are stored unpermuted.
"""

from __future__ import annotations

import math
import pathlib
import re
import threading

import numpy as np

from models.checkpoints.base import Checkpoint, CheckpointError, check_finite
from models.checkpoints.gguf_header import FLOAT_TYPES, INT_TYPES, MetadataArray, scan_gguf
from models.checkpoints.llama_config import (ARCHITECTURES, FLOAT_LIMITS, LIMITS, LlamaConfig,
                                             check_float, check_int)

__all__ = ["GGUFCheckpoint", "gguf_to_hf_name", "llama_cpp_permute", "unpermute_qk"]

_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3's norms: four per block, named as in HF's Gemma3DecoderLayer, and QK-norm.
_GEMMA3_LAYER = {**_LAYER, "ffn_norm": "pre_feedforward_layernorm",
                 "post_attention_norm": "post_attention_layernorm",
                 "post_ffw_norm": "post_feedforward_layernorm",
                 "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}
_LAYERS = {"llama": _LAYER, "qwen2": _LAYER, "gemma3": _GEMMA3_LAYER}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    """The HF name of a llama.cpp tensor name in a model of ``arch`` (None if it has none)."""
    m = _BLK.match(name)
    if m:
        part = _LAYERS[arch].get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    stem, _, kind = name.rpartition(".")
    return f"{_GLOBAL[stem]}.{kind}" if stem in _GLOBAL else None


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int | None = None) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf.py`` permutation of Q / K rows (HF → GGUF)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """The inverse of :func:`llama_cpp_permute` with ``n_head`` heads (GGUF → HF)."""
    return (w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def _f32_value(x) -> float:
    """A GGUF float32 scalar as the Python float it was written from (1e-05, not 9.99e-06)."""
    return float(str(np.float32(x)))


class GGUFCheckpoint(Checkpoint):
    """A llama-architecture GGUF file, read in HF names and layout."""

    def __init__(self, path):
        import gguf

        self.path = pathlib.Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no such GGUF file: {self.path}")
        self.layout = layout = scan_gguf(self.path)
        try:
            self.reader = reader = gguf.GGUFReader(self.path, "r")
            tensors = list(reader.tensors)
        except Exception as e:  # noqa: BLE001 - numpy / struct errors of a cut or garbled file
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file "
                                  f"({type(e).__name__}: {e})") from None
        if int(reader.data_offset) != layout.data_start or len(tensors) != len(layout.tensors):
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file (gguf reads the "
                                  f"data section at {reader.data_offset}, the header puts it at "
                                  f"{layout.data_start})")
        self._tensors = {}
        self._shapes = {}
        arch = self._value("general.architecture", "llama")[1]
        if arch not in _LAYERS:
            raise CheckpointError(f"{self.path}: general.architecture is {arch!r}, not one of "
                                  f"{', '.join(repr(a) for a in ARCHITECTURES)}")
        for t, info in zip(tensors, layout.tensors):
            if (t.name, int(t.data_offset), int(t.n_bytes), int(t.tensor_type)) != (
                    info.name, info.data_offset, info.n_bytes, info.ggml_type):
                raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file (tensor "
                                      f"{info.name}: gguf and the header disagree)")
            hf = gguf_to_hf_name(t.name, arch)
            if hf is None:
                continue
            if hf in self._tensors:
                raise CheckpointError(f"{self.path}: tensors {self._tensors[hf].name} and "
                                      f"{t.name} both map to {hf}")
            self._tensors[hf] = t
            # GGUF lists dimensions innermost first: (in, out) → HF (out, in).
            self._shapes[hf] = tuple(reversed(info.dims))
        try:
            self.config = self._config()
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise CheckpointError(f"{self.path}: cannot read the model config from the GGUF "
                                  f"metadata ({e})") from None
        self.tokenizer = None
        if "tokenizer.ggml.tokens" in reader.fields:
            from models.tokenizer import Tokenizer

            try:
                self.tokenizer = Tokenizer.from_gguf(reader)
            except Exception as e:  # noqa: BLE001 - report, but the weights stay usable
                raise CheckpointError(f"{self.path}: cannot build the tokenizer from the GGUF "
                                      f"metadata ({type(e).__name__}: {e})") from None
        self._cache: dict[str, np.ndarray] = {}
        self._lock = threading.Lock()
        name = self._value("general.name", None)[1]
        self.title = name if isinstance(name, str) and name else None

    def _value(self, key, default=KeyError):
        """The metadata value of ``key`` as (GGUF value type, value)."""
        field = self.layout.fields.get(key)
        if field is None:
            if default is KeyError:
                raise ValueError(f"missing metadata key {key!r}")
            return None, default
        return field

    def _int(self, key, field, default=KeyError, lo=None, hi=None) -> int | None:
        vtype, value = self._value(key, default)
        if vtype is None and value is None:
            return None
        if vtype is not None and vtype not in INT_TYPES:
            raise ValueError(f"{key} has GGUF value type {vtype}, not an integer type")
        limits = LIMITS[field] if field else (lo, hi)
        return check_int(key, value, *limits)

    def _float(self, key, field, default) -> float:
        vtype, value = self._value(key, default)
        if vtype is not None and vtype not in FLOAT_TYPES | INT_TYPES:
            raise ValueError(f"{key} has GGUF value type {vtype}, not a number")
        value = _f32_value(value) if vtype == 6 and math.isfinite(value) else value
        return check_float(key, value, *FLOAT_LIMITS[field])

    def _config(self) -> LlamaConfig:
        arch = self._value("general.architecture", "llama")[1]
        for key in (f"{arch}.rope.scaling.type", f"{arch}.attn_logit_softcapping",
                    f"{arch}.final_logit_softcapping"):
            value = self._value(key, None)[1]
            if value is not None and value not in ("none", 0, 0.0):
                raise ValueError(f"{key} = {value!r} is not supported by this model code")
        d = self._int(f"{arch}.embedding_length", "d_model")
        n_heads = self._int(f"{arch}.attention.head_count", "n_heads")
        n_kv = self._int(f"{arch}.attention.head_count_kv", "n_kv_heads", n_heads)
        if n_heads % n_kv:
            raise ValueError(f"{arch}.attention.head_count = {n_heads} is not a multiple of "
                             f"{arch}.attention.head_count_kv = {n_kv}")
        head_dim = self._int(f"{arch}.attention.key_length", "head_dim", None)
        if head_dim is None:
            if d % n_heads:
                raise ValueError(f"{arch}.embedding_length = {d} is not a multiple of "
                                 f"{arch}.attention.head_count = {n_heads} (and no "
                                 f"{arch}.attention.key_length is given)")
            head_dim = d // n_heads
        if head_dim % 2:
            raise ValueError(f"the head dimension {head_dim} ({arch}.attention.key_length or "
                             f"embedding_length / head_count) is odd; RoPE needs it even")
        for key in (f"{arch}.attention.value_length", f"{arch}.rope.dimension_count"):
            other = self._int(key, "head_dim", None)
            if other is not None and other != head_dim:
                raise ValueError(f"{key} = {other} differs from the head dimension {head_dim}; "
                                 f"this model code needs them equal")
        vocab = self._int(f"{arch}.vocab_size", "vocab_size", None)
        if vocab is None:
            tokens = self.layout.fields.get("tokenizer.ggml.tokens")
            if tokens is not None and isinstance(tokens[1], MetadataArray):
                vocab = check_int("len(tokenizer.ggml.tokens)", tokens[1].count,
                                  *LIMITS["vocab_size"])
            elif "model.embed_tokens.weight" in self._shapes:
                vocab = self._shapes["model.embed_tokens.weight"][0]
            else:
                raise ValueError(f"missing metadata key '{arch}.vocab_size'")
        bos = self._int("tokenizer.ggml.bos_token_id", None, None, 0, vocab - 1)
        eos = self._int("tokenizer.ggml.eos_token_id", None, None, 0, vocab - 1)
        features = {}
        if arch == "gemma3":
            features["sliding_window"] = self._int(f"{arch}.attention.sliding_window",
                                                   "sliding_window", 0)
        return LlamaConfig.for_arch(
            arch, vocab_size=vocab, d_model=d,
            n_layers=self._int(f"{arch}.block_count", "n_layers"),
            n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            ffn_dim=self._int(f"{arch}.feed_forward_length", "ffn_dim"),
            rope_theta=self._float(f"{arch}.rope.freq_base", "rope_theta", 10000.0),
            rms_eps=self._float(f"{arch}.attention.layer_norm_rms_epsilon", "rms_eps", 1e-5),
            tie_embeddings="lm_head.weight" not in self._tensors,
            max_seq_len=self._int(f"{arch}.context_length", "max_seq_len", 2048),
            bos_token_id=bos, eos_token_ids=() if eos is None else (eos,), **features)

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self._shapes:
            raise KeyError(f"{self.path}: no tensor {name!r}")
        return self._shapes[name]

    def _full(self, name: str) -> np.ndarray:
        arr = self._cache.get(name)
        if arr is not None:
            return arr
        with self._lock:
            arr = self._cache.get(name)
            if arr is not None:
                return arr
            import gguf

            t = self._tensors.get(name)
            if t is None:
                raise KeyError(f"{self.path}: no tensor {name!r}")
            try:
                arr = gguf.quants.dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise CheckpointError(f"{self.path}: tensor {t.name}: cannot dequantize "
                                      f"{t.tensor_type.name} ({e})") from None
            arr = np.ascontiguousarray(arr, np.float32).reshape(self._shapes[name])
            check_finite(self.path, t.name, arr)
            arch = self.config.arch
            if arch == "gemma3" and name.endswith("norm.weight"):
                arr = arr - np.float32(1.0)
            elif arch == "llama" and name.endswith("self_attn.q_proj.weight"):
                arr = np.ascontiguousarray(unpermute_qk(arr, self.config.n_heads))
            elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
                arr = np.ascontiguousarray(unpermute_qk(arr, self.config.n_kv_heads))
            arr.flags.writeable = False
            self._cache[name] = arr
            return arr

    def read(self, name: str, index=()) -> np.ndarray:
        return self._full(name)[index]

    def drop_cache(self) -> None:
        with self._lock:
            self._cache.clear()

    def close(self) -> None:
        self.drop_cache()
