"""Perplexity of a tensor-parallel Llama on a text file, under a communication strategy.

    .venv/bin/python -m models.eval --model smollm2 --text FILE --tp 3 --comm flash --bits 4 \\
        --window 512 --max-windows 6 [--json OUT]

The text is tokenized without BOS and cut into consecutive non-overlapping windows of
``--window`` tokens; the first ``--max-windows`` are scored, each on its own (no state carried
between windows): every token after the first of a window is predicted from those before it.
Perplexity is exp of the mean negative log-likelihood over all those predictions.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time

from models import cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.eval", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_common(parser)
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    return parser


def progress(done: int, total: int, start: float, out=sys.stderr, *, unit: str = "windows",
             what: str = "") -> None:
    """:func:`jax_flashcomm.tune.progress`, counting ``windows`` by default."""
    from jax_flashcomm import tune

    tune.progress(done, total, start, out, unit=unit, what=what)


def window_tokens(ids, window: int, max_windows: int):
    """The first ``max_windows`` full non-overlapping windows of ``ids``."""
    count = min(len(ids) // window, max_windows)
    if count == 0:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return [ids[i * window:(i + 1) * window] for i in range(count)]


def nll_fn():
    import jax
    import jax.numpy as jnp

    @jax.jit
    def nll(logits, tokens):
        """Negative log-likelihood of tokens[:, 1:] given the logits at the positions before."""
        logp = jax.nn.log_softmax(logits[:, :-1].astype(jnp.float32), axis=-1)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]

    return nll


def setup_windows(args):
    """``(model, ckpt, mesh, comm, windows)``: the model of ``args`` on its mesh (this sets the
    device count, then imports jax) and the token windows of ``args.text``."""
    with open(args.text, encoding="utf-8") as f:
        text = f.read()
    model, ckpt, mesh, comm = cli.setup(args)
    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    windows = window_tokens(ckpt.tokenizer.encode(text), args.window, args.max_windows)
    return model, ckpt, mesh, comm, windows


def run(args, log=sys.stderr) -> dict:
    model, ckpt, mesh, _, windows = setup_windows(args)
    import numpy as np

    import jax_flashcomm as fc
    from models import traffic
    from models.engine import Engine

    engine = Engine(model, mesh, cache_len=max(args.window, 64))
    nll = nll_fn()
    per_window, start = [], time.perf_counter()
    print(f"{cli.describe(args)}, TP={args.tp}: {len(windows)} windows of {args.window} tokens",
          file=log)
    progress(0, len(windows), start, log)
    with fc.record() as plans:  # the plans of the calls that ran (traced in the first window)
        for i, w in enumerate(windows):
            tokens = np.asarray([w], np.int32)
            per_window.append(np.asarray(nll(engine.score(tokens), tokens))[0]
                              .astype(np.float64))
            progress(i + 1, len(windows), start, log)
    all_nll = np.concatenate(per_window)
    wire, paths = traffic.plans_wire_vs_bf16(plans)
    return {
        "perplexity": math.exp(float(all_nll.mean())),
        "tokens": int(all_nll.size),
        "mean_nll": float(all_nll.mean()),
        "window_perplexity": [math.exp(float(w.mean())) for w in per_window],
        "wire_vs_bf16": wire,
        "all_reduce_paths": paths,
        "seconds": time.perf_counter() - start,
        "options": {k: getattr(args, k) for k in (
            "model", "tp", "comm", "bits", "rs_bits", "ag_bits", "format", "rs_format",
            "ag_format", "group_size", "spikes",
            "rotation", "min_bytes", "dtype", "window", "max_windows", "text", "fuse_norm",
            "comm_policy")},
        "comm": cli.describe(args),
        "machine": platform.processor() or platform.machine(),
        "traces": {str(k): v for k, v in engine.traces.items()},
    }


def run_windows_cli(parser, args, run_fn) -> dict | None:
    """The common part of the perplexity CLIs: checks the options, runs ``run_fn(args)`` and
    adds the machine it ran on; ``None`` (the error printed) when the checkpoint or text fails."""
    cli.check(parser, args, quantize_all=True)
    try:
        result = run_fn(args)
    except cli.RUN_ERRORS as e:
        cli.fail(parser, e)
        return None
    from models.machine import first_line

    result["machine"] = first_line()
    return result


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    result = run_windows_cli(parser, args, run)
    if result is None:
        return 2
    print(f"perplexity {result['perplexity']:.4f} over {result['tokens']} tokens "
          f"({result['comm']}, TP={args.tp}, {result['seconds']:.1f} s)")
    if args.json:
        return cli.run_checked(parser, write_json, args.json, result)
    return 0


def write_json(path, result, **kwargs) -> int:
    """Write ``result`` as JSON to ``path``; exit status 0."""
    with open(path, "w") as f:
        json.dump(result, f, indent=1, **kwargs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
