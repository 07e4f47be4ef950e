"""One command for the evidence on the real model: accuracy tables, TTFT on emulated links, the
GPU cost model, their plots, and the README's headline table.

    .venv/bin/python -m benchmarks.evidence [--only accuracy ttft gpu_model headline] [--dry-run]

Runs, in order (each prints its own progress bar):

1. ``benchmarks.llm.accuracy``: SmolLM2 perplexity / KL / top-1 for every setting (TP 3 and 9)
   -> docs/results/accuracy.{json,md,png} (about 50 minutes on 2 cores).
2. ``benchmarks.llm.ttft.links``: TTFT and decode at TP=3, 3 gloo processes on a tc-limited
   loopback (root) -> docs/results/ttft.{json,md,png} (about 15 minutes).
3. ``benchmarks.gpu.cost_model``: the cost model, checked against 2. and the all-reduce
   measurements -> docs/results/gpu_model.{json,md,png} (seconds).
4. the headline table of README.md, from the three JSON files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.shared.pages import replace_block
from benchmarks.shared.results import REPO, RESULTS
from benchmarks.shared.runtime import command_parser

BEGIN, END = "<!-- evidence headline: begin -->", "<!-- evidence headline: end -->"
STEPS = {
    "accuracy": [sys.executable, "-m", "benchmarks.llm.accuracy"],
    "ttft": [sys.executable, "-m", "benchmarks.llm.ttft.links"],
    "gpu_model": [sys.executable, "-m", "benchmarks.gpu.cost_model"],
}


def _load(name):
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _accuracy_row(acc, label, tp=3):
    return next((r for r in acc["rows"] if r["label"] == label and r["tp"] == tp), None)


def headline(acc, ttft, model) -> str:
    """The README's table: per setting, the accuracy cost at TP=3 and the measured TTFT speedups
    against the exact all-reduce that moves bf16 (a GPU user's baseline) first, against
    XLA:CPU's f32 exact all-reduce second, and the predicted ones (a dash where a file or row
    is missing)."""
    rows = [("auto (default, int8 budget)", None, "auto"),
            ("int8 (default)", "int8 default", "int8"), ("int6 (default)", "int6 default", "int6"),
            ("rs4/ag8 (default)", "rs4/ag8 default", "int4/8"),
            ("int4 (default)", "int4 default", "int4")]
    ttft_rows = {(r["link"], r["strategy"]): r for r in (ttft or {}).get("rows", [])}
    paper = {p["gpu"]: p["predicted"] for p in (model or {}).get("predictions", {}).get(
        "paper", []) if p["kind"] == "ttft"}

    def speedup(link, strategy, baseline):
        base, row = ttft_rows.get((link, baseline)), ttft_rows.get((link, strategy))
        return f"{base['ttft_s'] / row['ttft_s']:.2f}x" if base and row else "-"

    def predicted(gpu, strategy):
        value = paper.get(gpu, {}).get(strategy)
        return f"{value:.2f}x" if value else "-"

    lines = ["| setting (SmolLM2-135M, TP=3) | wire vs bf16 ring | Δ perplexity | KL vs exact "
             "| top-1 = exact | TTFT vs bf16 exact, PCIe-class link | NVLink-class link "
             "| TTFT vs f32 exact, PCIe / NVLink "
             "| predicted TTFT speedup L40 / A100 (70B, TP=4) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, label, strategy in rows:
        r = _accuracy_row(acc, label) if acc and label else None
        acc_cells = ([f"{r['vs_bf16_ring']:.3f}x", f"{100 * r['delta_ppl']:+.2f}%",
                      f"{r['kl']:.1e}", f"{100 * r['top1']:.1f}%"] if r else
                     ["as int8 where it quantizes"] + ["-"] * 3 if label is None else ["-"] * 4)
        lines.append(f"| {name} | " + " | ".join(acc_cells)
                     + f" | **{speedup('pcie', strategy, 'exact-bf16')}**"
                     f" | **{speedup('nvlink', strategy, 'exact-bf16')}**"
                     f" | {speedup('pcie', strategy, 'exact')} / "
                     f"{speedup('nvlink', strategy, 'exact')}"
                     f" | {predicted('L40', strategy)} / {predicted('A100', strategy)} |")
    machines = {(acc or {}).get("machine", "?"), (ttft or {}).get("machine", "?")}
    where = (f"on `{machines.pop()}`" if len(machines) == 1 else
             f"accuracy on `{(acc or {}).get('machine', '?')}`, TTFT on "
             f"`{(ttft or {}).get('machine', '?')}`")
    lines.append(f"\nMeasured {where} by `.venv/bin/python -m benchmarks.evidence` "
                 "(docs/accuracy.md, docs/ttft.md, docs/gpu_model.md). bf16 exact: the exact "
                 "all-reduce moving bf16 (`benchmarks/collectives/bf16_baseline.py`), half the "
                 "bytes of XLA:CPU's f32 `lax.psum`.")
    return "\n".join(lines)


def write_headline(readme: Path) -> str:
    table = headline(_load("accuracy"), _load("ttft"), _load("gpu_model"))
    replace_block(readme, BEGIN, END, table)
    return table


def main(argv=None) -> int:
    parser = command_parser("benchmarks.evidence", __doc__)
    parser.add_argument("--only", nargs="+", choices=[*STEPS, "headline"],
                        default=[*STEPS, "headline"])
    parser.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = parser.parse_args(argv)
    steps = [s for s in [*STEPS, "headline"] if s in args.only]
    if "ttft" in steps and os.geteuid() != 0 and not args.dry_run:
        parser.error("the TTFT step needs root (network namespaces and tc); "
                     "leave it out with --only")
    times = {}
    for i, step in enumerate(steps, 1):
        command = STEPS.get(step, ["(README.md headline table)"])
        print(f"== [{i}/{len(steps)}] {step}: {' '.join(command)}", flush=True)
        if args.dry_run:
            continue
        start = time.perf_counter()
        if step == "headline":
            print(write_headline(REPO / "README.md"))
        else:
            subprocess.run(command, cwd=REPO, check=True)
        times[step] = time.perf_counter() - start
        print(f"== [{i}/{len(steps)}] {step}: {times[step] / 60:.1f} min", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
