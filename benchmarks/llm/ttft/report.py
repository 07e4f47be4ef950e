"""The tables and the plot of a TTFT run (``benchmarks.llm.ttft.links``'s record): the links,
every strategy on each (against exact and the bf16 baseline), auto's choices."""

from __future__ import annotations

import os

from benchmarks.llm.ttft.settings import BF16_BASELINE


def add_link_model(data) -> None:
    """Each row's ``ttft_unlimited_plus_link_s``: the same strategy's unlimited TTFT plus the
    bytes all N ranks send in one prefill at the link's set (aggregate) rate. The cost model's
    first term and second term, from this run's measurements; no latency term."""
    unl = {r["strategy"]: r["ttft_s"] for r in data["rows"] if r["link"] == "unlimited"}
    for r in data["rows"]:
        rate = data["links"][r["link"]]["rate_bytes_per_s"]
        r["ttft_unlimited_plus_link_s"] = (
            unl[r["strategy"]] + (0.0 if rate is None
                                  else data["tp"] * r["prefill_bytes_per_rank"] / rate))


def speedups(rows, baseline: str = "exact") -> dict:
    """``{(link, strategy): the baseline's TTFT / this TTFT}`` (links with a baseline row)."""
    base = {r["link"]: r["ttft_s"] for r in rows if r["strategy"] == baseline}
    return {(r["link"], r["strategy"]): base[r["link"]] / r["ttft_s"] for r in rows
            if r["link"] in base}


def markdown(data) -> str:
    sp = speedups(data["rows"])
    exact_dec = {r["link"]: r["decode_s_per_token"] for r in data["rows"]
                 if r["strategy"] == "exact"}
    bf16 = speedups(data["rows"], BF16_BASELINE)
    head = ["link", "strategy", "TTFT ms (median)", "TTFT vs exact", "TTFT vs exact-bf16",
            "unlimited + bytes/rate ms",
            "decode ms/token (side by side)", "decode vs exact", "prefill MB/rank",
            "decode KB/rank",
            "collectives/prefill"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in data["rows"]:
        lines.append("| " + " | ".join([
            r["link"], r["strategy"], f"{r['ttft_s'] * 1e3:.0f}",
            f"**{sp[r['link'], r['strategy']]:.2f}x**",
            f"{bf16[r['link'], r['strategy']]:.2f}x" if bf16 else "-",
            f"{r['ttft_unlimited_plus_link_s'] * 1e3:.0f}", f"{r['decode_s_per_token'] * 1e3:.1f}",
            f"{exact_dec[r['link']] / r['decode_s_per_token']:.2f}x",
            f"{r['prefill_bytes_per_rank'] / 1e6:.2f}", f"{r['decode_bytes_per_rank'] / 1e3:.1f}",
            str(r["collectives_prefill"])]) + " |")
    return "\n".join(lines)


def auto_markdown(data) -> str:
    """What ``auto`` ran on each link: its layout (the faster of the all-reduce and the
    sequence-parallel prefill, timed side by side) and where its collectives quantized."""
    def said(q):
        if isinstance(q, dict):
            return ", ".join(f"{k} {'quantized' if v else 'exact'}" for k, v in q.items())
        return "quantized" if q else "exact"

    head = ["link", "auto's prefill layouts, timed side by side (ms, median)", "auto ran",
            "its prefill", "its decode step"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for link, lay in data.get("auto_layouts", {}).items():
        q = lay["quantizes"][lay["chosen"]]
        lines.append("| " + " | ".join([
            link, ", ".join(f"{k} {v * 1e3:.0f}" for k, v in lay["prefill_s"].items()),
            lay["chosen"], said(q["prefill"]), said(q["decode"])]) + " |")
    return "\n".join(lines) if len(lines) > 2 else ""


def links_markdown(data) -> str:
    head = ["link", "set rate (MB/s, aggregate)", "psum-measured rate (MB/s)",
            "small psum (ms)", "calibration"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, ln in data["links"].items():
        rate = ln["rate_bytes_per_s"]
        lines.append("| " + " | ".join([
            name, "-" if rate is None else f"{rate / 1e6:.2f}",
            f"{ln['measured_bytes_per_s'] / 1e6:.2f}", f"{ln['small_psum_s'] * 1e3:.2f}",
            ln["calibration"]]) + " |")
    return "\n".join(lines)


def tables(data) -> str:
    """The tables of a run's page: the links, the strategies on each, and auto's choices."""
    table = markdown(data)
    auto = auto_markdown(data)
    table += f"\n\n{auto}" if auto else ""
    return f"{links_markdown(data)}\n\n{table}\n"


def plot(data, path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, sp = data["rows"], speedups(data["rows"])
    links = list(data["links"])
    strategies = list(dict.fromkeys(r["strategy"] for r in rows))
    fig, axes = plt.subplots(1, len(links), figsize=(4.6 * len(links), 4.2), squeeze=False)
    for ax, link in zip(axes[0], links):
        by = {r["strategy"]: r for r in rows if r["link"] == link}
        ys = [by[s]["ttft_s"] for s in strategies]
        bars = ax.bar(range(len(strategies)), ys,
                      color=["0.55" if s == "exact" else "tab:blue" for s in strategies])
        model = [by[s]["ttft_unlimited_plus_link_s"] for s in strategies]
        if link != "unlimited":
            ax.scatter(range(len(strategies)), model, marker="_", s=300, color="k", zorder=3,
                       label="unlimited TTFT + all ranks' bytes / rate")
            ax.legend(fontsize=7, loc="upper right")
        for i, (b, s) in enumerate(zip(bars, strategies)):
            top = max(b.get_height(), model[i] if link != "unlimited" else 0)
            ax.annotate(f"{sp[link, s]:.2f}x", (b.get_x() + b.get_width() / 2, top),
                        xytext=(0, 2), textcoords="offset points", ha="center", va="bottom",
                        fontsize=8)
        ax.set_xticks(range(len(strategies)), strategies, rotation=35, ha="right", fontsize=8)
        rate = data["links"][link]["rate_bytes_per_s"]
        ax.set_title(f"{link}" + ("" if rate is None else f" ({rate / 1e6:.1f} MB/s)"),
                     fontsize=9)
        ax.set_ylabel("TTFT (s, median)")
        ax.set_ylim(0, max(ys + model) * 1.2)
    fig.suptitle(f"{data.get('model', 'SmolLM2-135M').split(' (')[0]} TP={data['tp']}, prompt "
                 f"{data['prompt_tokens']} tokens, {data['tp']} gloo processes on "
                 f"{os.cpu_count()} CPU cores; label: speedup vs exact", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
