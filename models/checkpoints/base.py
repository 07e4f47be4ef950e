"""The checkpoint base class, its error and the tensor shapes a config implies: what
:mod:`models.checkpoints` (which opens a checkpoint of any format) and the format modules
(:mod:`models.checkpoints.gguf`, :mod:`models.checkpoints.safetensors`) share, so that the
formats do not import the module that imports them. Code outside these modules imports the
names from :mod:`models.checkpoints`, which re-exports them."""

from __future__ import annotations

import abc
import pathlib
import re
from typing import TYPE_CHECKING

import numpy as np

from models.checkpoints.llama_config import LlamaConfig

if TYPE_CHECKING:
    from models.tokenizer import Tokenizer

__all__ = ["Checkpoint", "CheckpointError", "check_finite", "expected_shapes", "validate"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: truncated, corrupt, missing or misshapen tensors."""


class Checkpoint(abc.ABC):
    """Config, tokenizer and HF-layout float32 tensors of a model."""

    config: LlamaConfig
    tokenizer: "Tokenizer | None" = None
    path: pathlib.Path | None = None
    #: The model's name as the file gives it (a GGUF's ``general.name``), or None.
    title: str | None = None

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

    def close(self) -> None:  # noqa: B027 - an optional hook: most formats hold no files open
        """Release the files (optional)."""

    def drop_cache(self) -> None:  # noqa: B027 - an optional hook: most formats cache nothing
        """Forget the tensors kept from earlier reads (a later read reads the file again)."""

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
        if c.qkv_bias:
            out.update({p + "self_attn.q_proj.bias": (hq,), p + "self_attn.k_proj.bias": (hkv,),
                        p + "self_attn.v_proj.bias": (hkv,)})
        if c.qk_norm:
            out.update({p + "self_attn.q_norm.weight": (c.head_dim,),
                        p + "self_attn.k_norm.weight": (c.head_dim,)})
        if c.sandwich_norms:
            out.update({p + "pre_feedforward_layernorm.weight": (d,),
                        p + "post_feedforward_layernorm.weight": (d,)})
    out["model.norm.weight"] = (d,)
    if not c.tie_embeddings:
        out["lm_head.weight"] = (v, d)
    return out


_LAYER_NAME = re.compile(r"^model\.layers\.(\d+)\.")


def validate(ckpt: Checkpoint) -> None:
    """Raise :class:`CheckpointError` unless every expected tensor is present and well shaped,
    and no tensor belongs to a layer the config does not have (a layer count that shrank would
    otherwise load a shallower model without a word)."""
    have = set(ckpt.names())
    n_layers = ckpt.config.n_layers
    for name in sorted(have):
        m = _LAYER_NAME.match(name)
        if m and int(m.group(1)) >= n_layers:
            raise CheckpointError(f"{ckpt.path}: tensor {name} belongs to layer {m.group(1)}, but "
                                  f"the config has {n_layers} layers (n_layers / block_count)")
    for name, shape in expected_shapes(ckpt.config).items():
        if name not in have:
            raise CheckpointError(f"{ckpt.path}: missing tensor {name} (expected shape {shape})")
        actual = tuple(int(s) for s in ckpt.shape(name))
        if actual != shape:
            raise CheckpointError(f"{ckpt.path}: tensor {name} has shape {actual}, expected "
                                  f"{shape} from the config")


def check_finite(path, name: str, arr: np.ndarray) -> np.ndarray:
    """``arr`` if every value is finite; else a :class:`CheckpointError` naming the tensor (no
    real checkpoint holds a NaN or infinite weight: one that does is corrupt)."""
    if not np.isfinite(arr).all():
        bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
        raise CheckpointError(f"{path}: tensor {name} holds {bad} non-finite value(s) (NaN or "
                              f"inf): corrupt data")
    return arr
