"""TTFT (prefill) and per-token decode latency of a model (SmolLM2-135M at TP=3 by default) on
emulated links.

    .venv/bin/python -m benchmarks.llm.ttft.links [--model smollm2] [--tp 3] \\
        [--links pcie,nvlink] \\
        [--strategies exact,int8,int4,int4/8,overlap,overlap+int8] [--prompt-tokens 128] \\
        [--decode-tokens 16] [--reps 3] [--decode-steps N] [--out docs/results/ttft] [--quick] \\
        [--transport xla|shm]

``--tp`` worker processes (one CPU device each, ``jax.distributed`` over gloo) run in a private
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
model (``--model``: a known name, fetched on first use, or a path).

``--transport xla`` (default): every strategy's collectives go over gloo, through the
tc-limited loopback. ``--transport shm``: every strategy but ``exact`` / ``exact-bf16`` (the
gloo baselines) runs its collectives and ring steps over shared memory (``transport="p2p"``,
docs/transport.md, "Across processes"), and the shared-memory transport emulates the same link
as one bus of the same rate (``jax_flashcomm.transport.shm.set_link_rate``); ``exact-shm`` is
the exact all-reduce over it.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from benchmarks.llm.ttft.report import add_link_model, plot, speedups, tables
from benchmarks.llm.ttft.settings import (BURST, DEFAULT_STRATEGIES, LINKS, LO_MTU,
                                          SHM_STRATEGIES, TBF_LATENCY, TP, TRANSPORTS,
                                          parse_links, parse_strategies)
from benchmarks.shared.results import RESULTS, write_page
from benchmarks.shared.runtime import command_parser



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
    wargs = ["--model", args.model, "--links", ",".join(args.links),
             "--strategies", ",".join(args.names),
             "--prompt-tokens", args.prompt_tokens, "--decode-tokens", args.decode_tokens,
             "--reps", args.reps, "--transport", args.transport,
             "--decode-steps", args.decode_steps or args.reps * args.decode_tokens]
    try:
        results = run_workers("benchmarks.llm.ttft.links_worker", args.tp, args=wargs,
                              rate="10gbit", burst=BURST, latency=TBF_LATENCY, mtu=LO_MTU,
                              timeout=args.timeout, pin_cpus=False, port=24600,
                              env={"FLASHCOMM_TTFT_PROGRESS": str(progress)})
    finally:
        stop.set()
        tail.join(timeout=5)
        progress.unlink(missing_ok=True)
    return results[0]


def main(argv=None) -> int:
    ap = command_parser("benchmarks.llm.ttft.links", __doc__)
    ap.add_argument("--model", default="smollm2",
                    help="a known model name (models/checkpoints/fetch.py) or a checkpoint path")
    ap.add_argument("--tp", type=int, default=TP, help="worker processes (the TP size)")
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
    for name, lo in (("--tp", 2), ("--prompt-tokens", 1), ("--decode-tokens", 1), ("--reps", 1),
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
