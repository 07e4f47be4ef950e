"""Write the page of every result in docs/results from its record, with the tables of the
benchmark that produced it (each benchmark writes its own page when it runs; this re-renders
them all, e.g. after a change to the page format, without measuring anything).

    .venv/bin/python -m benchmarks.render_results [NAME ...]    # default: every docs/results/*.json
"""

from __future__ import annotations

import argparse
import json
import sys

from benchmarks.shared.results import RESULTS, write_page


def _ttft(data):
    from benchmarks.llm.ttft import links

    return links.tables(data)


def _ttft_p2p(data):
    from benchmarks.llm.ttft import p2p

    return p2p.markdown(data)


def _accuracy(data):
    from benchmarks.llm import accuracy_page

    return accuracy_page.tables(data)


def _format_probe(data):
    from benchmarks.llm import format_probe

    return format_probe.table(data)


def _ring_overlap(data):
    from benchmarks.collectives import matmul_overlap_p2p

    return matmul_overlap_p2p.markdown(data["rows"])


def _transport(data):
    from benchmarks.collectives import allreduce_p2p

    return allreduce_p2p.markdown(data["rows"])


def _allreduce(data):
    from benchmarks.collectives import allreduce_speed

    return allreduce_speed.page_tables(data)


def _outliers(data):
    from benchmarks.codec import outliers

    return outliers.markdown(data["results"])


def _decode(data):
    from benchmarks.autotune import auto_vs_fixed

    return auto_vs_fixed.markdown(data)


def _gpu_model(data):
    from benchmarks.gpu import cost_model

    return cost_model.markdown(data)


def _cuda_check(data):
    from benchmarks.gpu import check

    return check.markdown(data)


def _shm_allreduce(data):
    from benchmarks.collectives import allreduce_shm

    return allreduce_shm.markdown(data)


def _layer_sensitivity(data):
    from benchmarks.llm import layer_sensitivity

    return layer_sensitivity.tables(data)


#: The tables of each kind of record (by the start of its name; the rest get their rows).
TABLES = {"ttft_p2p": _ttft_p2p, "ttft": _ttft, "autotune_shm": _ttft, "accuracy": _accuracy,
          "format_probe": _format_probe, "ring_overlap": _ring_overlap,
          "transport": _transport, "allreduce_error": None, "allreduce": _allreduce,
          "outliers": _outliers, "decode": _decode, "gpu_model": _gpu_model,
          "cuda_check": _cuda_check, "shm_allreduce": _shm_allreduce,
          "layer_sensitivity": _layer_sensitivity}


def tables_of(name: str):
    """The function that gives the tables of the record ``name`` (None: its rows)."""
    for n in range(len(name), 0, -1):
        if name[:n] in TABLES:
            return TABLES[name[:n]]
    return None


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
    return 0


if __name__ == "__main__":
    sys.exit(main())
