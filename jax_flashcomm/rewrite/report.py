"""The rewrite report: one row per collective found in the traced function.

Rows are in the order the interpreter met them (program order, nested bodies in place; a
scan or while body once, however many iterations). ``str(report)`` is a fixed-width table.
"""

from __future__ import annotations

import collections
import dataclasses
import os

__all__ = ["ReportRow", "Report", "short_path"]

def short_path(path: str) -> str:
    """``path`` relative to the working directory when under it, else its last three parts
    (the form of a report row's ``site``)."""
    try:
        rel = os.path.relpath(path)
    except ValueError:
        rel = path
    if not rel.startswith(".."):
        return rel
    return "/".join(path.split(os.sep)[-3:])


#: Values of :attr:`ReportRow.action`.
ACTIONS = ("quantized", "exact", "fused", "kept")


@dataclasses.dataclass(frozen=True)
class ReportRow:
    """One collective of the traced function and what rewrite did with it.

    ``action`` is ``"quantized"`` (replaced by the flashcomm collective, which quantized it),
    ``"exact"`` (replaced by the flashcomm collective, whose size policy or ``bits=None`` chose
    the exact lax path: the same equation as before), ``"fused"`` (replaced, with its matmul, by
    a ring collective matmul) or ``"kept"`` (left as it was). ``reason`` says why.
    """

    primitive: str          # the jaxpr primitive (psum_invariant, reduce_scatter, ...)
    op: str                 # the lax name (psum, psum_scatter, all_gather, ...)
    axes: tuple
    shape: tuple            # per-rank operand shape
    dtype: str
    bytes_per_rank: int
    axis_size: int
    site: str               # innermost user frame, "file:line (function)"
    scope: str              # jax.named_scope name stack ("" if none)
    path: str               # nesting: "shard_map/scan/cond[1]"
    action: str
    detail: str             # e.g. "int8/int8", "all_gather_matmul int8", "lax"
    reason: str

    def __str__(self):
        return (f"{self.op}{list(self.axes)} {self.dtype}{list(self.shape)} "
                f"{self.bytes_per_rank} B/rank at {self.site} [{self.path}]: {self.action} "
                f"{self.detail} ({self.reason})")


class Report:
    """The rows of one trace of a rewritten function (a sequence of :class:`ReportRow`)."""

    def __init__(self, rows=(), compile_seconds: float | None = None):
        self.rows: list[ReportRow] = list(rows)
        #: the extra compile that listed the partitioner's collectives (GSPMD), in seconds
        self.compile_seconds = compile_seconds

    def __iter__(self):
        return iter(self.rows)

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        return self.rows[index]

    def __repr__(self):
        return f"Report({len(self.rows)} collectives: {dict(self.counts())})"

    def counts(self, by: str = "action") -> collections.Counter:
        """How many rows per value of a field (``"action"``, ``"op"``, ``"primitive"`` ...)."""
        return collections.Counter(getattr(row, by) for row in self.rows)

    def where(self, **fields) -> list[ReportRow]:
        """The rows whose fields equal the given values, e.g. ``where(op="psum")``."""
        return [r for r in self.rows if all(getattr(r, k) == v for k, v in fields.items())]

    @property
    def rewritten(self) -> list[ReportRow]:
        """Rows replaced by flashcomm (quantized, exact or fused)."""
        return [r for r in self.rows if r.action != "kept"]

    def __str__(self):
        header = ("#", "op", "axes", "operand", "B/rank", "N", "site", "path", "action", "reason")
        lines = []
        for i, r in enumerate(self.rows):
            scope = f" {{{r.scope}}}" if r.scope else ""
            lines.append((str(i), r.op, ",".join(map(str, r.axes)),
                          f"{r.dtype}{list(r.shape)}".replace(" ", ""), str(r.bytes_per_rank),
                          str(r.axis_size), r.site + scope, r.path,
                          f"{r.action} {r.detail}".strip(), r.reason))
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
                  for i, h in enumerate(header)]
        fmt = "  ".join(f"{{:{'>' if h in ('#', 'B/rank', 'N') else '<'}{w}}}"
                        for h, w in zip(header, widths))
        out = [fmt.format(*header)] + [fmt.format(*line) for line in lines]
        summary = ", ".join(f"{n} {a}" for a, n in sorted(self.counts().items()))
        out.append(f"{len(self.rows)} collectives" + (f": {summary}" if summary else ""))
        return "\n".join(line.rstrip() for line in out)
