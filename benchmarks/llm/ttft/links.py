"""TTFT (prefill) and per-token decode latency of SmolLM2-135M at TP=3 on emulated links.

    .venv/bin/python -m benchmarks.llm.ttft.links [--links pcie,nvlink] \\
        [--strategies exact,int8,int4,int4/8,overlap,overlap+int8] [--prompt-tokens 128] \\
        [--decode-tokens 16] [--reps 3] [--decode-steps N] [--out docs/results/ttft] [--quick] \\
        [--transport xla|shm]

Three worker processes (one CPU device each, ``jax.distributed`` over gloo) run in a private
network namespace (``benchmarks/shared/netns.py``, root). Process 0 sets the namespace's loopback
qdisc between measurements: none ("unlimited"), then a ``tc tbf`` rate per link. The rate of a
link is calibrated in the same run: the achieved FLOP/s of the exact prefill with no limit,
times the bytes-per-FLOP of a GPU system (``SYSTEMS``). Each strategy (``models.compare``'s
names: exact, overlap, intB, intR/A, overlap+intB) is compiled once and timed on every link:
``--reps`` generations of the same prompt (a fixed slice of the ``models.corpus`` text): its
prefill (TTFT) and a greedy decode of ``--decode-tokens`` tokens, the strategies in turn. The
decode figure is then measured side by side: ``--decode-steps`` (default ``reps x
decode-tokens``) decode steps of every
strategy, one step of each in turn, each from a cache of its own (identical programs timed in
generations of their own differ by up to 8%; the generations' decode medians are kept as
``decode_in_generation_s_per_token``). Writes ``OUT.json``, ``OUT.png`` and the page ``OUT.md``
(docs/results/ttft.md; docs/ttft.md explains the tables). Needs root, iproute2 and the
SmolLM2 GGUF (fetched on first use).

``--transport xla`` (default): every strategy's collectives go over gloo, through the
tc-limited loopback. ``--transport shm``: every strategy but ``exact`` / ``exact-bf16`` (the
gloo baselines) runs its collectives and ring steps over shared memory (``transport="p2p"``,
docs/transport.md, "Across processes"), and the shared-memory transport emulates the same link
as one bus of the same rate (``jax_flashcomm.transport.shm.set_link_rate``); ``exact-shm`` is
the exact all-reduce over it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.shared.results import RESULTS, write_page


TP = 3
LINKS = ("pcie", "nvlink")
DEFAULT_STRATEGIES = "exact,exact-bf16,int8,int4,int4/8,overlap,overlap+int8,auto"
#: With ``--transport shm``.
SHM_STRATEGIES = "exact,exact-shm,int8,int4,overlap,overlap+int8,auto"
TRANSPORTS = ("xla", "shm")
# GPU systems whose ratio of link bandwidth to compute the emulated links copy (assumptions,
# docs/ttft.md): all-reduce bus bandwidth NCCL achieves, dense bf16 tensor-core peak.
SYSTEMS = {
    "pcie": {"system": "NVIDIA L40 + PCIe Gen4 x16", "bus_bytes_per_s": 25e9,
             "flops_per_s": 181e12},
    "nvlink": {"system": "NVIDIA A100 SXM4 + NVLink 3", "bus_bytes_per_s": 230e9,
               "flops_per_s": 312e12},
}
# tbf: the bucket must hold one packet of lo's MTU or such packets are dropped, and tokens
# pile up in it while the ranks compute: a bucket of 128 KB (lo's default 64 KiB MTU) let up to
# 128 KB of every collective through at once, a credit no real link gives (first run: TTFTs
# 0.7-1 s below "unlimited + bytes / rate"). So lo's MTU is set to 1500 and the bucket to 16 KB
# (4 ms at the PCIe-class rate). A long latency (queue limit = rate x latency) keeps TCP from
# losing packets at low rates.
LO_MTU, BURST, TBF_LATENCY = 1500, "16kb", "2s"


# --- pure parts: strategies, FLOPs, calibration, bytes ----------------------------------------

#: The exact strategy whose all-reduces move bf16 (benchmarks/collectives/bf16_baseline.py): the
#: baseline of a GPU user, whose exact all-reduce moves bf16 activations.
BF16_BASELINE = "exact-bf16"


def parse_strategies(text: str, transport: str = "xla") -> list:
    """``[(name, TPComm)]`` of a comma-separated list (``models.compare.parse_setting``,
    :data:`BF16_BASELINE` and, with ``transport="shm"``, ``exact-shm``); exact first (the
    calibration is relative to it). Every strategy's config takes ``transport`` (module
    docstring)."""
    from benchmarks.collectives.bf16_baseline import Bf16WireComm
    from models.compare import parse_setting

    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise ValueError("--strategies is empty")
    if len(set(names)) != len(names):
        raise ValueError(f"--strategies repeats a name: {text!r}")
    if "exact" in names:
        names.remove("exact")
    if transport not in TRANSPORTS:
        raise ValueError(f"--transport must be one of {TRANSPORTS}, got {transport!r}")
    if "exact-shm" in names and transport != "shm":
        raise ValueError("exact-shm needs --transport shm")
    out = []
    for n in ["exact"] + names:
        if n == BF16_BASELINE:
            out.append((n, Bf16WireComm()))
            continue
        name, comm = parse_setting("exact" if n == "exact-shm" else n)
        over = "p2p" if transport == "shm" and n != "exact" else "xla"
        out.append((n, _over(comm, over)))
    return out


def _over(comm, transport: str):
    """``comm`` with its config's transport set to ``transport``."""
    import dataclasses

    from jax_flashcomm.nn import TPComm

    return TPComm(comm.quantization, comm.axis_name, layout=comm.layout,
                  config=dataclasses.replace(comm.config, transport=transport),
                  bidirectional=comm.bidirectional, fuse_norm=comm.fuse_norm)


def parse_links(text: str) -> list[str]:
    links = [s.strip() for s in text.split(",") if s.strip()]
    bad = [x for x in links if x not in LINKS]
    if bad or not links or len(set(links)) != len(links):
        raise ValueError(f"--links: choose distinct names among {', '.join(LINKS)}, got {text!r}")
    return links


def prefill_flops(cfg, seq: int, batch: int = 1) -> float:
    """FLOPs (2 per multiply-add) of one prefill of ``seq`` positions as the engine executes
    it: the projections and MLP of every position, attention scores and values over all
    ``seq`` keys (computed, then masked), the LM head of the last position. Norms, RoPE and
    softmax are left out (O(seq d), under 1%)."""
    attention = 2 * 2 * seq * seq * cfg.n_heads * cfg.head_dim
    return float(block_matmul_flops(cfg, seq, batch)
                 + batch * (cfg.n_layers * attention + 2 * cfg.d_model * cfg.vocab_size))


def block_matmul_flops(cfg, seq: int, batch: int = 1) -> float:
    """FLOPs of the blocks' projections and MLPs in one prefill of ``seq`` positions (the
    matmuls the row- and column-parallel layers run)."""
    d, dh, f = cfg.d_model, cfg.head_dim, cfg.ffn_dim
    q, kv = cfg.n_heads * dh, cfg.n_kv_heads * dh
    per_token = 2 * d * (q + 2 * kv) + 2 * q * d + 2 * d * 2 * f + 2 * f * d
    return float(batch * cfg.n_layers * seq * per_token)


def link_rate(achieved_flops_per_s: float, system: dict) -> float:
    """Aggregate loopback rate (bytes/s) whose ratio to the CPU's achieved FLOP/s is the GPU
    system's ratio of per-GPU bus bandwidth to per-GPU FLOP/s. The N ranks share both the
    loopback qdisc and the 2 cores, so N cancels: per rank R/N bytes/s against A/N FLOP/s."""
    if not achieved_flops_per_s > 0:
        raise ValueError(f"achieved FLOP/s must be positive, got {achieved_flops_per_s}")
    return achieved_flops_per_s * system["bus_bytes_per_s"] / system["flops_per_s"]


def _payload(elems: int, bits: int, group: int, spikes: int, multiple: int = 1) -> float:
    """Bytes of one codec payload of ``elems`` values (whole groups, ``multiple`` chunks)."""
    from jax_flashcomm.codec import spec

    return spec.padded_size(elems, group, multiple) * spec.wire_bytes_per_element(
        bits, group, spikes)


def step_traffic(cfg, tp: int, comm, seq: int, *, decode: bool, batch: int = 1,
                 itemsize: int = 4, auto_quantizes=False) -> dict:
    """Bytes each rank sends, and collectives it joins, in one prefill of ``seq`` (padded)
    positions or one decode step, as the model is written (docs/ttft.md "Bytes"):

    * embedding: exact ``psum`` of the (B, S, d) partial lookups (``psum_scatter`` with the
      sequence-parallel overlap kinds); logits of the last position ``all_gather``-ed over the
      vocabulary; with overlap, the final ``all_gather`` of the sequence;
    * per layer, after attention and after the MLP: ``lax.psum`` (exact: a ring, 2 (N-1)/N of
      the operand), the two-step quantized psum ((N-1)/N of each phase's payload, the operand
      padded to N chunks of whole groups), or with overlap an all-gather ring (N-1 permutes of
      this rank's S/N rows; quantized with ``ag_bits`` for overlap+int) before the column
      matmul and a reduce-scatter (ring of N-1 permutes of S/N rows, or the quantized
      ``psum_scatter``: (N-1)/N of the rs payload) after the row matmul.
    A decode step has S = 1 and all-reduces (the overlap kinds too). ``auto`` counts as flash
    where ``auto_quantizes`` (the choice it made for this step's all-reduces), else as exact;
    ``auto+overlap``'s sequence-parallel prefill takes ``{"ag": bool, "rs": bool}`` (whether
    its all-gather rings and its reduce-scatters quantized; a bool: both alike);
    a comm with ``wire_itemsize`` (the bf16 baseline) moves its all-reduces in that many bytes.
    ``{"bytes": total, "blocks": the 2L per-layer collectives' bytes, "collectives": count}``.
    """
    if tp < 2:
        return {"bytes": 0.0, "blocks": 0.0, "collectives": 0}
    n, d, L = tp, cfg.d_model, cfg.n_layers
    s = 1 if decode else seq
    sp = comm.overlap and not decode
    if sp and s % n:
        raise ValueError(f"sequence-parallel prefill needs seq % {n} == 0, got {s}")
    elems = batch * s * d
    act = elems * itemsize
    ring = 2 * (n - 1) / n * act
    if sp:
        fixed, count = (n - 1) / n * act + (n - 1) / n * act, 2   # embed psum_scatter, gather
    else:
        fixed, count = ring, 1                                      # embed psum
    vocab_padded = -(-cfg.vocab_size // n) * n
    fixed += (n - 1) * batch * vocab_padded // n * 4                # logits all_gather (f32)
    count += 1
    c = comm.config
    if comm.kind.startswith("auto"):
        q = auto_quantizes if isinstance(auto_quantizes, dict) else {"ag": bool(auto_quantizes),
                                                                      "rs": bool(auto_quantizes)}
    else:
        q = {"ag": comm.quantized, "rs": comm.quantized}
    if sp:  # an all-gather ring before the column matmul, a reduce-scatter after the row one
        ag = (n - 1) * (_payload(elems // n, c.phase2_bits, c.group_size, c.phase2_spikes)
                        if q["ag"] else act / n)
        rs = ((n - 1) / n * _payload(elems, c.phase1_bits, c.group_size, c.phase1_spikes, n)
              if q["rs"] else (n - 1) * act / n)   # the quantized psum_scatter, or a ring
        block, per = ag + rs, (n - 1) + (1 if q["rs"] else n - 1)
    elif q["rs"]:  # the two-step quantized all-reduce
        block = (n - 1) / n * (_payload(elems, c.phase1_bits, c.group_size, c.phase1_spikes, n)
                               + _payload(elems, c.phase2_bits, c.group_size, c.phase2_spikes, n))
        per = 2
    else:
        wire = getattr(comm, "wire_itemsize", None)           # bf16 baseline: two collectives
        block, per = (ring, 1) if wire is None else (ring * wire / itemsize, 2)
    blocks = 2 * L * block
    return {"bytes": fixed + blocks, "blocks": blocks, "collectives": count + 2 * L * per}


def strategy_fields(name: str, comm) -> dict:
    """The row fields that describe a strategy."""
    q = comm.quantized
    return {"strategy": name, "kind": comm.kind,
            "rs_bits": comm.config.phase1_bits if q else None,
            "ag_bits": comm.config.phase2_bits if q else None,
            "group_size": comm.config.group_size if q else None,
            "spikes": [comm.config.phase1_spikes, comm.config.phase2_spikes] if q else None}


# --- launcher ---------------------------------------------------------------------------------

def _tail(path: Path, stop: threading.Event) -> None:
    """Print the lines process 0 appends to its progress file, as they come."""
    pos = 0
    while True:
        done = stop.is_set()
        if path.exists():
            with open(path) as fh:
                fh.seek(pos)
                chunk = fh.read()
                pos = fh.tell()
            if chunk:
                print(chunk, end="", flush=True)
        if done:
            return
        stop.wait(1.0)


def run(args) -> dict:
    from benchmarks.shared.netns import run_workers

    progress = Path(f"/tmp/flashcomm-ttft-progress-{os.getpid()}.txt")
    progress.unlink(missing_ok=True)
    stop = threading.Event()
    tail = threading.Thread(target=_tail, args=(progress, stop), daemon=True)
    tail.start()
    wargs = ["--links", ",".join(args.links), "--strategies", ",".join(args.names),
             "--prompt-tokens", args.prompt_tokens, "--decode-tokens", args.decode_tokens,
             "--reps", args.reps, "--transport", args.transport,
             "--decode-steps", args.decode_steps or args.reps * args.decode_tokens]
    try:
        results = run_workers("benchmarks.llm.ttft.links_worker", TP, args=wargs,
                              rate="10gbit", burst=BURST, latency=TBF_LATENCY, mtu=LO_MTU,
                              timeout=args.timeout, pin_cpus=False, port=24600,
                              env={"FLASHCOMM_TTFT_PROGRESS": str(progress)})
    finally:
        stop.set()
        tail.join(timeout=5)
        progress.unlink(missing_ok=True)
    return results[0]


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
    fig.suptitle(f"SmolLM2-135M TP={data['tp']}, prompt {data['prompt_tokens']} tokens, "
                 f"3 gloo processes on 2 CPU cores; label: speedup vs exact", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.llm.ttft.links", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--links", default=",".join(LINKS))
    ap.add_argument("--strategies", default=DEFAULT_STRATEGIES)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="decode steps of every strategy timed side by side on each link "
                         "(default: reps x decode-tokens)")
    ap.add_argument("--out", default=str(RESULTS / "ttft"),
                    help="output prefix (.json, .png, .md are added)")
    ap.add_argument("--timeout", type=float, default=2400.0, help="seconds for the workers")
    ap.add_argument("--quick", action="store_true",
                    help="64 prompt tokens, 4 decode tokens, 2 reps, exact and int4 only "
                         "(exact, exact-shm and overlap with --transport shm)")
    ap.add_argument("--transport", choices=TRANSPORTS, default="xla",
                    help="xla: every collective over gloo; shm: the strategies but exact over "
                         "shared memory, paced at the link's rate (module docstring)")
    args = ap.parse_args(argv)
    if args.transport == "shm" and args.strategies == DEFAULT_STRATEGIES:
        args.strategies = SHM_STRATEGIES
    if args.quick:
        args.prompt_tokens, args.decode_tokens, args.reps = 64, 4, 2
        if args.strategies == DEFAULT_STRATEGIES:
            args.strategies = "exact,int4"
        elif args.strategies == SHM_STRATEGIES:
            args.strategies = "exact,exact-shm,overlap"
    for name, lo in (("--prompt-tokens", 1), ("--decode-tokens", 1), ("--reps", 1),
                     ("--decode-steps", 1)):
        value = getattr(args, name[2:].replace("-", "_"))
        if value is not None and value < lo:
            ap.error(f"{name} must be >= {lo}")
    try:
        args.links = parse_links(args.links)
        args.names = [n for n, _ in parse_strategies(args.strategies, args.transport)]
    except ValueError as e:
        ap.error(str(e))
    from benchmarks.shared.netns import available

    reason = available()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    from models.machine import first_line

    machine = first_line()
    print(machine, flush=True)
    start = time.perf_counter()
    load_before = os.getloadavg()
    data = {"machine": machine, **run(args)}
    data["load_average"] = {"before": list(load_before), "after": list(os.getloadavg())}
    add_link_model(data)
    data["command"] = "python -m benchmarks.llm.ttft.links " + " ".join(
        sys.argv[1:] if argv is None else argv)
    data["wall_s"] = time.perf_counter() - start
    out = args.out[:-5] if args.out.endswith(".json") else args.out
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(data, indent=1))
    plot(data, out + ".png")
    block = tables(data)
    write_page(out + ".json", data, tables=block)
    print(block)
    sp = speedups(data["rows"])
    for link in args.links:
        for s in args.names[1:]:
            print(f"{link}: {s} TTFT {sp[link, s]:.2f}x exact's")
    print(f"wrote {out}.json, {out}.png, {out}.md ({data['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
