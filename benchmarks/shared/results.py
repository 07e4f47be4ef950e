"""Where the benchmarks' results go, and their pages.

A result is three files of ``docs/results/``, all written by the command that measures it:
``<name>.json`` (the record: the command, the machine and every figure), ``<name>.png`` (its
plot, where it has one) and ``<name>.md`` (its page: what was measured, the command, the
machine, the figures as tables, the plot, and the guide page that explains them).
:func:`write_page` writes the page; a benchmark gives it its own tables, else the record's rows
are shown as one table.

Nothing here imports jax (:mod:`benchmarks.shared.runtime` says why)."""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["REPO", "RESULTS", "PAGES", "write_page", "page_info", "rows_table", "machine_line"]

#: The repository root (the benchmarks run from it: ``.venv/bin/python -m benchmarks.GROUP.NAME``).
REPO = Path(__file__).resolve().parents[2]
#: The folder of the result records, plots and pages.
RESULTS = REPO / "docs" / "results"

#: Per result (its file name's stem, or the longest registered start of it): the page's title
#: and the guide page of ``docs/`` that explains its figures.
PAGES = {
    "accuracy": ("Accuracy of quantized communication on SmolLM2", "accuracy.md"),
    "all_gather_ring": ("Quantized all_gather: the ring, the one-shot gather, lax.all_gather",
                        "reliability.md"),
    "allreduce": ("Quantized all-reduce against the best exact JAX all-reduce", "allreduce.md"),
    "allreduce_error": ("Relative error of the quantized psum per bits", "allreduce.md"),
    "autotune_shm": ("The automatic choice over the shared-memory transport, SmolLM2 TP=3",
                     "autotune.md"),
    "codec": ("CPU codec throughput beside single-core memcpy", "benchmarks.md"),
    "cuda_check": ("The GPU check: tests, codec kernels and psum on GPUs", "cuda.md"),
    "decode": ("Decode and TTFT in one process: auto against the fixed settings", "autotune.md"),
    "format_probe": ("FP8 and FP4 group formats on SmolLM2, simulated", "format_probe.md"),
    "fp_codec": ("Floating-point formats: CPU kernel speed", "fp_formats.md"),
    "fused_norm": ("The all-reduce's epilogue fused against the unfused ops", "fused_norm.md"),
    "gpu_model": ("The GPU cost model of the all-reduce and of TTFT", "gpu_model.md"),
    "layer_sensitivity": ("Per-site sensitivity of SmolLM2's all-reduces, and per-site policies",
                          "accuracy.md"),
    "outliers": ("Quantized all-reduce error per codec option on outlier data", "outliers.md"),
    "overlap": ("Ring collective matmuls against unfused, processes over gloo", "overlap.md"),
    "rewrite_maxtext": ("The rewrite on MaxText-style programs", "rewrite.md"),
    "ring_overlap": ("Ring matmuls on the p2p transport, link paced: exposed communication",
                     "transport.md"),
    "shm_allreduce": ("The all-reduce between processes: shared memory against gloo",
                      "transport.md"),
    "transport": ("The p2p transport against lax.psum and the xla transport", "transport.md"),
    "ttft": ("TTFT and decode of SmolLM2 at TP=3 on emulated links", "ttft.md"),
    "ttft_p2p": ("TTFT of SmolLM2 at TP=3 in one process: the rings on the p2p transport",
                 "ttft.md"),
    "ttft_shm": ("TTFT and decode between processes over shared memory", "ttft_shm.md"),
    "zero_dtype": ("Which type a group's zero has on the wire", "format.md"),
}

_MAX_COLUMNS = 12
_MAX_ROWS = 80


def machine_line(record: dict) -> str:
    """The machine a record was measured on, as one line (records keep it as a string, or as a
    dict of ``models.machine``'s fields)."""
    m = record.get("machine") or record.get("cpu") or (record.get("meta") or {}).get("machine")
    if isinstance(m, dict):
        parts = [str(m[k]) for k in ("cpu", "machine", "gpu", "cores") if m.get(k) is not None]
        extra = ", ".join(f"{k} {m[k]}" for k in ("isa", "python", "jax", "jaxlib") if m.get(k))
        return " / ".join(parts) + (f"; {extra}" if extra else "")
    return str(m) if m else "not recorded"


def _rows(record):
    """The record's list of result rows (dicts), where it has one."""
    for key in ("rows", "results"):
        rows = record.get(key)
        if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
            return rows
        if isinstance(rows, dict) and rows and all(isinstance(r, dict) for r in rows.values()):
            return [{"case": k, **v} for k, v in rows.items()]
    return None


def _cell(v) -> str:
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v).replace("|", "\\|")


def rows_table(record: dict) -> str:
    """The record's rows as a markdown table: the scalar fields of its ``rows`` (or
    ``results``), at most 12 columns and 80 rows; ``""`` where it has none."""
    rows = _rows(record)
    if not rows:
        return ""
    columns = []
    for r in rows:
        for k, v in r.items():
            if k not in columns and (v is None or isinstance(v, (str, int, float, bool))):
                columns.append(k)
    columns = columns[:_MAX_COLUMNS]
    if not columns:
        return ""
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(r.get(c, "")) for c in columns) + " |"
              for r in rows[:_MAX_ROWS]]
    if len(rows) > _MAX_ROWS:
        lines.append(f"\n({len(rows) - _MAX_ROWS} more rows in the record)")
    return "\n".join(lines)


def page_info(stem: str) -> tuple[str, str | None]:
    """``(title, guide page)`` of the result ``stem`` (:data:`PAGES`; its longest registered
    start: ``allreduce_bf16_4p`` is an ``allreduce``)."""
    for n in range(len(stem), 0, -1):
        if stem[:n] in PAGES:
            return PAGES[stem[:n]]
    return stem.replace("_", " "), None


def write_page(json_path, record: dict | None = None, *, tables: str | None = None,
               title: str | None = None, about: str = "", guide: str | None = None) -> Path:
    """Write the page of the result whose record is ``json_path`` (read when ``record`` is
    None): ``json_path`` with ``.md``, beside it. ``tables``: the benchmark's own tables
    (markdown), else :func:`rows_table`; ``title`` and ``guide`` (the page of ``docs/`` that
    explains the figures) default to :data:`PAGES`'s; ``about``: a sentence on this run.
    Returns the page's path."""
    json_path = Path(json_path)
    if record is None:
        record = json.loads(json_path.read_text())
    default_title, default_guide = page_info(json_path.stem)
    title, guide = title or default_title, guide or default_guide
    command = record.get("command") or (record.get("meta") or {}).get("command")
    if command and command.startswith("python"):  # the README's environment runs it
        command = ".venv/bin/" + command
    out = [f"# {title}", ""]
    if about:
        out += [about, ""]
    out.append(f"Command: `{command}`" if command else
               "Command: not recorded (the benchmark's module docstring gives it)")
    out += ["", f"Machine: {machine_line(record)}", ""]
    if guide:
        out += [f"What the figures mean: [docs/{guide}](../{guide}).", ""]
    out += [f"Record: [{json_path.name}]({json_path.name}).", ""]
    body = tables if tables is not None else rows_table(record)
    if body:
        out += [body.rstrip("\n"), ""]
    plot = json_path.with_suffix(".png")
    if plot.exists():
        out += [f"![{title}]({plot.name})", ""]
    page = json_path.with_suffix(".md")
    page.write_text("\n".join(out))
    return page
