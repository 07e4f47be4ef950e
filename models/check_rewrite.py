"""Perplexity of comm="exact" rewritten by jax_flashcomm.rewrite against comm="flash".

    .venv/bin/python -m models.check_rewrite --model smollm2 --tp 3 --bits 8 --text FILE \\
        --window 512 --max-windows 2 [--json OUT]

The same weights are scored twice per window, as models.eval does: with comm="flash" and the
given options, and with comm="exact" (lax.psum after every row-parallel matmul) whose scoring
step is rewritten by ``jax_flashcomm.rewrite`` with the same CommConfig. The embedding's exact
psum, which comm="flash" keeps exact too, is skipped by the policy
(``skip_sites=("VocabParallelEmbedding",)``). Prints both perplexities, whether they are equal
and whether every window's logits are bit-equal, the rewrite report, and for reference the
perplexity of comm="exact" itself (lax.psum, not rewritten).
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from models import cli
from models.eval import write_json, nll_fn, progress, run_windows_cli, setup_windows

#: The policy's call-site filter: comm="flash" quantizes the row-parallel all-reduces only.
SKIP_SITES = ("VocabParallelEmbedding",)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.check_rewrite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_common(parser)
    parser.set_defaults(comm="flash")
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    return parser


def run(args, log=sys.stderr) -> dict:
    model, ckpt, mesh, comm, windows = setup_windows(args)
    import jax
    import numpy as np

    from jax_flashcomm.nn import TPComm
    from jax_flashcomm.rewrite import RewritePolicy, rewrite
    from models.engine import Engine
    from models.llama import set_comm

    cache_len = max(args.window, 64)
    flash = Engine(model, mesh, cache_len=cache_len)                 # captures comm="flash"
    exact = Engine(set_comm(model, TPComm("exact", comm.axis_name)), mesh, cache_len=cache_len)
    policy = RewritePolicy(config=comm.config, skip_sites=SKIP_SITES)
    rewritten = rewrite(exact._score, policy)
    rewritten_score = jax.jit(rewritten)
    nll = nll_fn()
    results = {"flash": [], "rewritten": [], "exact": []}
    bit_equal, start = [], time.perf_counter()
    print(f"{cli.describe(args)} vs exact rewritten, TP={args.tp}: {len(windows)} windows of "
          f"{args.window} tokens", file=log)
    progress(0, len(windows), start, log)
    report = None
    for i, w in enumerate(windows):
        tokens = np.asarray([w], np.int32)
        if report is None:
            report = rewritten.report(exact.state, exact._put(tokens))
        logits_flash = np.asarray(flash.score(tokens))
        logits_rewritten = np.asarray(rewritten_score(exact.state, exact._put(tokens)))
        logits_exact = np.asarray(exact.score(tokens))
        bit_equal.append(bool(np.array_equal(logits_flash, logits_rewritten)))
        for key, logits in (("flash", logits_flash), ("rewritten", logits_rewritten),
                            ("exact", logits_exact)):
            results[key].append(np.asarray(nll(logits, tokens))[0].astype(np.float64))
        progress(i + 1, len(windows), start, log)
    ppl = {k: math.exp(float(np.concatenate(v).mean())) for k, v in results.items()}
    return {
        "perplexity_flash": ppl["flash"],
        "perplexity_exact_rewritten": ppl["rewritten"],
        "perplexities_equal": ppl["flash"] == ppl["rewritten"],
        "perplexity_exact_lax": ppl["exact"],
        "logits_bit_equal_per_window": bit_equal,
        "tokens": int(sum(v.size for v in results["flash"])),
        "seconds": time.perf_counter() - start,
        "policy": repr(policy),
        "report": [dict(vars(r)) for r in report],
        "report_table": str(report),
        "options": {k: getattr(args, k) for k in (
            "model", "tp", "bits", "rs_bits", "ag_bits", "group_size", "spikes", "rotation",
            "min_bytes", "dtype", "window", "max_windows", "text")},
        "comm": cli.describe(args),
    }


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.comm not in ("flash",):
        parser.error("--comm: the check compares comm='flash' with comm='exact' rewritten; "
                     "leave --comm at flash")
    result = run_windows_cli(parser, args, run)
    if result is None:
        return 2
    print(result["report_table"])
    print(f"perplexity comm=flash             {result['perplexity_flash']:.6f}")
    print(f"perplexity comm=exact, rewritten  {result['perplexity_exact_rewritten']:.6f}")
    print(f"perplexity comm=exact (lax)       {result['perplexity_exact_lax']:.6f}")
    print(f"equal: {result['perplexities_equal']}; logits bit-equal per window: "
          f"{result['logits_bit_equal_per_window']} ({result['tokens']} tokens, {result['comm']}, "
          f"TP={args.tp}, {result['seconds']:.1f} s)")
    if args.json and cli.run_checked(parser, write_json, args.json, result, default=str):
        return 2
    return 0 if result["perplexities_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
