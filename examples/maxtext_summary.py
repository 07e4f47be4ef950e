"""The tables ``examples/maxtext_adopt.py`` prints from its measurements: status per stage,
the collectives of each compiled program, the figures, the failures."""

from __future__ import annotations

from hlo_collectives import ABBR

__all__ = ["summarize"]

VARIANTS = ("exact", "int8", "int8-xla")     # the rewrite's settings, in table order
BATCHES = 8          # random token batches the accuracy figures are taken over


def _counts(h):
    """``AR 4+2 [8+2]``: HLO instructions inside the decoder + outside it [executions per step,
    when the loops make them differ]."""
    if not h:
        return "-"
    out = []
    for k in (k for k in ABBR if k in h["instructions"]):
        i, n = h["instructions"][k], h["per_step"][k]
        out.append(f"{ABBR[k]} {i['decoder']}+{i['outside']}" + (
            f" [{n['decoder']}+{n['outside']}]" if n != i else ""))
    return " ".join(out) or "none"


def summarize(results):
    def st(r, key):
        return r["stages"].get(key, {})

    def ok(r, key):
        return "ok" if st(r, key).get("ok") else "FAIL" if key in r["stages"] else "-"
    print("\n== status (a failed variant lists its failed stages: J jit-first, R report, "
          "C compile, E eager, A accuracy; closure: the report with the RNG state closed over, run "
          "where the closed-over function runs as written)")
    rows = [("config", "build", "as written", *VARIANTS, "closure")]
    for r in results:
        bad = ["".join(k[0].upper() for k in ("jit_first", "report", "compile", "eager",
                                              "accuracy")
                       if not st(r, f"{v}.{k}").get("ok")) for v in VARIANTS]
        rows.append((r["config"], ok(r, "build"), ok(r, "as_written"),
                     *(f"FAIL {c}" if c else "ok" for c in bad),
                     f"{ok(r, 'closure.report')}" if st(r, "closure.as_written").get("ok")
                     else "as written: FAIL" if "closure.as_written" in r["stages"] else "-"))
    _table(rows)
    print("\n== collectives of each compiled HLO: instructions in the decoder+outside it "
          "[executions per step]")
    rows = [("config", "as written", *VARIANTS)] + [(r["config"], *map(_counts, [
        st(r, "as_written").get("hlo")] + [st(r, f"{v}.compile").get("hlo") for v in VARIANTS]))
        for r in results]
    _table(rows)
    print(f"\n== figures: KiB per rank per step; exact: eager rw(*args) against the as-written "
          f"logits; int8: over {BATCHES} batches of 4 x 32 tokens; t: trace+compile s as "
          f"written, report+compile s rewritten")
    rows = [("config", "KiB as/ex/i8/xla", "exact max|d| bit-eq",
             "int8 relL2 top1 tie-aware", "int8-xla relL2 top1 tie-aware",
             "jit-first==eager ex/i8/xla",
             "i8 jit-first==as written", "t as/ex/i8/xla")]
    for r in results:
        comp = [st(r, "as_written")] + [st(r, f"{v}.compile") for v in VARIANTS]
        hlo = [c.get("hlo") for c in comp]
        ev = [st(r, f"{v}.eager").get("vs_as_written") for v in VARIANTS[:1]] + [
            st(r, f"{v}.accuracy") or None for v in VARIANTS[1:]]
        jf = [st(r, f"{v}.eager").get("jit_first_vs_eager") for v in VARIANTS]
        jf8 = st(r, "int8.jit_first").get("vs_as_written")
        ts = [c["trace_compile_s"] + st(r, f"{v}.report").get("report_s", 0)
              if "trace_compile_s" in c else None for c, v in zip(comp, ("-",) + VARIANTS)]
        rows.append((
            r["config"], "/".join(f"{h['bytes_total'] / 1024:.0f}" if h else "-" for h in hlo),
            f"{ev[0]['max_abs']:.2e} {'yes' if ev[0]['bit_equal'] else 'no'}" if ev[0] else "-",
            *(f"{e['rel_l2']:.2e} {e['top1']:.3f} {e.get('top1_ties', e['top1']):.3f}"
              if e and "top1" in e else "-" for e in ev[1:]),
            "/".join("-" if j is None else "yes" if j["bit_equal"] else f"no({j['max_abs']:.1e})"
                     for j in jf),
            "-" if jf8 is None else "yes" if jf8["bit_equal"] else "no",
            "/".join("-" if t is None else f"{t:.1f}" for t in ts)))
    _table(rows)
    print("\n== failures (stages of one configuration that failed alike share a line)")
    for r in results:
        alike = {}
        for key, s in r["stages"].items():
            if not s.get("ok"):
                e = s.get("error", "")
                why = (e if len(e) < 320 else f"{e[:150]} ... {e[-150:]}", *s.get(
                    "flashcomm_frames", [])[-2:], *s.get("stderr", []))
                alike.setdefault(why, []).append(key)
        for why, keys in alike.items():
            print(f"{r['config']} {', '.join(keys)}: " + "\n    ".join(why))


def _table(rows):
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())


def markdown(data) -> str:
    """The docs' table (docs/rewrite.md) from the JSON ``--json`` writes."""
    def st(r, key):
        return r["stages"].get(key, {})

    out = ["| configuration | XLA's collectives in the decoder (per step) | int8: XLA all-reduce "
           "/ reduce-scatter left in the decoder | KiB per rank per step: as written, int8 "
           "(ratio) | exact bit-equal | int8 rel. L2 | int8 top-1 strict / tie-aware | "
           "`jax.jit(rewrite(f))` first = eager (exact, int8) | seconds: as written, "
           "rewritten int8 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["results"]:
        a, i8 = st(r, "as_written")["hlo"], st(r, "int8.compile")["hlo"]
        kinds = ", ".join(f"{v['decoder']} {k}" for k, v in a["per_step"].items() if v["decoder"])
        left = sum(i8["per_step"].get(k, {}).get("decoder", 0)
                   for k in ("all-reduce", "reduce-scatter"))
        ka, ki = a["bytes_total"] / 1024, i8["bytes_total"] / 1024
        exact, acc = st(r, "exact.eager")["vs_as_written"], st(r, "int8.accuracy")
        first = ["yes" if st(r, f"{v}.eager")["jit_first_vs_eager"]["bit_equal"] else "no"
                 for v in ("exact", "int8")]
        seconds = st(r, "int8.compile")["trace_compile_s"] + st(r, "int8.report")["report_s"]
        out.append(f"| {r['config']} | {kinds} | {left} | {ka:.0f}, {ki:.0f} ({ki / ka:.2f}x) | "
                   f"{'yes' if exact['bit_equal'] else 'no'} | {acc['rel_l2'] * 100:.2f}% | "
                   f"{acc['top1'] * 100:.1f}% / {acc['top1_ties'] * 100:.1f}% | "
                   f"{', '.join(first)} | {st(r, 'as_written')['trace_compile_s']:.1f}, "
                   f"{seconds:.1f} |")
    return "\n".join(out)
