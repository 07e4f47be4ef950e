# long file: the collectives Explicit sharding implies, one rule per primitive, read as a table
"""The collectives a jaxpr implies through sharding in types (Explicit mesh axes).

With Explicit axes (``jax.make_mesh``'s default since JAX 0.10) a model has no collective in its
jaxpr: every communication point is in the types, and XLA inserts the collective when it
partitions. This module reads them off the equations:

* ``dot_general`` whose contracting dimensions are sharded over axes ``R`` in both operands:
  each rank computes a partial sum, reduced over ``R``. If no output dimension carries ``R``
  the dot is an **all-reduce** (``f32[2,8,256@tp] x f32[256@tp,64] -> f32[2,8,64]``); if one
  output dimension is sharded as the operands leave it plus ``R`` it is a **reduce-scatter**
  along that dimension (``-> f32[2,8@tp,64]``); if the output is typed unreduced over ``R``
  (``{U:tp}``) the reduction is deferred to where it is resharded.
* ``reshard`` that drops trailing axes ``A`` from one dimension's sharding (``f32[2,8@tp,64]``
  to ``f32[2,8,64]``) is an **all-gather** over ``A`` along that dimension; from an unreduced
  type to a reduced one it is the deferred **all-reduce**.

A pattern is matched only when the flashcomm op computes exactly what XLA would; everything else
(operands sharded differently on a contracting pair, a partially unreduced output, an output
sharding that moves axes between dimensions, an unreduced value with uses outside the chain) is
a :class:`Kept` with its reason. The shapes are per rank: every Explicit axis is manual in the
``shard_map`` island that replaces the pattern (:mod:`jax_flashcomm.rewrite.islands`).
"""

# Over 400 lines: one analysis per sharded equation kind (dot, reduce_sum, reshard, unreduced
# chain), which share the spec helpers above them.

from __future__ import annotations

import dataclasses

import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from jax_flashcomm.jax_compat import core

__all__ = ["Implied", "Kept", "Region", "entry", "entries", "analyze_dot", "analyze_reduce",
           "analyze_reshard",
           "unreduced_region", "LINEAR_PRIMITIVES"]

#: Primitives an unreduced value may pass through between its dots and its reduction point
#: (linear in the unreduced operands, so the sum can move after them).
LINEAR_PRIMITIVES = frozenset({"add", "add_any", "sub", "neg", "convert_element_type"})


@dataclasses.dataclass(frozen=True)
class Implied:
    """One collective a sharded equation implies.

    Attributes:
      op: ``"psum"``, ``"psum_scatter"`` or ``"all_gather"``.
      axes: the mesh axes it runs over, in the order of the sharding (major first).
      dim: the scatter / gather dimension (None for ``psum``).
      mesh: the equation's (abstract) mesh.
      manual: the island's manual axes (every Explicit axis of the mesh).
      in_specs: the PartitionSpecs of the island's inputs.
      out_spec: the PartitionSpec of its output.
      shape: the collective's operand, per rank.
      dtype: its dtype.
      operand: for an all-gather of a dot's operand (the contracted dimension sharded in it
        alone), which operand (0 or 1); None otherwise.
    """

    op: str
    axes: tuple
    dim: int | None
    mesh: object
    manual: frozenset
    in_specs: tuple
    out_spec: object
    shape: tuple
    dtype: object
    operand: int | None = None     # an all-gather of this dot operand before the dot

    @property
    def axis_size(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.axes], dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class Kept:
    """A communication point left to XLA, and why (``op``/``axes`` as far as they are known)."""

    op: str
    axes: tuple
    reason: str
    shape: tuple = ()
    dtype: object = None


@dataclasses.dataclass(frozen=True)
class Region:
    """An unreduced chain: the dots that produce the partial sums (``sources``), the linear
    equations between them (``inner``), and the reshard that reduces them (``sink``), by
    equation index; ``inputs`` are the variables the chain reads from outside."""

    sources: tuple
    inner: tuple
    sink: int
    inputs: tuple
    implied: Implied

    @property
    def eqns(self) -> tuple:
        return tuple(sorted((*self.sources, *self.inner)))


def entry(value) -> tuple:
    """A spec entry as a tuple of axis names."""
    if value is None:
        return ()
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def entries(aval) -> tuple[tuple, frozenset, object] | None:
    """``(per-dimension axis tuples, unreduced axes, mesh)`` of a sharded aval (axes of size 1
    left out), or None when it carries no mesh axes (no mesh, or only Auto / Manual ones)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or not getattr(mesh, "axis_names", ()):
        return None
    spec = sharding.spec
    parts = tuple(spec.partitions) if hasattr(spec, "partitions") else tuple(spec)
    sizes = dict(mesh.shape)
    real = lambda axes: tuple(a for a in axes if sizes.get(a, 2) != 1)  # noqa: E731
    # an axis of size 1 shards nothing: a dimension over it alone is replicated
    per_dim = tuple(real(entry(parts[d])) if d < len(parts) else () for d in range(aval.ndim))
    unreduced = frozenset(real(getattr(spec, "unreduced", ()) or ()))
    return per_dim, unreduced, mesh


def explicit_axes(mesh) -> frozenset:
    return frozenset(n for n, t in zip(mesh.axis_names, mesh.axis_types)
                     if t == AxisType.Explicit)


def spec_of(per_dim: tuple) -> P:
    """The PartitionSpec of per-dimension axis tuples."""
    return P(*(None if not e else e[0] if len(e) == 1 else e for e in per_dim))


def local_shape(shape, per_dim, mesh) -> tuple:
    sizes = dict(mesh.shape)
    return tuple(int(n) // int(np.prod([sizes[a] for a in e], dtype=np.int64))
                 for n, e in zip(shape, per_dim))


def _all_explicit(mesh, *axis_sets) -> bool:
    explicit = explicit_axes(mesh)
    return all(set(s) <= explicit for s in axis_sets)


def _natural_output(dot, lhs, rhs) -> tuple | str:
    """The output sharding a dot gives with no communication (batch dims, lhs free dims, rhs
    free dims), or why there is none."""
    (lc, rc), (lb, rb) = dot.params["dimension_numbers"]
    for i, j in zip(lb, rb):
        if lhs[i] != rhs[j]:
            return (f"batch dimensions sharded differently in the operands ({lhs[i]} and "
                    f"{rhs[j]})")
    free_l = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    free_r = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    return tuple(lhs[i] for i in lb) + tuple(lhs[d] for d in free_l) + tuple(
        rhs[d] for d in free_r)


def _sliced_contraction(lhs, rhs, lc, rc):
    """The operands' layouts with a contracted dimension that one operand has replicated and
    the other sharded over axes ``R`` taken as sharded over ``R`` in both: the replicated one
    is sliced locally (no communication; a one-hot lookup into a vocab-sharded table, say),
    and the dot sums partial products over ``R``, as XLA partitions it. Unchanged where the
    replicated operand already uses ``R`` in another dimension."""
    lhs, rhs = list(lhs), list(rhs)
    for i, j in zip(lc, rc):
        for mine, other, k, m in ((lhs, rhs, i, j), (rhs, lhs, j, i)):
            used = {a for d, e in enumerate(mine) if d != k for a in e}
            if not mine[k] and other[m] and not used & set(other[m]):
                mine[k] = other[m]
    return tuple(lhs), tuple(rhs)


def _gathered_output(out, natural, out_u):
    """``(d, axes)`` when ``out`` is the dot's natural layout with trailing ``axes`` of one
    dimension ``d`` gathered (XLA computes the dot sharded, then all-gathers it), else None."""
    diff = [d for d in range(len(out)) if out[d] != natural[d]]
    if out_u or len(diff) != 1:
        return None
    d = diff[0]
    if natural[d][:len(out[d])] != out[d] or len(natural[d]) == len(out[d]):
        return None
    return d, natural[d][len(out[d]):]


def _gathered_operand(dot, lhs, rhs, out, out_u, mesh):
    """An all-gather of one operand along its contracted dimension, where the other operand
    has that dimension replicated and cannot take the first one's axes there (they shard
    another of its dimensions): XLA gathers the operand and the dot is local. None otherwise
    (or when the dot would not then give ``out``)."""
    (lc, rc), _ = dot.params["dimension_numbers"]
    pairs = [(i, j) for i, j in zip(lc, rc) if lhs[i] != rhs[j]]
    if len(pairs) != 1 or out_u:
        return None
    i, j = pairs[0]
    for k, (mine, other, d) in enumerate(((lhs, rhs, i), (rhs, lhs, j))):
        peer = j if k == 0 else i
        if mine[d] and not other[peer] and _all_explicit(mesh, mine[d]):
            local = list(mine)
            local[d] = ()
            new_lhs, new_rhs = (tuple(local), rhs) if k == 0 else (lhs, tuple(local))
            if _natural_output(dot, new_lhs, new_rhs) != out:
                return None
            aval = dot.invars[k].aval
            return Implied("all_gather", tuple(mine[d]), d, mesh=mesh,
                           manual=explicit_axes(mesh), in_specs=(spec_of(lhs), spec_of(rhs)),
                           out_spec=spec_of(out), shape=local_shape(aval.shape, mine, mesh),
                           dtype=aval.dtype, operand=k)
    return None


def analyze_dot(dot) -> Implied | Kept | None:
    """The collective a ``dot_general`` equation implies, None if it implies none."""
    lhs_aval, rhs_aval = (v.aval for v in dot.invars)
    out_aval = dot.outvars[0].aval
    got = [entries(a) for a in (lhs_aval, rhs_aval, out_aval)]
    if any(g is None for g in got):
        return None
    (lhs, lhs_u, mesh), (rhs, rhs_u, _), (out, out_u, _) = got
    (lc, rc), _ = dot.params["dimension_numbers"]
    reduced: list = []
    lhs, rhs = _sliced_contraction(lhs, rhs, lc, rc)
    gathered = _gathered_operand(dot, lhs, rhs, out, out_u, mesh)
    if gathered is not None:
        return gathered
    for i, j in zip(lc, rc):
        if lhs[i] != rhs[j]:
            axes = tuple(dict.fromkeys(lhs[i] + rhs[j]))
            return Kept("psum", axes,
                        f"the contracted dimension is sharded over {list(axes)} differently in "
                        f"the two operands ({spec_of((lhs[i],))} and {spec_of((rhs[j],))}): "
                        f"XLA gathers an operand or sums partial products here, as it finds "
                        f"cheaper; the rewrite takes a dot whose operands are sharded alike "
                        f"along it")
        reduced += [a for a in lhs[i] if a not in reduced]
    natural = _natural_output(dot, lhs, rhs)
    used = {a for e in (*lhs, *rhs, *out) for a in e} | set(out_u) | set(reduced)
    if not used or not _all_explicit(mesh, used):
        return None
    if lhs_u or rhs_u:
        return Kept("psum", tuple(lhs_u | rhs_u), "an unreduced operand of a dot")
    if isinstance(natural, str):
        return Kept("psum", tuple(reduced), natural)
    if not reduced:
        if out == natural and not out_u:
            return None
        gather = _gathered_output(out, natural, out_u)
        if gather is not None and _all_explicit(mesh, gather[1]):
            d, axes = gather
            return Implied("all_gather", axes, d, mesh=mesh, manual=explicit_axes(mesh),
                           in_specs=(spec_of(lhs), spec_of(rhs)), out_spec=spec_of(out),
                           shape=local_shape(out_aval.shape, natural, mesh),
                           dtype=out_aval.dtype)
        return Kept("reshard", tuple(sorted(used)),
                    f"the output sharding {spec_of(out)} differs from the operands' "
                    f"{spec_of(natural)} (an implied reshard after the dot)")
    shape = local_shape(out_aval.shape, natural, mesh)
    common = dict(mesh=mesh, manual=explicit_axes(mesh),
                  in_specs=(spec_of(lhs), spec_of(rhs)), shape=shape, dtype=out_aval.dtype)
    if out_u:
        if set(out_u) != set(reduced) or out != natural:
            return Kept("psum", tuple(reduced),
                        f"unreduced over {sorted(out_u)} but the contraction is sharded over "
                        f"{reduced} (a partial unreduced reduction)", shape, out_aval.dtype)
        return Implied("unreduced", tuple(reduced), None, out_spec=spec_of(out), **common)
    diff = [d for d in range(len(out)) if out[d] != natural[d]]
    if not diff:
        return Implied("psum", tuple(reduced), None, out_spec=spec_of(out), **common)
    if len(diff) == 1:
        d = diff[0]
        prefix, suffix = out[d][:len(natural[d])], out[d][len(natural[d]):]
        if prefix == natural[d] and set(suffix) == set(reduced) and len(suffix) == len(reduced):
            n = int(np.prod([mesh.shape[a] for a in suffix]))
            if shape[d] % n == 0:
                return Implied("psum_scatter", suffix, d, out_spec=spec_of(out), **common)
            return Kept("psum_scatter", suffix, f"dimension {d} ({shape[d]} per rank) does not "
                        f"divide over {suffix}", shape, out_aval.dtype)
    return Kept("psum", tuple(reduced),
                f"XLA sums the partial products over {reduced} and moves the sum to "
                f"{spec_of(out)}, a layout the operands do not give ({spec_of(natural)}); the "
                f"rewrite takes a sum to the operands' layout or a reduce-scatter of it",
                shape, out_aval.dtype)


def analyze_reduce(eqn) -> Implied | Kept | None:
    """The all-reduce a ``reduce_sum`` over sharded dimensions implies (an RMSNorm's mean of
    squares over a hidden dimension split over ``R``), None if it implies none."""
    got_in, got_out = entries(eqn.invars[0].aval), entries(eqn.outvars[0].aval)
    if got_in is None or got_out is None:
        return None
    (src, src_u, mesh), (dst, dst_u, _) = got_in, got_out
    axes = tuple(eqn.params["axes"])
    reduced = tuple(dict.fromkeys(a for d in axes for a in src[d]))
    if not reduced or not _all_explicit(mesh, reduced):
        return None
    kept_dims = tuple(src[d] for d in range(len(src)) if d not in axes)
    dtype = eqn.outvars[0].aval.dtype
    shape = local_shape(eqn.outvars[0].aval.shape, kept_dims, mesh)
    if src_u or dst_u or dst != kept_dims or not np.issubdtype(dtype, np.floating):
        return Kept("psum", reduced, f"XLA sums the partial sums of reduce_sum over "
                    f"{list(reduced)}; the rewrite takes a float sum whose result keeps the "
                    f"operand's other dimensions' layout", shape, dtype)
    return Implied("psum", reduced, None, mesh=mesh, manual=explicit_axes(mesh),
                   in_specs=(spec_of(src),), out_spec=spec_of(dst), shape=shape, dtype=dtype)


def analyze_reshard(eqn) -> Implied | Kept | None:
    """The collective a ``reshard`` equation implies (None if none, e.g. a local slice).

    A reshard from an unreduced type is the sink of an unreduced chain: it comes back as an
    :class:`Implied` ``"psum"`` whose ``in_specs`` are filled in by :func:`unreduced_region`.
    """
    in_aval, out_aval = eqn.invars[0].aval, eqn.outvars[0].aval
    got_in, got_out = entries(in_aval), entries(out_aval)
    if got_in is None or got_out is None:
        return None
    (src, src_u, mesh), (dst, dst_u, dst_mesh) = got_in, got_out
    if tuple(dst_mesh.axis_types) != tuple(mesh.axis_types):
        return None        # into or out of an auto_axes / explicit_axes region: no data moves
    used = {a for e in (*src, *dst) for a in e} | set(src_u) | set(dst_u)
    if not used or not _all_explicit(mesh, used):
        return None
    shape = local_shape(in_aval.shape, src, mesh)
    common = dict(mesh=mesh, manual=explicit_axes(mesh), in_specs=(spec_of(src),),
                  out_spec=spec_of(dst), shape=shape, dtype=in_aval.dtype)
    if src_u:
        if dst_u or src != dst:
            return Kept("psum", tuple(sorted(src_u)),
                        f"a reshard from unreduced over {sorted(src_u)} to {spec_of(dst)}"
                        f"{' unreduced over ' + str(sorted(dst_u)) if dst_u else ''} (only a "
                        f"full reduction with the same dimension sharding is rewritten)",
                        shape, in_aval.dtype)
        return Implied("psum", tuple(sorted(src_u, key=mesh.axis_names.index)), None, **common)
    if dst_u:
        return Kept("reshard", tuple(sorted(dst_u)), "a reshard to an unreduced type")
    diff = [d for d in range(len(src)) if src[d] != dst[d]]
    if not diff:
        return None
    gathered = [d for d in diff if dst[d] == src[d][:len(dst[d])]]
    if all(src[d] == dst[d][:len(src[d])] for d in diff):
        return None  # every changed dimension only gains axes: a local slice
    if len(diff) == 1 and gathered:
        d = diff[0]
        return Implied("all_gather", src[d][len(dst[d]):], d, **common)
    return Kept("reshard", tuple(sorted(used)),
                f"a reshard from {spec_of(src)} to {spec_of(dst)} that is not an all-gather "
                f"along one dimension (an all-to-all or a general reshard)", shape,
                in_aval.dtype)


def _unreduced(var) -> frozenset:
    got = entries(var.aval) if isinstance(var, core.Var) else None
    return got[1] if got is not None else frozenset()


def unreduced_region(jaxpr, sink: int, sink_implied: Implied, producer: dict, users: dict,
                     analyzed: dict) -> Region | Kept:
    """The unreduced chain that ends at the reshard equation ``sink``.

    Args:
      jaxpr: the jaxpr holding it.
      sink: the index of the reshard from the unreduced type.
      sink_implied: :func:`analyze_reshard`'s result for it.
      producer: ``{var: index of the equation computing it}``.
      users: ``{var: [indices of the equations reading it]}`` (None: a jaxpr output).
      analyzed: ``{index: analyze_dot result}`` of the jaxpr's dots.

    Returns:
      The :class:`Region`, or a :class:`Kept` saying why the chain is not rewritten.
    """
    axes = set(sink_implied.axes)
    sources, inner, stack = set(), set(), [jaxpr.eqns[sink].invars[0]]
    while stack:
        var = stack.pop()
        i = producer.get(var)
        if i is None:
            return Kept("psum", sink_implied.axes, "the unreduced value is an input of the "
                        "traced function or body")
        if i in sources or i in inner:
            continue
        eqn, found = jaxpr.eqns[i], analyzed.get(i)
        if isinstance(found, Implied) and found.op == "unreduced":
            if set(found.axes) != axes:
                return Kept("psum", sink_implied.axes, "the chain mixes unreduced axes")
            sources.add(i)
        elif eqn.primitive.name in LINEAR_PRIMITIVES:
            inner.add(i)
            stack.extend(v for v in eqn.invars if _unreduced(v))
        else:
            return Kept("psum", sink_implied.axes,
                        f"the unreduced value comes from {eqn.primitive.name}, not from dots "
                        f"and {sorted(LINEAR_PRIMITIVES)}")
    members = sources | inner
    for i in members:
        for v in jaxpr.eqns[i].outvars:
            if any(u is None or (u != sink and u not in members) for u in users.get(v, [])):
                return Kept("psum", sink_implied.axes,
                            "an unreduced value of the chain has uses outside it")
    outputs = {v for i in members for v in jaxpr.eqns[i].outvars}
    inputs: list = []
    for i in sorted(members):
        for v in jaxpr.eqns[i].invars:
            if isinstance(v, core.Var) and v not in outputs and v not in inputs:
                inputs.append(v)
    specs = tuple(spec_of(entries(v.aval)[0]) if entries(v.aval) else P() for v in inputs)
    implied = dataclasses.replace(sink_implied, in_specs=specs)
    return Region(tuple(sorted(sources)), tuple(sorted(inner)), sink, tuple(inputs), implied)
