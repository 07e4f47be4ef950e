"""Convert any checkpoint (a known name, a GGUF file, a Hugging Face directory) to a Hugging Face
directory in float32: ``config.json``, ``model.safetensors`` (or shards
``model-0000i-of-0000n.safetensors`` and ``model.safetensors.index.json`` when the tensors exceed
``--max-shard-mb``), and the tokenizer files when the source has a tokenizer.

    python -m models.convert smollm2 /tmp/smollm2-hf --max-shard-mb 100
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

from models.checkpoint import Checkpoint, expected_shapes, open_checkpoint

__all__ = ["convert", "write_checkpoint", "main"]


def _plan(shapes: dict[str, tuple[int, ...]], max_bytes: int | None) -> list[list[str]]:
    """Tensor names grouped into shards of at most ``max_bytes`` (one tensor may exceed it)."""
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        nbytes = 4 * int(np.prod(shape, dtype=np.int64))
        if max_bytes is not None and shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def write_checkpoint(ckpt: Checkpoint, outdir, max_shard_mb: float | None = None,
                     log=None) -> pathlib.Path:
    """Write ``ckpt`` (its expected tensors, float32) as a Hugging Face directory."""
    from safetensors.numpy import save_file

    out = pathlib.Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    shapes = expected_shapes(ckpt.config)
    max_bytes = None if max_shard_mb is None else int(max_shard_mb * 2 ** 20)
    shards = _plan(shapes, max_bytes)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)
    weight_map, total = {}, 0
    for k, names in enumerate(shards):
        fname = ("model.safetensors" if len(shards) == 1
                 else f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors")
        tensors = {n: np.ascontiguousarray(ckpt.read(n), np.float32) for n in names}
        total += sum(t.nbytes for t in tensors.values())
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        (out / fname).chmod(0o644)
        weight_map.update(dict.fromkeys(names, fname))
        if log:
            log(f"convert: wrote {fname} ({len(names)} tensors)")
        del tensors
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(ckpt.config.to_hf(), indent=2) + "\n")
    if ckpt.tokenizer is not None:
        ckpt.tokenizer.save(out)
    return out


def convert(src, outdir, max_shard_mb: float | None = None, log=None) -> pathlib.Path:
    """Open ``src`` (name, GGUF, HF directory) and write it to ``outdir`` in HF layout."""
    return write_checkpoint(open_checkpoint(src), outdir, max_shard_mb, log=log)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a known model name (e.g. smollm2), a .gguf file or an HF dir")
    p.add_argument("outdir", help="the Hugging Face directory to write")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the safetensors into shards of at most this many MiB")
    args = p.parse_args(argv)
    out = convert(args.src, args.outdir, args.max_shard_mb,
                  log=lambda m: print(m, file=sys.stderr, flush=True))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
