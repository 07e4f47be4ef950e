"""What FP8 and FP4 group formats would cost a real model, simulated before the codec has them.

    .venv/bin/python -m benchmarks.llm.format_probe [--tp 3] [--formats all] \\
        [--out docs/results/format_probe]

The codec's formats are integer groups (docs/format.md); the formats of current hardware are
floating-point: FP8 E4M3 values with a scale per group, MXFP4 (E2M1 values, an E8M0 power-of-two
scale per 32, the OCP Microscaling spec) and NVFP4 (E2M1 values, an E4M3 scale per 16 and an
f32 scale per tensor). This probe measures what they would cost SmolLM2 before any kernel
exists, with the same windows and metrics as ``benchmarks.llm.accuracy``.

Each setting replaces the model's all-reduces (every one, as ``min_bytes=0``) by a simulated
two-phase quantized all-reduce, with the rounding where the codec's would be:

1. every rank's partial sum, flattened and cut into groups, is quantized and dequantized in f32
   in the reduce-scatter format (``phase1``);
2. the f32 sum of those over the ranks (``lax.psum``) is quantized and dequantized again in the
   all-gather format (``phase2``), identically on every rank.

Optionally a group's orthonormal Walsh-Hadamard transform is quantized instead of the group
(``+hH``: blocks of H values), undone after decoding. Settings ending in ``+smooth`` divide every
channel of a call site's message by a static scale before quantizing and multiply the sum by it
after (linear, so exact without rounding; the smoothing of SmoothQuant applied to a collective):
``amax_c ** --alpha`` normalized to a geometric mean of 1, ``amax_c`` the channel's largest
magnitude at that site over ``--calibration-windows`` windows that follow the scored ones. Settings
with ``+order`` permute each call site's channels by a static order from the same calibration
(:func:`spreading_order`: the largest channels dealt to different groups, where a spike takes each;
``+order16``: to different NVFP4 blocks) and permute the sum back: zero wire bytes. Wire bytes per
value are each format's codes and scales as its spec stores them, averaged over the two phases,
against a bf16 ring's 2.0. A simulation (numerics only, in ``jnp``): not the codec, nothing here
runs a kernel. With ``--upgrade K [K ...]`` every setting is also scored with its ``K`` most
sensitive call sites in ``fp8`` (the sites ranked by their KL when quantized alone, from
``benchmarks.llm.layer_sensitivity``'s JSON, measured on other windows); the wire bytes are then
the mean over the 60 sites. Writes ``OUT.json`` and its page, ``OUT.md`` (docs/format_probe.md reads
them).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

from benchmarks.llm.fp_formats import FORMATS, SPIKE_GROUP, simulated_comm
from benchmarks.llm.scoring import score_windows
from benchmarks.shared.results import REPO, RESULTS, write_page
from benchmarks.shared.runtime import command_parser
from models import cli  # sets no jax state


#: (reduce-scatter format, all-gather format) per setting.
SETTINGS = {
    "fp8": ("fp8", "fp8"), "mxfp8": ("mxfp8", "mxfp8"),
    "mxfp4": ("mxfp4", "mxfp4"), "mxfp4+h32": ("mxfp4+h32", "mxfp4+h32"),
    "nvfp4": ("nvfp4", "nvfp4"), "nvfp4+h16": ("nvfp4+h16", "nvfp4+h16"),
    "nvfp4+h128": ("nvfp4+h128", "nvfp4+h128"),
    "nvfp4/fp8": ("nvfp4", "fp8"), "nvfp4+h128/fp8": ("nvfp4+h128", "fp8"),
    "fp8/nvfp4+h128": ("fp8", "nvfp4+h128"),
    "nvfp4+spike": ("nvfp4+spike", "nvfp4+spike"),
    "nvfp4+2spikes": ("nvfp4+2spikes", "nvfp4+2spikes"),
    "mxfp4+spike": ("mxfp4+spike", "mxfp4+spike"),
    "nvfp4+spike/fp8": ("nvfp4+spike", "fp8"),
    "mxfp4+smooth": ("mxfp4", "mxfp4"), "nvfp4+smooth": ("nvfp4", "nvfp4"),
    "nvfp4+h16+smooth": ("nvfp4+h16", "nvfp4+h16"),
    "nvfp4+smooth/fp8": ("nvfp4", "fp8"),
    "nvfp4+order": ("nvfp4", "nvfp4"), "nvfp4+spike+order": ("nvfp4+spike", "nvfp4+spike"),
    "nvfp4+spike+order/fp8": ("nvfp4+spike", "fp8"),
    "nvfp4+order16": ("nvfp4", "nvfp4"), "nvfp4+spike+order16": ("nvfp4+spike", "nvfp4+spike"),
}


def channel_amax(model, mesh, windows, n_layers: int) -> dict:
    """``{(layer, site): amax per channel}`` of every block all-reduce's operand (every rank's
    partial sum), over ``windows`` scored with exact communication."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from jax_flashcomm.nn import TPComm
    from models.llama import SITES, set_comm

    stats = {}

    def record(key, amax):
        stats[key] = np.maximum(stats.get(key, 0.0), np.asarray(amax, np.float32))

    def recorder(key):
        class Recorder(TPComm):
            def all_reduce(self, x):
                a = jnp.max(jnp.abs(x.astype(jnp.float32)).reshape(-1, x.shape[-1]), axis=0)
                jax.debug.callback(lambda v: record(key, v), a)
                return lax.psum(x, self.axis_name)
        return Recorder("exact", "tp")

    set_comm(model, TPComm("exact"), overrides={
        (layer, site): recorder((layer, site)) for layer in range(n_layers) for site in SITES})
    score_windows(model, mesh, windows)
    return stats


def smoothing_scales(amax, alpha: float):
    """Channel scales ``amax ** alpha``, normalized to a geometric mean of 1 (channels that were
    0 everywhere get 1)."""
    import numpy as np

    a = np.asarray(amax, np.float64)
    s = np.where(a > 0, a, 1.0) ** alpha
    return (s / np.exp(np.mean(np.log(s)))).astype(np.float32)


def spreading_order(amax, group: int = SPIKE_GROUP):
    """A channel order (position i takes channel ``order[i]``) that deals the channels, largest
    calibration magnitude first, to the ``group``-value units of a row in turn: the row's
    ``C // group`` largest channels land in different units, a quarter unit from each unit's
    start (so that they stay apart when a row starts half a group in), then the next ones beside
    them; the channels past the last whole unit get the smallest. Units of a spike group
    (``+order``): the largest channels travel as spikes instead of setting their blocks' scales;
    units of an NVFP4 block (``+order16``): each block gets one of the largest."""
    import numpy as np

    a = np.asarray(amax, np.float64)
    c = a.size
    whole = c // group
    slots = [j * group + (group // 4 + k) % group for k in range(group) for j in range(whole)]
    slots += list(range(whole * group, c))
    order = np.empty(c, np.int64)
    order[np.asarray(slots)] = np.argsort(-a, kind="stable")
    return order


def run(args) -> dict:
    cli.set_devices(args.tp)
    import jax

    from jax_flashcomm.nn import TPComm
    from models import corpus
    from models.eval import progress, window_tokens
    from models.llama import set_comm
    from models.machine import first_line
    from models.llama.params import load_model

    from models.llama import SITES

    names = list(SETTINGS) if args.formats == "all" else args.formats.split(",")
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    every = window_tokens(ckpt.tokenizer.encode(corpus.load_text(corpus.DEFAULT)),
                          args.window, args.max_windows + args.calibration_windows)
    windows, calibration = every[:args.max_windows], every[args.max_windows:]
    data = {"machine": first_line(), "model": args.model, "tp": args.tp, "window": args.window,
            "windows": len(windows), "calibration_windows": len(calibration),
            "alpha": args.alpha, "rows": [],
            "command": " ".join([".venv/bin/python -m benchmarks.llm.format_probe",
                                 *sys.argv[1:]])}
    scales = amax = None
    if any("+smooth" in n or "+order" in n for n in names):
        if not calibration:
            raise SystemExit("the +smooth and +order settings need --calibration-windows >= 1 "
                             "(the text has no window after the scored ones)")
        amax = channel_amax(model, mesh, calibration, ckpt.config.n_layers)
        scales = {key: smoothing_scales(a, args.alpha) for key, a in amax.items()}
    set_comm(model, TPComm("exact"))
    exact = score_windows(model, mesh, windows)
    ppl0 = math.exp(float(exact["nll"].mean()))
    data["rows"].append({"setting": "exact", "perplexity": ppl0, "delta_ppl": 0.0, "kl": 0.0,
                         "top1": 1.0, "vs_bf16_ring": 1.0})
    ranked = []
    if args.upgrade:
        sites = json.loads(Path(args.sensitivity).read_text())["sites"]
        ranked = [(s["layer"], s["site"]) for s in sorted(sites, key=lambda s: -s["kl"])]
        data["sensitivity"] = str(Path(args.sensitivity).relative_to(REPO)
                                  if Path(args.sensitivity).resolve().is_relative_to(REPO)
                                  else args.sensitivity)
    runs = [(n, k) for n in names for k in [0, *args.upgrade]]
    all_sites = [(layer, site) for layer in range(ckpt.config.n_layers) for site in SITES]
    upgrade = FORMATS["fp8"]
    start = time.perf_counter()
    for i, (name, k) in enumerate(runs):
        label = name if not k else f"{name}, top {k} in fp8"
        progress(i, len(runs), start, unit="settings", what=label)
        rs, ag = (FORMATS[f] for f in SETTINGS[name])
        up = set(ranked[:k])
        if "+smooth" in name or "+order" in name or up:
            unit = 16 if "+order16" in name else SPIKE_GROUP
            set_comm(model, TPComm("exact"), overrides={
                key: (simulated_comm(upgrade, upgrade) if key in up else simulated_comm(
                    rs, ag, channel_scale=scales[key] if "+smooth" in name else None,
                    channel_order=spreading_order(amax[key], unit) if "+order" in name else None))
                for key in all_sites})
        else:
            set_comm(model, simulated_comm(rs, ag))
        s = score_windows(model, mesh, windows, exact["logps"])
        ppl = math.exp(float(s["nll"].mean()))
        base = (rs.bytes_per_value + ag.bytes_per_value) / 2
        mean = (base * (len(all_sites) - len(up)) + upgrade.bytes_per_value * len(up)) / len(
            all_sites)
        data["rows"].append({
            "setting": label, "rs_format": rs.name, "ag_format": ag.name, "upgraded": k,
            "perplexity": ppl, "delta_ppl": ppl / ppl0 - 1, "kl": float(s["kl"].mean()),
            "top1": float(s["top1"].mean()), "vs_bf16_ring": mean / 2.0})
    progress(len(runs), len(runs), start, unit="settings", what="done")
    return data


def table(data: dict) -> str:
    lines = [f"SmolLM2 at TP={data['tp']}, {data['windows']} windows of {data['window']} tokens; "
             f"`{data['machine']}`", "",
             "| setting | reduce-scatter | all-gather | × bf16 ring bytes | perplexity | Δ ppl "
             "| KL (nats) | top-1 |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        lines.append(f"| {r['setting']} | {r.get('rs_format', '-')} | {r.get('ag_format', '-')} "
                     f"| {r['vs_bf16_ring']:.3f} | {r['perplexity']:.3f} "
                     f"| {r['delta_ppl']:+.2%} | {r['kl']:.2e} | {r['top1']:.4f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = command_parser("benchmarks.llm.format_probe", __doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--tp", type=int, default=3)
    ap.add_argument("--formats", default="all",
                    help=f"comma-separated settings, or all ({', '.join(SETTINGS)})")
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--max-windows", type=int, default=6)
    ap.add_argument("--calibration-windows", type=int, default=4,
                    help="windows after the scored ones that calibrate the +smooth settings")
    ap.add_argument("--alpha", type=float, default=0.5,
                    help="smoothing strength: channel scale = calibration amax ** alpha")
    ap.add_argument("--upgrade", type=int, nargs="*", default=[],
                    help="also score each setting with its K most sensitive sites in fp8")
    ap.add_argument("--sensitivity", default=str(RESULTS / "layer_sensitivity.json"),
                    help="benchmarks.llm.layer_sensitivity's JSON (the sites' ranking)")
    ap.add_argument("--out", default=str(RESULTS / "format_probe"),
                    help="output prefix: OUT.json and its page, OUT.md")
    args = ap.parse_args(argv)
    if any(k < 1 for k in args.upgrade):
        ap.error("--upgrade values must be >= 1")
    if args.tp < 2 or args.window < 2 or args.max_windows < 1 or args.calibration_windows < 0:
        ap.error("--tp must be >= 2, --window >= 2, --max-windows >= 1, "
                 "--calibration-windows >= 0")
    data = run(args)
    Path(args.out + ".json").write_text(json.dumps(data, indent=1))
    print(table(data))
    write_page(args.out + ".json", data, tables=table(data))
    return 0


if __name__ == "__main__":
    sys.exit(main())
