"""Worker of benchmarks/ttft.py: one of the TP processes, started by ``run_workers`` inside the
benchmark's network namespace (run as the module ``benchmarks.ttft_worker``). Process 0 also
sets the namespace's loopback qdisc (``tc``) between measurements, with barriers around each
change, and reports progress to the file in ``$FLASHCOMM_TTFT_PROGRESS``."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from benchmarks import ttft
from benchmarks.netns import worker_init, write_result


def _namespace() -> str:
    """The name of the network namespace this process is in; refuses to touch ``tc`` outside
    one of the benchmark's own (benchmarks/netns.py names them ``flashcomm-...``)."""
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
    args = ap.parse_args()
    pid, nproc = worker_init(1)
    import jax
    import numpy as np
    from jax import lax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from jax_flashcomm.costmodel import Link
    from jax_flashcomm.selection import Call, choose
    from jax_flashcomm.tuning import use_link as use_tuning_link
    from models.corpus import load_text
    from models.engine import Engine
    from models.llama import set_comm
    from models.weights import load_model

    t_start = time.perf_counter()
    progress = os.environ.get("FLASHCOMM_TTFT_PROGRESS")

    def log(msg: str) -> None:
        if pid == 0 and progress:
            with open(progress, "a") as fh:
                fh.write(f"[{time.perf_counter() - t_start:6.0f} s] {msg}\n")

    links = ttft.parse_links(args.links)
    strategies = ttft.parse_strategies(args.strategies)
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

    def auto_quantizes(comm, seq: int, decode: bool) -> bool:
        """Whether the automatic choice quantized this step's block all-reduces."""
        nbytes = (1 if decode else seq) * cfg.d_model * 4
        call = Call("psum", nbytes, 4, "float32", nproc, "cpu", "processes",
                    "other processes", (comm.config.phase1_bits, comm.config.phase2_bits),
                    comm.config.group_size)
        return choose(call).candidate != "lax"

    rows, compute = [], {}
    for name, comm in strategies:
        set_comm(model, comm)
        t = time.perf_counter()
        use_link("unlimited")
        engine = None if comm.kind == "auto" else compiled()
        log(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s")
        for link in ["unlimited"] + links:
            use_link(link)
            with use_tuning_link(link_profile(link) if comm.kind == "auto" else None):
                if comm.kind == "auto":   # the choice is made at trace time, per link
                    t = time.perf_counter()
                    engine = compiled()
                    log(f"{name}: compiled for {link} in {time.perf_counter() - t:.1f} s")
                seq = engine.bucket(len(ids))
                samples, decode, tokens = [], [], []
                for rep in range(args.reps):
                    last = rep == args.reps - 1
                    out = list(engine.generate(ids, args.decode_tokens + 1 if last else 1))
                    samples.append(engine.last_timings["ttft"])
                    if last:
                        decode, tokens = engine.last_timings["decode"], out
                auto = {step: comm.kind == "auto" and auto_quantizes(comm, seq, step == "decode")
                        for step in ("prefill", "decode")}
            pre = ttft.step_traffic(cfg, nproc, comm, seq, decode=False,
                                    auto_quantizes=auto["prefill"])
            dec = ttft.step_traffic(cfg, nproc, comm, seq, decode=True,
                                    auto_quantizes=auto["decode"])
            row = {"link": link, **ttft.strategy_fields(name, comm),
                   "auto_quantizes": auto if comm.kind == "auto" else None,
                   "ttft_s": statistics.median(samples), "ttft_samples_s": samples,
                   "decode_s_per_token": statistics.median(decode),
                   "decode_samples_s": decode,
                   "prefill_bytes_per_rank": pre["bytes"], "decode_bytes_per_rank": dec["bytes"],
                   "prefill_block_bytes_per_rank": pre["blocks"],
                   "decode_block_bytes_per_rank": dec["blocks"],
                   "collectives_prefill": pre["collectives"],
                   "collectives_decode": dec["collectives"],
                   "tokens": [int(x) for x in tokens]}
            rows.append(row)
            log(f"{name} on {link}: TTFT {row['ttft_s'] * 1e3:.0f} ms "
                f"({', '.join(f'{s * 1e3:.0f}' for s in samples)}), decode "
                f"{row['decode_s_per_token'] * 1e3:.1f} ms/token")
            if name == "exact" and link == "unlimited":
                flops = ttft.prefill_flops(cfg, seq)
                compute = {"exact_prefill_flops": flops, "exact_prefill_s_unlimited":
                           row["ttft_s"], "achieved_flops_per_s": flops / row["ttft_s"],
                           "prefill_positions": seq}
                for ln in links:
                    rates[ln] = ttft.link_rate(compute["achieved_flops_per_s"], ttft.SYSTEMS[ln])
                log(f"calibration: {flops / 1e9:.1f} GFLOP in {row['ttft_s']:.3f} s = "
                    f"{compute['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s; rates " + ", ".join(
                        f"{ln} {rates[ln] / 1e6:.2f} MB/s" for ln in links))
    use_link("unlimited")
    for name, info in link_info.items():
        info["calibration"] = _calibration(name, compute)
        if name in ttft.SYSTEMS:
            info.update({"gpu_" + k: v for k, v in ttft.SYSTEMS[name].items()})
    write_result({"tp": nproc, "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens,
                  "reps": args.reps, "model": "SmolLM2-135M-Instruct (GGUF Q4_1, run in f32)",
                  "links": {k: link_info[k] for k in ["unlimited"] + links},
                  "compute": compute, "rows": rows, "tbf": {"burst": ttft.BURST,
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
