"""The ``shard_map`` islands that replace the collectives implied by Explicit sharding.

:func:`plan_islands` decides, for one jaxpr, which equations become an island (the patterns of
:mod:`jax_flashcomm.rewrite.explicit`, filtered by the policy, fused with their dot when the
policy fuses matmuls); :func:`emit` builds one. Every Explicit axis of the mesh is manual in an
island, so its body sees per-rank shards the way XLA's partitioned program does; its inputs
and output keep the shardings they had, so the program around it is unchanged:

* dot, all-reduce: ``shard_map(lambda a, b: fc.psum(dot(a, b), R))``;
* dot, reduce-scatter: ``fc.psum_scatter(dot(a, b), R, scatter_dimension=d, tiled=True)``
  (or :func:`~jax_flashcomm.matmul_reduce_scatter` when fused);
* reshard, all-gather: ``fc.all_gather(x, A, axis=d, tiled=True)`` (or
  :func:`~jax_flashcomm.all_gather_matmul` with the dot that consumes it);
* unreduced chain: the dots and the linear steps up to the reshard, then ``fc.psum``.

The all-gather's result is replicated but typed varying inside the island (there is no
varying-to-invariant cast), so that island is built with ``check_vma=False`` under a
``custom_vjp`` whose backward is the reshard's own transpose (a local slice): flashcomm's
all-gather decodes every payload, its own too, with one kernel, so the replicas are
bit-identical and the replicated type holds.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import PartitionSpec as P

from jax_flashcomm import _axes
from jax_flashcomm.allreduce import psum as flash_psum
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.jax_compat import core
from jax_flashcomm.planner import quantizes, record
from jax_flashcomm.fused_norm import psum_add_rms_norm
from jax_flashcomm.rewrite import explicit, fusion, norm_fusion
from jax_flashcomm.rewrite.explicit import Implied, Kept
from jax_flashcomm.scatter_gather import all_gather as flash_all_gather
from jax_flashcomm.scatter_gather import psum_scatter as flash_psum_scatter

__all__ = ["Island", "IslandPlan", "plan_islands", "emit"]

#: Equation parameters that name a sharding; None inside an island, where every axis is manual.
_SHARDING_PARAMS = ("out_sharding", "sharding")


@dataclasses.dataclass(frozen=True)
class Island:
    """One island, emitted at equation ``at``.

    Attributes:
      kind: ``"collective"`` (a dot with its all-reduce / reduce-scatter, or a reshard's
        all-gather), ``"region"`` (an unreduced chain), ``"all_gather_matmul"``,
        ``"matmul_reduce_scatter"`` or ``"norm"`` (a dot, its all-reduce, the residual add and
        the RMSNorm: two results).
      implied: the collective.
      at: the equation whose result the island replaces.
      report: the equation reported (the dot, the reshard, or the gather of a fused pair).
      eqns: the equations it evaluates, in order (``at`` last).
      inputs: its inputs (jaxpr atoms).
      note: why a matmul or a norm was not fused with it, if it was not.
    """

    kind: str
    implied: Implied
    at: int
    report: int
    eqns: tuple
    inputs: tuple
    note: str = ""
    norm: object = None        # the norm_fusion.NormFusion of a "norm" island


@dataclasses.dataclass
class IslandPlan:
    islands: dict = dataclasses.field(default_factory=dict)   # at -> Island
    kept: dict = dataclasses.field(default_factory=dict)      # eqn -> Kept
    skip: set = dataclasses.field(default_factory=set)        # eqns evaluated by an island
    exact: dict = dataclasses.field(default_factory=dict)     # eqn -> Island left as it was


def plan_islands(jaxpr, users: dict, producer: dict, select, fuse: bool, config_of,
                 fuse_norm: bool = False) -> IslandPlan:
    """The islands of one jaxpr.

    Args:
      jaxpr: the jaxpr.
      users: ``{var: [indices of the equations reading it]}`` (None: a jaxpr output).
      producer: ``{var: index of the equation computing it}``.
      select: ``select(index, implied) -> (bool, reason)``, the policy's filter for the
        equation at ``index``.
      fuse: whether the policy fuses matmuls.
      fuse_norm: whether it fuses an all-reduce with the residual add and RMSNorm after it.
      config_of: ``config_of(index)``, the policy's CommConfig at the equation at ``index``
        (its size policy decides whether a reduce-scatter is quantized, which is never fused).

    Returns:
      The :class:`IslandPlan`. A collective the config would not quantize (the exact setting,
      or below the size policy) is left to XLA, its own program and bits (``exact``), unless
      the policy fuses matmuls or norms (whose exact paths are flashcomm's rings and norm).
    """
    plan = IslandPlan()
    analyzed = {}
    for i, eqn in enumerate(jaxpr.eqns):
        if eqn.primitive.name == "dot_general":
            found = explicit.analyze_dot(eqn)
        elif eqn.primitive.name == "reshard":
            found = explicit.analyze_reshard(eqn)
        elif eqn.primitive.name == "reduce_sum":
            found = explicit.analyze_reduce(eqn)
        else:
            continue
        if found is not None:
            analyzed[i] = found
    for i, found in analyzed.items():
        eqn = jaxpr.eqns[i]
        if isinstance(found, Kept):
            plan.kept[i] = found
            continue
        if found.op == "unreduced":
            continue                                  # rewritten (or reported) at its reshard
        if eqn.primitive.name == "reshard" and found.op == "psum":
            region = explicit.unreduced_region(jaxpr, i, found, producer, users, analyzed)
            if isinstance(region, Kept):
                plan.kept[i] = region
                continue
            island = Island("region", region.implied, i, i, (*region.eqns, i), region.inputs)
        else:
            island = Island("collective", found, i, i, (i,), tuple(eqn.invars))
        selected, why = select(i, island.implied)
        if not selected:
            plan.kept[i] = Kept(found.op, found.axes, why, found.shape, found.dtype)
            continue
        if not (fuse or fuse_norm) and not quantizes(
                found.op, found.nbytes, found.axis_size, found.dtype, config_of(i)):
            plan.exact[i] = island      # the exact path is XLA's own collective: keep its bits
            continue
        plan.islands[i] = island
        plan.skip.update(island.eqns[:-1])
    if fuse:
        _plan_fusions(jaxpr, plan, analyzed, users, producer, config_of)
    if fuse_norm:
        _plan_norms(jaxpr, plan, users, producer)
    return plan


def _plan_norms(jaxpr, plan: IslandPlan, users, producer):
    """A dot's all-reduce followed by the residual add and an RMSNorm: one island with
    :func:`~jax_flashcomm.psum_add_rms_norm` (two results: the norm's and the new residual)."""
    for i, island in list(plan.islands.items()):
        if island.kind != "collective" or island.implied.op != "psum":
            continue
        match, note = norm_fusion.match_psum_norm(jaxpr, i, users, producer)
        if match is None or plan.skip & set(match.eqns) or set(match.eqns) & set(plan.islands):
            note = f"not fused with a norm: {note or 'overlaps another island'}"
            plan.islands[i] = dataclasses.replace(island, note=note)
            continue
        specs = [explicit.entries(v.aval) for v in (match.residual, match.weight, match.out,
                                                     match.new_residual)]
        if any(s is None or s[1] for s in specs):
            continue
        residual, weight, out, new = (explicit.spec_of(s[0]) for s in specs)
        implied = dataclasses.replace(island.implied, in_specs=(*island.implied.in_specs,
                                                                residual, weight),
                                      out_spec=(out, new))
        del plan.islands[i]
        plan.islands[match.last] = Island(
            "norm", implied, match.last, i, (i, *match.eqns),
            (*island.inputs, match.residual, match.weight), norm=match)
        plan.skip.update({i, *match.eqns} - {match.last})


def _plan_fusions(jaxpr, plan: IslandPlan, analyzed, users, producer, config_of):
    for i, island in list(plan.islands.items()):
        implied = island.implied
        if island.kind != "collective" or len(implied.axes) != 1:
            continue
        eqn = jaxpr.eqns[i]
        if implied.op == "all_gather" and eqn.primitive.name != "reshard":
            continue                  # a dot's own gather: not a gather feeding a dot
        if implied.op == "all_gather":
            fused, note = _gather_dot(jaxpr, i, implied, analyzed, users)
        elif implied.op == "psum_scatter":
            if quantizes("matmul_reduce_scatter", implied.nbytes, implied.axis_size,
                         implied.dtype, config_of(i)):
                note = ("not fused: quantized psum_scatter after the dot (there is no quantized "
                        "reduce-scatter ring)")
                fused = None
            else:
                fused, note = _dot_scatter(eqn, i, implied)
        else:
            continue
        if fused is None:
            plan.islands[i] = dataclasses.replace(island, note=note)
            continue
        del plan.islands[i]
        plan.islands[fused.at] = fused
        plan.skip.update(fused.eqns[:-1])


def _gather_dot(jaxpr, i, implied: Implied, analyzed, users):
    k, why = fusion.gathered_dot(jaxpr, jaxpr.eqns[i].outvars[0], implied.dim, users)
    if k is None:
        return None, why
    if k in analyzed:
        return None, "not fused: the dot implies a collective of its own"
    dot = jaxpr.eqns[k]
    w = dot.invars[1]
    w_entries = explicit.entries(w.aval)
    if w_entries is None or w_entries[0] != ((), implied.axes):
        return None, (f"not fused: the weight is not sharded over {implied.axes[0]!r} in its "
                      f"columns only")
    out_entries = explicit.entries(dot.outvars[0].aval)[0]
    fused = dataclasses.replace(implied, in_specs=(implied.in_specs[0], explicit.spec_of(
        w_entries[0])), out_spec=explicit.spec_of(out_entries))
    return Island("all_gather_matmul", fused, k, i, (i, k), (jaxpr.eqns[i].invars[0], w)), ""


def _dot_scatter(dot, i, implied: Implied):
    problem = fusion.dot_problem(dot, dot.invars[0])
    if problem:
        return None, f"not fused: {problem}"
    if implied.dim >= dot.invars[0].aval.ndim - 1:
        return None, "not fused: the scatter dimension is the weight's column dimension"
    return Island("matmul_reduce_scatter", implied, i, i, (i,), tuple(dot.invars)), ""


def _local(eqn, invals):
    """``eqn`` bound on per-rank values: its sharding parameters dropped, its operands made to
    vary over the same axes (what tracing ``jnp`` code inside a shard_map does implicitly)."""
    if len(invals) > 1:
        invals = _axes.match_varying(invals, ())
    params = {k: (None if k in _SHARDING_PARAMS else v) for k, v in eqn.params.items()}
    out = eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))
    return out if eqn.primitive.multiple_results else [out]


def _gather(implied: Implied, eqn, vals, config):
    """A reshard's all-gather; a dot's operand gathered, then the local dot; or the local
    dot, then its result gathered."""
    if eqn.primitive.name == "reshard":
        return _collective(implied, vals[0], config)
    if implied.operand is not None:
        vals[implied.operand] = _collective(implied, vals[implied.operand], config)
        return _local(eqn, vals)[0]
    return _collective(implied, _local(eqn, vals)[0], config)


def _collective(implied: Implied, x, config):
    if implied.op == "psum":
        return flash_psum(x, implied.axes, config=config)
    if implied.op == "psum_scatter":
        return flash_psum_scatter(x, implied.axes, scatter_dimension=implied.dim, tiled=True,
                                  config=config)
    return flash_all_gather(x, implied.axes, axis=implied.dim, tiled=True, config=config)


def emit(island: Island, jaxpr, invals, config) -> tuple[jax.Array, list]:
    """The island's result, and the :class:`~jax_flashcomm.Plan` of its flashcomm call.

    Args:
      island: what to build.
      jaxpr: the jaxpr holding its equations.
      invals: the values of ``island.inputs``.
      config: the CommConfig of the flashcomm op.
    """
    implied, plans = island.implied, []

    def body(*vals):
        env = dict(zip(island.inputs, vals))
        with record() as seen:
            if island.kind == "all_gather_matmul":
                out = all_gather_matmul(vals[0], vals[1], implied.axes[0], axis=implied.dim,
                                        config=config)
            elif island.kind == "matmul_reduce_scatter":
                out = matmul_reduce_scatter(vals[0], vals[1], implied.axes[0], axis=implied.dim,
                                            config=config)
            elif island.kind == "collective" and implied.op == "all_gather":
                out = _gather(implied, jaxpr.eqns[island.at], list(vals), config)
            elif island.kind == "norm":
                dot = jaxpr.eqns[island.report]
                partial = _local(dot, list(vals[:2]))[0]
                out = psum_add_rms_norm(partial, vals[2], vals[3], implied.axes,
                                        eps=island.norm.eps, config=config)
            else:
                for k in island.eqns[:-1] if island.kind == "region" else island.eqns:
                    eqn = jaxpr.eqns[k]
                    args = [a.val if isinstance(a, core.Literal) else env[a]
                            for a in eqn.invars]
                    env.update(zip(eqn.outvars, _local(eqn, args)))
                last = jaxpr.eqns[island.eqns[-1]]
                partial = (env[last.invars[0]] if island.kind == "region"
                           else env[last.outvars[0]])
                out = _collective(implied, partial, config)
        plans.extend(seen)
        if island.kind == "norm":
            return tuple(_axes.invariant_over_unit_axes(o, s) for o, s in zip(out, out_spec))
        return _axes.invariant_over_unit_axes(out, out_spec)

    outs = ((island.norm.out, island.norm.new_residual) if island.kind == "norm"
            else (jaxpr.eqns[island.at].outvars[0],))
    in_specs = tuple(_with_unit_axes(s, core.typeof(v)) for s, v in zip(implied.in_specs, invals))
    out_spec = tuple(_with_unit_axes(s, v.aval) for s, v in zip(
        implied.out_spec if island.kind == "norm" else (implied.out_spec,), outs))
    out_spec = out_spec if island.kind == "norm" else out_spec[0]

    def run(*vals, check_vma=True):
        # an operand replicated along a dimension the island takes sharded: a local slice
        vals = [v if P(*core.typeof(v).sharding.spec) == s else jax.sharding.reshard(v, s)
                for v, s in zip(vals, in_specs)]
        return jax.shard_map(body, mesh=implied.mesh, in_specs=in_specs, out_specs=out_spec,
                             axis_names=set(implied.manual), check_vma=check_vma)(*vals)

    if island.kind == "collective" and implied.op == "all_gather":
        out = _replicated_gather(run, jaxpr.eqns[island.at])(*invals)
    else:
        out = run(*invals)
    return out, plans


def _with_unit_axes(spec, aval):
    """``spec``, or ``aval``'s own spec where the two differ only in axes of size 1 (the
    analysis leaves those out, as they shard nothing; shard_map matches specs by name)."""
    sharding = getattr(aval, "sharding", None)
    own = getattr(sharding, "spec", None)
    if own is None or getattr(own, "unreduced", None):
        return spec
    sizes = dict(sharding.mesh.shape)

    def real(s):
        return [tuple(a for a in explicit.entry(e) if sizes.get(a, 2) != 1) for e in s]

    ndim = max(len(own), len(spec))
    pad = lambda s: list(s) + [None] * (ndim - len(s))  # noqa: E731
    return P(*own) if real(pad(own)) == real(pad(spec)) else spec


def _replicated_gather(run, eqn):
    """The all-gather island with a replicated result (see the module docstring); its
    backward rule is the original equation's (a reshard's: a local slice; a dot's: its
    transpose)."""
    def original(*args):
        return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(dict(eqn.params)))

    @jax.custom_vjp
    def gather(*x):
        return run(*x, check_vma=False)

    def fwd(*x):
        return gather(*x), x

    def bwd(x, ct):
        return tuple(jax.vjp(original, *x)[1](ct))

    gather.defvjp(fwd, bwd)
    return gather
