"""Worker of ``benchmarks.llm.ttft.links``: one of the TP processes, started by
``run_workers`` inside the benchmark's network namespace (run as this module). Process 0 also
sets the namespace's loopback qdisc (``tc``) between measurements, with barriers around each
change, and reports progress to the file in ``$FLASHCOMM_TTFT_PROGRESS``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import time

from benchmarks.llm.ttft import settings
from benchmarks.llm.ttft.link_control import EmulatedLinks, calibration_text
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


def _args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--links", required=True)
    ap.add_argument("--strategies", required=True)
    ap.add_argument("--prompt-tokens", type=int, required=True)
    ap.add_argument("--decode-tokens", type=int, required=True)
    ap.add_argument("--reps", type=int, required=True)
    ap.add_argument("--decode-steps", type=int, required=True)
    ap.add_argument("--transport", choices=settings.TRANSPORTS, default="xla")
    return ap.parse_args()


class Worker:
    """One TP process of the run: the model and its prompt, the links (process 0 sets them),
    the compiled engine of every strategy (auto's per link, under the table measured on it)."""

    def __init__(self, args, pid: int, nproc: int):
        import jax

        from models.corpus import load_text
        from models.demo import model_title
        from models.llama.params import load_model

        self.args, self.pid, self.nproc = args, pid, nproc
        self.t_start = time.perf_counter()
        self.progress = os.environ.get("FLASHCOMM_TTFT_PROGRESS")
        self.links = settings.parse_links(args.links)
        self.strategies = settings.parse_strategies(args.strategies, args.transport)
        self.shm = None
        if args.transport == "shm":
            from jax_flashcomm.transport import shm

            reason = shm.setup()
            if reason is not None:
                raise SystemExit(f"--transport shm: the shared-memory transport cannot run: "
                                 f"{reason}")
            self.shm = shm
        self.mesh = jax.make_mesh((nproc,), ("tp",), devices=jax.devices())
        self.model, ckpt = load_model(args.model, tp=nproc, mesh=self.mesh)
        self.model_name = model_title(ckpt, args.model)
        self.cfg = self.model.cfg
        self.ids = ckpt.tokenizer.encode(load_text())[:args.prompt_tokens]
        if len(self.ids) < args.prompt_tokens:
            raise SystemExit(f"the corpus has only {len(self.ids)} tokens")
        self.log(f"model loaded on {nproc} processes; prompt {len(self.ids)} tokens")
        self.net = EmulatedLinks(self.mesh, pid, self.shm, self.log)
        self.engines, self.step_engines = {}, {}
        self.tables, self.contexts, self.auto_paths = {}, {}, {}
        self.auto_comms, self.auto_layouts = {}, {}

    def log(self, msg: str) -> None:
        if self.pid == 0 and self.progress:
            with open(self.progress, "a") as fh:
                fh.write(f"[{time.perf_counter() - self.t_start:6.0f} s] {msg}\n")

    def use_link(self, name: str) -> None:
        self.net.use_link(name)

    def compiled(self):
        from models.engine import Engine

        engine = Engine(self.model, self.mesh,
                        cache_len=len(self.ids) + self.args.decode_tokens + 1)
        list(engine.generate(self.ids, 2))                       # compile prefill + decode
        return engine

    def block_paths(self, plans, seq: int, overlap: bool) -> dict:
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
                    or p.nbytes == positions * self.cfg.d_model * 4)}
                if len(paths) != 1:
                    raise RuntimeError(f"auto's {step} {part or 'block'} collectives: "
                                       f"quantized {paths}")
                got[part] = paths.pop()
            out[step] = got.get("", got)
        return out

    def decode_stepper(self, engine, comm):
        """A function timing one decode step of ``engine`` per call (its cache kept between
        calls; a step's time does not depend on the cache's values), ``comm`` set first."""
        import jax
        import numpy as np

        from models.llama import set_comm

        state = {"cache": engine.new_cache(1), "token": np.array([self.ids[-1]], np.int32),
                 "pos": len(self.ids)}

        def step():
            set_comm(self.model, comm)
            t = time.perf_counter()
            token, _, state["cache"] = engine.decode(state["token"], state["pos"],
                                                     state["cache"], jax.random.key(0))
            state["token"] = np.asarray(token)
            dt = time.perf_counter() - t
            state["pos"] = min(state["pos"] + 1, engine.cache_len - 1)  # short caches
            return [dt]
        return step

    def make_decode_step(self, config):
        """The decode step with every all-reduce under ``config`` (auto's candidates, pinned):
        its engine built once, under no limit; one decode step per call."""
        from jax_flashcomm.nn import TPComm
        from models.llama import set_comm

        comm = TPComm("exact" if config.exact else "quantized", "tp", config=config)
        if config not in self.step_engines:
            link = self.net.current
            self.use_link("unlimited")
            set_comm(self.model, comm)
            self.step_engines[config] = self.compiled()
            self.use_link(link)
        return self.decode_stepper(self.step_engines[config], comm)

    def prefill_runner(self, engine, comm, context):
        """A function timing one prefill of ``engine`` per call under ``comm`` and the
        (link profile, table) ``context``."""
        from jax_flashcomm.costs import use_link as use_tuning_link
        from jax_flashcomm.costs import use_table
        from models.llama import set_comm

        def run():
            set_comm(self.model, comm)
            with use_tuning_link(context[0]), use_table(context[1]):
                list(engine.generate(self.ids, 1))
            return [engine.last_timings["ttft"]]
        return run

    def calibrate(self) -> dict:
        """1. the exact prefill's FLOP/s with no limit, which sets the emulated links' rates."""
        from models.llama import set_comm

        set_comm(self.model, dict(self.strategies)["exact"])
        self.use_link("unlimited")
        engine = self.engines["exact", None] = self.compiled()
        self.seq = engine.bucket(len(self.ids))
        calib = []
        for _ in range(self.args.reps):
            list(engine.generate(self.ids, 1))
            calib.append(engine.last_timings["ttft"])
        flops = settings.prefill_flops(self.cfg, self.seq)
        compute = {"exact_prefill_flops": flops, "exact_prefill_s_unlimited": min(calib),
                   "achieved_flops_per_s": flops / min(calib), "prefill_positions": self.seq}
        for ln in self.links:
            self.net.rates[ln] = settings.link_rate(compute["achieved_flops_per_s"],
                                                settings.SYSTEMS[ln])
        self.log(f"calibration: {flops / 1e9:.1f} GFLOP in {min(calib):.3f} s = "
                 f"{compute['achieved_flops_per_s'] / 1e9:.1f} GFLOP/s; rates " + ", ".join(
                     f"{ln} {self.net.rates[ln] / 1e6:.2f} MB/s" for ln in self.links))
        return compute

    def auto_table(self, name, comm, link):
        """Auto's table on ``link`` (already set): the psum rows of :data:`TUNE_SIZES`, then a
        decode step's all-reduces ranked inside the decode step."""
        from jax_flashcomm.costs import Table, machine_key
        from jax_flashcomm.tune import measure_in_step, measure_mesh

        shm = self.args.transport == "shm"
        table = Table(key=machine_key(f"ttft {link}"), rows=tuple(measure_mesh(
            self.mesh, "tp", TUNE_SIZES, (comm.config.phase1_bits,), 3,
            ops=(("psum", "float32"),), layout="processes",
            # with the shared-memory transport its candidates are measured on the same
            # emulated link (the cost model underprices the exact sum on a paced bus)
            transports=("p2p", "xla") if shm else ("xla",),
            exact_p2p=shm, calls=1, rounds=3)))
        # a decode step's all-reduces ranked inside the decode step: isolated 2 KB calls
        # rank them wrongly here (docs/autotune.md, "Decode: measured in the step")
        steps = measure_in_step(
            self.make_decode_step, "psum", comm.config, nbytes=self.cfg.d_model * 4,
            n=self.nproc, dtype="float32", layout="processes", rounds=STEP_ROUNDS,
            candidates=(("lax", "exact/p2p", "quantized/p2p") if shm
                        else ("lax", "quantized/xla")))
        self.log(f"{name} on {link}: decode step " + ", ".join(
            f"{r.candidate} {r.seconds * 1e3:.2f} ms" for r in steps))
        return dataclasses.replace(table, rows=table.rows + tuple(steps))

    def compile_auto(self, name, comm, link) -> None:
        """Auto on ``link``: its table measured there, then both layouts compiled under it;
        the faster prefill decides which layout auto runs on that link."""
        from jax_flashcomm.costs import use_link as use_tuning_link
        from jax_flashcomm.costs import use_table
        from jax_flashcomm.planner import record
        from jax_flashcomm.tune import measure_steps
        from models.llama import set_comm

        self.use_link(link)
        table = self.auto_table(name, comm, link)
        self.tables[link] = [dataclasses.asdict(r) for r in table.rows]
        context = self.contexts[name, link] = (self.net.profile(link), table)
        layouts = {}
        for lay in (comm, dataclasses.replace(comm, layout="sequence_parallel")):
            set_comm(self.model, lay)  # the step measurement left its last candidate's comm
            with use_tuning_link(context[0]), use_table(table), record() as plans:
                layouts[lay.kind] = (lay, self.compiled(),
                                     self.block_paths(plans, self.seq, lay.overlap))
        prefill = measure_steps({k: self.prefill_runner(e, c, context)
                                 for k, (c, e, _) in layouts.items()}, rounds=LAYOUT_ROUNDS)
        chosen = min(prefill, key=prefill.get)
        self.auto_comms[link], self.engines[name, link], self.auto_paths[link] = layouts[chosen]
        self.auto_layouts[link] = {"chosen": chosen, "prefill_s": prefill,
                                   "quantizes": {k: v[2] for k, v in layouts.items()},
                                   "rounds": LAYOUT_ROUNDS}
        self.log(f"{name} on {link}: prefill " + ", ".join(
            f"{k} {v * 1e3:.0f} ms" for k, v in prefill.items()) + f"; runs {chosen}")

    def compile_all(self) -> None:
        """2. every engine compiled (warm); auto's once per link, in both layouts."""
        from models.llama import set_comm

        for name, comm in self.strategies:
            set_comm(self.model, comm)
            t = time.perf_counter()
            if comm.kind != "auto":
                if (name, None) not in self.engines:
                    self.use_link("unlimited")
                    self.engines[name, None] = self.compiled()
            else:
                for link in ["unlimited"] + self.links:
                    self.compile_auto(name, comm, link)
            self.log(f"{name}: compiled and warmed up in {time.perf_counter() - t:.1f} s")

    def ran(self, comm, link):
        """The comm a strategy ran on ``link``: auto's chosen layout there, else its own."""
        return self.auto_comms[link] if comm.kind == "auto" else comm

    def key(self, name, comm, link):
        return (name, link) if comm.kind == "auto" else (name, None)

    def run_once(self, name, comm, link, decode_tokens):
        """One generation of ``name`` on ``link`` (the link already set)."""
        from jax_flashcomm.costs import active as tuning_active
        from jax_flashcomm.costs import use_link as use_tuning_link
        from jax_flashcomm.costs import use_table
        from models.llama import set_comm

        key = self.key(name, comm, link)
        profile, table = self.contexts.get(key, (None, None))
        auto = (self.auto_paths.get(link) if comm.kind == "auto"
                else {"prefill": False, "decode": False})
        set_comm(self.model, self.ran(comm, link))
        with use_tuning_link(profile), use_table(table if table is not None else
                                                 tuning_active()):
            out = list(self.engines[key].generate(self.ids, decode_tokens + 1))
        timings = self.engines[key].last_timings
        return timings["ttft"], timings["decode"], out, auto

    def generations(self):
        """3. rounds: every link, every strategy (the order rotated each round), so the
        machine's slow spells hit every setting alike; every generation gives a TTFT and
        decode steps. Returns ``(samples, last)``: per (strategy, link) the samples, and the
        last generation's tokens and auto paths."""
        strategies, links = self.strategies, ["unlimited"] + self.links
        samples = {(n, ln): {"ttft": [], "decode": [], "side_by_side": []}
                   for n, _ in strategies for ln in links}
        last = {}
        for r in range(self.args.reps):
            for link in links:
                self.use_link(link)
                order = strategies[r % len(strategies):] + strategies[:r % len(strategies)]
                for name, comm in order:
                    t, dec, out, auto = self.run_once(name, comm, link, self.args.decode_tokens)
                    samples[name, link]["ttft"].append(t)
                    samples[name, link]["decode"].extend(dec)
                    last[name, link] = (out, auto)
            self.log(f"round {r + 1}/{self.args.reps} done")
        return samples, last

    def decode_side_by_side(self, samples) -> None:
        """4. one decode step of every strategy in turn (the order rotated), from a cache of
        its own; identical programs timed in generations of their own differ by up to 8% (the
        machine drifts between generations), step by step they share its state."""
        strategies = self.strategies
        for link in ["unlimited"] + self.links:
            self.use_link(link)
            steppers = {name: self.decode_stepper(self.engines[self.key(name, comm, link)],
                                                  self.ran(comm, link))
                        for name, comm in strategies}
            for k in range(self.args.decode_steps):
                for name, _ in strategies[k % len(strategies):] + strategies[:k % len(strategies)]:
                    samples[name, link]["side_by_side"].extend(steppers[name]())
            self.log(f"decode side by side on {link} done")

    def row(self, name, comm, link, smp, tokens, auto) -> dict:
        """The record's row of ``name`` on ``link``."""
        ran = self.ran(comm, link)
        pre = settings.step_traffic(self.cfg, self.nproc, ran, self.seq, decode=False,
                                    auto_quantizes=auto["prefill"])
        dec = settings.step_traffic(self.cfg, self.nproc, ran, self.seq, decode=True,
                                    auto_quantizes=auto["decode"])
        row = {"link": link, **settings.strategy_fields(name, comm),
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
        self.log(f"{name} on {link}: TTFT {row['ttft_s'] * 1e3:.0f} ms, decode "
                 f"{row['decode_s_per_token'] * 1e3:.1f} ms/token side by side (median of "
                 f"{len(smp['side_by_side'])}), "
                 f"{row['decode_in_generation_s_per_token'] * 1e3:.1f} in generations")
        return row

    def result(self, rows, compute) -> dict:
        """The record process 0 hands back (the links' checks and calibration, every row)."""
        for name, info in self.net.link_info.items():
            info["calibration"] = calibration_text(name, compute)
            if name in settings.SYSTEMS:
                info.update({"gpu_" + k: v for k, v in settings.SYSTEMS[name].items()})
        return {"tp": self.nproc, "prompt_tokens": len(self.ids),
                "decode_tokens": self.args.decode_tokens, "reps": self.args.reps,
                "decode_steps": self.args.decode_steps,
                "model": f"{self.model_name} (run in f32)",
                "links": {k: self.net.link_info[k] for k in ["unlimited"] + self.links},
                "compute": compute, "rows": rows, "auto_tables": self.tables,
                "auto_layouts": self.auto_layouts,
                "tbf": {"burst": settings.BURST, "latency": settings.TBF_LATENCY}}


def main() -> None:
    args = _args()
    pid, nproc = worker_init(1)
    worker = Worker(args, pid, nproc)
    compute = worker.calibrate()
    worker.compile_all()
    samples, last = worker.generations()
    worker.decode_side_by_side(samples)
    rows = [worker.row(name, comm, link, samples[name, link], *last[name, link])
            for name, comm in worker.strategies for link in ["unlimited"] + worker.links]
    worker.use_link("unlimited")
    write_result(worker.result(rows, compute))


if __name__ == "__main__":
    main()
