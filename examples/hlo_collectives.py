"""The collectives of a compiled (optimized) HLO module, counted per step.

``hlo_collectives(jax.jit(f).lower(*args).compile().as_text(), mesh)`` lists every all-reduce,
reduce-scatter, all-gather, all-to-all and collective-permute instruction, and every flashcomm
p2p/shm FFI call (the custom calls that move bytes between ranks; a ring's ``_done`` half is not
counted twice), with:

* how many times a step runs it: the product of the ``known_trip_count`` of the while loops
  around its computation (a loop without one counts once and is listed in
  ``unknown_trip_counts``; both branches of a conditional count);
* its per-rank operand bytes: the operand of an all-reduce, all-to-all or collective-permute (all
  the arrays of a tuple-valued one), the result over the group size for an all-gather, the result
  times the group size for a reduce-scatter; for a p2p call, its wire buffers (the outputs after
  the first, the decoded result);
* where it sits: ``decoder`` when a ``*DecoderLayer.__call__`` frame is in its stack or its
  computation is in the body of a while loop issued from MaxText's layer scan
  (``_apply_layers_sequentially``), else ``embed`` / ``head`` (an ``Embed.__call__`` /
  ``apply_output_head`` frame) or ``other``. Stacks come from the module's StackFrames tables.
"""

from __future__ import annotations

import re

import numpy as np

__all__ = ["ABBR", "hlo_collectives"]

ABBR = {"all-reduce": "AR", "reduce-scatter": "RS", "all-gather": "AG", "all-to-all": "A2A",
        "collective-permute": "CP", "p2p": "p2p"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%\S+\s*=\s*(?P<type>\([^)]*\)|\S+)\s+(?P<op>all-reduce|"
                    r"reduce-scatter|all-gather|all-to-all|collective-permute|custom-call)"
                    r"(?:-start)?\(")
_HEAD = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")
_ARRAY = re.compile(r"\b([a-z]+[0-9]*)\[([0-9,]*)\]")
_GROUPS = re.compile(r"replica_groups=(mesh\[[^\]]*\]\s*\{[^}]*\}|\{[^=]*?\}\}|\{\}|"
                     r"\[[0-9,]*\]<=\[[0-9,]*\](?:T\([0-9,]*\))?)")


def _frames(text):
    """``chain(stack_frame_id)``: the function names of a stack, innermost first. A printed
    parent_frame_id is the parent's id plus one (1: none), as the module's tables read."""
    def table(name):
        m = re.search(rf"^{name}\n(.*?)(?:\n\n|\Z)", text, re.S | re.M)
        return m.group(1) if m else ""
    fns = dict(re.findall(r'^(\d+) "(.*)"$', table("FunctionNames"), re.M))
    locs = dict(re.findall(r"^(\d+) \{file_name_id=\d+ function_name_id=(\d+)",
                           table("FileLocations"), re.M))
    frames = {int(k): (fns.get(locs.get(loc), "?"), int(p) - 1) for k, loc, p in re.findall(
        r"^(\d+) \{file_location_id=(\d+) parent_frame_id=(\d+)", table("StackFrames"), re.M)}

    def chain(k):
        out = []
        while k in frames and len(out) < 200:
            out.append(frames[k][0])
            k = frames[k][1]
        return out
    return chain


def _calls(text, chain):
    """Per computation: how many times a step runs it (the known trip counts of the while loops
    around it) and the stack functions of those while instructions."""
    edges, comp, entry, unknown = {}, None, None, []
    for line in text.splitlines():
        head = _HEAD.match(line)
        if head:
            comp, entry = head.group(2), head.group(2) if head.group(1) else entry
            edges.setdefault(comp, [])
            continue
        trip = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', line)
        frame = re.search(r"stack_frame_id=(\d+)", line)
        for key, names in re.findall(r"\b(body|calls|branch_computations|true_computation|"
                                     r"false_computation)=\{?(%[^,}\s]+(?:,\s*%[^,}\s]+)*)", line):
            if key == "body" and not trip:
                unknown.append(comp)
            n = int(trip.group(1)) if key == "body" and trip else 1
            fns = frozenset(chain(int(frame.group(1)))) if key == "body" and frame else frozenset()
            edges[comp] += [(callee, n, fns) for callee in re.findall(r"%([^,}\s]+)", names)]
    mult, loops = {}, {}

    def visit(c, m, around):
        mult[c] = mult.get(c, 0) + m
        loops[c] = loops.get(c, frozenset()) | around
        for callee, n, fns in edges.get(c, []):
            visit(callee, m * n, around | fns)
    visit(entry, 1, frozenset())
    return mult, loops, unknown


def hlo_collectives(text, mesh):
    """The collectives of an optimized HLO module: per kind and region, instructions, executions
    per step and bytes per rank per step; and one line per instruction (``items``)."""
    from jax_flashcomm.rewrite.partitioner import replica_groups
    n_dev, chain = int(np.prod(mesh.devices.shape)), _frames(text)
    mult, loops, unknown = _calls(text, chain)
    found, comp = [], None
    for line in text.splitlines():
        head = _HEAD.match(line)
        comp = head.group(2) if head else comp
        m = _INSTR.match(line)
        if m is None:
            continue
        op, arrays = m.group("op"), _ARRAY.findall(m.group("type"))
        sizes = [int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64))
                 * (1 if dt == "pred" else int(re.match(r"\D+(\d+)", dt).group(1)) // 8)
                 for dt, dims in arrays]
        if op == "custom-call":
            target = re.search(r'custom_call_target="flashcomm_(?:p2p|shm)_\w+', line)
            if target is None or target.group(0).endswith("_done"):
                continue
            op, nbytes = "p2p", sum(sizes[1:])
        else:
            groups = _GROUPS.search(line)
            g = replica_groups(groups.group(1), n_dev) if groups else None
            size = len(g[0]) if g and g[0] else n_dev
            nbytes = {"all-gather": sum(sizes) // size, "reduce-scatter": sum(sizes) * size}.get(
                op, sum(sizes))
        frame = re.search(r"stack_frame_id=(\d+)", line)
        fns = chain(int(frame.group(1))) if frame else []
        layer_loop = any("_apply_layers" in f for f in loops.get(comp, ()))
        where = ("decoder" if layer_loop or any("DecoderLayer.__call__" in f for f in fns) else
                 "embed" if any("Embed.__call__" in f for f in fns) else
                 "head" if any("apply_output_head" in f for f in fns) else "other")
        found.append((op, where, nbytes, mult.get(comp, 1), " < ".join(fns[:3])))
    out = dict(instructions={}, per_step={}, bytes_per_step={}, unknown_trip_counts=unknown,
               bytes_total=sum(f[2] * f[3] for f in found),
               items=[f"{o} {w} {b} B x{n} {fr}" for o, w, b, n, fr in found])
    for op, where, nbytes, n, _ in found:
        region = "decoder" if where == "decoder" else "outside"
        for key, v in (("instructions", 1), ("per_step", n), ("bytes_per_step", nbytes * n)):
            out[key].setdefault(op, {"decoder": 0, "outside": 0})[region] += v
    return out
