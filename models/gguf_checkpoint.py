"""A GGUF checkpoint (llama.cpp) read as a Hugging Face Llama checkpoint.

The file is memory-mapped with ``gguf.GGUFReader``; each tensor is dequantized
(``gguf.quants.dequantize``) to float32 on first read and cached. Names map from llama.cpp's
(``blk.{i}.attn_q.weight`` ...) to HF's (``model.layers.{i}.self_attn.q_proj.weight`` ...).

Q and K: llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of each head of ``q_proj`` /
``k_proj`` so that llama.cpp's interleaved-pair RoPE (pairs ``(2i, 2i+1)``) computes what HF's
rotate-half RoPE (pairs ``(i, i + dh/2)``) computes on the original rows::

    permute(w, n) = w.reshape(n, 2, dh // 2, in).swapaxes(1, 2).reshape(w.shape)

with ``n`` = query heads for Q and KV heads for K. :func:`unpermute_qk` inverts it on read, so
every tensor comes out in HF layout.
"""

from __future__ import annotations

import os
import pathlib
import re
import threading

import numpy as np

from models.checkpoint_base import Checkpoint, CheckpointError
from models.config import LlamaConfig

__all__ = ["GGUFCheckpoint", "llama_cpp_permute", "unpermute_qk", "gguf_to_hf_name"]

_LAYER = {
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm",
           "output": "lm_head"}
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """The HF name of a llama.cpp tensor name (None if it has none)."""
    m = _BLK.match(name)
    if m:
        part = _LAYER.get(m.group(2))
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
        size = os.path.getsize(self.path)
        try:
            self.reader = reader = gguf.GGUFReader(self.path, "r")
            tensors = list(reader.tensors)
        except Exception as e:  # noqa: BLE001 - numpy / struct errors of a cut or garbled file
            raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file "
                                  f"({type(e).__name__}: {e})") from None
        self._tensors = {}
        self._shapes = {}
        for t in tensors:
            end = int(t.data_offset) + int(t.n_bytes)
            if end > size:
                raise CheckpointError(f"{self.path}: truncated or corrupt GGUF file (tensor "
                                      f"{t.name} ends at byte {end}, the file has {size})")
            hf = gguf_to_hf_name(t.name)
            if hf is None:
                continue
            self._tensors[hf] = t
            # GGUF lists dimensions innermost first: (in, out) → HF (out, in).
            self._shapes[hf] = tuple(int(s) for s in reversed([int(x) for x in t.shape]))
        try:
            self.config = self._config()
        except (KeyError, ValueError, TypeError, IndexError) as e:
            raise CheckpointError(f"{self.path}: cannot read the model config from the GGUF "
                                  f"metadata ({type(e).__name__}: {e})") from None
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

    def _field(self, key, default=KeyError):
        field = self.reader.fields.get(key)
        if field is None:
            if default is KeyError:
                raise KeyError(key)
            return default
        return field.contents()

    def _config(self) -> LlamaConfig:
        arch = self._field("general.architecture", "llama")
        if arch != "llama":
            raise ValueError(f"general.architecture is {arch!r}, not 'llama'")
        k = lambda key, default=KeyError: self._field(f"{arch}.{key}", default)  # noqa: E731
        d = int(k("embedding_length"))
        n_heads = int(k("attention.head_count"))
        n_kv = int(k("attention.head_count_kv", n_heads))
        head_dim = int(k("attention.key_length", 0)) or d // n_heads
        vocab = k("vocab_size", None)
        if vocab is None:
            tokens = self._field("tokenizer.ggml.tokens", None)
            vocab = len(tokens) if tokens is not None else self._shapes[
                "model.embed_tokens.weight"][0]
        bos = self._field("tokenizer.ggml.bos_token_id", None)
        eos = self._field("tokenizer.ggml.eos_token_id", None)
        return LlamaConfig(
            vocab_size=int(vocab), d_model=d, n_layers=int(k("block_count")), n_heads=n_heads,
            n_kv_heads=n_kv, head_dim=head_dim, ffn_dim=int(k("feed_forward_length")),
            rope_theta=_f32_value(k("rope.freq_base", 10000.0)),
            rms_eps=_f32_value(k("attention.layer_norm_rms_epsilon", 1e-5)),
            tie_embeddings="lm_head.weight" not in self._tensors,
            max_seq_len=int(k("context_length", 2048)),
            bos_token_id=None if bos is None else int(bos),
            eos_token_ids=() if eos is None else (int(eos),))

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
            if name.endswith("self_attn.q_proj.weight"):
                arr = np.ascontiguousarray(unpermute_qk(arr, self.config.n_heads))
            elif name.endswith("self_attn.k_proj.weight"):
                arr = np.ascontiguousarray(unpermute_qk(arr, self.config.n_kv_heads))
            arr.flags.writeable = False
            self._cache[name] = arr
            return arr

    def read(self, name: str, index=()) -> np.ndarray:
        return self._full(name)[index]

    def close(self) -> None:
        self._cache.clear()
