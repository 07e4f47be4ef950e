"""Exact tensor parallelism changes nothing but f32 rounding: TP=N logits against TP=1.

    .venv/bin/python -m models.check_tp [--model smollm2] [--tp 3,9] [--tokens 128] [--json OUT]

Scores the first ``--tokens`` tokens of the corpus text at TP=1 in f32 and in f64 (the
reference for rounding), then at each TP size in f32 with exact communication (lax.psum) and
with the overlap strategy (ring collective matmuls). The tolerance is derived from TP=1 itself:
an f32 evaluation of the model is within ``e1 = max |logits_f32 - logits_f64|`` of the exact
function; a TP=N run is another f32 evaluation with its sums reassociated across ranks, so it
passes when its own distance to f64 is at most ``2 e1`` (and then, by the triangle inequality,
its distance to TP=1 is at most ``3 e1``). Uses max(TP) CPU devices. Without ``--tp``: every
size from 2 to 9 that divides the checkpoint's query heads (SmolLM2's 9 heads: 3 and 9;
Qwen2.5-1.5B's 12: 2, 3, 4, 6; Gemma 3 270M's 4: 2 and 4).
"""

from __future__ import annotations

import argparse
import json
import sys

from models import cli


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.check_tp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=cli.tp_list, default=None,
                        help="comma-separated TP sizes (default: every size from 2 to 9 that "
                             "divides the checkpoint's query heads)")
    parser.add_argument("--kinds", default="exact,overlap")
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def default_sizes(n_heads: int) -> list[int]:
    """The TP sizes checked without ``--tp``: those from 2 to 9 that divide ``n_heads``."""
    return [tp for tp in range(2, 10) if n_heads % tp == 0]


def _main(args) -> int:
    from models.checkpoints import open_checkpoint

    ckpt = open_checkpoint(args.model)  # reads no tensor and starts no jax backend
    sizes = args.tp if args.tp is not None else default_sizes(ckpt.config.n_heads)
    if not sizes:
        raise ValueError(f"{args.model}: {ckpt.config.n_heads} query heads: no TP size from 2 "
                         f"to 9 divides them; give --tp")
    cli.set_devices(max(sizes + [1]))
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jax_flashcomm.nn import TPComm
    from models.corpus import load_text
    from models.engine import Engine
    from models.machine import first_line
    from models.llama.params import load_model

    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    tokens = np.asarray([ckpt.tokenizer.encode(load_text())[:args.tokens]], np.int32)

    def logits(tp, kind="exact", dtype=jnp.float32):
        mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
        model, _ = load_model(args.model, tp=tp, mesh=mesh, comm=TPComm.from_kind(kind),
                              dtype=dtype, ckpt=ckpt)
        return np.asarray(Engine(model, mesh, cache_len=max(512, args.tokens)).score(tokens),
                          np.float64)

    print(first_line())
    with jax.enable_x64(True):
        f64 = logits(1, dtype=jnp.float64)
    f32 = logits(1)
    e1 = float(np.abs(f32 - f64).max())
    scale = float(np.abs(f64).max())
    print(f"{args.model}, {tokens.shape[1]} tokens: TP=1 f32 vs f64: max |d| = {e1:.3e} "
          f"(max |logit| {scale:.2f}); tolerance 2 e1 = {2 * e1:.3e}")
    rows, ok = [], True
    for tp in sizes:
        for kind in args.kinds.split(","):
            out = logits(tp, kind)
            d64, d1 = float(np.abs(out - f64).max()), float(np.abs(out - f32).max())
            passed = d64 <= 2 * e1
            ok &= passed
            rows.append({"tp": tp, "comm": kind, "max_abs_vs_f64": d64,
                         "max_abs_vs_tp1": d1, "passed": passed})
            print(f"TP={tp} {kind:<8} max |d| vs f64 {d64:.3e}, vs TP=1 f32 {d1:.3e}: "
                  f"{'ok' if passed else 'FAIL'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": first_line(), "model": args.model, "tokens": tokens.shape[1],
                       "tp1_f32_vs_f64": e1, "max_abs_logit": scale, "rows": rows}, f,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
