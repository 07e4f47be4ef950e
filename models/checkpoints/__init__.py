"""The checkpoint interface: a Llama-architecture model's config, tokenizer and tensors, read in
Hugging Face names and (out, in) layout, float32, whatever the file format.

:func:`open_checkpoint` takes a known model name (see :mod:`models.checkpoints.fetch`), a
``.gguf`` file or a Hugging Face directory (``config.json`` + safetensors), and checks that
every tensor the model needs is present with the shape its config implies.

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

import os
import pathlib

from models.checkpoints.base import Checkpoint, CheckpointError, expected_shapes, validate

__all__ = ["Checkpoint", "CheckpointError", "expected_shapes", "open_checkpoint"]


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
    from models.checkpoints.fetch import model_path

    path = model_path(name_or_path)
    if path.is_dir():
        from models.checkpoints.safetensors import SafetensorsCheckpoint

        ckpt: Checkpoint = SafetensorsCheckpoint(path)
    elif path.suffix == ".safetensors" and (path.parent / "config.json").is_file():
        from models.checkpoints.safetensors import SafetensorsCheckpoint

        ckpt = SafetensorsCheckpoint(path.parent, files=[path.name])
    elif path.suffix.lower() == ".gguf" or _is_gguf(path):
        from models.checkpoints.gguf import GGUFCheckpoint

        ckpt = GGUFCheckpoint(path)
    else:
        raise CheckpointError(f"{path}: not a checkpoint (expected a .gguf file or a Hugging Face "
                              f"directory with config.json and safetensors)")
    validate(ckpt)
    return ckpt
