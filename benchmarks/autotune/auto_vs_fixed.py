"""Decode and TTFT of SmolLM2 at TP=3 in one process, settings interleaved: is ``auto`` as fast as
the best fixed setting?

    .venv/bin/python -m benchmarks.autotune.auto_vs_fixed [--settings exact,int8,int4,auto] \\
        [--rounds 8] [--tokens 32] [--prompt-tokens 24,200] [--ttft-repeats 3] \\
        [--out docs/results/decode.json]

One process, ``--tp`` CPU devices (the models' in-process layout; ``models.demo`` runs the same
settings for 3 rounds, fewer than it takes to rank them within a few percent on 2 cores). Each
setting gets its compiled engine (prefill buckets and decode step warmed up); then ``--rounds``
rounds, each running every setting in turn (the order rotated every round, so slow spells of
the machine hit every setting alike): per prompt length ``1 + --ttft-repeats`` prefills (TTFT)
and, for the first, ``--tokens`` greedy decode steps (every step's time kept), the settings'
generations of the first prompt advanced a token at a time in turn, then the other prefills
one setting after another. Reported per setting: the median decode
step (and its tokens/s), the median TTFT per prompt length, and each against the best fixed
setting (every setting but ``auto``): ``auto / best`` >= 0.97 is the bar for decode (and
TTFT at most 1.05x the best's).
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path

from benchmarks.shared.results import write_page
from benchmarks.shared.runtime import MALLOC_KEEP, command_parser, reexec_with
from models import cli



def run(args) -> dict:
    cli.set_devices(args.tp)
    import jax

    from models.cli import parse_setting
    from models.corpus import load_text
    from models.engine import Engine
    from models.eval import progress
    from models.llama import set_comm
    from models.machine import describe, first_line
    from models.llama.params import load_model
    from jax_flashcomm import record
    from jax_flashcomm import costs as tuning

    print(first_line(), flush=True)
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    text_ids = ckpt.tokenizer.encode(load_text())
    prompts = {n: text_ids[:n] for n in args.prompt_tokens}
    settings = [parse_setting(s) for s in args.settings]
    engines, plans = {}, {}
    for name, comm in settings:
        set_comm(model, comm)
        engine = Engine(model, mesh, cache_len=max(prompts) + args.tokens + 8)
        with record() as recorded:
            for ids in prompts.values():
                list(engine.generate(ids, 2))
        engines[name] = (comm, engine)
        plans[name] = sorted({f"{p.op} {p.nbytes} B: {p.path}"
                              + (f" over {p.transport}" if p.transport else "")
                              for p in recorded})
        print(f"{name}: compiled; {plans[name]}", file=sys.stderr, flush=True)
    names = [n for n, _ in settings]
    steps, ttft = _timed_rounds(args, engines, prompts, names, set_comm, progress)
    rows = []
    for name, comm in settings:
        step = statistics.median(steps[name])
        rows.append({"setting": name, "comm": comm.kind, "decode_step_s": step,
                     "tokens_per_s": 1 / step, "decode_steps": len(steps[name]),
                     "ttft_s": {str(n): statistics.median(v) for n, v in ttft[name].items()},
                     "ttft_samples_s": {str(n): v for n, v in ttft[name].items()},
                     "decode_round_medians_s": [
                         statistics.median(steps[name][i:i + args.tokens - 1])
                         for i in range(0, len(steps[name]), args.tokens - 1)],
                     "plans": plans[name]})
    fixed = [r for r in rows if r["comm"] != "auto"]
    best_dec = max(r["tokens_per_s"] for r in fixed)
    for r in rows:
        r["decode_vs_best_fixed"] = r["tokens_per_s"] / best_dec
        r["ttft_vs_best_fixed"] = {n: min(f["ttft_s"][n] for f in fixed) / t
                                   for n, t in r["ttft_s"].items()}
    table = tuning.active()
    return {"machine": describe(), "tp": args.tp, "rounds": args.rounds, "tokens": args.tokens,
            "prompt_tokens": list(prompts), "tuning_table": None if table is None else
            {"created": table.created, "isa": table.codec.get("isa")},
            "command": ".venv/bin/python -m benchmarks.autotune.auto_vs_fixed "
                       + " ".join(sys.argv[1:]),
            "rows": rows}


def _timed_rounds(args, engines, prompts, names, set_comm, progress):
    """``--rounds`` rounds over the settings' engines (module docstring): every decode step's
    time per setting, and per setting and prompt length every TTFT."""
    from models.compare import advance_in_turn

    steps = {name: [] for name in names}
    ttft = {name: {n: [] for n in prompts} for name in names}
    start = time.perf_counter()
    first, *others = prompts
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        # the first prompt's generations a token at a time, the settings in turn
        advance_in_turn([(engines[name][1].generate(prompts[first], args.tokens),
                          functools.partial(set_comm, engines[name][1].model, engines[name][0]))
                         for name in order])
        for name in order:
            timings = engines[name][1].last_timings
            ttft[name][first].append(timings["ttft"])
            steps[name].extend(timings["decode"])
        for n in [first] * args.ttft_repeats + others * (1 + args.ttft_repeats):
            for name in order:
                comm, engine = engines[name]
                set_comm(engine.model, comm)
                list(engine.generate(prompts[n], 1))
                ttft[name][n].append(engine.last_timings["ttft"])
        progress(r + 1, args.rounds, start, sys.stderr, unit="rounds")
    return steps, ttft


def markdown(data) -> str:
    lengths = data["prompt_tokens"]
    head = ["setting", "decode tok/s (median step)", "vs best fixed",
            *(f"TTFT ms, {n} tokens" for n in lengths), *(f"vs best, {n}" for n in lengths)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        lines.append("| " + " | ".join([
            r["setting"], f"{r['tokens_per_s']:.2f}", f"{r['decode_vs_best_fixed']:.3f}x",
            *(f"{r['ttft_s'][str(n)] * 1e3:.1f}" for n in lengths),
            *(f"{r['ttft_vs_best_fixed'][str(n)]:.3f}x" for n in lengths)]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = command_parser("benchmarks.autotune.auto_vs_fixed", __doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--settings", default="exact,int8,int4,auto")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--ttft-repeats", type=int, default=3,
                    help="more prefills per prompt length, setting and round, in turn")
    ap.add_argument("--prompt-tokens", default="24,200")
    ap.add_argument("--out", default=None, help="write the JSON here")
    args = ap.parse_args(argv)
    try:
        args.settings = [s.strip() for s in args.settings.split(",") if s.strip()]
        args.prompt_tokens = sorted({int(n) for n in args.prompt_tokens.split(",")})
        for s in args.settings:
            cli.parse_setting(s)
    except ValueError as e:
        ap.error(str(e))
    if args.rounds < 1 or args.tokens < 2 or min(args.prompt_tokens) < 1 or args.tp < 2:
        ap.error("--rounds >= 1, --tokens >= 2, --prompt-tokens >= 1 and --tp >= 2")
    if not any(cli.parse_setting(s)[1].kind != "auto" for s in args.settings):
        ap.error("--settings needs at least one fixed setting to compare with")
    data = run(args)
    print(markdown(data))
    if args.out:
        Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
        write_page(args.out, data, tables=markdown(data))
        print("wrote", args.out, "and its page")
    return 0


if __name__ == "__main__":
    reexec_with(MALLOC_KEEP)
    sys.exit(main())
