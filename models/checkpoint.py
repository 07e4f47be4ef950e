"""The checkpoint interface: a Llama-architecture model's config, tokenizer and tensors, read in
Hugging Face names and (out, in) layout, float32, whatever the file format.

:func:`open_checkpoint` takes a known model name (see :mod:`models.fetch`), a ``.gguf`` file or
a Hugging Face directory (``config.json`` + safetensors), and checks that every tensor the model
needs is present with the shape its config implies.

Tensor names (``V`` vocabulary, ``D`` model width, ``H``/``KV`` query/KV heads of ``dh``, ``F``
MLP width)::

    model.embed_tokens.weight                          (V, D)
    model.layers.{i}.input_layernorm.weight            (D,)
    model.layers.{i}.self_attn.{q,k,v}_proj.weight     (H*dh, D) / (KV*dh, D) / (KV*dh, D)
    model.layers.{i}.self_attn.o_proj.weight           (D, H*dh)
    model.layers.{i}.post_attention_layernorm.weight   (D,)
    model.layers.{i}.mlp.{gate,up}_proj.weight         (F, D)
    model.layers.{i}.mlp.down_proj.weight              (D, F)
    model.norm.weight                                  (D,)
    lm_head.weight                                     (V, D), only when not tied
"""

from __future__ import annotations

import abc
import os
import pathlib
from typing import TYPE_CHECKING

import numpy as np

from models.config import LlamaConfig

if TYPE_CHECKING:
    from models.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "expected_shapes", "open_checkpoint"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: truncated, corrupt, missing or misshapen tensors."""


class Checkpoint(abc.ABC):
    """Config, tokenizer and HF-layout float32 tensors of a model."""

    config: LlamaConfig
    tokenizer: "Tokenizer | None" = None
    path: pathlib.Path | None = None

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Every tensor name (HF names)."""

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]:
        """The HF shape of tensor ``name``."""

    @abc.abstractmethod
    def read(self, name: str, index=()) -> np.ndarray:
        """Tensor ``name`` (float32, HF layout), or just ``[index]`` of it (a tuple of slices),
        so that one shard can be read alone."""

    def close(self) -> None:
        """Release the files (optional)."""

    def __repr__(self):
        return f"{type(self).__name__}({str(self.path)!r}, {self.config})"


def expected_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """The name → HF shape of every tensor a checkpoint of ``config`` must hold."""
    c = config
    d, v, f = c.d_model, c.vocab_size, c.ffn_dim
    hq, hkv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    out = {"model.embed_tokens.weight": (v, d)}
    for i in range(c.n_layers):
        p = f"model.layers.{i}."
        out.update({
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (hq, d),
            p + "self_attn.k_proj.weight": (hkv, d),
            p + "self_attn.v_proj.weight": (hkv, d),
            p + "self_attn.o_proj.weight": (d, hq),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (f, d),
            p + "mlp.up_proj.weight": (f, d),
            p + "mlp.down_proj.weight": (d, f),
        })
    out["model.norm.weight"] = (d,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


def validate(ckpt: Checkpoint) -> None:
    """Raise :class:`CheckpointError` unless every expected tensor is present and well shaped."""
    have = set(ckpt.names())
    for name, shape in expected_shapes(ckpt.config).items():
        if name not in have:
            raise CheckpointError(f"{ckpt.path}: missing tensor {name} (expected shape {shape})")
        actual = tuple(int(s) for s in ckpt.shape(name))
        if actual != shape:
            raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {actual}, expected "
                                  f"{shape} from the config")


def _is_gguf(path: pathlib.Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def open_checkpoint(name_or_path: str | os.PathLike) -> Checkpoint:
    """The checkpoint of a known name (fetched on first use), a ``.gguf`` file or a Hugging Face
    directory, validated against its config.

    Raises ``FileNotFoundError`` for a path that does not exist, :class:`CheckpointError` for a
    truncated / corrupt file or a missing / misshapen tensor.
    """
    from models.fetch import model_path

    path = model_path(name_or_path)
    if path.is_dir():
        from models.safetensors_checkpoint import SafetensorsCheckpoint

        ckpt: Checkpoint = SafetensorsCheckpoint(path)
    elif path.suffix == ".safetensors" and (path.parent / "config.json").is_file():
        from models.safetensors_checkpoint import SafetensorsCheckpoint

        ckpt = SafetensorsCheckpoint(path.parent, files=[path.name])
    elif path.suffix.lower() == ".gguf" or _is_gguf(path):
        from models.gguf_checkpoint import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
    else:
        raise CheckpointError(f"{path}: not a checkpoint (expected a .gguf file or a Hugging Face "
                              f"directory with config.json and safetensors)")
    validate(ckpt)
    return ckpt
