"""Accuracy of quantized communication on a real model: perplexity, KL and top-1 vs exact.

    .venv/bin/python -m benchmarks.llm.accuracy [--text FILE] [--tp 3 9] [--sections ...] \\
        [--window 512] [--max-windows 6] [--out docs/results/accuracy] [--resume]

SmolLM2-135M-Instruct (models/) scores the same token windows once with exact communication and
once per setting; every all-reduce of the model runs the setting (``min_bytes=0``). Per row:
perplexity and its change vs exact at the same TP, the mean KL divergence of the next-token
distributions KL(exact || setting), the fraction of positions whose top-1 token equals exact's,
and the bytes per element the setting puts on the wire (per phase, a bf16 ring = 2.0; the ratio
to it). Sections (a table of the page each):

- ``grid``: bits {8, 6, 5, 4, 3, 2} x group size {32, 64, 128, 256, 1024}, no spikes, no
  rotation, at every ``--tp``.
- ``options``: spikes 0/1/2 x rotation off/Hadamard at G=128 and bits 8, 6, 4, 3; signed
  Hadamard at 8 and 6 bits (first TP).
- ``mixes``: per-phase bits (reduce-scatter 4 / all-gather 8 and the reverse), with the options.
- ``coarse``: one scale and zero per rank's chunk of each message (G = the chunk), the
  per-tensor baseline of the paper's Fig. 4, at every ``--tp``.
- ``overlap``: ``flash+overlap``: the overlap rings with the quantized all-gather ring and the
  once-quantized reduce-scatter.
- ``defaults``: the library's defaults (``CommConfig(bits=B)``, at every ``--tp``) and the
  candidates for them.
- ``formats``: one row per wire format at every ``--tp``: the int8 / int6 / int4 / rs4-ag8
  defaults, int4 with two spikes and Hadamard rotation (G=128 and G=32), fp8, mxfp4, nvfp4 and
  nvfp4 reduce-scatter with an fp8 all-gather (the comparison of the model families).
- ``layers``: the per-site policies of ``benchmarks/llm/layer_sensitivity.py``
  (``--sensitivity``: its JSON, calibrated on other windows of the text): its base setting with the
  ``k`` most sensitive all-reduces at its upgrade bits, for every ``k`` it tried, at its TP.

Rows are written to ``OUT.json`` as they finish (``--resume`` skips those already there);
``OUT.md`` is the page of the tables (docs/accuracy.md reads them) and ``OUT.png`` the plot.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from benchmarks.llm.scoring import score_windows, wire
from models import cli  # sets no jax state

from benchmarks.shared.results import RESULTS
from benchmarks.shared.runtime import command_parser


GRID_BITS = (8, 6, 5, 4, 3, 2)
GRID_GROUPS = (32, 64, 128, 256, 1024)
SECTIONS = ("grid", "options", "mixes", "coarse", "overlap", "defaults", "formats", "layers")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One row: a communication strategy at one TP size."""
    section: str
    tp: int
    kind: str = "flash"                 # exact | flash | flash+overlap
    rs_bits: int | None = None
    ag_bits: int | None = None
    group_size: int = 128
    spikes: int | str = 0
    rotation: int = 0
    coarse: bool = False                # group size = one rank's chunk of the message
    default: bool = False               # CommConfig(bits=...) with every other option default
    upgraded: int = 0                   # layers section: the k most sensitive sites upgraded
    rs_format: str = "int"              # the group format of each phase (docs/format.md)
    ag_format: str = "int"

    @property
    def label(self) -> str:
        if self.kind == "exact":
            return "exact"
        if self.rs_format != "int" or self.ag_format != "int":
            return (self.rs_format if self.rs_format == self.ag_format
                    else f"rs {self.rs_format}/ag {self.ag_format}")
        bits = (f"int{self.rs_bits}" if self.rs_bits == self.ag_bits
                else f"rs{self.rs_bits}/ag{self.ag_bits}")
        if self.default:
            return f"{bits} default" + (f" +{self.upgraded} sites" if self.section == "layers"
                                        else "")
        prefix = "overlap+" if self.kind == "flash+overlap" else ""
        group = "per-tensor" if self.coarse else f"G={self.group_size}"
        sites = f" +{self.upgraded} sites" if self.section == "layers" else ""
        return f"{prefix}{bits} {group} s={self.spikes} r={self.rotation}{sites}"

    @property
    def key(self) -> str:
        return f"{self.section}|{self.tp}|{self.label}"


def settings(tps, sections, sensitivity: dict | None = None, layer_ks=None) -> list[Setting]:
    """Every row of the requested sections, exact first at each TP (``sensitivity``: the
    layer_sensitivity JSON the ``layers`` section needs, its policies scored at every TP;
    ``layer_ks``: only those of its greedy rows, None: all)."""
    rows, first = [], tps[0]
    for tp in tps:
        rows.append(Setting("exact", tp, kind="exact"))
        if "grid" in sections:
            rows += [Setting("grid", tp, rs_bits=b, ag_bits=b, group_size=g)
                     for b in GRID_BITS for g in GRID_GROUPS]
        if "coarse" in sections:
            rows += [Setting("coarse", tp, rs_bits=b, ag_bits=b, coarse=True) for b in (8, 6, 4)]
    if "options" in sections:
        rows += [Setting("options", first, rs_bits=b, ag_bits=b, spikes=s, rotation=r)
                 for b in (8, 6, 4, 3) for r in (0, 1) for s in (0, 1, 2)]
        rows += [Setting("options", first, rs_bits=b, ag_bits=b, spikes=s, rotation=2)
                 for b in (8, 6) for s in (0, 1)]
    if "mixes" in sections:
        rows += [Setting("mixes", first, rs_bits=rs, ag_bits=ag, spikes=s, rotation=r)
                 for rs, ag in ((4, 8), (8, 4)) for r in (0, 1) for s in (0, 1, 2)]
        rows += [Setting("mixes", first, rs_bits=4, ag_bits=8, group_size=g, spikes=s)
                 for g in (32, 64) for s in (1, 2)]
    if "overlap" in sections:
        rows += [Setting("overlap", first, kind="flash+overlap", rs_bits=rs, ag_bits=ag,
                         spikes=s, rotation=r)
                 for rs, ag in ((8, 8), (4, 8), (4, 4)) for s, r in ((0, 0), (1, 1))]
    if "defaults" in sections:
        rows += [Setting("defaults", tp, rs_bits=rs, ag_bits=ag, spikes="auto", default=True)
                 for tp in tps for rs, ag in ((8, 8), (6, 6), (4, 4), (4, 8))]
        rows += [Setting("defaults", first, rs_bits=8, ag_bits=8, group_size=256, spikes=1),
                 Setting("defaults", first, rs_bits=8, ag_bits=8, group_size=256, spikes=1,
                         rotation=1)]
    if "formats" in sections:
        for tp in tps:
            rows += [Setting("formats", tp, rs_bits=rs, ag_bits=ag, spikes="auto", default=True)
                     for rs, ag in ((8, 8), (6, 6), (4, 4), (4, 8))]
            rows += [Setting("formats", tp, rs_bits=4, ag_bits=4, group_size=g, spikes=2,
                             rotation=1) for g in (128, 32)]
            rows += [Setting("formats", tp, rs_format=rs, ag_format=ag)
                     for rs, ag in (("fp8", "fp8"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4"),
                                    ("nvfp4", "fp8"))]
    if "layers" in sections:
        if sensitivity is None:
            raise ValueError("the layers section needs --sensitivity (a layer_sensitivity JSON)")
        options = {k: sensitivity[k] for k in ("group_size", "spikes", "rotation")
                   if sensitivity.get(k) is not None}
        rows += [Setting("layers", tp, rs_bits=sensitivity["bits"],
                         ag_bits=sensitivity["ag_bits"] or sensitivity["bits"],
                         **({"spikes": "auto", "default": True} if not options else options),
                         upgraded=r["k"])
                 for tp in tps for r in sensitivity["greedy"]
                 if layer_ks is None or r["k"] in layer_ks]
    return rows


def coarse_group(window: int, d_model: int, tp: int) -> int:
    """The group size that makes one group of each rank's chunk of a (window, d_model)
    all-reduce (a multiple of 8, as the codec needs)."""
    return -(-(window * d_model) // (tp * 8)) * 8


def comm_config(s: Setting, window: int, d_model: int):
    """The ``(TPComm, CommConfig or None)`` of a row."""
    from jax_flashcomm import CommConfig
    from jax_flashcomm.nn import TPComm

    if s.kind == "exact":
        return TPComm("exact"), None
    if s.rs_format != "int" or s.ag_format != "int":
        config = CommConfig(format=s.rs_format, ag_format=s.ag_format, min_bytes=0)
    elif s.default:
        config = CommConfig(bits=s.rs_bits, ag_bits=s.ag_bits if s.ag_bits != s.rs_bits else None,
                            min_bytes=0)
    else:
        group = coarse_group(window, d_model, s.tp) if s.coarse else s.group_size
        config = CommConfig(bits=s.rs_bits, ag_bits=s.ag_bits, group_size=group, min_bytes=0,
                            spikes=s.spikes, rotation=s.rotation)
    return TPComm.from_kind(s.kind, config=config), config


def evaluate(model, mesh, setting: Setting, windows, reference, d_model, sensitivity=None):
    """One row: scores every window under the setting. ``reference`` is exact's list of
    log-prob arrays (None when this row is exact: it then returns them as ``logps``)."""
    from benchmarks.llm import layer_sensitivity
    from models.llama import SITES, set_comm

    comm, config = comm_config(setting, len(windows[0]), d_model)
    overrides = (layer_sensitivity.policy_overrides(sensitivity, setting.upgraded)
                 if setting.upgraded else None)
    set_comm(model, comm, overrides=overrides)
    start = time.perf_counter()
    scored = score_windows(model, mesh, windows, reference)
    nll, kl, top1 = scored["nll"], scored["kl"], scored["top1"]
    row = {"section": setting.section, "tp": setting.tp, "label": setting.label,
           **{k: v for k, v in dataclasses.asdict(setting).items() if k not in ("section", "tp")},
           "perplexity": math.exp(float(nll.mean())), "mean_nll": float(nll.mean()),
           "kl": float(kl.mean()), "kl_max": float(kl.max()), "top1": float(top1.mean()),
           "tokens": int(nll.size), "seconds": time.perf_counter() - start, **wire(config)}
    if overrides:
        upgrade = layer_sensitivity.upgrade_config(sensitivity["upgrade_bits"])
        row.update(layer_sensitivity.mean_wire(config, upgrade, model.cfg.n_layers * len(SITES),
                                               len(overrides)),
                   upgraded_sites=[list(k) for k in overrides])
    if config is not None:
        row.update(group_size=config.group_size, rs_spikes=config.phase1_spikes,
                   ag_spikes=config.phase2_spikes, rotation=config.rotation)
    return row, scored["logps"]


def run(args) -> dict:
    out_json = Path(args.out + ".json")
    data = {"rows": []}
    if args.resume and out_json.exists():
        data = json.loads(out_json.read_text())
    done = {f"{r['section']}|{r['tp']}|{r['label']}" for r in data["rows"]}
    sensitivity = (json.loads(Path(args.sensitivity).read_text())
                   if "layers" in args.sections else None)
    todo = settings(args.tp, args.sections, sensitivity, args.layer_ks)
    cli.set_devices(max(args.tp))
    import jax

    from models import corpus
    from models.eval import progress, window_tokens
    from models.machine import first_line
    from models.llama.params import load_model

    text = (Path(args.text).read_text(encoding="utf-8") if args.text
            else corpus.load_text(corpus.DEFAULT))
    data.update(command=" ".join(["python -m benchmarks.llm.accuracy", *sys.argv[1:]]),
                machine=first_line(), model=args.model, window=args.window,
                max_windows=args.max_windows, text=args.text or f"models.corpus {corpus.DEFAULT}",
                tps=sorted(set(data.get("tps", [])) | set(args.tp)))
    print(data["machine"], file=sys.stderr)
    start, count = time.perf_counter(), 0
    for tp in args.tp:
        rows = [s for s in todo if s.tp == tp]
        if all(s.key in done for s in rows):
            count += len(rows)
            continue
        mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
        model, ckpt = load_model(args.model, tp=tp, mesh=mesh)
        windows = window_tokens(ckpt.tokenizer.encode(text), args.window, args.max_windows)
        exact_row, reference = evaluate(model, mesh, rows[0], windows, None, ckpt.config.d_model)
        for s in rows:
            progress(count, len(todo), start, unit="rows", what=f"TP={tp} {s.label}")
            if s.key not in done:
                row = exact_row if s.kind == "exact" else evaluate(
                    model, mesh, s, windows, reference, ckpt.config.d_model, sensitivity)[0]
                row["delta_ppl"] = row["perplexity"] / exact_row["perplexity"] - 1
                data["rows"].append(row)
                done.add(s.key)
                out_json.write_text(json.dumps(data, indent=1))
            count += 1
        del reference
    progress(count, len(todo), start, unit="rows", what="done")
    return data


def main(argv=None) -> int:
    parser = command_parser("benchmarks.llm.accuracy", __doc__)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", default=None,
                        help="UTF-8 text file (default: models.corpus's default text)")
    parser.add_argument("--tp", type=int, nargs="+", default=[3, 9])
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--out", default=str(RESULTS / "accuracy"))
    parser.add_argument("--sensitivity", default=str(RESULTS / "layer_sensitivity.json"),
                        help="benchmarks/llm/layer_sensitivity.py's JSON (the layers section)")
    parser.add_argument("--layer-ks", type=int, nargs="+", default=None,
                        help="the layers section: only the greedy rows of these k (default: "
                             "all)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the rows already in OUT.json and run only the others")
    parser.add_argument("--report-only", action="store_true",
                        help="only rewrite the tables and the plot from OUT.json")
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.tp) or args.window < 2 or args.max_windows < 1:
        parser.error("--tp values must be >= 1, --window >= 2, --max-windows >= 1")
    from benchmarks.llm import accuracy_page as accuracy_report

    data = (json.loads(Path(args.out + ".json").read_text()) if args.report_only
            else run(args))
    print(accuracy_report.tables(data))
    accuracy_report.plot(data, Path(args.out + ".png"))
    accuracy_report.write_markdown(data, Path(args.out + ".json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
