"""TTFT of SmolLM2 at TP=3 in one process: the overlap rings on the p2p transport, link emulated.

    .venv/bin/python -m benchmarks.llm.ttft.p2p [--prompt-tokens 128] [--reps 5] \\
        [--out docs/results/ttft_p2p] [--quick]

``benchmarks.llm.ttft.links`` runs the ranks as processes over gloo, where the p2p transports do
not apply (their peers are the devices of one process). Here the three ranks are the CPU devices of
one process, the configuration the p2p transports exist for (one process driving several GPUs), and
the only link that can be slowed is the ring transport's own: ``link_emulation`` paces each ring
step's copy (per link, i.e. per receiving rank). Rows, one process, one run:

- ``exact`` (``lax.psum``) and ``overlap`` on the ``xla`` transport (``lax.ppermute``): XLA's
  in-process collectives, memory copies, no link to slow;
- ``overlap`` on ``p2p``: unpaced, then paced at the NVLink-class and PCIe-class rates (the GPU
  system's bus bytes per FLOP, ``settings.SYSTEMS``, times the FLOP/s this process achieves
  per rank in the exact prefill), at the "matched" rate whose link time equals the
  share of the unpaced prefill spent in the ring matmuls' dots (their FLOP share of the
  prefill; what overlap can hide at most), and at ``--extra-rates``.

For each paced row: the bytes each rank receives per prefill (the transport's own timeline,
``ring_steps.recording``), the time those bytes take on the link (``comm``), the link time hidden
behind compute (``TTFT_unpaced + comm - TTFT_paced``) and the share not hidden:
``exposed = (TTFT_paced - TTFT_unpaced) / comm`` (0: all hidden behind the dots, 1: none; the
model-level counterpart of docs/transport.md's per-op figure). Writes ``OUT.json`` and its page
``OUT.md`` (docs/results/ttft_p2p.md; docs/ttft.md reads it) and prints the table.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

from models import cli  # sets no jax state

from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import command_parser


TP = 3


def exposed_fraction(ttft_paced: float, ttft_unpaced: float, comm_s: float) -> float:
    """Share of the link time the prefill did not hide behind its compute."""
    if not comm_s > 0:
        raise ValueError(f"comm time must be positive, got {comm_s}")
    return (ttft_paced - ttft_unpaced) / comm_s


def ring_dot_share(cfg, seq: int) -> float:
    """FLOP share of a prefill in the matmuls the overlap rings run next to (every
    projection and the MLP; not the attention core nor the LM head)."""
    from benchmarks.llm.ttft import settings

    return settings.block_matmul_flops(cfg, seq) / settings.prefill_flops(cfg, seq)


def per_link_rate(achieved_flops_per_s: float, system: dict, ranks: int) -> float:
    """Bytes/s of one rank's link whose ratio to one rank's achieved FLOP/s is the GPU
    system's ratio of per-GPU bus bandwidth to per-GPU FLOP/s."""
    from benchmarks.llm.ttft import settings

    return settings.link_rate(achieved_flops_per_s, system) / ranks


def run(args) -> dict:
    cli.set_devices(TP)
    import jax

    from benchmarks.llm.ttft import settings
    from jax_flashcomm.nn import TPComm
    from jax_flashcomm.transport import ring_steps
    from models.corpus import load_text
    from models.engine import Engine
    from models.eval import progress
    from models.llama import set_comm
    from models.machine import first_line
    from models.llama.params import load_model

    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    model, ckpt = load_model("smollm2", tp=TP, mesh=mesh)
    ids = ckpt.tokenizer.encode(load_text())[:args.prompt_tokens]
    print(first_line(), file=sys.stderr)

    def measure(comm, rate=None) -> dict:
        """Median TTFT of ``args.reps`` prefills (after a warm-up that compiles), and with
        ``rate`` the bytes rank 0 received in one of them."""
        set_comm(model, comm)
        # the rate is read when the prefill is traced: compile it (the first call) inside
        with ring_steps.link_emulation(rate) if rate else contextlib.nullcontext():
            engine = Engine(model, mesh, cache_len=len(ids) + 2)
            list(engine.generate(ids, 1))
        list(engine.generate(ids, 1))
        samples = []
        for _ in range(args.reps):
            list(engine.generate(ids, 1))
            samples.append(engine.last_timings["ttft"])
        row = {"ttft_s": statistics.median(samples), "samples_s": samples,
               "seq": engine.bucket(len(ids))}
        if comm.overlap and comm.config.transport == "p2p":
            with ring_steps.recording() as events:
                list(engine.generate(ids, 1))
            moves = [e for e in events if e["kind"] == "move" and e["rank"] == 0]
            row["bytes_into_rank0"] = sum(e["bytes"] for e in moves)
            row["moves_into_rank0"] = len(moves)
        return row

    plan = [("exact", "-", TPComm("exact")),
            ("overlap", "xla", TPComm(layout="sequence_parallel", transport="xla")),
            ("overlap", "p2p", TPComm(layout="sequence_parallel", transport="p2p"))]
    rows, start = [], time.perf_counter()
    total = len(plan) + 3 + len(args.extra_rates)
    for i, (kind, transport, comm) in enumerate(plan):
        progress(i, total, start, unit="rows", what=f"{kind} {transport} unpaced")
        rows.append({"strategy": kind, "transport": transport, "link": "unpaced",
                     "rate_bytes_per_s": None, **measure(comm)})
    exact, unpaced = rows[0], rows[2]
    flops = settings.prefill_flops(model.cfg, exact["seq"])
    achieved = flops / exact["ttft_s"]
    rates = [(name, per_link_rate(achieved, settings.SYSTEMS[name], TP)) for name in settings.LINKS]
    share = ring_dot_share(model.cfg, exact["seq"])
    rates.append(("matched", unpaced["bytes_into_rank0"] / (unpaced["ttft_s"] * share)))
    rates += [(f"{r / 1e6:g} MB/s", r) for r in args.extra_rates]
    p2p = TPComm(layout="sequence_parallel", transport="p2p")
    for i, (name, rate) in enumerate(rates, len(plan)):
        progress(i, total, start, unit="rows", what=f"overlap p2p at {rate / 1e6:.2f} MB/s")
        row = {"strategy": "overlap", "transport": "p2p", "link": name, "rate_bytes_per_s": rate,
               **measure(p2p, rate)}
        row["comm_s"] = row["bytes_into_rank0"] / rate
        row["exposed"] = exposed_fraction(row["ttft_s"], unpaced["ttft_s"], row["comm_s"])
        row["hidden_s"] = unpaced["ttft_s"] + row["comm_s"] - row["ttft_s"]
        rows.append(row)
    progress(total, total, start, unit="rows", what="done")
    return {"machine": first_line(), "tp": TP, "prompt_tokens": len(ids), "reps": args.reps,
            "prefill_flops": flops, "achieved_flops_per_s": achieved, "ring_dot_share": share,
            "systems": {name: settings.SYSTEMS[name] for name in settings.LINKS},
            "command": "python -m benchmarks.llm.ttft.p2p " + " ".join(sys.argv[1:]),
            "rows": rows}


def markdown(data) -> str:
    lines = [f"Machine: `{data['machine']}`. TP={data['tp']}, one process (3 CPU devices), "
             f"{data['prompt_tokens']}-token prompt, median of {data['reps']}. Exact prefill: "
             f"{data['prefill_flops'] / 1e9:.1f} GFLOP at {data['achieved_flops_per_s'] / 1e9:.1f}"
             f" GFLOP/s; the ring matmuls' dots are {100 * data['ring_dot_share']:.0f}% of its "
             f"FLOPs.", "",
             "| strategy | ring transport | link (per rank) | TTFT | bytes into a rank | "
             "link time | hidden | exposed |", "|---|---|---|---|---|---|---|---|"]
    for r in data["rows"]:
        rate = ("memcpy" if r["rate_bytes_per_s"] is None
                else f"{r['link']}: {r['rate_bytes_per_s'] / 1e6:.2f} MB/s")
        moved = (f"{r['bytes_into_rank0'] / 2**20:.2f} MiB ({r['moves_into_rank0']} moves)"
                 if "bytes_into_rank0" in r else "-")
        comm = f"{r['comm_s'] * 1e3:.0f} ms" if "comm_s" in r else "-"
        exposed = f"**{r['exposed']:.2f}**" if "exposed" in r else "-"
        hidden = f"{r['hidden_s'] * 1e3:.0f} ms" if "hidden_s" in r else "-"
        lines.append(f"| {r['strategy']} | {r['transport']} | {rate} | "
                     f"{r['ttft_s'] * 1e3:.0f} ms | {moved} | {comm} | {hidden} | {exposed} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = command_parser("benchmarks.llm.ttft.p2p", __doc__)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--extra-rates", type=float, nargs="*", default=[],
                        help="more per-link rates (bytes/s) for the paced p2p rows")
    parser.add_argument("--out", default=str(RESULTS / "ttft_p2p"),
                        help="output prefix (.json and the page, .md, are added)")
    parser.add_argument("--quick", action="store_true", help="32 tokens, 2 reps")
    args = parser.parse_args(argv)
    if args.quick:
        args.prompt_tokens, args.reps = 32, 2
    if args.prompt_tokens < 2 or args.reps < 1:
        parser.error("--prompt-tokens >= 2 and --reps >= 1")
    data = run(args)
    Path(args.out + ".json").write_text(json.dumps(data, indent=1))
    table = markdown(data)
    print(table)
    write_page(args.out + ".json", data, tables=table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
