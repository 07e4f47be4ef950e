"""Convert any checkpoint (a known name, a GGUF file, a Hugging Face directory) to a Hugging Face
directory: ``config.json``, ``model.safetensors`` (or shards ``model-0000i-of-0000n.safetensors``
and ``model.safetensors.index.json`` when the tensors exceed ``--max-shard-mb``), and
``tokenizer.json`` / ``tokenizer_config.json`` when the source has a tokenizer.

Tensors are stored float32 (default; exact for a GGUF, whose dequantized values are float32) or
bfloat16 (``--dtype bfloat16``: half the size, rounded to nearest even). Why: the rest of the
code, and ``transformers``, read this layout directly, and it is sharded so that a device can
read its part of each tensor without the rest.

    .venv/bin/python -m models.convert smollm2 /tmp/smollm2-hf --max-shard-mb 100 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys

from models import cli
from models.checkpoints.convert import DTYPES, convert


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m models.convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src", help="a known model name (e.g. smollm2), a .gguf file or an HF dir")
    p.add_argument("outdir", help="the Hugging Face directory to write")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the safetensors into shards of at most this many MiB")
    p.add_argument("--dtype", choices=DTYPES, default="float32",
                   help="the stored tensor type (default float32)")
    return p


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def _main(args) -> int:
    out = convert(args.src, args.outdir, args.max_shard_mb,
                  log=lambda m: print(m, file=sys.stderr, flush=True), dtype=args.dtype)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
