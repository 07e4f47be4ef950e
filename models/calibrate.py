"""Choose each all-reduce's format within a perplexity budget: a per-site comm policy.

    .venv/bin/python -m models.calibrate --model smollm2 --tp 3 --max-wire 0.35 \\
        --budget-ppl 0.5 --out policy.json

Runs the model on calibration windows of ``--text`` (default: the ``models.corpus`` text the
accuracy tables use, from window ``--calib-first``: after the 6 windows ``models.eval`` scores,
so a policy is never judged on the text it was chosen on), and calls
:func:`jax_flashcomm.calibrate`:

1. each all-reduce alone in each ``--candidates`` setting, the others exact: its sensitivity,
   the KL of the next-token distributions against exact's, as a perplexity change
   (``100 * (exp(KL) - 1)`` percent: the expected change when the model's own distribution is
   the data's; smooth and additive, where a single site's measured perplexity change is noise);
2. the cheapest per-site choice whose summed sensitivities fit the budget and whose mean wire
   bytes fit ``--max-wire`` (over a bf16 ring's);
3. that policy whole, held to ``--budget-ppl`` (percent) on the measured calibration
   perplexity; the target shrinks while it misses (``--rounds``).

The policy file (a :class:`jax_flashcomm.CommPolicy`) goes to ``--out``; ``models.eval``,
``models.generate`` and ``models.compare`` take it as ``--comm-policy FILE``. docs/calibration.md
has the measurements.
"""

from __future__ import annotations

import argparse
import math
import sys
import time

from models import cli

#: The default candidate settings (``models.compare`` setting names), cheapest first.
CANDIDATES = "nvfp4,nvfp4/fp8,int8"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.calibrate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2",
                        help="a known model name (smollm2), a GGUF file or a Hugging Face "
                             "directory")
    parser.add_argument("--tp", type=int, default=3, help="tensor-parallel size")
    parser.add_argument("--max-wire", dest="max_wire", type=float, default=None,
                        help="the cap on the mean wire bytes per element over a bf16 ring's "
                             "(e.g. 0.35; default: none)")
    parser.add_argument("--budget-ppl", dest="budget_ppl", type=float, required=True,
                        help="the perplexity increase the policy may add, in percent of exact's "
                             "on the calibration windows (e.g. 0.5)")
    parser.add_argument("--out", required=True, help="the policy file to write (JSON)")
    parser.add_argument("--candidates", default=CANDIDATES,
                        help=f"comma-separated quantized settings of models.compare (intB, "
                             f"intR/A, fp8, mxfp4, nvfp4, nvfp4/fp8, ...; default {CANDIDATES}): "
                             f"each site takes one of them or stays exact")
    parser.add_argument("--text", default=None,
                        help="calibration text file (default: models.corpus pydoc-topics)")
    parser.add_argument("--calib-first", dest="calib_first", type=int, default=6,
                        help="the first calibration window (default 6: after the windows "
                             "models.eval scores)")
    parser.add_argument("--calib-windows", dest="calib_windows", type=int, default=4,
                        help="calibration windows (default 4)")
    parser.add_argument("--window", type=int, default=512, help="tokens per window")
    parser.add_argument("--rounds", type=int, default=4,
                        help="whole-policy measurements at most (default 4)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--sensitivity-from", dest="sensitivity_from", default=None,
                        metavar="FILE",
                        help="a policy file of an earlier run (same model, TP, candidates and "
                             "calibration windows): reuse its per-site sensitivities, measure "
                             "only whole policies (another budget or cap in minutes)")
    parser.add_argument("--plot", default=None, metavar="PNG",
                        help="also draw each site's sensitivity per candidate and the choice")
    return parser


def reused_sensitivity(args) -> dict | None:
    """The per-site sensitivities of ``--sensitivity-from``, checked against the options."""
    if args.sensitivity_from is None:
        return None
    from jax_flashcomm.policy import config_to_dict

    info = cli.load_policy(args.sensitivity_from).info
    wanted = {"model": args.model, "tp": args.tp, "dtype": args.dtype, "window": args.window,
              "calib_first": args.calib_first, "calib_windows": args.calib_windows}
    differ = {k: (info.get(k), v) for k, v in wanted.items() if info.get(k) != v}
    if args.text is not None and info.get("text") != args.text:
        differ["text"] = (info.get("text"), args.text)
    candidates = [config_to_dict(c) for c in checked_candidates(args)]
    if list((info.get("candidates") or {}).values()) != candidates:
        differ["candidates"] = (info.get("candidate_settings"), args.candidates)
    if differ or "sensitivity" not in info:
        why = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in differ.items())
        raise ValueError(f"--sensitivity-from {args.sensitivity_from}: measured under other "
                         f"options ({why or 'no sensitivity recorded'})")
    return info["sensitivity"]


def candidate_configs(text: str):
    """The quantized :class:`jax_flashcomm.CommConfig` of each ``--candidates`` name."""
    configs = []
    for name in (n.strip() for n in text.split(",")):
        label, comm = cli.parse_setting(name)
        if comm.quantization != "quantized" or comm.layout != "all_reduce":
            raise ValueError(f"--candidates: {label!r} is not a quantized all-reduce setting "
                             f"(intB, intR/A, fp8, mxfp4, nvfp4, R/A of those)")
        configs.append(comm.config)
    return configs


def checked_candidates(args):
    """The candidate configs :func:`main` parsed (``args.candidate_configs``), or those of
    ``args.candidates`` for options that did not go through it."""
    parsed = getattr(args, "candidate_configs", None)
    return parsed if parsed is not None else candidate_configs(args.candidates)


def run(args, log=sys.stderr):
    """Calibrates; returns the :class:`jax_flashcomm.CommPolicy` (also written to ``--out``)."""
    cli.set_devices(args.tp)
    import jax
    import jax.numpy as jnp

    import jax_flashcomm as fc
    from jax_flashcomm.nn import TPComm
    from models import corpus
    from models.eval import window_tokens
    from models.llama import policy_comms, set_comm, site_names
    from models.machine import first_line
    from models.window_scores import score_windows
    from models.llama.params import load_model

    candidates = checked_candidates(args)
    reused = reused_sensitivity(args)
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    dtype = jnp.float32 if args.dtype == "float32" else jnp.bfloat16
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh, dtype=dtype)
    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    if args.text is None:
        text, text_name = corpus.load_text(corpus.DEFAULT), f"models.corpus {corpus.DEFAULT}"
    else:
        with open(args.text, encoding="utf-8") as f:
            text, text_name = f.read(), args.text
    windows = window_tokens(ckpt.tokenizer.encode(text), args.window,
                            args.calib_first + args.calib_windows)[args.calib_first:]
    if len(windows) < args.calib_windows:
        raise ValueError(f"the text has {len(windows) + args.calib_first} windows of "
                         f"{args.window} tokens, too few for --calib-first {args.calib_first} "
                         f"--calib-windows {args.calib_windows}")
    n_layers = ckpt.config.n_layers
    start = time.perf_counter()
    set_comm(model, TPComm("exact"))
    exact = score_windows(model, mesh, windows)
    reference, exact_nll = exact["logps"], float(exact["nll"].mean())
    print(f"{first_line()}\nexact calibration perplexity {math.exp(exact_nll):.4f} over "
          f"{exact['nll'].size} predictions ({len(windows)} windows of {args.window})", file=log)
    measured = {}

    def scored(assignment):
        key = tuple(sorted((s, c) for s, c in assignment.items()))
        if key not in measured:
            comm, overrides = policy_comms(fc.CommPolicy(sites=tuple(assignment.items())),
                                           n_layers)
            set_comm(model, comm, overrides=overrides)
            r = score_windows(model, mesh, windows, reference)
            measured[key] = (float(r["kl"].mean()), float(r["nll"].mean()))
        return measured[key]

    def kl_percent(assignment):
        return 100.0 * math.expm1(scored(assignment)[0])

    def ppl_percent(assignment):
        return 100.0 * math.expm1(scored(assignment)[1] - exact_nll)

    policy = fc.calibrate(
        kl_percent, site_names(n_layers), candidates, budget=args.budget_ppl,
        max_wire=args.max_wire, rounds=args.rounds, verify=ppl_percent, sensitivity=reused,
        progress_out=log,
        info={"model": args.model, "tp": args.tp, "dtype": args.dtype, "text": text_name,
              "calib_first": args.calib_first, "calib_windows": args.calib_windows,
              "window": args.window, "exact_perplexity": math.exp(exact_nll),
              "sensitivity_measure": "100 * (exp(mean KL) - 1), one site alone",
              "budget_measure": "calibration perplexity change, percent",
              "candidate_settings": [n.strip() for n in args.candidates.split(",")],
              "machine": first_line()})
    final = scored(dict((s, c) for s, c in policy.sites if c is not None))
    policy.info.update(kl=final[0], perplexity=math.exp(final[1]),
                       seconds=time.perf_counter() - start)
    policy.save(args.out)
    return policy


def chosen_settings(policy) -> list[str]:
    """The candidate setting name (``--candidates``) each site of a calibrated policy got, in
    site order; ``"exact"`` for a site kept exact."""
    from jax_flashcomm.policy import config_to_dict

    info = policy.info
    names = {repr(options): name for name, options in zip(info["candidate_settings"],
                                                           info["candidates"].values())}
    return [names.get(repr(config_to_dict(c)), "exact") for _, c in policy.sites]


def summary(policy) -> str:
    """What the policy chose, in a few lines."""
    from collections import Counter

    info = policy.info
    counts = Counter(chosen_settings(policy))
    mix = ", ".join(f"{n} {name}" for name, n in counts.most_common())
    state = "within" if info["met"] else "NOT within"
    return (f"{len(policy.sites)} sites: {mix}; mean wire {info['mean_wire']:.3f}x of a bf16 "
            f"ring; calibration perplexity {info['perplexity']:.4f} "
            f"({info['measured']:+.2f}%, {state} the budget {info['budget']}%; predicted "
            f"{info['predicted']:+.2f}%), {info['seconds']:.0f} s")


def plot(policy, path) -> None:
    """Each site's sensitivity per candidate (log scale) and the candidate the policy chose."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    info = policy.info
    names = info["candidate_settings"]
    labels = list(info["candidates"])
    sites = [s for s, _ in policy.sites]
    fig, ax = plt.subplots(figsize=(max(8, 0.22 * len(sites)), 4))
    width = 0.8 / len(labels)
    for k, (label, name) in enumerate(zip(labels, names)):
        values = [max(info["sensitivity"][s][label], 1e-4) for s in sites]
        ax.bar([i + (k - (len(labels) - 1) / 2) * width for i in range(len(sites))], values,
               width, label=name)
    for i, chosen in enumerate(chosen_settings(policy)):
        ax.annotate(chosen, (i, 1e-4),
                    rotation=90, fontsize=6, ha="center", va="bottom", xytext=(0, 2),
                    textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xticks(range(len(sites)), sites, rotation=90, fontsize=6)
    ax.set_ylabel("sensitivity: 100 (exp(KL) - 1), %")
    met = "met" if info["met"] else "not met"
    ax.set_title(f"{info.get('model')} TP={info.get('tp')}: one site alone per candidate; "
                 f"chosen (bottom): mean wire {info['mean_wire']:.3f}x, calibration "
                 f"{info['measured']:+.2f}% (budget {info['budget']}%, {met})", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, args)
    if not args.budget_ppl >= 0:
        parser.error(f"--budget-ppl must be >= 0 (percent), got {args.budget_ppl}")
    try:
        args.candidate_configs = candidate_configs(args.candidates)
        reused_sensitivity(args)
    except (ValueError, OSError) as e:
        parser.error(str(e))

    def body():
        policy = run(args)
        print(summary(policy))
        if args.plot:
            plot(policy, args.plot)
        print(f"wrote {args.out}")
        return 0

    return cli.run_checked(parser, body)


if __name__ == "__main__":
    sys.exit(main())
