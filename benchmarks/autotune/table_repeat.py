"""How far two tuning tables of one machine agree, and how well any latency + bandwidth model
could fit one: the evidence behind docs/autotune.md's "The cost model".

    .venv/bin/python -m jax_flashcomm.tune --out /tmp/tune_a.json
    .venv/bin/python -m jax_flashcomm.tune --out /tmp/tune_b.json      # later, same machine
    .venv/bin/python -m benchmarks.autotune.table_repeat /tmp/tune_a.json /tmp/tune_b.json \\
        [--json OUT]

For the call rows at or above ``--min-bytes`` (default 256 KiB, the bar of the model check):

* **repeat**: rows measured in both tables (same op, layout, axis size, dtype, bytes, candidate,
  bits), how many agree within 25% (``tune.TOLERANCE``), by candidate, and the largest
  difference. A model can be within 25% of both tables only where they are within 50% of each
  other, and of every table only where the tables repeat;
* **fit**: per table and per series (one op, dtype, axis size and candidate over the sizes), the
  ``time = a + bytes / b`` line with the smallest largest relative error over the series' own
  rows (a, b >= 0; a grid search): the best any latency-plus-bandwidth model could do, fitted
  to the answers. By candidate: the series it fits within 25% at every size, and the rows
  within 25% of it.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

from benchmarks.shared.results import write_page
from benchmarks.shared.runtime import command_parser
from jax_flashcomm import costs as tuning
from jax_flashcomm.tune import TOLERANCE


def _rows(table, min_bytes: int) -> dict:
    return {(r.op, r.layout, r.n, r.dtype, r.nbytes, r.candidate, r.bits): r.seconds
            for r in table.rows if r.scope == "call" and r.nbytes >= min_bytes}


def repeat(a, b, min_bytes: int) -> dict:
    """``{candidate: {"rows", "within", "max_diff"}}`` over the rows of both tables."""
    ra, rb = _rows(a, min_bytes), _rows(b, min_bytes)
    out = defaultdict(lambda: {"rows": 0, "within": 0, "max_diff": 0.0})
    for key in ra.keys() & rb.keys():
        diff = rb[key] / ra[key] - 1
        s = out[key[5]]
        s["rows"] += 1
        s["within"] += abs(diff) <= TOLERANCE
        s["max_diff"] = max(s["max_diff"], abs(diff))
    return dict(out)


def best_line(nbytes, seconds) -> tuple[float, float, np.ndarray]:
    """``(a, b, relative errors)`` of the ``a + nbytes / b`` line with the least largest
    relative error (a grid over a in [0, min time] and 1/b over 1e-13..1e-7 s/B)."""
    x, y = np.asarray(nbytes, float), np.asarray(seconds, float)
    a = np.linspace(0.0, y.min(), 101)[:, None, None]
    inv_b = np.geomspace(1e-13, 1e-7, 1201)[None, :, None]
    err = np.abs((a + inv_b * x[None, None, :]) / y - 1).max(axis=2)
    i, j = np.unravel_index(np.argmin(err), err.shape)
    best_a, best_inv = float(a[i, 0, 0]), float(inv_b[0, j, 0])
    return best_a, 1.0 / best_inv, np.abs((best_a + best_inv * x) / y - 1)


def fit(table, min_bytes: int) -> dict:
    """``{candidate: {"series", "series_within", "rows", "within", "worst_series_err"}}`` of
    the best line per series (series of at least 3 sizes: two points fit any line)."""
    series = defaultdict(list)
    for (op, layout, n, dtype, nbytes, cand, bits), s in _rows(table, min_bytes).items():
        series[op, layout, n, dtype, cand, bits].append((nbytes, s))
    out = defaultdict(lambda: {"series": 0, "series_within": 0, "rows": 0, "within": 0,
                               "worst_series_err": 0.0})
    for key, pts in series.items():
        if len(pts) < 3:
            continue
        pts.sort()
        _, _, err = best_line([p[0] for p in pts], [p[1] for p in pts])
        s = out[key[4]]
        s["series"] += 1
        s["series_within"] += bool(err.max() <= TOLERANCE)
        s["rows"] += len(pts)
        s["within"] += int((err <= TOLERANCE).sum())
        s["worst_series_err"] = max(s["worst_series_err"], float(err.max()))
    return dict(out)


def main(argv=None) -> int:
    ap = command_parser("benchmarks.autotune.table_repeat", __doc__)
    ap.add_argument("tables", nargs="+", help="one or two tuning tables (JSON)")
    ap.add_argument("--min-bytes", type=int, default=256 * 1024)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if len(args.tables) > 2:
        ap.error("give one or two tables")
    tables = []
    for path in args.tables:
        try:
            tables.append(tuning.Table.from_json(json.loads(Path(path).read_text())))
        except (OSError, ValueError) as e:
            ap.error(f"{path}: {e}")
    out = {"tables": args.tables, "min_bytes": args.min_bytes, "tolerance": TOLERANCE,
           "fit": [fit(t, args.min_bytes) for t in tables]}
    for path, t, f in zip(args.tables, tables, out["fit"]):
        print(f"{path} ({t.created}): the best a + bytes/b line per series; series it fits "
              f"within {TOLERANCE:.0%} at every size, rows within {TOLERANCE:.0%} of it:")
        for cand, s in sorted(f.items()):
            print(f"  {cand:14s} series {s['series_within']:2d} of {s['series']:2d}, rows "
                  f"{s['within']:3d} of {s['rows']:3d}  (worst series: "
                  f"{s['worst_series_err']:.0%})")
    if len(tables) == 2:
        out["repeat"] = repeat(*tables, args.min_bytes)
        print(f"the two tables row by row, within {TOLERANCE:.0%} of each other:")
        for cand, s in sorted(out["repeat"].items()):
            print(f"  {cand:14s} {s['within']:3d} of {s['rows']:3d}  (largest difference "
                  f"{s['max_diff']:.0%})")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
        write_page(args.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
