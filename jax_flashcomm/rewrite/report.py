"""The rewrite report: one row per collective found in the traced function.

Rows are in the order the interpreter met them (program order, nested bodies in place; a
scan or while body once, however many iterations). ``str(report)`` is a fixed-width table.
"""

from __future__ import annotations

import collections
import dataclasses
import os

__all__ = ["ReportRow", "Report", "short_path", "sent_bytes"]

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
    detail: str             # e.g. "int8/int8", "lax", "all_gather_matmul int8"
    reason: str
    sent: int | None = None  # bytes this rank sends for the rewrite's collective (None: XLA's)

    @property
    def xla_sent(self) -> int:
        """Bytes one rank sends for this collective as XLA runs it (a ring over ``axis_size``
        ranks of the operand's dtype)."""
        return sent_bytes(self.op, self.bytes_per_rank, self.axis_size)

    @property
    def rewrite_sent(self) -> int:
        """Bytes one rank sends for it in the rewritten program (XLA's where it was kept)."""
        return self.xla_sent if self.sent is None else self.sent

    def __str__(self):
        return (f"{self.op}{list(self.axes)} {self.dtype}{list(self.shape)} "
                f"{self.bytes_per_rank} B/rank at {self.site} [{self.path}]: {self.action} "
                f"{self.detail}, sends {self.rewrite_sent} B/rank (XLA {self.xla_sent}) "
                f"({self.reason})")


def sent_bytes(op: str, nbytes: float, axis_size: int, per_byte: tuple = (1.0, 1.0)) -> int:
    """Bytes one rank sends for collective ``op`` of ``nbytes`` per rank over a ring of
    ``axis_size`` ranks.

    Args:
      op: ``psum`` (reduce-scatter then all-gather), ``psum_scatter``, ``all_gather`` (of an
        ``nbytes`` shard), the ring matmuls, ``all_to_all`` (every slice but this rank's own),
        ``ragged_all_to_all`` (at most its whole operand: the rows sent depend on the data), or
        another lax name (its operand once).
      nbytes: the operand's bytes per rank.
      axis_size: ranks.
      per_byte: the payload bytes per operand byte of the reduce-scatter and the all-gather
        phase (1.0 unquantized; wire bytes per element / itemsize quantized).

    Returns:
      The bytes.
    """
    n, (rs, ag) = max(int(axis_size), 1), per_byte
    share = (n - 1) / n * nbytes
    by_op = {"psum": share * (rs + ag), "psum_scatter": share * rs,
             "matmul_reduce_scatter": share * rs, "all_gather": (n - 1) * nbytes * ag,
             "all_gather_matmul": (n - 1) * nbytes * ag, "all_to_all": share * ag,
             "ragged_all_to_all": nbytes * ag}
    return int(round(by_op.get(op, nbytes)))


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
        header = ("#", "op", "axes", "operand", "B/rank", "N", "sent XLA", "sent", "site",
                  "path", "action", "reason")
        lines = []
        for i, r in enumerate(self.rows):
            scope = f" {{{r.scope}}}" if r.scope else ""
            lines.append((str(i), r.op, ",".join(map(str, r.axes)),
                          f"{r.dtype}{list(r.shape)}".replace(" ", ""), str(r.bytes_per_rank),
                          str(r.axis_size), str(r.xla_sent), str(r.rewrite_sent),
                          r.site + scope, r.path,
                          f"{r.action} {r.detail}".strip(), r.reason))
        widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
                  for i, h in enumerate(header)]
        right = ("#", "B/rank", "N", "sent XLA", "sent")
        fmt = "  ".join(f"{{:{'>' if h in right else '<'}{w}}}"
                        for h, w in zip(header, widths))
        out = [fmt.format(*header)] + [fmt.format(*line) for line in lines]
        summary = ", ".join(f"{n} {a}" for a, n in sorted(self.counts().items()))
        out.append(f"{len(self.rows)} collectives" + (f": {summary}" if summary else ""))
        own = [r for r in self.rows if r.path != "partitioner"]
        if own:
            xla, ours = sum(r.xla_sent for r in own), sum(r.rewrite_sent for r in own)
            out.append(f"bytes sent per rank (the typed program's collectives, a ring each): "
                       f"XLA {xla}, rewritten {ours}" + (f" ({ours / xla:.3f}x)" if xla else ""))
        return "\n".join(line.rstrip() for line in out)
