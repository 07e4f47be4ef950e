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

import dataclasses
import json
import math
import sys
import time
from pathlib import Path

from benchmarks.llm.scoring import score_windows
from models import cli  # sets no jax state

from benchmarks.shared.results import REPO, RESULTS, write_page
from benchmarks.shared.runtime import command_parser


#: Values per group of the spike selection (the codec's default group size).
SPIKE_GROUP = 128
#: E2M1 and E4M3 limits: the largest finite value, and the exponent of the largest power of
#: two an element can hold (OCP MX v1.0, section 6.3: shared scale 2^(floor(log2 amax) - emax)).
E2M1_MAX, E2M1_EMAX = 6.0, 2
E4M3_MAX, E4M3_EMAX = 448.0, 8


@dataclasses.dataclass(frozen=True)
class Format:
    """One phase's simulated format: ``element`` ("e2m1" or "e4m3"), ``scale`` ("e8m0": a power
    of two; "e4m3": an E4M3 scale under an f32 per-message scale, NVFP4's two levels; "bf16":
    amax / element max rounded up to bf16), values per scale ``block``, and a Hadamard rotation
    of ``hadamard`` values (0: none)."""
    name: str
    element: str
    scale: str
    block: int
    hadamard: int = 0
    spikes: int = 0  # values per SPIKE_GROUP kept in bf16 with a 1-byte position

    @property
    def bytes_per_value(self) -> float:
        code = 0.5 if self.element == "e2m1" else 1.0
        return (code + {"e8m0": 1, "e4m3": 1, "bf16": 2}[self.scale] / self.block
                + 3 * self.spikes / SPIKE_GROUP)


FORMATS = {f.name: f for f in (
    Format("fp8", "e4m3", "bf16", 128),
    Format("mxfp8", "e4m3", "e8m0", 32),
    Format("mxfp4", "e2m1", "e8m0", 32),
    Format("mxfp4+h32", "e2m1", "e8m0", 32, 32),
    Format("nvfp4", "e2m1", "e4m3", 16),
    Format("nvfp4+h16", "e2m1", "e4m3", 16, 16),
    Format("nvfp4+h128", "e2m1", "e4m3", 16, 128),
    Format("nvfp4+spike", "e2m1", "e4m3", 16, 0, 1),
    Format("nvfp4+2spikes", "e2m1", "e4m3", 16, 0, 2),
    Format("mxfp4+spike", "e2m1", "e8m0", 32, 0, 1),
)}

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


def hadamard_matrix(n: int):
    """The orthonormal Walsh-Hadamard matrix of order ``n`` (a power of two), Sylvester's."""
    import numpy as np

    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard order must be a power of two, got {n}")
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def _cast(x, element: str):
    """``x`` rounded to the nearest element value (ties to even), saturated at its largest."""
    import jax.numpy as jnp

    top, dtype = ((E2M1_MAX, jnp.float4_e2m1fn) if element == "e2m1"
                  else (E4M3_MAX, jnp.float8_e4m3fn))
    return jnp.clip(x, -top, top).astype(dtype).astype(jnp.float32)


def fake_quantize(x, fmt: Format):
    """``x`` (f32, any shape) quantized to ``fmt`` and decoded back, flattened into groups of
    ``fmt.block`` values (zero-padded at the end), as the codec groups a message."""
    import jax.numpy as jnp

    flat = jnp.ravel(x).astype(jnp.float32)
    unit = max(fmt.block, fmt.hadamard, SPIKE_GROUP if fmt.spikes else 1)
    pad = (-flat.size) % unit
    v = jnp.pad(flat, (0, pad))
    kept = None
    if fmt.spikes:  # each group's largest magnitudes travel apart, in bf16
        groups = v.reshape(-1, SPIKE_GROUP)
        top = jnp.argsort(-jnp.abs(groups), axis=1)[:, :fmt.spikes]
        mask = jnp.zeros(groups.shape, bool).at[jnp.arange(groups.shape[0])[:, None], top].set(True)
        kept = jnp.where(mask, groups.astype(jnp.bfloat16).astype(jnp.float32), 0.0).reshape(-1)
        v = jnp.where(mask, 0.0, groups).reshape(-1)
    if fmt.hadamard:
        h = jnp.asarray(hadamard_matrix(fmt.hadamard))
        v = (v.reshape(-1, fmt.hadamard) @ h).reshape(-1)
    g = v.reshape(-1, fmt.block)
    amax = jnp.max(jnp.abs(g), axis=1, keepdims=True)
    top, emax = (E2M1_MAX, E2M1_EMAX) if fmt.element == "e2m1" else (E4M3_MAX, E4M3_EMAX)
    if fmt.scale == "e8m0":
        exp = jnp.floor(jnp.log2(jnp.where(amax > 0, amax, 1.0))) - emax
        scale = jnp.exp2(jnp.clip(exp, -127, 127))
    elif fmt.scale == "e4m3":  # NVFP4: an f32 scale per message, an E4M3 one per block
        tensor = jnp.max(amax) / (E4M3_MAX * top)
        tensor = jnp.where(tensor > 0, tensor, 1.0)
        scale = _cast(amax / top / tensor, "e4m3") * tensor
    else:  # bf16, rounded up so that amax / scale <= top
        s = (amax / top).astype(jnp.bfloat16)
        s = jnp.where(s.astype(jnp.float32) * top < amax, jnp.nextafter(s, jnp.inf), s)
        scale = s.astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)
    q = jnp.where(scale > 0, _cast(g / safe, fmt.element) * scale, 0.0).reshape(-1)
    if fmt.hadamard:
        q = (q.reshape(-1, fmt.hadamard) @ h.T).reshape(-1)
    if kept is not None:
        q = q + kept  # a spike's own code is 0 (it was zeroed before the quantization)
    return q[:flat.size].reshape(x.shape)


def simulated_psum(x, axis_name: str, rs: Format, ag: Format):
    """The two-phase quantized all-reduce of ``x`` over ``axis_name``, simulated (module
    docstring); inside ``shard_map``, replicated result of ``x``'s dtype."""
    import jax.numpy as jnp
    from jax import lax

    total = lax.psum(fake_quantize(x.astype(jnp.float32), rs), axis_name)
    return fake_quantize(total, ag).astype(x.dtype)


def simulated_comm(rs: Format, ag: Format, axis_name: str = "tp", channel_scale=None,
                   channel_order=None):
    """A ``TPComm("exact")`` whose all-reduces are :func:`simulated_psum`, of the message
    divided by ``channel_scale`` (one per value of its last axis) and multiplied back after,
    and with its last axis permuted by ``channel_order`` (position i takes channel
    ``channel_order[i]``) and permuted back after."""
    import jax.numpy as jnp
    import numpy as np

    from jax_flashcomm.nn import TPComm

    scale = None if channel_scale is None else jnp.asarray(channel_scale, jnp.float32)
    order = None if channel_order is None else jnp.asarray(channel_order)
    back = None if channel_order is None else jnp.asarray(np.argsort(channel_order))

    class SimulatedFormatComm(TPComm):
        def all_reduce(self, x):
            v = x.astype(jnp.float32)
            if scale is not None:
                v = v / scale
            if order is not None:
                v = v[..., order]
            y = simulated_psum(v, self.axis_name, rs, ag).astype(jnp.float32)
            if back is not None:
                y = y[..., back]
            if scale is not None:
                y = y * scale
            return y.astype(x.dtype)

    return SimulatedFormatComm("exact", axis_name)


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
