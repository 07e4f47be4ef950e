"""The collectives XLA's SPMD partitioner inserts into a compiled program (GSPMD, Auto axes).

A model sharded by annotations alone (weights placed with ``NamedSharding``, activations pinned
with ``with_sharding_constraint``, Auto mesh axes) has no collective in its jaxpr: XLA inserts
them when it partitions the compiled module. :func:`inserted_collectives` compiles the function
for the given arguments and reads them from the optimized HLO: the kind, the mesh axes (from the
replica groups and the mesh's device order), the per-rank operand, the jaxpr equation each comes
from (the ``op_name`` metadata: name stack and primitive) and its source line (the module's
stack-frame tables).
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from jax_flashcomm.rewrite.report import ReportRow, short_path

__all__ = ["Inserted", "inserted_collectives", "parse_collectives", "replica_groups",
           "partitioner_mesh", "partitioner_rows"]

#: HLO collective opcodes and the lax names of what they compute.
OPS = {"all-reduce": "psum", "reduce-scatter": "psum_scatter", "all-gather": "all_gather",
       "all-to-all": "all_to_all", "collective-permute": "ppermute"}

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>\([^)]*\)|\S+)\s+"
    r"(?P<op>all-reduce|reduce-scatter|all-gather|all-to-all|collective-permute)(?:-start)?\(")
_ARRAY = re.compile(r"(?P<dtype>[a-z]+[0-9]*)\[(?P<dims>[0-9,]*)\]")
_DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64",
           "s32": "int32", "s8": "int8", "u8": "uint8", "s64": "int64", "u32": "uint32",
           "pred": "bool"}


@dataclasses.dataclass(frozen=True)
class Inserted:
    """One collective of the partitioned program.

    Attributes:
      kind: the HLO opcode (``all-reduce``, ``reduce-scatter``, ``all-gather``, ...).
      op: its lax name (``psum``, ``psum_scatter``, ``all_gather``, ...).
      axes: the mesh axes its groups run over (``()`` when they match no set of axes).
      group_size: ranks per group.
      shape: the per-rank operand.
      dtype: its dtype name.
      op_name: the equation it comes from (JAX's name stack, then the primitive).
      site: ``"file:line (function)"`` of that equation, or ``"?"``.
    """

    kind: str
    op: str
    axes: tuple
    group_size: int
    shape: tuple
    dtype: str
    op_name: str
    site: str

    @property
    def primitive(self) -> str:
        return self.op_name.rsplit("/", 1)[-1] if self.op_name else "?"

    @property
    def bytes_per_rank(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def replica_groups(text: str, n_devices: int) -> list[list[int]] | None:
    """The groups of an HLO ``replica_groups=`` value, or None if the form is unknown.

    Forms: ``{{0,1},{2,3}}``; iota ``[2,4]<=[8]`` and ``[2,4]<=[4,2]T(1,0)``; mesh
    ``mesh['axis_0'=2,'axis_1'=4] {'axis_1'}`` (groups over the named axes).
    """
    text = text.strip()
    if text.startswith("{"):
        groups = re.findall(r"\{([0-9,\s]*)\}", text)
        return [[int(v) for v in g.split(",") if v.strip()] for g in groups if g.strip()]
    m = re.match(r"\[([0-9,]+)\]<=\[([0-9,]+)\](?:T\(([0-9,]+)\))?", text)
    if m:
        shape = [int(v) for v in m.group(1).split(",")]
        ids = np.arange(int(np.prod([int(v) for v in m.group(2).split(",")]))).reshape(
            [int(v) for v in m.group(2).split(",")])
        if m.group(3):
            ids = ids.transpose([int(v) for v in m.group(3).split(",")])
        return ids.reshape(shape).reshape(shape[0], -1).tolist()
    m = re.match(r"mesh\[([^\]]*)\]\s*\{([^}]*)\}", text)
    if m:
        axes = re.findall(r"'([^']+)'=([0-9]+)", m.group(1))
        names = [a for a, _ in axes]
        over = re.findall(r"'([^']+)'", m.group(2))
        sizes = [int(s) for _, s in axes]
        ids = np.arange(int(np.prod(sizes, dtype=np.int64))).reshape(sizes)
        keep = [i for i, a in enumerate(names) if a not in over]
        moved = ids.transpose(keep + [names.index(a) for a in over])
        return moved.reshape(-1, int(np.prod([dict(axes)[a] for a in over] or [1],
                                              dtype=np.int64))).tolist()
    return None


def _mesh_axes(groups, mesh) -> tuple:
    """The mesh axes whose groups (device positions in ``mesh``'s order) are ``groups``."""
    want = {frozenset(g) for g in groups}
    names, shape = tuple(mesh.axis_names), tuple(mesh.devices.shape)
    ids = np.arange(int(np.prod(shape))).reshape(shape)
    for k in range(1, len(names) + 1):
        for subset in itertools.combinations(range(len(names)), k):
            keep = [i for i in range(len(names)) if i not in subset]
            size = int(np.prod([shape[i] for i in subset]))
            got = ids.transpose(keep + list(subset)).reshape(-1, size)
            if {frozenset(g) for g in got.tolist()} == want:
                return tuple(names[i] for i in subset)
    return ()


def _frames(text: str) -> dict[int, str]:
    """``{stack_frame_id: "file:line (function)"}`` from the module's stack-frame tables."""
    def table(name):
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        return m.group(1).splitlines() if m else []

    files = dict(re.findall(r'^(\d+) "(.*)"$', "\n".join(table("FileNames")), re.M))
    functions = dict(re.findall(r'^(\d+) "(.*)"$', "\n".join(table("FunctionNames")), re.M))
    locations = {k: (f, fn, line) for k, f, fn, line in re.findall(
        r"^(\d+) \{file_name_id=(\d+) function_name_id=(\d+) line=(\d+)",
        "\n".join(table("FileLocations")), re.M)}
    frames = {}
    for k, loc in re.findall(r"^(\d+) \{file_location_id=(\d+)", "\n".join(
            table("StackFrames")), re.M):
        if loc in locations:
            f, fn, line = locations[loc]
            frames[int(k)] = f"{short_path(files.get(f, '?'))}:{line} ({functions.get(fn, '?')})"
    return frames


def parse_collectives(text: str, mesh) -> list[Inserted]:
    """The collectives of an optimized HLO module's text, in module order.

    Args:
      text: ``compiled.as_text()``.
      mesh: the mesh the program was partitioned over (its device order numbers the ranks).

    Returns:
      One :class:`Inserted` per collective instruction (those in a loop body once).
    """
    frames, n = _frames(text), int(np.prod(mesh.devices.shape))
    found = []
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        arrays = _ARRAY.findall(m.group("type"))
        if not arrays:
            continue
        dtype, dims = arrays[0]
        shape = tuple(int(d) for d in dims.split(",") if d)
        groups_text = re.search(r"replica_groups=(mesh\[[^\]]*\]\s*\{[^}]*\}|\{[^=]*?\}\}|"
                                r"\{\}|\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?)", line)
        groups = replica_groups(groups_text.group(1), n) if groups_text else None
        if not groups or not groups[0]:
            groups = [list(range(n))]
        size = len(groups[0])
        op = m.group("op")
        dim = re.search(r"dimensions=\{(\d+)\}", line)
        if op == "all-gather" and dim:          # the operand is the result split over the group
            d = int(dim.group(1))
            shape = shape[:d] + (shape[d] // size,) + shape[d + 1:]
        elif op == "reduce-scatter" and dim:
            d = int(dim.group(1))
            shape = shape[:d] + (shape[d] * size,) + shape[d + 1:]
        name = re.search(r'op_name="([^"]*)"', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        found.append(Inserted(
            kind=op, op=OPS[op], axes=_mesh_axes(groups, mesh), group_size=size, shape=shape,
            dtype=_DTYPES.get(dtype, dtype), op_name=name.group(1) if name else "",
            site=frames.get(int(frame.group(1)), "?") if frame else "?"))
    return found


def inserted_collectives(fn, args, kwargs, mesh) -> tuple[list[Inserted], float]:
    """Compile ``fn`` for these arguments and list the collectives XLA inserted.

    Args:
      fn: the function (it is wrapped in ``jax.jit``).
      args, kwargs: its arguments (arrays or ``jax.ShapeDtypeStruct``s with shardings).
      mesh: the mesh of their shardings.

    Returns:
      ``(collectives, seconds)``: the list, and the time the extra compile took.
    """
    import time

    start = time.perf_counter()
    text = jax.jit(fn).lower(*args, **kwargs).compile().as_text()
    return parse_collectives(text, mesh), time.perf_counter() - start


def partitioner_mesh(leaves):
    """The mesh of the first argument sharded over an Auto axis of size > 1, or None."""
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if not isinstance(sharding, NamedSharding):
            continue
        mesh = sharding.mesh
        if any(t == AxisType.Auto and mesh.shape[n] > 1
               for n, t in zip(mesh.axis_names, mesh.axis_types)) and hasattr(mesh, "devices"):
            return mesh
    return None


def partitioner_rows(inserted, rows, unsupported: str | None = None) -> list[ReportRow]:
    """The report rows of the collectives the partitioner inserted, each with what the rewrite
    did there.

    Collectives and islands are matched in program order (the module's order is the jaxpr's:
    the layers of a scan or a repeated block share their source lines and ``op_name``, so a
    match by name alone would pair a gather with a reduction). A collective takes the first
    unmatched island of the same reduction kind (an all-reduce XLA slices afterwards is the
    reduce-scatter the island runs) over the same axes: of its source line and per-rank bytes,
    else of its source line, else of its bytes (XLA often moves a gather or a reduction to a
    neighbouring equation). None matched: kept, with the reason of a kept row at its line.
    """
    islands = [r for r in rows if r.path != "partitioner" and r.action != "kept"]
    kept = [r for r in rows if r.path != "partitioner" and r.action == "kept"]
    used: set = set()

    def pick(c, test):
        for k, r in enumerate(islands):
            if k not in used and _same_kind(c, r) and test(r):
                used.add(k)
                return r
        return None

    out = []
    for c in inserted:
        same = (pick(c, lambda r: r.site == c.site and r.bytes_per_rank == c.bytes_per_rank)
                or pick(c, lambda r: r.site == c.site)
                or pick(c, lambda r: r.bytes_per_rank == c.bytes_per_rank))
        why = next((r.reason for r in kept if r.site == c.site), None)
        out.append(_row(c, same, unsupported, why))
    return out


def _same_kind(c: Inserted, r: ReportRow) -> bool:
    reductions = {"psum", "psum_scatter"}
    ops_match = c.op == r.op or (c.op in reductions and r.op in reductions)
    return ops_match and (not c.axes or tuple(c.axes) == tuple(r.axes))


#: What each collective does to the data, in the report's words.
_DOES = {"all-reduce": "sums the partial results of every rank",
         "reduce-scatter": "sums the partial results and scatters the sum",
         "all-gather": "gathers an operand every rank holds a slice of",
         "all-to-all": "moves an operand to another sharding (all-to-all)",
         "collective-permute": "sends an operand to a neighbour (collective-permute)"}


def _row(c: Inserted, same, unsupported, kept_reason=None) -> ReportRow:
    what = (f"inserted by XLA's SPMD partitioner: its {c.kind} for {c.primitive} "
            f"{_DOES.get(c.kind, '')} ({c.dtype}{list(c.shape)} per rank)")
    if same is not None:
        action, detail = same.action, same.detail
        where = "at the same equation" if same.site == c.site else f"at {same.site}"
        reason = f"{what}; replaced by the rewrite's {same.op} {where} ({same.reason})"
    else:
        action, detail = "kept", "xla"
        if unsupported:
            why = f"the program could not be typed with Explicit axes ({unsupported})"
        elif kept_reason:
            why = f"the rewrite left this equation to XLA: {kept_reason}"
        else:
            why = ("no collective of the typed program matches it (XLA's own choice of where to "
                   "communicate)")
        reason = f"{what}; {why}"
    row = ReportRow(
        primitive=c.primitive, op=c.op, axes=c.axes, shape=c.shape, dtype=c.dtype,
        bytes_per_rank=c.bytes_per_rank, axis_size=c.group_size, site=c.site,
        scope=c.op_name, path="partitioner", action=action, detail=detail, reason=reason)
    if same is None or same.sent is None or not same.xla_sent:
        return row
    return dataclasses.replace(row, sent=round(row.xla_sent * same.sent / same.xla_sent))
