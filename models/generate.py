"""Generate text with a tensor-parallel Llama on CPU devices, streaming tokens as they come.

    .venv/bin/python -m models.generate --model smollm2 --tp 3 --comm flash --bits 4 \\
        --prompt "What is the capital of France?" --max-new-tokens 64 [--greedy]

The prompt is wrapped in the model's chat template (``--raw`` sends it as is); a checkpoint
without one (Gemma 3 270M's GGUF) gets the prompt itself after BOS, and a note on stderr says so
(``models.chat_template.prompt_ids``). Before the timed
run, a short warm-up generation compiles the prefill bucket and the decode step, so TTFT and
tokens/s are those of the compiled program. Afterwards it prints TTFT, decode tokens/s and the
bytes each rank sends in the all-reduces of one decode step (``models/traffic.py``).
"""

from __future__ import annotations

import argparse
import sys
import time

from models import cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_common(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding")
    parser.add_argument("--temperature", type=float, default=0.2)
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--raw", action="store_true", help="no chat template")
    parser.add_argument("--cache-len", type=int, default=1024, help="KV cache positions")
    return parser


def run(args, out=None) -> dict:
    """Generate for ``args``; stream to ``out`` (default: the ``sys.stdout`` of the call); return
    the text, ids and timings."""
    out = sys.stdout if out is None else out
    t0 = time.perf_counter()
    model, ckpt, mesh, comm = cli.setup(args)  # sets the device count, then imports jax
    from models.chat_template import prompt_ids
    from models.engine import Engine, Sampling
    from models.traffic import allreduce_bytes_per_token

    tok = ckpt.tokenizer
    if tok is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    ids = tok.encode(args.prompt) if args.raw else prompt_ids(tok, args.prompt)
    engine = Engine(model, mesh, cache_len=args.cache_len)
    engine.bucket(len(ids))  # a prompt longer than the cache fails here, before compiling
    sampling = Sampling() if args.greedy else Sampling(args.temperature, args.top_k, args.top_p)
    stop = set(ckpt.config.eos_token_ids) | set(tok.eos_ids)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    for _ in engine.generate(ids, min(2, args.max_new_tokens), sampling=sampling,
                             seed=args.seed):
        pass
    compile_s = time.perf_counter() - t1

    generated, shown = [], ""
    for tid in engine.generate(ids, args.max_new_tokens, sampling=sampling, seed=args.seed,
                               stop_ids=stop):
        generated.append(tid)
        if tid in stop:
            break
        full = tok.decode(generated)
        if not full.endswith("\ufffd"):  # wait for the rest of a multi-byte character
            out.write(full[len(shown):])
            out.flush()
            shown = full
    out.write("\n")
    timings = engine.last_timings
    decode = timings["decode"]
    tps = len(decode) / sum(decode) if decode else float("nan")
    itemsize = 4 if args.dtype == "float32" else 2
    traffic = allreduce_bytes_per_token(ckpt.config, args.tp, comm, itemsize=itemsize)
    return {"text": tok.decode([t for t in generated if t not in stop]), "ids": generated,
            "prompt_tokens": len(ids), "ttft_s": timings["ttft"], "tokens_per_s": tps,
            "allreduce_bytes_per_token": traffic["sent"], "exact_bytes_per_token":
            traffic["exact"], "load_s": load_s, "compile_s": compile_s,
            "traces": dict((str(k), v) for k, v in engine.traces.items())}


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def _main(args) -> int:
    r = run(args)
    ratio = (f" ({r['allreduce_bytes_per_token'] / r['exact_bytes_per_token']:.3f}x of exact)"
             if r["exact_bytes_per_token"] else "")
    print(f"[{cli.describe(args)}, TP={args.tp}] prompt {r['prompt_tokens']} tokens, "
          f"generated {len(r['ids'])}; load {r['load_s']:.1f} s, compile {r['compile_s']:.1f} s")
    print(f"TTFT {r['ttft_s'] * 1e3:.1f} ms, {r['tokens_per_s']:.1f} tokens/s, "
          f"all-reduce bytes sent per rank per token {r['allreduce_bytes_per_token']:.0f}{ratio}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
