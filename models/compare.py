"""Side by side: one model, several communication settings, same prompts and text.

    .venv/bin/python -m models.compare --tp 3 --settings exact,int8,int6,int4 --text FILE \\
        [--prompts models/prompts.json] [--max-new-tokens 32] [--window 512] [--max-windows 6] \\
        [--json OUT]

A setting is ``exact``, ``overlap``, ``intB`` (flash, B bits both phases), ``intR/A``
(flash, reduce-scatter R bits, all-gather A bits), ``overlap+intB``, or ``auto`` / ``autoB``
(per call, exact or B-bit quantized, whichever is predicted faster; docs/autotune.md; in the
sequence-parallel layout: ``overlap+auto``).
The weights are loaded once; each setting gets its own compiled engine. For each setting:
perplexity over the text windows, greedy continuations of the prompts, stopped at EOS (and how
many of their tokens match the first setting's before the first difference, the table's
"greedy match", and position by position), TTFT and decode tokens/s of the first prompt (with
``--rounds R``: R rounds, the settings' generations advanced a token at a time in turn), and
the bytes each rank sends in one decode step's all-reduces.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import statistics
import sys
import time

from models import cli


def greedy(engine, tok, prompts, max_new: int, stop):
    """Greedy continuations (token ids, up to and including an id of ``stop``) of
    chat-formatted prompts (the prompt itself after BOS for a checkpoint without a chat
    template: :func:`models.chat_template.prompt_ids`), and the first one's timings."""
    from models.chat_template import prompt_ids
    from models.engine import Sampling

    outs, timings = [], None
    for p in prompts:
        ids = prompt_ids(tok, p)
        outs.append(list(engine.generate(ids, max_new, sampling=Sampling(), stop_ids=stop)))
        if timings is None:
            timings = dict(engine.last_timings)
    return outs, timings


def matching(a, b) -> tuple[int, int]:
    """(tokens of ``a`` equal to ``b``'s before the first difference, tokens equal position by
    position); out of ``len(b)``, the reference's length."""
    prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return prefix, sum(x == y for x, y in zip(a, b))


def run(model, ckpt, mesh, settings, *, text=None, window=512, max_windows=6, prompts=(),
        max_new_tokens=32, rounds: int = 1, log=sys.stderr) -> list[dict]:
    """One row per setting (module docstring); with ``rounds > 1`` the first prompt's
    generation is timed in ``rounds`` rounds (:func:`interleaved`: the settings advanced a token
    at a time in turn, the order rotated each round, so that the machine's slow spells hit them
    alike): TTFT is the median of the rounds' prefills, tokens/s of all their decode steps."""
    from jax_flashcomm import record
    from models.eval import nll_fn, window_tokens
    from models.traffic import plans_wire_vs_bf16

    tok = ckpt.tokenizer
    stop = tuple(set(ckpt.config.eos_token_ids) | set(tok.eos_ids))
    windows = window_tokens(tok.encode(text), window, max_windows) if text is not None else []
    nll = nll_fn()
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rows, retimes = [], []
    for label, comm in settings:
        with record() as plans:
            row, retime = _run_setting(label, comm, model, ckpt, mesh, engine_args=dict(
                cache_len=max(window, 512)), windows=windows, window=window, nll=nll,
                prompts=prompts, max_new_tokens=max_new_tokens, stop=stop, log=log)
        rows.append(row)
        retimes.append(retime)
        rows[-1]["plans"] = dict(collections.Counter(
            f"{p.op}: {p.path}" + (f" over {p.transport}" if p.transport else "")
            for p in plans))
        rows[-1]["choice_sources"] = dict(collections.Counter(
            p.choice_source for p in plans if p.choice_source is not None))
        rows[-1]["wire_vs_bf16"], _ = plans_wire_vs_bf16(plans)  # of the calls that ran
    if prompts:
        if rounds > 1:  # the interleaved rounds replace the first timing, taken alone
            for row in rows:
                row["ttft_samples_s"], row["decode_samples_s"] = [], []
        for r in range(rounds if rounds > 1 else 0):
            print(f"timing round {r + 1}/{rounds}", file=log)
            order = [(j + r) % len(rows) for j in range(len(rows))]
            for i, (ttfts, decode) in zip(order, interleaved([retimes[i] for i in order])):
                rows[i]["ttft_samples_s"].extend(ttfts)
                rows[i]["decode_samples_s"].extend(decode)
        for row in rows:
            dec = row["decode_samples_s"]
            row["ttft_s"] = statistics.median(row["ttft_samples_s"])
            if dec:  # --max-new-tokens 1: the first token only, no decode step timed
                row["tokens_per_s"] = len(dec) / sum(dec)
                row["tokens_per_s_median"] = 1 / statistics.median(dec)
        base = rows[0]["continuations"]
        for row in rows:
            pairs = [matching(a, b) for a, b in zip(row["continuations"], base)]
            row["match_prefix"] = [p for p, _ in pairs]
            row["match_positions"] = [m for _, m in pairs]
            row["reference_lengths"] = [len(b) for b in base]
    return rows


def _run_setting(label, comm, model, ckpt, mesh, *, engine_args, windows, window, nll, prompts,
                 max_new_tokens, stop, log) -> tuple[dict, object]:
    """One setting's row of :func:`run`, and a function that times the first prompt's
    generation again (the setting's communication set on the model again: one model, every
    setting's engine)."""
    import numpy as np

    from models.engine import Engine
    from models.eval import progress
    from models.llama import set_comm
    from models.traffic import allreduce_bytes_per_token

    from jax_flashcomm.policy import CommPolicy

    tok = ckpt.tokenizer
    policy = comm if isinstance(comm, CommPolicy) else None
    overrides = None
    if policy is not None:
        from models.llama import policy_comms

        comm, overrides = policy_comms(policy, ckpt.config.n_layers)
    set_comm(model, comm, overrides=overrides)
    engine = Engine(model, mesh, **engine_args)
    row = {"setting": label, "comm": "policy" if policy is not None else comm.kind}
    if policy is None and comm.quantized:
        row.update(rs_bits=comm.config.phase1_bits, ag_bits=comm.config.phase2_bits,
                   rs_spikes=comm.config.phase1_spikes,
                   ag_spikes=comm.config.phase2_spikes, group_size=comm.config.group_size)
    if windows:
        print(f"{label}: perplexity over {len(windows)} windows of {window}", file=log)
        start, parts = time.perf_counter(), []
        for i, w in enumerate(windows):
            t = np.asarray([w], np.int32)
            parts.append(np.asarray(nll(engine.score(t), t))[0].astype(np.float64))
            progress(i + 1, len(windows), start, log)
        row["perplexity"] = math.exp(float(np.concatenate(parts).mean()))
        row["tokens"] = int(sum(p.size for p in parts))
    if prompts:
        # warm-up: compile the prefill buckets and the decode step before timing
        greedy(engine, tok, prompts[:1], 2, ())
        outs, timings = greedy(engine, tok, prompts, max_new_tokens, stop)
        row["continuations"] = outs
        row["texts"] = [tok.decode(o, skip_special_tokens=True) for o in outs]
        row["ttft_samples_s"] = [timings["ttft"]]
        row["decode_samples_s"] = list(timings["decode"])
    if policy is None:
        row["allreduce_bytes_per_token"] = allreduce_bytes_per_token(ckpt.config, model.tp,
                                                                     comm)["sent"]
    else:  # the sum over the sites, each at its own config
        per_site = [allreduce_bytes_per_token(ckpt.config, model.tp, c)["sent"]
                    / (2 * ckpt.config.n_layers) for c in
                    (overrides.get(k, comm) for k in _site_keys(ckpt.config.n_layers))]
        row["allreduce_bytes_per_token"] = sum(per_site)
    row["traces"] = {str(k): v for k, v in engine.traces.items()}

    from models.chat_template import prompt_ids
    from models.engine import Sampling

    ids = prompt_ids(tok, prompts[0]) if prompts else None

    def activate():  # one model, every setting's engine: the engine reads the model's comm
        set_comm(model, comm, overrides=overrides)

    def retime(max_new=max_new_tokens):
        activate()
        return engine, engine.generate(ids, max_new, sampling=Sampling(), stop_ids=stop), activate
    return row, retime


#: Prefills timed per setting and round beside its generation's (TTFT: a prefill is a few
#: hundred ms, so more samples cost little and steady the median).
TTFT_REPEATS = 3


def interleaved(retimes) -> list[tuple[list[float], list[float]]]:
    """One round of :func:`run`'s timing: every setting's generation of the first prompt
    advanced a token at a time, the settings in turn (so that a slow spell of the machine,
    seconds long, hits every setting alike), then :data:`TTFT_REPEATS` prefills each, in turn.

    Args:
      retimes: per setting, a function of ``max_new`` returning its engine, the generator of
        its generation and the function that sets its communication on the model.

    Returns:
      Per setting (in order), its TTFT samples and decode step times.
    """
    started = [retime() for retime in retimes]
    advance_in_turn([(gen, activate) for _, gen, activate in started])
    out = [([engine.last_timings["ttft"]], list(engine.last_timings["decode"]))
           for engine, _, _ in started]
    for _ in range(TTFT_REPEATS):
        for i, retime in enumerate(retimes):
            engine, gen, _ = retime(1)
            list(gen)
            out[i][0].append(engine.last_timings["ttft"])
    return out


def advance_in_turn(generations) -> None:
    """Run generators to their ends a step at a time, in turn (each step after its
    ``activate()``: the setting it needs set on the shared model).

    Args:
      generations: ``(generator, activate)`` pairs.
    """
    active = list(generations)
    while active:
        for pair in list(active):
            gen, activate = pair
            activate()
            if next(gen, _END) is _END:
                active.remove(pair)


_END = object()


def table(rows, tp: int) -> str:
    """A plain-text table of the rows."""
    exact_ppl = rows[0].get("perplexity")
    lines = [f"{'setting':<12}{'perplexity':>12}{'vs first':>10}{'TTFT ms':>10}"
             f"{'tok/s':>8}{'AR B/token':>12}{'greedy match':>14}"]
    for r in rows:
        ppl = r.get("perplexity")
        rel = f"{(ppl / exact_ppl - 1) * 100:+.2f}%" if ppl and exact_ppl else "-"
        match = (f"{sum(r['match_prefix'])}/{sum(len(c) for c in rows[0]['continuations'])}"
                 if "match_positions" in r else "-")
        ttft, tps = r.get("ttft_s"), r.get("tokens_per_s")
        lines.append(f"{r['setting']:<12}{f'{ppl:.4f}' if ppl else '-':>12}{rel:>10}"
                     f"{f'{ttft * 1e3:.1f}' if ttft is not None else '-':>10}"
                     f"{f'{tps:.1f}' if tps is not None else '-':>8}"
                     f"{r['allreduce_bytes_per_token']:>12.0f}{match:>14}")
    return "\n".join(lines)


def _site_keys(n_layers: int):
    from models.llama import SITES

    return [(layer, site) for layer in range(n_layers) for site in SITES]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.compare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--settings", default="exact,int8,int6,int4",
                        help="comma-separated settings: exact, overlap, intB, intR/A, fp8, "
                             "mxfp4, nvfp4, either phase a format (nvfp4/fp8), overlap+<setting>, "
                             "auto, autoB, overlap+auto")
    for flag in ("format", "rs_format", "ag_format"):
        parser.add_argument("--" + flag.replace("_", "-"), dest=flag, default=None,
                            choices=("int", "fp8", "mxfp4", "nvfp4"),
                            help="add the setting of this (reduce-scatter / all-gather) group "
                                 "format to --settings (int: 8 bits)")
    parser.add_argument("--comm-policy", dest="comm_policy", default=None, metavar="FILE",
                        help="add the setting 'policy': a per-site jax_flashcomm.CommPolicy "
                             "(JSON, as models.calibrate writes)")
    parser.add_argument("--text", default=None, help="text file for perplexity")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=6)
    parser.add_argument("--prompts", default=None, help="JSON list of prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1,
                        help="time the first prompt's generation this many times per setting, "
                             "the settings in turn (medians over the rounds)")
    parser.add_argument("--json", default=None)
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    cli.check(parser, args)
    if args.text is None and args.prompts is None:
        parser.error("nothing to compare: give --text FILE (perplexity) and/or --prompts FILE "
                     "(greedy continuations)")
    return cli.run_checked(parser, _main, args)


def _main(args) -> int:
    cli.set_devices(args.devices or args.tp)
    import jax

    from models.llama.params import load_model

    text = None
    if args.text is not None:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    prompts = []
    if args.prompts:
        with open(args.prompts, encoding="utf-8") as f:
            prompts = json.load(f)
    mesh = jax.make_mesh((args.tp,), ("tp",), devices=jax.devices()[:args.tp])
    model, ckpt = load_model(args.model, tp=args.tp, mesh=mesh)
    if ckpt.tokenizer is None:
        raise ValueError(f"{args.model}: the checkpoint has no tokenizer")
    rows = run(model, ckpt, mesh, args.comm_settings, text=text, window=args.window,
               max_windows=args.max_windows, prompts=prompts,
               max_new_tokens=args.max_new_tokens, rounds=args.rounds)
    from models.machine import first_line

    machine = first_line()
    print(machine)
    print(f"model {args.model}, TP={args.tp}")
    print(table(rows, args.tp))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "model": args.model, "tp": args.tp,
                       "window": args.window, "max_windows": args.max_windows,
                       "text": args.text, "prompts": prompts, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
