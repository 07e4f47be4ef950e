"""The README's first command: SmolLM2-135M-Instruct (or any ``--model``: a known name, a GGUF
file, a Hugging Face directory) tensor-parallel over 3 CPU devices, with exact, int8 and int4
all-reduces and the automatic choice (``auto``: per call, exact or int8, whichever the tuning
table or the cost model predicts faster), side by side.

    .venv/bin/python -m models.demo [--model smollm2] [--tp 3] [--settings exact,int8,int4,auto]
        [--max-new-tokens 24] [--rounds 3] [--window 256]

Fetches the model on first use (``models/checkpoints/fetch.py``), loads its weights once, and for
each setting prints the TTFT and decode tokens/s (medians over ``--rounds`` rounds, each
advancing every setting's greedy generation a token at a time in turn, then timing a few more
prefills each in turn, so that the machine's slow spells hit every setting alike; tokens/s of
the median step), the
perplexity on a short passage (the first window of ``models/corpus.py``'s text), the bytes each
rank sends in one decode step's all-reduces, and the first words the model answers. The table's
title names the checkpoint: its own name (a GGUF's ``general.name``), else the ``--model``
argument's. A checkpoint without a chat template gets the prompt itself after BOS
(``models.chat_template.prompt_ids``).
``benchmarks/autotune/auto_vs_fixed.py`` runs more rounds to rank the settings within a few percent.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

from models import cli

PROMPT = "What is the capital of France, and what is it famous for?"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--settings", default="exact,int8,int4,auto")
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--window", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed generations per setting, the settings in turn")
    return parser


def model_title(ckpt, model: str) -> str:
    """The name the demo prints for a checkpoint: the file's own (a GGUF's ``general.name``),
    else the ``--model`` argument's (a known name, or the file or folder name)."""
    title = ckpt.title
    if title and title.strip():
        return " ".join(title.split())
    path = pathlib.Path(model)
    return path.stem if path.suffix == ".gguf" else path.name or model


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def _main(args) -> int:
    cli.set_devices(args.tp)
    import jax

    from models.compare import run
    from models.corpus import load_text
    from models.llama.params import load_model
    from models.machine import first_line

    print(first_line())
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    print(f"loading {args.model} at TP={args.tp} ...", file=sys.stderr)
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    rows = run(model, ckpt, mesh, args.comm_settings, text=load_text(), window=args.window,
               max_windows=1, prompts=[args.prompt], max_new_tokens=args.max_new_tokens,
               rounds=args.rounds)
    print(f"\n{model_title(ckpt, args.model)}, TP={args.tp} on {args.tp} CPU devices; "
          f"perplexity on {rows[0]['tokens'] + 1} tokens of text; prompt: {args.prompt!r}; "
          "TTFT and tok/s: " + (f"medians over {args.rounds} interleaved rounds"
                                if args.rounds > 1 else "one generation") + " per setting")
    print(f"{'setting':<8}{'TTFT ms':>9}{'tok/s':>7}{'ppl':>9}{'AR bytes/tok':>13}  answer")
    for r in rows:
        words = " ".join(r["texts"][0].split()[:10])
        print(f"{r['setting']:<8}{r['ttft_s'] * 1e3:>9.1f}{r['tokens_per_s_median']:>7.1f}"
              f"{r['perplexity']:>9.3f}{r['allreduce_bytes_per_token']:>13.0f}  {words}")
    for (_, comm), r in zip(args.comm_settings, rows):
        if comm.quantization == "auto":
            print(f"{r['setting']} chose, per traced call site: " + "; ".join(
                f"{k} x{v}" for k, v in sorted(r["plans"].items())))
            print(f"{r['setting']}'s times came from: " + "; ".join(
                f"{k} x{v}" for k, v in sorted(r["choice_sources"].items()))
                + " (a table: the tune command measured this machine; the cost model: its "
                  "defaults, docs/autotune.md)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
