"""Tables, page and plot of ``benchmarks.llm.accuracy``'s record (docs/results/accuracy.md,
docs/results/accuracy.png)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.shared.results import write_page

TITLES = {
    "grid": "Bits x group size (no spikes, no rotation)",
    "coarse": "Per-tensor baseline: one scale and zero per rank's chunk of a message",
    "options": "Spikes and rotation (G=128)",
    "mixes": "Per-phase bits: reduce-scatter / all-gather",
    "overlap": "flash+overlap: quantized all-gather ring, once-quantized reduce-scatter",
    "defaults": "The library's defaults (`CommConfig(bits=B)`) and the candidates",
    "formats": "One row per wire format (integer defaults and options, FP8, MXFP4, NVFP4)",
    "layers": ("Per-site policies: the k most sensitive all-reduces at the upgrade bits "
               "(benchmarks/llm/layer_sensitivity.py, calibrated on other windows)"),
}


def _cells(r) -> list[str]:
    return [f"{r['bytes_per_element']:.3f}", f"{r['vs_bf16_ring']:.3f}",
            f"{r['perplexity']:.4f}", f"{100 * r['delta_ppl']:+.3f}%", f"{r['kl']:.2e}",
            f"{100 * r['top1']:.2f}%"]


HEAD = ["B/elem", "x bf16 ring", "perplexity", "vs exact", "KL", "top-1"]


def _resolved(r) -> str:
    """What a default row's options resolved to."""
    rotation = {0: "no rotation", 1: "Hadamard", 2: "signed Hadamard"}.get(r["rotation"],
                                                                  str(r["rotation"]))
    return (f" (G={r['group_size']}, spikes {r['rs_spikes']}/{r['ag_spikes']}, {rotation})")


def _table(header, body) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in body]
    return "\n".join(lines)


def _by(data, section, tp=None):
    return [r for r in data["rows"] if r["section"] == section and (tp is None or r["tp"] == tp)]


def exact_rows(data) -> dict:
    return {r["tp"]: r for r in data["rows"] if r["section"] == "exact"}


def tables(data) -> str:
    """Markdown tables of every section present in ``data``."""
    out = [f"Machine: `{data.get('machine', '?')}`. Model {data.get('model')}, "
           f"{data['max_windows']} windows of {data['window']} tokens of {data.get('text')} "
           f"({next(iter(exact_rows(data).values()), {}).get('tokens', '?')} predictions). "
           "B/elem: wire bytes per element and phase (a bf16 ring: 2.0). KL: mean "
           "KL(exact || setting) of the next-token distributions, nats. top-1: positions whose "
           "most likely token is exact's."]
    ex = exact_rows(data)
    out.append("\n### Exact\n\n" + _table(["TP", "perplexity"], [
        [tp, f"{r['perplexity']:.4f}"] for tp, r in sorted(ex.items())]))
    tps = sorted({r["tp"] for r in _by(data, "grid")})
    if tps:
        body = {}
        for r in _by(data, "grid"):
            key = (-r["rs_bits"], r["group_size"])
            body.setdefault(key, [r["rs_bits"], r["group_size"], f"{r['bytes_per_element']:.3f}",
                                  f"{r['vs_bf16_ring']:.3f}"] + [""] * (3 * len(tps)))
            i = 4 + 3 * tps.index(r["tp"])
            body[key][i:i + 3] = [f"{100 * r['delta_ppl']:+.3f}%", f"{r['kl']:.2e}",
                                  f"{100 * r['top1']:.2f}%"]
        head = ["bits", "G", "B/elem", "x bf16 ring"] + [
            f"{h} TP={tp}" for tp in tps for h in ("Δppl", "KL", "top-1")]
        out.append(f"\n### {TITLES['grid']}\n\n" + _table(head, [body[k] for k in sorted(body)]))
    for section in ("coarse", "options", "mixes", "overlap", "defaults", "formats", "layers"):
        rows = _by(data, section)
        if rows:
            body = [[r["tp"], r["label"] + (_resolved(r) if r.get("default") else "")]
                    + _cells(r) for r in rows]
            out.append(f"\n### {TITLES[section]}\n\n" + _table(["TP", "setting"] + HEAD, body))
    return "\n".join(out)


def write_markdown(data, json_path: Path) -> Path:
    """The page of the run whose record is ``json_path`` (``.md`` beside it): the tables."""
    return write_page(json_path, data, tables=tables(data))


def plot(data, path: Path) -> None:
    """Perplexity change vs bits, one line per group size, one panel per TP; the per-tensor
    baseline as crosses, the library's defaults as stars (a change below 0.02%, or negative,
    drawn at 0.02% and labelled with its value)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tps = sorted({r["tp"] for r in _by(data, "grid")})
    if not tps:
        return
    fig, axes = plt.subplots(1, len(tps), figsize=(5.5 * len(tps), 4.2), sharey=True,
                             squeeze=False)
    for ax, tp in zip(axes[0], tps):
        rows = _by(data, "grid", tp)
        for g in sorted({r["group_size"] for r in rows}):
            pts = sorted((r["rs_bits"], 100 * r["delta_ppl"]) for r in rows
                         if r["group_size"] == g)
            ax.plot([p[0] for p in pts], [max(p[1], 1e-3) for p in pts], marker="o",
                    label=f"G={g}")
        coarse = sorted((r["rs_bits"], 100 * r["delta_ppl"]) for r in _by(data, "coarse", tp))
        if coarse:
            ax.plot([p[0] for p in coarse], [max(p[1], 1e-3) for p in coarse], "kx--",
                    label="per-tensor")
        for r in _by(data, "defaults", tp):
            if r.get("default") and r["rs_bits"] == r["ag_bits"]:
                y = 100 * r["delta_ppl"]
                ax.plot(r["rs_bits"], max(y, 0.02), "k*", ms=12,
                        label="default (G=128, auto spikes / rotation)"
                        if r["rs_bits"] == 8 else None)
                ax.annotate(f"{y:+.2f}%", (r["rs_bits"], max(y, 0.02)), fontsize=7,
                            xytext=(6, -10), textcoords="offset points")
        ax.axhline(0.1, color="grey", lw=0.8, ls=":")
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_xlabel("bits per value (both phases)")
        ax.set_title(f"SmolLM2-135M, TP={tp}")
        ax.invert_xaxis()
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].set_ylabel("perplexity increase vs exact (%)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Quantized all-reduce: perplexity vs bits per group size "
                 "(dotted 0.1%, dashed 1%)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
