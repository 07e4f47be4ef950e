"""Which all-reduces of a model a low-bit setting hurts, and a per-site policy chosen from that.

    .venv/bin/python -m benchmarks.llm.layer_sensitivity [--tp 3] [--bits 4] [--ag-bits 8] \\
        [--upgrade-bits 8] [--ks 0 1 2 3 4 6 8 12] [--out docs/results/layer_sensitivity] [--resume]

SmolLM2-135M-Instruct (models/) has two all-reduces per block (``models.llama.SITES``: after
the attention output projection and after the MLP down projection), 60 in all. On calibration
windows of the default text (``--calib-first``: windows after the ones docs/accuracy.md scores,
so the policy is never chosen on the text it is judged on) this measures:

- ``sites``: each all-reduce alone under the base setting (``CommConfig(bits, ag_bits)``, the
  library defaults otherwise), every other one exact: KL(exact || that) of the next-token
  distributions and the change of the mean negative log-likelihood.
- ``greedy``: every all-reduce under the base setting except the ``k`` most sensitive sites
  (by the ``sites`` KL), which get ``CommConfig(bits=upgrade_bits)``, for each ``k`` of ``--ks``;
  with the wire bytes per element averaged over the sites (every all-reduce of a step has the
  same size, so the average is the model's).

The smallest ``k`` whose calibration perplexity is within ``--target`` of exact is the chosen
policy (``chosen`` in the JSON); ``benchmarks.llm.accuracy --sections layers`` scores it on
the evaluation windows. Rows are written to ``OUT.json`` as they finish; ``OUT.md`` gets the
table and ``OUT.png`` the per-site plot.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from benchmarks.llm.scoring import score_windows, wire
from models import cli  # sets no jax state

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import command_parser



def base_config(bits: int, ag_bits: int | None, group_size: int | None = None,
                spikes: int | None = None, rotation: int | None = None):
    """The base setting: ``bits`` / ``ag_bits`` and the given codec options (None: the
    library's defaults)."""
    from jax_flashcomm import CommConfig

    options = {k: v for k, v in dict(group_size=group_size, spikes=spikes,
                                     rotation=rotation).items() if v is not None}
    return CommConfig(bits=bits, ag_bits=ag_bits if ag_bits != bits else None, min_bytes=0,
                      **options)


def data_base_config(data: dict):
    """:func:`base_config` of a sensitivity record (older records: defaults)."""
    return base_config(data["bits"], data["ag_bits"], data.get("group_size"),
                       data.get("spikes"), data.get("rotation"))


def upgrade_config(bits: int):
    from jax_flashcomm import CommConfig

    return CommConfig(bits=bits, min_bytes=0)


def ranked_sites(data: dict) -> list[tuple[int, str]]:
    """The sites by their single-site KL, largest first."""
    rows = sorted(data["sites"], key=lambda r: (-r["kl"], r["layer"], r["site"]))
    return [(r["layer"], r["site"]) for r in rows]


def policy_overrides(data: dict, k: int) -> dict:
    """``{(layer, site): TPComm}`` of the upgraded sites of the greedy row ``k``."""
    from jax_flashcomm.nn import TPComm

    upgrade = TPComm("quantized", config=upgrade_config(data["upgrade_bits"]))
    return {site: upgrade for site in ranked_sites(data)[:k]}


def mean_wire(base, upgrade, n_sites: int, k: int) -> dict:
    """Wire bytes per element averaged over ``n_sites`` equal all-reduces, ``k`` upgraded."""
    b, u = wire(base)["bytes_per_element"], wire(upgrade)["bytes_per_element"]
    per = (b * (n_sites - k) + u * k) / n_sites
    return {"bytes_per_element": per, "vs_bf16_ring": per / 2.0}


def score(model, mesh, windows, reference, overrides: dict, base=None) -> dict:
    """``mean_nll`` and mean ``kl`` against ``reference`` (exact's log-probs; None: score exact
    and return its ``logps``) with ``base`` (None: exact) and per-site ``overrides``."""
    from jax_flashcomm.nn import TPComm
    from models.llama import set_comm

    set_comm(model, TPComm("exact") if base is None else TPComm("quantized", config=base),
             overrides=overrides)
    scored = score_windows(model, mesh, windows, reference)
    return {"mean_nll": float(scored["nll"].mean()), "kl": float(scored["kl"].mean()),
            "logps": scored["logps"]}


def run(args) -> dict:
    out_json = Path(args.out + ".json")
    data = json.loads(out_json.read_text()) if args.resume and out_json.exists() else {}
    if args.ranking_from:
        # the sites' ranking measured before (under its own base): only the greedy rows run here
        ranked = json.loads(Path(args.ranking_from).read_text())
        data.update(sites=ranked["sites"], ranking_from={
            "record": Path(args.ranking_from).name, "base": _mix(ranked)})
    cli.set_devices(args.tp)
    import jax

    from jax_flashcomm.nn import TPComm
    from models import corpus
    from models.eval import progress, window_tokens
    from models.llama import SITES
    from models.machine import first_line
    from models.llama.params import load_model

    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    ids = ckpt.tokenizer.encode(corpus.load_text(corpus.DEFAULT))
    windows = window_tokens(ids, args.window, args.calib_first + args.calib_windows)
    windows = windows[args.calib_first:]
    if len(windows) < args.calib_windows:
        raise SystemExit(f"the text has too few windows for --calib-first {args.calib_first} "
                         f"--calib-windows {args.calib_windows}")
    data.update(command=" ".join(["python -m benchmarks.llm.layer_sensitivity", *sys.argv[1:]]),
                machine=first_line(), model=args.model, tp=args.tp, window=args.window,
                text=f"models.corpus {corpus.DEFAULT}", calib_first=args.calib_first,
                calib_windows=args.calib_windows, bits=args.bits, ag_bits=args.ag_bits,
                group_size=args.group_size, spikes=args.spikes, rotation=args.rotation,
                upgrade_bits=args.upgrade_bits, target=args.target)
    base, upgrade = data_base_config(data), upgrade_config(args.upgrade_bits)
    data.setdefault("sites", [])
    data.setdefault("greedy", [])
    print(data["machine"], file=sys.stderr)
    exact = score(model, mesh, windows, None, {})
    reference, exact_nll = exact["logps"], exact["mean_nll"]
    data["exact_perplexity"] = math.exp(exact_nll)
    sites = [(layer, site) for layer in range(ckpt.config.n_layers) for site in SITES]
    done = {(r["layer"], r["site"]) for r in data["sites"]}
    quantized = TPComm("quantized", config=base)
    total, start = len(sites) + len(args.ks), time.perf_counter()
    for count, (layer, site) in enumerate(sites):
        progress(count, total, start, unit="runs", what=f"layer {layer} {site}")
        if (layer, site) in done:
            continue
        r = score(model, mesh, windows, reference, {(layer, site): quantized})
        data["sites"].append({"layer": layer, "site": site, "kl": r["kl"],
                              "delta_nll": r["mean_nll"] - exact_nll})
        out_json.write_text(json.dumps(data, indent=1))
    done_k = {r["k"] for r in data["greedy"]}
    for count, k in enumerate(args.ks, len(sites)):
        progress(count, total, start, unit="runs", what=f"greedy k={k}")
        if k in done_k:
            continue
        r = score(model, mesh, windows, reference, policy_overrides(data, k), base=base)
        data["greedy"].append({"k": k, "sites": [list(s) for s in ranked_sites(data)[:k]],
                               "kl": r["kl"], "perplexity": math.exp(r["mean_nll"]),
                               "delta_ppl": math.exp(r["mean_nll"] - exact_nll) - 1,
                               **mean_wire(base, upgrade, len(sites), k)})
        out_json.write_text(json.dumps(data, indent=1))
    progress(total, total, start, unit="runs", what="done")
    data["greedy"].sort(key=lambda r: r["k"])
    within = [r["k"] for r in data["greedy"] if r["delta_ppl"] <= args.target]
    data["chosen"] = min(within) if within else None
    out_json.write_text(json.dumps(data, indent=1))
    return data


def _mix(data: dict) -> str:
    mix = (f"rs{data['bits']}/ag{data['ag_bits']}" if data["ag_bits"] not in (None, data["bits"])
           else f"int{data['bits']}")
    options = [f"{key}={data[name]}" for key, name in (("G", "group_size"), ("s", "spikes"),
                                                       ("r", "rotation"))
               if data.get(name) is not None]
    return " ".join([mix, *options])


def tables(data: dict) -> str:
    """The page's tables: the greedy policies, and the most sensitive sites alone."""
    mix = _mix(data)
    ranking = data.get("ranking_from")
    lines = [f"Sites ranked by {ranking['record']} (its base {ranking['base']}, one site at a "
             "time); the greedy rows below measured here.", ""] if ranking else []
    lines += [f"Calibration: {data['calib_windows']} windows x {data['window']} tokens from "
             f"window {data['calib_first']} of {data['text']}, TP={data['tp']}, exact "
             f"perplexity {data['exact_perplexity']:.4f}. Base {mix} (library defaults "
             f"otherwise), upgraded sites int{data['upgrade_bits']}. {data['machine']}.", "",
             "| upgraded sites k | calibration Δppl | KL | bytes/elem | × bf16 ring | sites |",
             "|---|---|---|---|---|---|"]
    for r in data["greedy"]:
        names = ", ".join(f"{layer}.{site}" for layer, site in r["sites"]) or "-"
        mark = " **(chosen)**" if r["k"] == data.get("chosen") else ""
        lines.append(f"| {r['k']}{mark} | {100 * r['delta_ppl']:+.2f}% | {r['kl']:.2e} | "
                     f"{r['bytes_per_element']:.3f} | {r['vs_bf16_ring']:.3f}× | {names} |")
    top = sorted(data["sites"], key=lambda r: -r["kl"])[:10]
    alone = ranking["base"] if ranking else mix
    lines += ["", f"The ten most sensitive sites alone ({alone} there, exact elsewhere):", "",
              "| site | KL | Δ mean NLL |", "|---|---|---|"]
    lines += [f"| {r['layer']}.{r['site']} | {r['kl']:.2e} | {r['delta_nll']:+.5f} |" for r in top]
    return "\n".join(lines) + "\n"


def write_report(data: dict, out: str) -> None:
    """``OUT.png`` and the page ``OUT.md`` (the greedy table, the most sensitive sites)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    mix = _mix(data)

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(13, 3.8), width_ratios=(3, 1))
    layers = sorted({r["layer"] for r in data["sites"]})
    for offset, site, color in ((-0.2, "attn", "tab:blue"), (0.2, "mlp", "tab:orange")):
        kl = {r["layer"]: r["kl"] for r in data["sites"] if r["site"] == site}
        ax.bar([x + offset for x in layers], [kl.get(x, 0) for x in layers], width=0.4,
               color=color, label=f"{site} all-reduce")
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.set_ylabel("KL(exact || one site quantized)")
    alone = data["ranking_from"]["base"] if data.get("ranking_from") else mix
    ax.set_title(f"{data.get('model', 'smollm2')}, TP={data['tp']}: one all-reduce at {alone}, "
                 "the rest exact",
                 fontsize=10)
    ax.legend()
    greedy = data["greedy"]
    ax2.plot([r["vs_bf16_ring"] for r in greedy], [100 * r["delta_ppl"] for r in greedy], "o-")
    for r in greedy:
        ax2.annotate(f"k={r['k']}", (r["vs_bf16_ring"], 100 * r["delta_ppl"]), fontsize=7,
                     xytext=(3, 3), textcoords="offset points")
    ax2.axhline(100 * data["target"], color="gray", ls="--", lw=0.8)
    ax2.set_xlabel("wire bytes, × bf16 ring")
    ax2.set_ylabel("calibration Δperplexity (%)")
    ax2.set_title(f"k most sensitive sites at int{data['upgrade_bits']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=120)
    plt.close(fig)
    write_page(out + ".json", data, tables=tables(data))


def main(argv=None) -> int:
    parser = command_parser("benchmarks.llm.layer_sensitivity", __doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--ag-bits", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=None,
                        help="the base setting's group size (default: the library's)")
    parser.add_argument("--spikes", type=int, default=None,
                        help="the base setting's spikes per group (default: the library's)")
    parser.add_argument("--rotation", type=int, default=None,
                        help="the base setting's rotation (default: the library's)")
    parser.add_argument("--upgrade-bits", type=int, default=8)
    parser.add_argument("--ks", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6, 8, 12])
    parser.add_argument("--target", type=float, default=0.005,
                        help="calibration Δperplexity the chosen k must reach (default 0.5%%)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--calib-first", type=int, default=6,
                        help="first calibration window (accuracy.py scores windows 0..5)")
    parser.add_argument("--calib-windows", type=int, default=2)
    parser.add_argument("--out", default=str(RESULTS / "layer_sensitivity"))
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--report-only", action="store_true")
    parser.add_argument("--ranking-from", default=None,
                        help="take the sites' ranking from this record (a layer_sensitivity "
                             "JSON, measured under its own base) and run only the greedy rows")
    args = parser.parse_args(argv)
    if args.report_only:
        data = json.loads(Path(args.out + ".json").read_text())
    else:
        data = run(args)
    write_report(data, args.out)
    print(Path(args.out + ".md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
