"""Write the page of every result in docs/results from its record, with the tables of the
benchmark that produced it, and the list of them (docs/results/index.md). Each benchmark writes
its own page when it runs; this re-renders them all (after a change to the page format, say)
without measuring anything.

    .venv/bin/python -m benchmarks.render_results [NAME ...]    # default: every docs/results/*.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys

from benchmarks.shared.results import RESULTS, page_info, write_page


#: The tables of each kind of record (by the start of its name; the others get their rows):
#: ``(module, function, field)``: ``module.function(record[field])``, or of the whole record
#: where ``field`` is None.
TABLES = {
    "ttft_p2p": ("benchmarks.llm.ttft.p2p", "markdown", None),
    "ttft": ("benchmarks.llm.ttft.report", "tables", None),
    "autotune_shm": ("benchmarks.llm.ttft.report", "tables", None),
    "accuracy": ("benchmarks.llm.accuracy_page", "tables", None),
    "format_probe": ("benchmarks.llm.format_probe", "table", None),
    "layer_sensitivity": ("benchmarks.llm.layer_sensitivity", "tables", None),
    "ring_overlap": ("benchmarks.collectives.matmul_overlap_p2p", "markdown", "rows"),
    "transport": ("benchmarks.collectives.allreduce_p2p", "markdown", "rows"),
    "allreduce_error": None,
    "allreduce": ("benchmarks.collectives.allreduce_speed", "page_tables", None),
    "shm_allreduce": ("benchmarks.collectives.allreduce_shm", "markdown", None),
    "outliers": ("benchmarks.codec.outliers", "markdown", "results"),
    "decode": ("benchmarks.autotune.auto_vs_fixed", "markdown", None),
    "gpu_model": ("benchmarks.gpu.cost_model", "markdown", None),
    "cuda_check": ("benchmarks.gpu.check", "markdown", None),
}


def tables_of(name: str):
    """The function that gives the tables of the record ``name`` (None: its rows)."""
    entry = next((TABLES[name[:n]] for n in range(len(name), 0, -1) if name[:n] in TABLES),
                 None)
    if entry is None:
        return None
    module, function, field = entry

    def render(record):
        fn = getattr(importlib.import_module(module), function)
        return fn(record if field is None else record[field])
    return render


def write_index() -> None:
    """docs/results/index.md: every result page, by the guide page that explains it."""
    by_guide: dict = {}
    for path in sorted(RESULTS.glob("*.json")):
        title, guide = page_info(path.stem)
        by_guide.setdefault(guide or "", []).append(f"- [{path.stem}]({path.stem}.md): {title}")
    out = ["# Results", "", "Every result of the benchmarks: its page (the command, the machine, "
           "the figures, the plot), beside its record (`.json`) and plot (`.png`). Written by "
           "the benchmark that measures it; `.venv/bin/python -m benchmarks.render_results` "
           "rewrites the pages and this list. The benchmarks: [docs/benchmarks.md]"
           "(../benchmarks.md).", ""]
    for guide, lines in sorted(by_guide.items()):
        out += [f"## [docs/{guide}](../{guide})" if guide else "## Others", "", *lines, ""]
    out += ["## Records of the library's and the models' commands", "",
            "Written by the command their page names (`models.check_tp`, "
            "`models.calibrate`, `jax_flashcomm.tune`, ...), read there:", ""]
    for folder, guide in (("models", "models.md"), ("calibration", "calibration.md"),
                          ("tune_tables", "autotune.md")):
        names = sorted(p.name for p in (RESULTS / folder).glob("*.json"))
        out.append(f"- [docs/{guide}](../{guide}): "
                   + ", ".join(f"[{folder}/{n}]({folder}/{n})" for n in names))
    out.append("")
    (RESULTS / "index.md").write_text("\n".join(out))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.render_results",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("names", nargs="*", help="records of docs/results (default: every one)")
    args = ap.parse_args(argv)
    paths = ([RESULTS / f"{n.removesuffix('.json')}.json" for n in args.names] if args.names
             else sorted(RESULTS.glob("*.json")))
    for path in paths:
        data = json.loads(path.read_text())
        render, tables = tables_of(path.stem), None
        try:
            tables = render(data) if render else None
        except (KeyError, TypeError, ValueError, IndexError) as e:
            # a record of an earlier version of its benchmark, without a field the tables
            # show now: its rows instead
            print(f"{path.name}: its benchmark's tables need {e!r}; the rows instead")
        print("wrote", write_page(path, data, tables=tables).relative_to(RESULTS.parent.parent))
    if not args.names:
        write_index()
        print("wrote docs/results/index.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
