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

#: Per result (its file name's stem, or the longest registered start of it): the guide page of
#: ``docs/`` that explains its figures, and the page's title.
_PAGES = """
accuracy           accuracy.md      Accuracy of quantized communication on SmolLM2
accuracy_qwen      accuracy.md      Accuracy of quantized communication on Qwen2.5-Coder-1.5B
accuracy_gemma     accuracy.md      Accuracy of quantized communication on Gemma 3 270M
all_to_all_inproc  alltoall.md      The expert-parallel all-to-all in one process
all_to_all_shm     alltoall.md      The expert-parallel all-to-all between processes, emulated link
all_gather_ring    reliability.md   Quantized all_gather: ring, one-shot gather, lax.all_gather
allreduce          allreduce.md     Quantized all-reduce against the best exact JAX all-reduce
allreduce_error    allreduce.md     Relative error of the quantized psum per bits
autotune_shm       autotune.md      The automatic choice on the shared-memory transport, TP=3
codec              benchmarks.md    CPU codec throughput beside single-core memcpy
cuda_check         cuda.md          The GPU check: tests, codec kernels and psum on GPUs
exact_p2p          transport.md     The exact all-reduce over the p2p transport against lax.psum
decode             autotune.md      Decode and TTFT in one process: auto against the fixed settings
format_probe       format_probe.md  FP8 and FP4 group formats on SmolLM2, simulated
fp_codec           fp_formats.md    Floating-point formats: CPU kernel speed
fused_norm         fused_norm.md    The all-reduce's epilogue fused against the unfused ops
gpu_model          gpu_model.md     The GPU cost model of the all-reduce and of TTFT
layer_sensitivity  accuracy.md      Per-site sensitivity of SmolLM2's all-reduces, and policies
layer_sensitivity_qwen  accuracy.md  Per-site sensitivity of Qwen2.5-1.5B's all-reduces, policies
load               models.md        Load time and peak memory of a checkpoint, f32 and bf16
moe_top1           moe.md           Top-1 of a trained tiny MoE LM at EP=4, quantized all-to-alls
outliers           outliers.md      Quantized all-reduce error per codec option on outlier data
overlap            overlap.md       Ring collective matmuls against unfused, processes over gloo
rewrite_maxtext    rewrite.md       The rewrite on MaxText-style programs
ring_overlap       transport.md     Ring matmuls on the p2p transport, link paced: exposed comm
shm_allreduce      transport.md     The all-reduce between processes: shared memory against gloo
transport          transport.md     The p2p transport against lax.psum and the xla transport
ttft               ttft.md          TTFT and decode of SmolLM2 at TP=3 on emulated links
ttft_p2p           ttft.md          TTFT of SmolLM2 at TP=3 in one process, rings on p2p
ttft_shm           ttft_shm.md      TTFT and decode between processes over shared memory
zero_dtype         format.md        Which type a group's zero has on the wire
"""
PAGES = {stem: (title, guide) for stem, guide, title in
         (line.split(None, 2) for line in _PAGES.strip().splitlines())}

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


def cpu_cores() -> str:
    """This machine's CPU and core count, as the benchmarks name it beside their figures."""
    import os

    from jax_flashcomm import costs

    return f"{costs.cpu_name()}, {os.cpu_count()} cores"


def save_result(out, record: dict, tables: str) -> None:
    """Write ``record`` as JSON to ``out`` (when given) and its page beside it (:func:`write_page`
    with ``tables``)."""
    if out is None:
        return
    out = Path(out)
    out.write_text(json.dumps(record, indent=1) + "\n")
    write_page(out, record, tables=tables)
