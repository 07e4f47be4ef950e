"""Writing any checkpoint (a known name, a GGUF file, a Hugging Face directory) as a Hugging Face
directory: ``config.json``, ``model.safetensors`` (or shards ``model-0000i-of-0000n.safetensors``
and ``model.safetensors.index.json`` when the tensors exceed ``max_shard_mb``), and
``tokenizer.json`` / ``tokenizer_config.json`` when the source has a tokenizer.

Tensors are stored float32 (default; exact for a GGUF, whose dequantized values are float32) or
bfloat16 (half the size, rounded to nearest even). Why: the rest of the code, and
``transformers``, read this layout directly, and it is sharded so that a device can read its
part of each tensor without the rest. The command line is ``.venv/bin/python -m models.convert``.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from models.checkpoints import Checkpoint, expected_shapes, open_checkpoint

__all__ = ["convert", "write_checkpoint", "DTYPES"]

DTYPES = ("float32", "bfloat16")


def _plan(shapes: dict[str, tuple[int, ...]], max_bytes: int | None,
          itemsize: int = 4) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_bytes`` (one tensor may exceed it)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = itemsize * int(np.prod(shape, dtype=np.int64))
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(ckpt: Checkpoint, outdir, max_shard_mb: float | None = None,
                     log=None, dtype: str = "float32") -> pathlib.Path:
    """Write ``ckpt`` (its expected tensors, in ``dtype``) as a Hugging Face directory."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    if max_shard_mb is not None and max_shard_mb <= 0:
        raise ValueError(f"max_shard_mb must be positive, got {max_shard_mb}")
    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(ckpt.config)
    max_bytes = None if max_shard_mb is None else int(max_shard_mb * 2 ** 20)
    shards = _plan(shapes, max_bytes, 4 if dtype == "float32" else 2)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {n: np.ascontiguousarray(ckpt.read(n), np.float32) for n in names}
        total += _save(tensors, out / fname, dtype)
        (out / fname).chmod(0o644)
        weight_map.update(dict.fromkeys(names, fname))
        if log:
            log(f"convert: wrote {fname} ({len(names)} tensors)")
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config = ckpt.config.to_hf()
    config["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save(out)
    return out


def _save(tensors: dict[str, np.ndarray], path: pathlib.Path, dtype: str) -> int:
    """Write float32 ``tensors`` to the safetensors file ``path`` as ``dtype``; the data bytes.

    safetensors' numpy API has no bfloat16, so a bfloat16 file is written by hand: the format is
    an 8-byte little-endian header length, a JSON header (name → dtype, shape, data offsets),
    then the raw little-endian tensor bytes.
    """
    if dtype == "float32":
        from safetensors.numpy import save_file

        save_file(tensors, str(path), metadata={"format": "pt"})
        return sum(t.nbytes for t in tensors.values())
    import ml_dtypes

    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name].astype(ml_dtypes.bfloat16)).tobytes()
        header[name] = {"dtype": "BF16", "shape": list(tensors[name].shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(len(head).to_bytes(8, "little"))
        f.write(head)
        for raw in blobs:
            f.write(raw)
    return offset


def convert(src, outdir, max_shard_mb: float | None = None, log=None,
            dtype: str = "float32") -> pathlib.Path:
    """Open ``src`` (name, GGUF, HF directory) and write it to ``outdir`` in HF layout."""
    return write_checkpoint(open_checkpoint(src), outdir, max_shard_mb, log=log, dtype=dtype)
