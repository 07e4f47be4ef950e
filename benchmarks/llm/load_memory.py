"""Load time and peak memory of a checkpoint in f32 and in bf16, each with a short generation.

    .venv/bin/python -m benchmarks.llm.load_memory --model qwen2.5-coder-1.5b --tp 2 \\
        [--dtypes float32 bfloat16] [--out docs/results/load_qwen2.5-1.5b]

Each dtype runs in a process of its own (``models.generate --greedy``: open the checkpoint,
dequantize, place the sharded parameters, compile, generate ``--max-new-tokens``), so its peak
resident memory (the child's own ``ru_maxrss``) is that dtype's alone. Printed and written
per dtype: the wall time of the load (checkpoint to placed parameters), of the compile, TTFT,
decode tokens/s, the peak resident memory, the parameters' bytes, and the generated text (the
same prompt, greedy), so the two dtypes can be compared on what they say.
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import command_parser

MODULE = "benchmarks.llm.load_memory"
PROMPT = "Write a Python function that returns the n-th Fibonacci number."


def child(args) -> dict:
    """One dtype in this process: ``models.generate``'s run, and the parameters' bytes."""
    import io

    from models import generate

    gen_args = generate.build_parser().parse_args(
        ["--model", args.model, "--tp", str(args.tp), "--dtype", args.dtype, "--greedy",
         "--prompt", PROMPT, "--max-new-tokens", str(args.max_new_tokens), "--comm", "exact"])
    r = generate.run(gen_args, out=io.StringIO())
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {**{k: r[k] for k in ("text", "load_s", "compile_s", "ttft_s", "tokens_per_s",
                                 "prompt_tokens")}, "peak_rss_gib": peak_kib / 2**20}


def measure(args, dtype: str) -> dict:
    """Run :func:`child` for ``dtype`` in a fresh interpreter; its row with the peak memory."""
    cmd = [sys.executable, "-m", MODULE, "--child", "--model", args.model, "--tp", str(args.tp),
           "--dtype", dtype, "--max-new-tokens", str(args.max_new_tokens)]
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{dtype}: the child failed (rc {done.returncode}):\n"
                         f"{done.stderr[-3000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {"dtype": dtype, **row, "process_s": wall}


def tables(record: dict) -> str:
    lines = [f"{record['model']} at TP={record['tp']}, one process per dtype, "
             f"{record['max_new_tokens']} greedy tokens of the prompt `{PROMPT}`.", "",
             "| dtype | load (s) | compile (s) | TTFT (ms) | tokens/s | peak RSS (GiB) | "
             "process (s) |", "|---|---|---|---|---|---|---|"]
    for r in record["rows"]:
        lines.append(f"| {r['dtype']} | {r['load_s']:.1f} | {r['compile_s']:.1f} | "
                     f"{1e3 * r['ttft_s']:.0f} | {r['tokens_per_s']:.2f} | "
                     f"{r['peak_rss_gib']:.1f} | {r['process_s']:.0f} |")
    lines += ["", "Generated:", ""]
    lines += [f"- {r['dtype']}: {json.dumps(r['text'])}" for r in record["rows"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = command_parser(MODULE, __doc__)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"],
                        choices=("float32", "bfloat16"))
    parser.add_argument("--max-new-tokens", type=int, default=8)
    parser.add_argument("--out", default=None,
                        help="OUT.json / OUT.md (default: docs/results/load_<model>)")
    parser.add_argument("--child", action="store_true", help=argparse_hidden())
    parser.add_argument("--dtype", default="float32", help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(args)))
        return 0
    from models.machine import first_line

    record = {"command": f"python -m {MODULE} " + " ".join(argv if argv is not None
                                                           else sys.argv[1:]),
              "machine": first_line(), "model": args.model, "tp": args.tp,
              "max_new_tokens": args.max_new_tokens, "rows": []}
    for dtype in args.dtypes:
        row = measure(args, dtype)
        print(f"{dtype}: load {row['load_s']:.1f} s, compile {row['compile_s']:.1f} s, peak "
              f"{row['peak_rss_gib']:.1f} GiB; {row['text']!r}", flush=True)
        record["rows"].append(row)
    out = args.out or str(RESULTS / f"load_{Path(args.model).name.removesuffix('.gguf')}")
    Path(out + ".json").write_text(json.dumps(record, indent=1))
    write_page(out + ".json", record, tables=tables(record))
    return 0


def argparse_hidden():
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
