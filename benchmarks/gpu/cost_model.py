"""A cost model of the two-step quantized all-reduce (Flash AllReduce) and of TTFT on GPUs.

The equations live in :mod:`jax_flashcomm.costs` (the library prices its automatic choice
with them). From bytes moved, link bandwidth and latency, and codec passes at HBM bandwidth, this
predicts the all-reduce speedup over a bf16 NCCL ring and the TTFT speedup of a tensor-parallel
Llama prefill on L40 (PCIe Gen4, a shared host-bridged bus), A100 and H100 (NVLink through
NVSwitch). The same equations, fed this machine's link (the tc-limited loopback) and its measured
CPU codec times, predict the emulated-link measurements of docs/results/allreduce_bf16*.json and of
docs/results/ttft.json, printed beside them. Every input is a named constant (sources in
docs/gpu_model.md); none is fitted to a row it predicts.

Re-run (a few seconds, no GPU)::

    .venv/bin/python -m benchmarks.gpu.cost_model   # -> docs/results/gpu_model.*, tables on stdout
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import statistics
from pathlib import Path

from benchmarks.shared.results import REPO, write_page
from jax_flashcomm.costs import (  # noqa: F401  (the model lives in the library)
    A100_FLOPS, A100_HBM, BF16, CODEC_EFFICIENCY, GPUS, H100_FLOPS, H100_HBM, KERNEL_LAUNCH_S,
    L40_FLOPS, L40_HBM, LINK_EFFICIENCY, MIB, NCCL_BASE_LATENCY_S, NCCL_STEP_LATENCY_S,
    NVLINK3_BYTES_PER_S, NVLINK4_BYTES_PER_S, PASSES, PCIE4_X16_BYTES_PER_S, PREFILL_MFU, Gpu,
    Link, exact_allreduce, flash_allreduce, gpu_allreduce_speedup)
from jax_flashcomm.codec import GroupFormat

EMULATED_LINK_FILES = ("docs/results/allreduce_bf16.json", "docs/results/allreduce_bf16_4p.json")
LINK_CALIBRATION_FILE = "docs/results/allreduce.json"   # another run; its ppermute column
CODEC_ISA_FILE = "docs/results/codec_isa.json"
TTFT_FILE = "docs/results/ttft.json"
TOLERANCE = 0.25               # the bar: predictions within 25% of the measurements


@dataclasses.dataclass(frozen=True)
class Llama:
    """The dimensions of a Llama-architecture decoder that its prefill cost depends on."""
    name: str
    n_layers: int
    d_model: int
    ffn_dim: int
    n_heads: int
    n_kv_heads: int
    vocab: int

    def prefill_flops(self, batch: int, seq: int) -> float:
        """Matmul FLOPs: q/k/v/o and the SwiGLU MLP per token, causal attention (QK^T and PV
        over half the square), and the logits of each sequence's last token."""
        d, hd = self.d_model, self.d_model // self.n_heads
        proj = d * (2 * d + 2 * self.n_kv_heads * hd) + 3 * d * self.ffn_dim
        attn = 2 * seq * seq * self.n_heads * hd      # 2 matmuls x 2 FLOPs x seq^2 / 2 x dims
        return batch * (self.n_layers * (2 * seq * proj + attn) + 2 * d * self.vocab)


MODELS = {m.name: m for m in (
    Llama("SmolLM2-135M", 30, 576, 1536, 9, 3, 49152),
    Llama("LLaMA-2-7B", 32, 4096, 11008, 32, 32, 32000),
    Llama("LLaMA-3-8B", 32, 4096, 14336, 32, 8, 128256),
    Llama("LLaMA-2-70B", 80, 8192, 28672, 64, 8, 32000),
    Llama("LLaMA-3-70B", 80, 8192, 28672, 64, 8, 128256))}


def int_wire_bytes(bits: int, group_size: int = 128, spikes: int = 0) -> float:
    """Bytes per value of the integer format at ``bits`` (the codec's figure)."""
    return GroupFormat("int", bits, group_size, 0, spikes).wire_bytes_per_element()


def ttft(model: Llama, gpu: Gpu, tp: int, batch: int, seq: int, bits: int | None = None) -> dict:
    """Prefill time: FLOPs / (TP x achieved FLOP/s) + 2 all-reduces per layer of batch*seq*d_model
    bf16 values (NCCL ring if ``bits`` is None, else Flash AllReduce at ``bits``)."""
    compute = model.prefill_flops(batch, seq) / (tp * gpu.bf16_flops * gpu.mfu)
    size = batch * seq * model.d_model * BF16
    ar = (exact_allreduce(size, tp, gpu.link, "ring") if bits is None
          else flash_allreduce(size, tp, gpu.link, gpu.codec_pass_s, bits))
    comm = 2 * model.n_layers * ar["total_s"]
    return {"compute_s": compute, "comm_s": comm, "ttft_s": compute + comm, "allreduce": ar}


# The paper's figures, and the setting its TTFT figures are compared in (docs/gpu_model.md).
PAPER_SETTING = {"model": "LLaMA-3-70B", "tp": 4, "batch": 8, "seq": 1024}
PAPER = [{"claim": "INT4 all-reduce vs NCCL ring, >= 64 MB", "gpu": "L40", "kind": "allreduce",
          "bits": 4, "size": 64 * MIB, "paper": 3.18},
         {"claim": "TTFT, INT4 vs bf16", "gpu": "L40", "kind": "ttft", "bits": 4, "paper": 2.06},
         {"claim": "TTFT, INT4 vs bf16", "gpu": "A100", "kind": "ttft", "bits": 4, "paper": 1.19}]
TTFT_SETTINGS = [("LLaMA-3-70B", 4, 8, 1024), ("LLaMA-3-70B", 8, 8, 1024),
                 ("LLaMA-3-8B", 4, 8, 1024), ("LLaMA-2-7B", 4, 8, 1024),
                 ("SmolLM2-135M", 3, 1, 1024)]
TABLE_SIZES = [MIB, 16 * MIB, 64 * MIB, 256 * MIB, 1024 * MIB]


def ttft_speedup(gpu: Gpu, bits: int, model: str = "LLaMA-3-70B", tp: int = 4, batch: int = 8,
                 seq: int = 1024) -> float:
    """bf16 TTFT / quantized TTFT; the defaults are PAPER_SETTING."""
    args = (MODELS[model], gpu, tp, batch, seq)
    return ttft(*args)["ttft_s"] / ttft(*args, bits=bits)["ttft_s"]


def sensitivity() -> list[dict]:
    """The paper-comparison predictions with one stated assumption changed at a time."""
    every = lambda **kw: {g: kw for g in GPUS}  # noqa: E731
    switched = dataclasses.replace(GPUS["L40"].link, topology="switched")
    variants = {"as stated": {},
                "L40 on per-GPU (switched) PCIe links": {"L40": {"link": switched}},
                "A100 on the L40's shared PCIe": {"A100": {"link": GPUS["L40"].link}},
                "prefill MFU 0.3": every(mfu=0.3), "prefill MFU 0.7": every(mfu=0.7),
                "codec efficiency 0.25": every(codec_efficiency=0.25),
                "codec efficiency 1.0": every(codec_efficiency=1.0)}
    gs = {name: {k: dataclasses.replace(v, **ch.get(k, {})) for k, v in GPUS.items()}
          for name, ch in variants.items()}
    return [{"variant": name,
             "L40 all-reduce int4 64 MiB N=4": gpu_allreduce_speedup(g["L40"], 64 * MIB, 4, 4),
             "L40 TTFT int4": ttft_speedup(g["L40"], 4),
             "A100 TTFT int4": ttft_speedup(g["A100"], 4)}
            for name, g in gs.items()]


# --- self-check on this machine's emulated link --------------------------------------------------
def parse_rate(text: str) -> float:
    """A ``tc`` rate (``400mbit``, ``2gbit``, ``50mbps``) in bytes/s (tc: k/m/g = 10^3/6/9)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)\s*", str(text).lower())
    if not m:
        raise ValueError(f"not a tc rate: {text!r} (expected e.g. '400mbit')")
    value = float(m[1]) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m[2]]
    return value / 8 if m[3] == "bit" else value


_load = lambda path: json.loads((REPO / path).read_text())  # noqa: E731


def emulated_latency(rate: float) -> dict:
    """Latency per step of the emulated link: ppermute time (one step; every rank sends its whole
    message, widened to f32, to a neighbour) minus its bytes at the nominal rate, at the
    smallest message of docs/results/allreduce.json (another run), mean over its process counts."""
    d = _load(LINK_CALIBRATION_FILE)
    res = [r["times_s"]["ppermute"] - int(n) * 2 * r["bytes"] / rate
           for n, rows in d["netns"].items() for r in rows if r["bytes"] == min(d["sizes"])]
    return {"latency_s": max(0.0, statistics.mean(res)), "residuals_s": res}


# A ``codec_pass_s`` pricing each pass at a measured time (s) times ``factor``.
cpu_codec = lambda times, factor: lambda name, elems, w1, w2, n: times[name] * factor  # noqa: E731


def isa_codec_times(isa_rows, isa: str, size: int, bits: int) -> dict:
    """Pass times for ``size`` bf16 bytes from docs/results/codec_isa.json (GB/s of the bf16
    operand, one process): the row of the largest size not above ``size``, else the smallest."""
    rows = [r for r in isa_rows if r["dtype"] == "bfloat16" and r["backend"] == "ffi"
            and r["isa"] == isa and r["bits"] == bits]
    if not rows:
        raise ValueError(f"{CODEC_ISA_FILE} has no bf16 ffi row for isa={isa} bits={bits}")
    below = [r for r in rows if r["size_mib"] * MIB <= size]
    r = max(below or [min(rows, key=lambda r: r["size_mib"])], key=lambda r: r["size_mib"])
    gbps = (r["quantize_gbps"], r["fused_sum_quantize_gbps"], r["dequantize_gbps"])
    return {p: size / (g * 1e9) for p, g in zip(PASSES, gbps)}


def emulated_allreduce_check() -> dict:
    """Predict every time and ratio of docs/results/allreduce_bf16*.json (bf16 two-step, int8/6/4)
    on a shared link at the file's tc rate. Codec: the ``--breakdown`` pass times of the same size
    and bits (measured with 2 processes), else docs/results/codec_isa.json throughputs (1 process);
    either x max(1, N / cores) / max(1, N_measured / cores) when N processes share the cores."""
    files = [_load(p) for p in EMULATED_LINK_FILES]
    bd_n, bd = next(((int(n), e) for d in files for n, e in d.get("breakdown", {}).items()),
                    (1, []))
    bd_times = {(e["bytes"], e["bits"]): e["times_s"] for e in bd}
    isa_rows, rate = _load(CODEC_ISA_FILE)["rows"], parse_rate(files[0]["rate"])
    lat, rows = emulated_latency(rate), []
    for path, d in zip(EMULATED_LINK_FILES, files):
        link = Link(parse_rate(d["rate"]), "shared", 0.0, lat["latency_s"])
        cores, isa = d["machine"]["cores"], d["machine"]["isa"]
        for nkey, entries in d["netns"].items():
            n = int(nkey)
            for e in entries:
                size, meas = e["bytes"], e["times_s"]
                ex = exact_allreduce(size, n, link, "two_step")["total_s"]
                rows.append({"file": path, "n": n, "bytes": size, "method": "bf16 two-step",
                             "measured_s": meas["bf16 two-step"], "predicted_s": ex})
                for b in d["bits"]:
                    times, n_meas, source = bd_times.get((size, b)), bd_n, "breakdown"
                    if times is None:
                        times, n_meas, source = (isa_codec_times(isa_rows, isa, size, b), 1,
                                                 "codec_isa")
                    q = flash_allreduce(size, n, link, cpu_codec(
                        times, max(1.0, n / cores) / max(1.0, n_meas / cores)), b)
                    rows.append({"file": path, "n": n, "bytes": size, "method": f"int{b}",
                                 "measured_s": meas[f"int{b}"], "predicted_s": q["total_s"],
                                 "codec_s": q["codec_s"], "codec_source": source,
                                 "measured_ratio": meas["bf16 two-step"] / meas[f"int{b}"],
                                 "predicted_ratio": ex / q["total_s"]})
    for r in rows:
        r["err"] = r["predicted_s"] / r["measured_s"] - 1
        if "measured_ratio" in r:
            r["ratio_err"] = r["predicted_ratio"] / r["measured_ratio"] - 1
    worst = max(abs(r[k]) for r in rows for k in ("err", "ratio_err") if k in r)
    return {"rate_bytes_per_s": rate, "latency": lat, "breakdown_nprocs": bd_n, "rows": rows,
            "max_abs_err": worst, "within_tolerance": worst <= TOLERANCE}


def ttft_check(data: dict) -> dict:
    """Predict each rate-limited row of docs/results/ttft.json from its "unlimited" twin, fitting
    nothing to the rows predicted (docs/gpu_model.md, "Self-check 2"): T_c = U - tp B / R_u
    (non-link work: unlimited TTFT less its own transfer), T_l = bus B / R + K lam (bus = tp on a
    shared link, 1 if "switched"; lam = small psum less the unlimited one, >= 0);
    TTFT = max(T_c, T_l + T_c min(1, C/N))."""
    if missing := [k for k in ("tp", "links", "rows") if k not in data]:
        raise ValueError(f"ttft json: missing key(s) {missing}")
    tp, notes, out, lat, links, m = int(data["tp"]), [], [], {}, data["links"], data.get("machine")
    c = (m.get("cores") if isinstance(m, dict)
         else next(iter(re.findall(r"(\d+) cores", str(m))), None))
    cores, unl = int(c or tp), links.get("unlimited", {})
    r_u, share = float(unl.get("measured_bytes_per_s") or 0), min(1.0, int(c or tp) / tp)
    notes += (["no core count in the file: C = N."] * (not c)
              + ["no unlimited psum rate: T_c = U."] * (not r_u > 0))
    key = lambda r: (r["strategy"], r["kind"], r.get("rs_bits"), r.get("ag_bits"),  # noqa: E731
                     r.get("group_size"))
    base = {key(r): r for r in data["rows"] if r["link"] == "unlimited"}
    for name, link in ((k, v) for k, v in links.items() if k != "unlimited"):
        rate = float(link.get("rate_bytes_per_s") or 0)
        if not rate > 0:
            raise ValueError(f"ttft json: links.{name}.rate_bytes_per_s must be > 0, got {rate}")
        bus = tp if link.get("topology", "shared") == "shared" else 1
        lat[name] = max(0.0, (link.get("small_psum_s") or 0.0) - (unl.get("small_psum_s") or 0.0))
        for r in (r for r in data["rows"] if r["link"] == name and key(r) in base):
            u, b = base[key(r)]["ttft_s"], r["prefill_bytes_per_rank"]
            t_c = max(0.0, u - (tp * b / r_u if r_u > 0 else 0.0))
            t_l = bus * b / rate + r.get("collectives_prefill", 0) * lat[name]
            pred = max(t_c, t_l + share * t_c)
            out.append({"link": name,
                        **{k: r.get(k) for k in ("strategy", "kind", "rs_bits", "ag_bits")},
                        "unlimited_s": u, "compute_s": t_c, "link_s": t_l,
                        "bounds_s": [max(t_c, t_l), t_c + t_l], "measured_s": r["ttft_s"],
                        "predicted_s": pred, "err": pred / r["ttft_s"] - 1})
    worst = max((abs(r["err"]) for r in out), default=None)
    return {"tp": tp, "cores": cores, "exposed_share": share, "unlimited_bytes_per_s": r_u or None,
            "latency_per_collective_s": lat, "rows": out, "notes": notes,
            "max_abs_err": worst, "within_tolerance": None if worst is None else worst <= TOLERANCE}


# --- output ---------------------------------------------------------------------------------------
def predictions() -> dict:
    """GPU all-reduce speedups by size, TTFT per setting, the paper rows, the sensitivity."""
    ar = [{"gpu": g, "n": n, "bits": b, "byte_ideal": BF16 / int_wire_bytes(b),
           "speedups": [gpu_allreduce_speedup(GPUS[g], s, n, b) for s in TABLE_SIZES]}
          for g in GPUS for n in (4, 8) for b in (8, 6, 4)]
    tt = []
    for model, tp, batch, seq in TTFT_SETTINGS:
        for g, gpu in GPUS.items():
            e = {"bf16" if b is None else f"int{b}": ttft(MODELS[model], gpu, tp, batch, seq, b)
                 for b in (None, 8, 4)}
            tt.append({"model": model, "tp": tp, "batch": batch, "seq": seq, "gpu": g, **e,
                       "comm_share": e["bf16"]["comm_s"] / e["bf16"]["ttft_s"], **{
                           f"speedup_int{b}": e["bf16"]["ttft_s"] / e[f"int{b}"]["ttft_s"]
                           for b in (8, 4)}})
    paper = [{**p, "predicted": {
                 f"N={n}, {s // MIB} MiB": gpu_allreduce_speedup(GPUS[p["gpu"]], s, n, p["bits"])
                 for n in (4, 8) for s in (p["size"], 1024 * MIB)} if p["kind"] == "allreduce"
              else {f"int{b}": ttft_speedup(GPUS[p["gpu"]], b) for b in (4, 8)}} for p in PAPER]
    for p in paper:  # the first prediction is the stated setting (N=4; PAPER_SETTING at INT4)
        p["error"] = next(iter(p["predicted"].values())) / p["paper"] - 1
    return {"allreduce": ar, "ttft": tt, "paper": paper, "sensitivity": sensitivity()}


_table = lambda head, rows: (  # noqa: E731
    ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    + ["| " + " | ".join(map(str, r)) + " |" for r in rows])


def markdown(res: dict) -> str:
    """The tables of docs/gpu_model.md."""
    P, ms = res["predictions"], lambda s: f"{s * 1e3:.1f} ms"
    pct, x = lambda e: f"{e:+.1%}", lambda v: f"{v:.2f}x"
    L = ["### All-reduce speedup over the NCCL bf16 ring "
         "(message = bf16 bytes per rank)\n"] + _table(
        ["GPU", "N", "bits", *(f"{s // MIB} MiB" for s in TABLE_SIZES), "byte ideal"],
        [[r["gpu"], r["n"], f"int{r['bits']}", *map(x, r["speedups"]), x(r["byte_ideal"])]
         for r in P["allreduce"]])
    L += ["\n### Predicted vs paper\n"] + _table(
        ["claim", "GPU", "paper", "predicted", "error (first)"],
        [[p["claim"], p["gpu"], x(p["paper"]),
          ", ".join(f"{k}: {x(v)}" for k, v in p["predicted"].items()), pct(p["error"])]
         for p in P["paper"]])
    L += ["\n### Sensitivity of the paper comparison "
          "(one assumption changed at a time)\n"] + _table(
        list(P["sensitivity"][0]),
        [[v if isinstance(v, str) else x(v) for v in s.values()] for s in P["sensitivity"]])
    L += ["\n### Predicted TTFT\n"] + _table(
        ["model", "TP", "batch x seq", "GPU", "bf16 TTFT", "comm share (bf16)", "int8 speedup",
         "int4 speedup"],
        [[t["model"], t["tp"], f"{t['batch']} x {t['seq']}", t["gpu"], ms(t["bf16"]["ttft_s"]),
          f"{t['comm_share']:.0%}", x(t["speedup_int8"]), x(t["speedup_int4"])] for t in P["ttft"]])
    em = res["checks"]["emulated_allreduce"]
    L += ["\n### Predicted vs measured: all-reduce on the emulated link "
          f"({em['rate_bytes_per_s'] / 1e6:.0f} MB/s, shared)\n"] + _table(
        ["N", "message", "method", "measured", "predicted", "error", "measured vs bf16 two-step",
         "predicted", "error", "codec priced from"],
        [[r["n"], f"{r['bytes'] // MIB} MiB", r["method"], ms(r["measured_s"]),
          ms(r["predicted_s"]), pct(r["err"])]
         + ([x(r["measured_ratio"]), x(r["predicted_ratio"]), pct(r["ratio_err"]),
             r["codec_source"]]
            if "measured_ratio" in r else ["", "", "", ""]) for r in em["rows"]])
    L.append(f"\nLargest |error| (times and ratios): {em['max_abs_err']:.1%}; "
             f"within {TOLERANCE:.0%}: {em['within_tolerance']}")
    tc = res["checks"]["ttft"]
    L.append("\n### Predicted vs measured: TTFT\n")
    if "skipped" in tc:
        return "\n".join(L + [tc["skipped"]])
    L += _table(["link", "strategy", "bits (rs/ag)", "unlimited", "T_c", "T_l", "[max, sum]",
                 "measured", "predicted", "error"],
                [[r["link"], r["strategy"], f"{r['rs_bits']}/{r['ag_bits']}",
                  *map(ms, (r["unlimited_s"], r["compute_s"], r["link_s"])),
                  " - ".join(map(ms, r["bounds_s"])), ms(r["measured_s"]), ms(r["predicted_s"]),
                  pct(r["err"])] for r in tc["rows"]])
    lat = ", ".join(f"{k}: {v * 1e6:.0f} us" for k, v in tc["latency_per_collective_s"].items())
    worst = "n/a" if tc["max_abs_err"] is None else f"{tc['max_abs_err']:.1%}"
    return "\n".join(L + [f"\nCores C = {tc['cores']}, exposed share min(1, C/N) = "
                          f"{tc['exposed_share']:.3f}, latency per collective: {lat}. Largest "
                          f"|error|: {worst}; within {TOLERANCE:.0%}: {tc['within_tolerance']}. "
                          + " ".join(tc["notes"])])


def plot(path: Path) -> None:
    """All-reduce speedup vs message size, one panel per GPU (N=4), one curve per bit width, the
    byte ideals dashed, the paper's 3.18x (L40, INT4, >= 64 MB) marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = [int(2 ** (k / 4)) for k in range(64, 121)]
    colors = {8: "tab:blue", 6: "tab:orange", 4: "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    topo = {"L40": "PCIe Gen4, shared bus", "A100": "NVLink3 + NVSwitch",
            "H100": "NVLink4 + NVSwitch"}
    for ax, g in zip(axes, GPUS):
        for b, c in colors.items():
            ax.plot(sizes, [gpu_allreduce_speedup(GPUS[g], s, 4, b) for s in sizes], color=c,
                    label=f"int{b}")
            ax.axhline(BF16 / int_wire_bytes(b), color=c, ls="--", lw=1,
                       label=f"int{b} byte ideal ({BF16 / int_wire_bytes(b):.2f}x)")
        if g == "L40":
            ax.plot([64 * MIB], [3.18], "*", color="k", ms=14, label="paper: INT4 3.18x (>= 64 MB)")
            ax.hlines(3.18, 64 * MIB, 2**30, color="k", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks([2**k for k in range(16, 31, 2)],
                      [f"{2 ** (k - 10)}K" if k < 20 else f"{2 ** (k - 20)}M"
                       for k in range(16, 31, 2)])
        ax.set(title=f"{g}, {topo[g]}, N=4", xlabel="message (bf16 bytes per rank)", ylim=(0, 4.2))
        ax.grid(alpha=0.3)
        ax.axhline(1.0, color="gray", lw=0.8)
    axes[0].set_ylabel("predicted speedup over the NCCL bf16 ring")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv=None) -> dict:
    """Compute everything, print the tables, write ``<out>.json``, ``<out>.png`` and the page."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="docs/results/gpu_model",
                    help="output prefix (.json, .png and the page, .md)")
    ap.add_argument("--ttft", default=TTFT_FILE, help="TTFT measurements to check against")
    args = ap.parse_args(argv)
    tpath = REPO / args.ttft
    res = {"command": ".venv/bin/python -m benchmarks.gpu.cost_model",
           "inputs": {"constants": {k: v for k, v in globals().items()
                                    if k.isupper() and isinstance(v, (int, float, str, tuple))},
                      "gpus": {g: dataclasses.asdict(v) for g, v in GPUS.items()},
                      "models": {m: dataclasses.asdict(v) for m, v in MODELS.items()},
                      "paper_setting": PAPER_SETTING, "table_sizes": TABLE_SIZES},
           "predictions": predictions(),
           "checks": {"emulated_allreduce": emulated_allreduce_check(),
                      "ttft": ttft_check(json.loads(tpath.read_text())) if tpath.exists() else {
                          "skipped": f"{args.ttft} does not exist yet "
                                     "(benchmarks.llm.ttft.links writes it): this check is "
                                     "skipped; re-run this script once it exists."}}}
    print(markdown(res))
    (REPO / f"{args.out}.json").write_text(json.dumps(res, indent=1) + "\n")
    plot(REPO / f"{args.out}.png")
    write_page(REPO / f"{args.out}.json", res, tables=markdown(res))
    print(f"\nwrote {args.out}.json, {args.out}.png and {args.out}.md")
    return res


if __name__ == "__main__":
    main()
