"""A Llama (or a Qwen2, a Gemma 3: the checkpoint says) written with Explicit sharding
(``examples/explicit_llama.py``) or with sharding annotations on Auto axes (``--style gspmd``:
``examples/gspmd_llama.py``), rewritten.

    .venv/bin/python -m models.corpus --out text.txt
    .venv/bin/python -m examples.rewrite_llama --model smollm2 --tp 3 --text text.txt \\
        --window 512 --max-windows 6 [--settings exact,int8,...] [--json OUT]

Scores the same windows as ``models.eval`` (tokenized without BOS, consecutive windows, each on
its own) under each setting and prints perplexity, the time to first token of one window
(prefill, median of 3 after compiling) and the rewrite report:

* ``exact``: the model as written (XLA's collectives);
* ``rewritten-exact``: ``rewrite(logits, CommConfig(bits=None))``, the islands with exact
  collectives (the rewrite's own check: it must equal ``exact`` within f32 rounding);
* ``int8``: ``rewrite(logits, CommConfig(bits=8, min_bytes=1 << 20))``, the library's defaults
  otherwise (rotation) and the 1 MiB size policy the figures of docs/rewrite.md were measured
  with, i.e. ``models.eval --comm flash --bits 8 --min-bytes 1048576``;
* ``int8-norm``: ``int8`` with ``fuse_norm=True``: each all-reduce, the residual add and the
  next RMSNorm are one ``psum_add_rms_norm`` (``docs/fused_norm.md``);
* ``int8-fused``: the sequence-parallel form rewritten with ``fuse_matmul=True``: the gathers
  fused with the column-parallel dots into ``all_gather_matmul`` rings (int8 chunks), the
  reduce-scatters quantized after the row-parallel dots.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time

SETTINGS = ("exact", "rewritten-exact", "int8", "int8-norm", "int8-fused")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m examples.rewrite_llama", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2", help="a known model name, a .gguf file "
                        "or a Hugging Face directory")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--text", required=True, help="a UTF-8 text file")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help=f"comma-separated, among {', '.join(SETTINGS)}")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--style", choices=("explicit", "gspmd"), default="explicit",
                        help="the model as written with Explicit sharding "
                        "(examples/explicit_llama.py) or with sharding annotations on Auto axes "
                        "(examples/gspmd_llama.py)")
    parser.add_argument("--quiet-report", action="store_true",
                        help="print the report's summary line only")
    return parser


def _setting(name: str):
    """``(sequence_parallel, RewritePolicy or None)`` of a setting."""
    import jax_flashcomm as fc
    from jax_flashcomm.rewrite import RewritePolicy

    INT8 = fc.CommConfig(bits=8, min_bytes=1 << 20)  # noqa: N806  (the settings' int8 config)
    return {"exact": (False, None),
            "rewritten-exact": (False, RewritePolicy(config=fc.CommConfig(bits=None))),
            "int8": (False, RewritePolicy(config=INT8)),
            "int8-norm": (False, RewritePolicy(config=INT8, fuse_norm=True)),
            "int8-fused": (True, RewritePolicy(config=INT8, fuse_matmul=True))}[name]


def run(args, log=sys.stderr) -> dict:
    from models.cli import set_devices

    set_devices(args.tp)
    import jax
    from jax.sharding import AxisType

    from examples import explicit_llama
    from models.checkpoints import open_checkpoint
    from models.eval import window_tokens

    ckpt = open_checkpoint(args.model)
    if ckpt.tokenizer is None:
        raise SystemExit(f"{args.model}: the checkpoint has no tokenizer")
    with open(args.text, encoding="utf-8") as f:
        windows = window_tokens(ckpt.tokenizer.encode(f.read()), args.window, args.max_windows)
    axis_type = AxisType.Explicit if args.style == "explicit" else AxisType.Auto
    mesh = jax.make_mesh((args.tp,), ("tp",), axis_types=(axis_type,),
                         devices=jax.devices()[:args.tp])
    with jax.set_mesh(mesh):
        dims, weights = explicit_llama.load(ckpt, mesh)
        results, reports = evaluate(dims, weights, windows, args.settings.split(","),
                                    style=args.style, mesh=mesh, log=log)
    for name, report in reports.items():
        text = str(report)
        print(f"{name}: " + (text.splitlines()[-1] if args.quiet_report else "\n" + text))
    return results


def evaluate(dims, weights, windows, settings, *, style: str = "explicit", mesh=None,
             log=sys.stderr) -> tuple[dict, dict]:
    """Perplexity, TTFT and report of each setting (call under the model's mesh).

    Args:
      dims, weights: :func:`examples.explicit_llama.load`'s results.
      windows: token id lists of one length.
      settings: names among :data:`SETTINGS`.
      style: ``"explicit"`` (:mod:`examples.explicit_llama`) or ``"gspmd"``
        (:mod:`examples.gspmd_llama`, on ``mesh``'s Auto axes).
      mesh: the weights' mesh.
      log: where the progress goes.

    Returns:
      ``({setting: {"perplexity", "tokens", "ttft_s", "first_window_s", "report_counts",
      "report_rows", "report_compile_s"}}, {setting: Report}``) (rewritten settings only in
      the second). ``first_window_s`` includes the compile; ``report_compile_s`` is the extra
      compile of a GSPMD report (None otherwise).
    """
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from examples import explicit_llama, gspmd_llama
    from jax_flashcomm.rewrite import rewrite
    from models.eval import nll_fn, progress

    nll, results, reports = nll_fn(), {}, {}
    window = len(windows[0])
    for name in settings:
        sp, policy = _setting(name)
        length = -(-window // dims.tp) * dims.tp if sp else window   # sequence parallel: S % TP
        gspmd = style == "gspmd"
        fn = (functools.partial(gspmd_llama.logits, dims, mesh, sequence_parallel=sp) if gspmd
              else functools.partial(explicit_llama.logits, dims, sequence_parallel=sp))
        placed = NamedSharding(mesh, P()) if gspmd else None
        if policy is not None:
            reports[name] = rewrite(fn, policy).report(
                weights_spec(weights),
                jax.ShapeDtypeStruct((1, length), np.int32, sharding=placed))
            fn = rewrite(fn, policy)
        # a rewritten GSPMD function is called outside jit: it reads the arguments' shardings
        # and compiles itself once per signature
        score = fn if gspmd and policy is not None else jax.jit(fn)

        def logits_of(w, score=score, length=length):
            tokens = np.zeros((1, length), np.int32)
            tokens[0, :len(w)] = w
            return score(weights, jax.device_put(tokens, placed))[:, :len(w)]

        start, per_window, first = time.perf_counter(), [], 0.0
        print(f"{name}: {len(windows)} windows of {window} tokens, TP={dims.tp}", file=log)
        progress(0, len(windows), start, log)
        for i, w in enumerate(windows):
            tokens = np.asarray([w], np.int32)
            per_window.append(np.asarray(nll(logits_of(w), tokens))[0].astype(np.float64))
            if i == 0:
                first = time.perf_counter() - start
            progress(i + 1, len(windows), start, log)
        ttft = []
        for _ in range(3):
            t0 = time.perf_counter()
            jax.block_until_ready(logits_of(windows[0]))
            ttft.append(time.perf_counter() - t0)
        all_nll = np.concatenate(per_window)
        report = reports.get(name)
        results[name] = {"perplexity": math.exp(float(all_nll.mean())),
                         "tokens": int(all_nll.size), "ttft_s": statistics.median(ttft),
                         "first_window_s": first,
                         "report_counts": dict(report.counts()) if report else {},
                         "report_rows": len(report) if report else 0,
                         "report_compile_s": report.compile_seconds if report else None}
        print(f"{name}: perplexity {results[name]['perplexity']:.6f}, TTFT "
              f"{results[name]['ttft_s'] * 1e3:.0f} ms", file=log)
    return results, reports


def weights_spec(weights: dict):
    """``weights`` with its arrays as ShapeDtypeStructs (a report traces, runs nothing)."""
    import jax

    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding)
                        if isinstance(a, jax.Array) else a, weights)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.settings.split(",") if s not in SETTINGS]
    if unknown:
        parser.error(f"--settings: unknown {unknown}; choose among {', '.join(SETTINGS)}")
    if args.tp < 1:
        parser.error("--tp must be at least 1")
    if not os.path.isfile(args.text):
        parser.error(f"--text {args.text}: no such file")
    results = run(args)
    from models.machine import first_line

    print(f"{'setting':<16} {'perplexity':>12} {'TTFT ms':>9}  report")
    for name, r in results.items():
        print(f"{name:<16} {r['perplexity']:>12.6f} {r['ttft_s'] * 1e3:>9.0f}  "
              f"{r['report_counts'] or '-'}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"results": results, "machine": first_line(), "options": vars(args)}, f,
                      indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
