"""Worker of ``benchmarks.llm.ttft.links``: one of the TP processes, started by
``run_workers`` inside the benchmark's network namespace (run as this module). Process 0 also
sets the namespace's loopback qdisc (``tc``) between measurements, with barriers around each
change, and reports progress to the file in ``$FLASHCOMM_TTFT_PROGRESS``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import time

from benchmarks.llm.ttft import links as ttft
from benchmarks.shared.netns import worker_init, write_result

#: The psum sizes (bytes per rank) the auto strategy measures on each link: a decode step's
#: 2.3 KB and a 129-token prefill's 297 KB lie between them. One call per program, the
#: host's pause between calls (a decode step's collectives have compute between them: on the
#: tc-limited loopback the token bucket refills there), the fastest of 3 rounds.
TUNE_SIZES = (2048, 32768, 524288)
#: Rounds of auto's step measurement (jax_flashcomm.tune: a decode step's all-reduces
#: ranked inside the step): one decode step of each candidate per round, in turn.
STEP_ROUNDS = 24
#: Rounds of auto's layout measurement: one prefill of each layout per round, in turn (the
#: all-reduce layout, ``TPComm("auto")``, against the sequence-parallel one, ``"auto+overlap"``).
LAYOUT_ROUNDS = 5


def _namespace() -> str:
    """The name of the network namespace this process is in; refuses to touch ``tc`` outside
    one of the benchmark's own (benchmarks/shared/netns.py names them ``flashcomm-...``)."""
    name = subprocess.run(["ip", "netns", "identify", str(os.getpid())], capture_output=True,
                          text=True, timeout=30).stdout.strip()
    if not name.startswith("flashcomm-"):
        raise RuntimeError(f"ttft_worker: not inside a benchmark namespace ({name!r}); "
                           f"refusing to change a qdisc")
    return name


def set_qdisc(rate_bytes_per_s: float | None) -> None:
    """No qdisc on lo (None) or ``tc tbf`` at ``rate_bytes_per_s`` (aggregate, both ways)."""
    _namespace()
    if rate_bytes_per_s is None:
        subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True,
                       timeout=30)  # fails harmlessly when there is none
        return
    subprocess.run(["tc", "qdisc", "replace", "dev", "lo", "root", "tbf", "rate",
                    f"{int(rate_bytes_per_s * 8)}bit", "burst", ttft.BURST, "latency",
                    ttft.TBF_LATENCY], check=True, capture_output=True, text=True, timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--links", required=True)
    ap.add_argument("--strategies", required=True)
    ap.add_argument("--prompt-tokens", type=int, required=True)
    ap.add_argument("--decode-tokens", type=int, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--decode-steps", type=int, required=True)
    ap.add_argument("--transport", choices=ttft.TRANSPORTS, default="xla")
    args = ap.parse_args()
    pid, nproc = worker_init(1)
    import jax
    import numpy as np
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.costs import Link
    from jax_flashcomm.nn import TPComm
    from jax_flashcomm.planner import record
    from jax_flashcomm.tune import measure_in_step, measure_steps
    from jax_flashcomm.tune import measure_mesh
    from jax_flashcomm.costs import Table, machine_key, use_table
    from jax_flashcomm.costs import active as tuning_active
    from jax_flashcomm.costs import use_link as use_tuning_link
    from models.corpus import load_text
    from models.engine import Engine
    from models.llama import set_comm
    from models.llama.params import load_model

    t_start = time.perf_counter()
    progress = os.environ.get("FLASHCOMM_TTFT_PROGRESS")

    def log(msg: str) -> None:
        if pid == 0 and progress:
            with open(progress, "a") as fh:
                fh.write(f"[{time.perf_counter() - t_start:6.0f} s] {msg}\n")

    links = ttft.parse_links(args.links)
    strategies = ttft.parse_strategies(args.strategies, args.transport)
    if args.transport == "shm":
        from jax_flashcomm.transport import shm

        reason = shm.setup()
        if reason is not None:
            raise SystemExit(f"--transport shm: the shared-memory transport cannot run: {reason}")
    mesh = jax.make_mesh((nproc,), ("tp",), devices=jax.devices())
    model, ckpt = load_model("smollm2", tp=nproc, mesh=mesh)
    cfg = model.cfg
    ids = ckpt.tokenizer.encode(load_text())[:args.prompt_tokens]
    if len(ids) < args.prompt_tokens:
        raise SystemExit(f"the corpus has only {len(ids)} tokens")
    log(f"model loaded on {nproc} processes; prompt {len(ids)} tokens")

    # link checks: a 4-byte psum (latency) and a 1 MiB-per-rank f32 psum (rate, as a ring)
    psum = jax.jit(jax.shard_map(lambda v: lax.psum(v, "tp"), mesh=mesh, in_specs=P("tp"),
                                 out_specs=P()))

    def global_ones(n_elems):
        return jax.make_array_from_process_local_data(
            NamedSharding(mesh, P("tp")), np.ones((1, n_elems), np.float32), (nproc, n_elems))

    small, big = global_ones(1), global_ones(256 * 1024)
    jax.block_until_ready((psum(small), psum(big)))

    def link_check() -> dict:
        lat = []
        for _ in range(5):
            t = time.perf_counter()
            jax.block_until_ready(psum(small))
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        jax.block_until_ready(psum(big))
        dt = time.perf_counter() - t
        sent = nproc * 2 * (nproc - 1) / nproc * big.nbytes / nproc   # all ranks, ring
        return {"small_psum_s": statistics.median(lat), "big_psum_s": dt,
                "measured_bytes_per_s": sent / dt}

    rates = {"unlimited": None}
    link_info: dict = {}
    current = ["(start)"]

    def use_link(name: str) -> None:
        if current[0] == name:
            return
        multihost_utils.sync_global_devices(f"before {name}")
        if pid == 0:
            set_qdisc(rates[name])
        if args.transport == "shm":  # the same link, emulated for shared memory
            shm.set_link_rate(rates[name] or 0.0)
        multihost_utils.sync_global_devices(f"after {name}")
        current[0] = name
        if name not in link_info:
            link_info[name] = {"rate_bytes_per_s": rates[name], **link_check()}
            log(f"link {name}: psum-measured {link_info[name]['measured_bytes_per_s'] / 1e6:.2f}"
                f" MB/s, 4-byte psum {link_info[name]['small_psum_s'] * 1e3:.2f} ms")

    def link_profile(name: str) -> Link:
        """The link the automatic choice prices: process 0's measurement of it (every process
        must make the same choice), shared by the ranks: the tc rate, or with no limit the
        psum-measured rate; the 4-byte psum's time as the latency of one collective."""
        info = link_info[name]
        mine = np.array([info["rate_bytes_per_s"] or info["measured_bytes_per_s"],
                         info["small_psum_s"]], np.float64)
        rate, lat = (float(v) for v in multihost_utils.broadcast_one_to_all(mine))
        return Link(rate, "shared", lat)

    def compiled():
        engine = Engine(model, mesh, cache_len=len(ids) + args.decode_tokens + 1)
        list(engine.generate(ids, 2))                       # compile prefill + decode
        return engine

    def block_paths(plans, seq: int, overlap: bool) -> dict:
        """Whether the traced ``plans`` quantized the prefill's and the decode step's block
        collectives (what the engine runs, not a prediction): ``{"prefill": bool, ...}``; a
        sequence-parallel prefill (``overlap``) ``{"ag": bool, "rs": bool}`` for its all-gather
        rings and reduce-scatters. Refuses a trace where calls of one kind took different
        paths."""
        kinds = {"prefill": {"ag": ("all_gather_matmul",), "rs": ("matmul_reduce_scatter",)}
                 if overlap else {"": ("psum", "psum_add_rms_norm")},
                 "decode": {"": ("psum", "psum_add_rms_norm")}}
        out = {}
        for step, positions in (("prefill", seq), ("decode", 1)):
            got = {}
            for part, ops in kinds[step].items():
                paths = {p.quantized for p in plans if p.op in ops and (
                    p.op not in ("psum", "psum_add_rms_norm")
                    or p.nbytes == positions * cfg.d_model * 4)}
                if len(paths) != 1:
                    raise RuntimeError(f"auto's {step} {part or 'block'} collectives: "
                                       f"quantized {paths}")
                got[part] = paths.pop()
            out[step] = got.get("", got)
        return out

    # 1. calibration: the exact prefill's FLOP/s with no limit sets the emulated links' rates
    exact = dict(strategies)["exact"]
    set_comm(model, exact)
    use_link("unlimited")
    engines = {("exact", None): compiled()}
    seq = engines["exact", None].bucket(len(ids))
    calib = []
    for _ in range(args.reps):
        list(engines["exact", None].generate(ids, 1))
        calib.append(engines["exact", None].last_timings["ttft"])
    flops = ttft.prefill_flops(cfg, seq)
    compute = {"exact_prefill_flops": flops, "exact_prefill_s_unlimited": min(calib),
               "achieved_flops_per_s": flops / min(calib), "prefill_positions": seq}
    for ln in links:
        rates[ln] = ttft.link_rate(compute["achieved_flops_per_s"], ttft.SYSTEMS[ln])
    log(f"calibration: {flops / 1e9:.1f} GFLOP in {min(calib):.3f} s = "
        f"{compute['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s; rates " + ", ".join(
            f"{ln} {rates[ln] / 1e6:.2f} MB/s" for ln in links))

    decode_bytes = cfg.d_model * 4  # one position's block all-reduce, f32
    step_engines = {}

    def decode_stepper(engine, comm):
        """A function timing one decode step of ``engine`` per call (its cache kept between
        calls; a step's time does not depend on the cache's values), ``comm`` set first."""
        state = {"cache": engine.new_cache(1), "token": np.array([ids[-1]], np.int32),
                 "pos": len(ids)}

        def step():
            set_comm(model, comm)
            t = time.perf_counter()
            token, _, state["cache"] = engine.decode(state["token"], state["pos"],
                                                     state["cache"], jax.random.key(0))
            state["token"] = np.asarray(token)
            dt = time.perf_counter() - t
            state["pos"] = min(state["pos"] + 1, engine.cache_len - 1)  # short caches
            return [dt]
        return step

    def make_decode_step(config):
        """The decode step with every all-reduce under ``config`` (auto's candidates, pinned):
        its engine built once, under no limit; one decode step per call."""
        comm = TPComm("exact" if config.exact else "quantized", "tp", config=config)
        if config not in step_engines:
            link = current[0]
            use_link("unlimited")
            set_comm(model, comm)
            step_engines[config] = compiled()
            use_link(link)
        return decode_stepper(step_engines[config], comm)

    def prefill_runner(engine, comm, context):
        """A function timing one prefill of ``engine`` per call under ``comm`` and the
        (link profile, table) ``context``."""
        def run():
            set_comm(model, comm)
            with use_tuning_link(context[0]), use_table(context[1]):
                list(engine.generate(ids, 1))
            return [engine.last_timings["ttft"]]
        return run

    # 2. every engine compiled (warm); auto's once per link, under the table measured on it, in
    # both layouts; the faster prefill decides which layout auto runs on that link
    tables, contexts, auto_paths, auto_comms, auto_layouts = {}, {}, {}, {}, {}
    for name, comm in strategies:
        set_comm(model, comm)
        t = time.perf_counter()
        for link in (["unlimited"] + links) if comm.kind == "auto" else [None]:
            if link is None:
                if (name, None) not in engines:
                    use_link("unlimited")
                    engines[name, None] = compiled()
                continue
            use_link(link)
            table = Table(key=machine_key(f"ttft {link}"), rows=tuple(measure_mesh(
                mesh, "tp", TUNE_SIZES, (comm.config.phase1_bits,), 3,
                ops=(("psum", "float32"),), layout="processes",
                # with the shared-memory transport its candidates are measured on the same
                # emulated link (the cost model underprices the exact sum on a paced bus)
                transports=("p2p", "xla") if args.transport == "shm" else ("xla",),
                exact_p2p=args.transport == "shm", calls=1, rounds=3)))
            # a decode step's all-reduces ranked inside the decode step: isolated 2 KB calls
            # rank them wrongly here (docs/autotune.md, "Decode: measured in the step")
            steps = measure_in_step(
                make_decode_step, "psum", comm.config, nbytes=decode_bytes, n=nproc,
                dtype="float32", layout="processes", rounds=STEP_ROUNDS,
                candidates=(("lax", "exact/p2p", "quantized/p2p") if args.transport == "shm"
                            else ("lax", "quantized/xla")))
            table = dataclasses.replace(table, rows=table.rows + tuple(steps))
            log(f"{name} on {link}: decode step " + ", ".join(
                f"{r.candidate} {r.seconds * 1e3:.2f} ms" for r in steps))
            tables[link] = [dataclasses.asdict(r) for r in table.rows]
            contexts[name, link] = (link_profile(link), table)
            layouts = {}
            for lay in (comm, dataclasses.replace(comm, kind="auto+overlap")):
                set_comm(model, lay)  # the step measurement left its last candidate's comm
                with use_tuning_link(contexts[name, link][0]), use_table(table), \
                        record() as plans:
                    layouts[lay.kind] = (lay, compiled(), block_paths(plans, seq, lay.overlap))
            prefill = measure_steps({k: prefill_runner(e, c, contexts[name, link])
                                     for k, (c, e, _) in layouts.items()}, rounds=LAYOUT_ROUNDS)
            chosen = min(prefill, key=prefill.get)
            auto_comms[link], engines[name, link], auto_paths[link] = layouts[chosen]
            auto_layouts[link] = {"chosen": chosen, "prefill_s": prefill,
                                  "quantizes": {k: v[2] for k, v in layouts.items()},
                                  "rounds": LAYOUT_ROUNDS}
            log(f"{name} on {link}: prefill " + ", ".join(
                f"{k} {v * 1e3:.0f} ms" for k, v in prefill.items()) + f"; runs {chosen}")
        log(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s")

    def run_once(name, comm, link, decode_tokens):
        """One generation of ``name`` on ``link`` (the link already set)."""
        key = (name, link) if comm.kind == "auto" else (name, None)
        profile, table = contexts.get(key, (None, None))
        auto = auto_paths.get(link) if comm.kind == "auto" else {"prefill": False,
                                                                  "decode": False}
        set_comm(model, auto_comms[link] if comm.kind == "auto" else comm)
        with use_tuning_link(profile), use_table(table if table is not None else
                                                 tuning_active()):
            out = list(engines[key].generate(ids, decode_tokens + 1))
        timings = engines[key].last_timings
        return timings["ttft"], timings["decode"], out, auto

    # 3. rounds: every link, every strategy (the order rotated each round), so the machine's
    # slow spells hit every setting alike; every generation gives a TTFT and decode steps
    samples = {(n, ln): {"ttft": [], "decode": [], "side_by_side": []} for n, _ in strategies
               for ln in ["unlimited"] + links}
    last = {}
    for r in range(args.reps):
        for link in ["unlimited"] + links:
            use_link(link)
            order = strategies[r % len(strategies):] + strategies[:r % len(strategies)]
            for name, comm in order:
                t, dec, out, auto = run_once(name, comm, link, args.decode_tokens)
                samples[name, link]["ttft"].append(t)
                samples[name, link]["decode"].extend(dec)
                last[name, link] = (out, auto)
        log(f"round {r + 1}/{args.reps} done")
    # 4. decode side by side: one step of every strategy in turn (the order rotated), from a
    # cache of its own; identical programs timed in generations of their own differ by up to
    # 8% (the machine drifts between generations), step by step they share its state
    steppers = {}
    for link in ["unlimited"] + links:
        use_link(link)
        for name, comm in strategies:
            key = (name, link) if comm.kind == "auto" else (name, None)
            steppers[name, link] = decode_stepper(
                engines[key], auto_comms[link] if comm.kind == "auto" else comm)
        for k in range(args.decode_steps):
            for name, _ in strategies[k % len(strategies):] + strategies[:k % len(strategies)]:
                samples[name, link]["side_by_side"].extend(steppers[name, link]())
        log(f"decode side by side on {link} done")
    rows = []
    for name, comm in strategies:
        for link in ["unlimited"] + links:
            smp, (tokens, auto) = samples[name, link], last[name, link]
            ran = auto_comms[link] if comm.kind == "auto" else comm
            pre = ttft.step_traffic(cfg, nproc, ran, seq, decode=False,
                                    auto_quantizes=auto["prefill"])
            dec = ttft.step_traffic(cfg, nproc, ran, seq, decode=True,
                                    auto_quantizes=auto["decode"])
            row = {"link": link, **ttft.strategy_fields(name, comm),
                   "auto_quantizes": auto if comm.kind == "auto" else None,
                   "auto_layout": ran.kind if comm.kind == "auto" else None,
                   "ttft_s": statistics.median(smp["ttft"]), "ttft_samples_s": smp["ttft"],
                   "decode_s_per_token": statistics.median(smp["side_by_side"]),
                   "decode_samples_s": smp["side_by_side"],
                   "decode_in_generation_s_per_token": statistics.median(smp["decode"]),
                   "decode_in_generation_samples_s": smp["decode"],
                   "prefill_bytes_per_rank": pre["bytes"], "decode_bytes_per_rank": dec["bytes"],
                   "prefill_block_bytes_per_rank": pre["blocks"],
                   "decode_block_bytes_per_rank": dec["blocks"],
                   "collectives_prefill": pre["collectives"],
                   "collectives_decode": dec["collectives"],
                   "tokens": [int(x) for x in tokens]}
            rows.append(row)
            log(f"{name} on {link}: TTFT {row['ttft_s'] * 1e3:.0f} ms, decode "
                f"{row['decode_s_per_token'] * 1e3:.1f} ms/token side by side (median of "
                f"{len(smp['side_by_side'])}), {row['decode_in_generation_s_per_token'] * 1e3:.1f}"
                f" in generations")
    use_link("unlimited")
    for name, info in link_info.items():
        info["calibration"] = _calibration(name, compute)
        if name in ttft.SYSTEMS:
            info.update({"gpu_" + k: v for k, v in ttft.SYSTEMS[name].items()})
    write_result({"tp": nproc, "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
                  "reps": args.reps, "decode_steps": args.decode_steps,
                  "model": "SmolLM2-135M-Instruct (GGUF Q4_1, run in f32)",
                  "links": {k: link_info[k] for k in ["unlimited"] + links},
                  "compute": compute, "rows": rows, "auto_tables": tables,
                  "auto_layouts": auto_layouts,
                  "tbf": {"burst": ttft.BURST,
                                                            "latency": ttft.TBF_LATENCY}})


def _calibration(name: str, compute: dict) -> str:
    if name == "unlimited":
        return "no qdisc on the namespace's loopback (gloo over TCP on 127.0.0.1)"
    s = ttft.SYSTEMS[name]
    return (f"aggregate tbf rate = {s['system']}: {s['bus_bytes_per_s'] / 1e9:g} GB/s "
            f"all-reduce bus bandwidth / "
            f"{s['flops_per_s'] / 1e12:g} TFLOP/s dense bf16 = "
            f"{s['bus_bytes_per_s'] / s['flops_per_s']:.3g} B/FLOP, times the measured "
            f"{compute['achieved_flops_per_s'] / 1e9:.2f} GFLOP/s of the exact prefill with no "
            f"limit")


if __name__ == "__main__":
    main()
