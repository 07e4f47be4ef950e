"""GSPMD programs (Auto axes) in the Explicit-sharding form the rewrite reads.

A model sharded by annotations alone gives a jaxpr without shardings in its types: the
placements of its arguments and its ``with_sharding_constraint`` equations are all there is,
and XLA's partitioner decides the rest. :func:`retype` evaluates that jaxpr again with the Auto
axes made Explicit, so that JAX's sharding rules type every value the way a model author writing
with Explicit axes would have:

* ``sharding_constraint`` becomes ``reshard`` to the same spec;
* a ``dot_general`` whose contracting dimensions are sharded (JAX asks for an ``out_sharding``
  there) gets the spec of the ``sharding_constraint`` that consumes it, if one does (a
  reduction to that layout: all-reduce, or reduce-scatter), else the operands' layout without
  the reduced axes (an all-reduce);
* another equation JAX cannot type (an ambiguous reshape, say) takes the spec of the
  constraint that consumes it; an elementwise one whose operands disagree gets them resharded
  to the most sharded one's spec (a local slice of the replicated ones: a broadcast mask, say);
  else its operands are replicated first (an all-gather: correct, and in the report);
* ``jit`` and ``checkpoint`` bodies are evaluated in place, ``scan`` / ``while`` / ``cond``
  bodies through ``lax.scan`` / ``lax.while_loop`` / ``lax.switch`` (a carry whose type changes
  in the body is resharded back to its initial type, a branch's results to the first
  branch's), custom derivatives through their primal body.

The result is a function of the same arguments whose jaxpr the Explicit patterns
(:mod:`jax_flashcomm.rewrite.explicit`) read; :func:`in_specs` and :func:`explicit_mesh_axes`
give what ``jax.sharding.explicit_axes`` needs to run it inside the caller's Auto program.
"""

from __future__ import annotations

import jax
import numpy as np
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm import _axes
from jax_flashcomm.jax_compat import core, source_info_util

__all__ = ["retype", "in_specs", "auto_axes_of", "lookup", "Retyper", "Unsupported",
           "CONSTRAINT_SCOPE"]


#: The name scope the typing gives the ``reshard`` of a ``with_sharding_constraint``
#: (:mod:`.untype` makes it a constraint again).
CONSTRAINT_SCOPE = "flashcomm_constraint"


class Unsupported(Exception):
    """A primitive the retyping does not handle (the program is then left to XLA)."""


def auto_axes_of(mesh) -> tuple:
    """The Auto axes of ``mesh``, size 1 included (argument specs and constraints name them)."""
    return tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Auto)


def in_specs(leaves, mesh) -> tuple:
    """The PartitionSpec of each argument leaf on ``mesh`` (replicated if it has none)."""
    specs = []
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None)
        if isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == mesh.axis_names:
            specs.append(sharding.spec)
        else:
            specs.append(P())
    return tuple(specs)


def _unmeshed(value):
    """A constant of the Auto trace (typed on its mesh when traced under ``jax.set_mesh``) as
    a host value, which the Explicit trace takes as replicated."""
    if (isinstance(value, (jax.Array, np.ndarray)) and not isinstance(value, core.Tracer)
            and not jnp.issubdtype(value.dtype, jax.dtypes.extended)):   # a PRNG key stays
        mesh = getattr(getattr(core.typeof(value), "sharding", None), "mesh", None)
        if mesh is not None and getattr(mesh, "axis_names", ()):
            return np.asarray(value)          # literals too (an ndarray that carries a type)
    return value


def _spec(sharding):
    return sharding.spec if isinstance(sharding, NamedSharding) else sharding


def _constraint_of(jaxpr, var, users):
    """The spec of the ``sharding_constraint`` that is ``var``'s only use, or None."""
    found = [u for u in dict.fromkeys(users.get(var, []))]
    if len(found) != 1 or found[0] is None:
        return None
    eqn = jaxpr.eqns[found[0]]
    if eqn.primitive.name != "sharding_constraint" or eqn.params.get("unconstrained_dims"):
        return None
    return _spec(eqn.params["sharding"])


def _replicated(x):
    spec = getattr(core.typeof(x), "sharding", None)
    if spec is None or all(p is None for p in spec.spec):
        return x
    return jax.sharding.reshard(x, P())


class Retyper:
    """Evaluates a jaxpr equation by equation under Explicit axes (see the module docstring)."""

    def eval(self, jaxpr, consts, args):
        env = {}

        def read(v):
            return _unmeshed(v.val) if isinstance(v, core.Literal) else env[v]

        env.update(zip(jaxpr.constvars, map(_unmeshed, consts)))
        env.update(zip(jaxpr.invars, args))
        users: dict = {}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, core.Var):
                    users.setdefault(v, []).append(i)
        for v in jaxpr.outvars:
            if isinstance(v, core.Var):
                users.setdefault(v, []).append(None)
        mesh = jax.sharding.get_abstract_mesh()
        for eqn in jaxpr.eqns:
            invals = [read(v) for v in eqn.invars]
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            # the equation's context holds the (empty) mesh of its Auto trace: ours goes inside
            # an equation of a library's jit body (jnp.take's) keeps its caller's source line
            tb = eqn.source_info.traceback
            if tb is None or source_info_util.user_frame(tb) is None:
                tb = source_info_util.current().traceback
            with (source_info_util.user_context(tb, name_stack=name_stack), eqn.ctx.manager,
                  jax.sharding.use_abstract_mesh(mesh)):
                outs = self.eqn(jaxpr, eqn, invals, users)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def eqn(self, jaxpr, eqn, invals, users):
        name, params = eqn.primitive.name, dict(eqn.params)
        if name == "sharding_constraint":
            if params.get("unconstrained_dims"):
                return invals[0]
            with jax.named_scope(CONSTRAINT_SCOPE):       # a constraint again once untyped
                return jax.sharding.reshard(invals[0], _spec(params["sharding"]))
        if name in ("jit", "pjit"):
            closed = params["jaxpr"]
            return self.eval(closed.jaxpr, closed.consts, invals)
        if name in ("remat2", "checkpoint"):
            return self.eval(params["jaxpr"], (), invals)
        if name in ("custom_jvp_call", "custom_vjp_call"):
            closed = params["call_jaxpr"]
            return self.eval(closed.jaxpr, closed.consts, invals)
        if name == "scan":
            return self.scan(params, invals)
        if name == "while":
            return self.while_loop(params, invals)
        if name == "cond":
            return self.cond(params, invals)
        if name == "gather":
            found = lookup(eqn, invals)
            if found is not None:
                return found
        if any(core.jaxprs_in_params(params)):
            raise Unsupported(f"{name} (a primitive with a body other than jit, scan, while, "
                              f"cond, checkpoint or a custom derivative)")
        return self.bind(jaxpr, eqn, invals, users)

    def bind(self, jaxpr, eqn, invals, users):
        # shardings recorded on the Auto trace's mesh name the same specs on ours
        mesh = jax.sharding.get_abstract_mesh()
        params = {k: NamedSharding(mesh, v.spec) if isinstance(v, NamedSharding) else v
                  for k, v in eqn.params.items()}
        prim = eqn.primitive

        def attempt(values, changed):
            try:
                return True, prim.bind(*values, **prim.get_bind_params({**params, **changed}))
            except Exception:  # noqa: BLE001 - JAX's sharding rules raise several kinds
                return False, None

        try:
            return prim.bind(*invals, **prim.get_bind_params(params))
        except Exception as first:  # noqa: BLE001
            key = next((k for k in ("out_sharding", "sharding") if k in params), None)
            target = (_constraint_of(jaxpr, eqn.outvars[0], users)
                      if key is not None and len(eqn.outvars) == 1 else None)
            if key is not None and target is None and prim.name == "dot_general":
                target = _reduced_output(eqn, invals)
            # in order; each built only when the one before failed (a reshard is an equation)
            tries = [lambda: (invals, {key: NamedSharding(mesh, target)}) if target is not None
                     else None,
                     lambda: (lambda m: (m, {}) if m is not None else None)(_matched(invals)),
                     lambda: ([_replicated(x) for x in invals], {})]
            for build in tries:
                built = build()
                if built is not None:
                    ok, out = attempt(*built)
                    if ok:
                        return out
            raise Unsupported(f"{prim.name}: {first}") from first

    def scan(self, params, invals):
        nc, nk = params["num_consts"], params["num_carry"]
        consts, init, xs = invals[:nc], invals[nc:nc + nk], invals[nc + nk:]
        body = params["jaxpr"]
        init_specs = [core.typeof(c).sharding.spec for c in init]

        def step(carry, x):
            outs = self.eval(body.jaxpr, body.consts, [*consts, *carry, *x])
            new = [o if core.typeof(o).sharding.spec == s else jax.sharding.reshard(o, s)
                   for o, s in zip(outs[:nk], init_specs)]
            return new, outs[nk:]

        carry, ys = lax.scan(step, list(init), list(xs), length=params["length"],
                             reverse=params["reverse"], unroll=params["unroll"])
        return [*carry, *ys]

    def while_loop(self, params, invals):
        nc, nb = params["cond_nconsts"], params["body_nconsts"]
        cond_consts, body_consts, init = invals[:nc], invals[nc:nc + nb], invals[nc + nb:]
        cond, body = params["cond_jaxpr"], params["body_jaxpr"]

        def cond_fn(carry):
            return self.eval(cond.jaxpr, cond.consts, [*cond_consts, *carry])[0]

        def body_fn(carry):
            return _keep_types(self.eval(body.jaxpr, body.consts, [*body_consts, *carry]), init)

        return lax.while_loop(cond_fn, body_fn, list(init))

    def cond(self, params, invals):
        index, operands = invals[0], invals[1:]
        branches = params["branches"]
        outs = [None]

        def branch(closed):
            def fn(*ops):
                got = self.eval(closed.jaxpr, closed.consts, list(ops))
                outs[0] = outs[0] or got
                return _keep_types(got, outs[0])
            return fn

        return lax.switch(index, [branch(b) for b in branches], *operands)


def lookup(eqn, invals):
    """A lookup into a table sharded along the dimension it indexes (``take``, ``.at[].get``,
    ``take_along_axis``; embedding tables split over the vocabulary) as XLA partitions it:
    each rank gathers the entries it holds (zeros elsewhere) and the looked-up entries are
    summed, a ``psum`` inside a ``shard_map`` that the rewrite then replaces like any other.
    None when the gather is not such a lookup.

    Replicating the table instead (what typing the gather with Explicit axes gives) would move
    the whole table: vocab x hidden per step instead of the rows looked up.
    """
    table, indices = invals
    dn, params = eqn.params["dimension_numbers"], eqn.params
    if not jnp.issubdtype(table.dtype, jnp.inexact) or indices.ndim == 0:
        return None
    sizes = dict(jax.sharding.get_abstract_mesh().shape)
    table_spec, index_spec = _specs(table), _specs(indices)
    real = lambda e: tuple(a for a in e if sizes[a] > 1)  # noqa: E731
    sharded = [d for d in range(table.ndim) if real(table_spec[d])
               and d not in dn.operand_batching_dims]
    if len(sharded) != 1 or sharded[0] not in dn.collapsed_slice_dims:
        return None
    k = sharded[0]
    rows = real(table_spec[k])
    index_axes = {a for e in index_spec for a in real(e)}
    batch_ok = all(real(table_spec[d]) == real(index_spec[b]) for d, b in zip(
        dn.operand_batching_dims, dn.start_indices_batching_dims))
    if (k not in dn.start_index_map or index_axes & set(rows) or real(index_spec[-1])
            or not batch_ok):
        return None
    n = int(np.prod([sizes[a] for a in rows]))
    if table.shape[k] % n:
        return None
    per_rank, size, component = table.shape[k] // n, table.shape[k], dn.start_index_map.index(k)
    clip = params["mode"] != lax.GatherScatterMode.FILL_OR_DROP
    fill = params.get("fill_value")
    out_ndim = indices.ndim - 1 + len(dn.offset_dims)
    batch = iter(index_spec[:-1])
    out_spec = P(*(None if d in dn.offset_dims else _one(next(batch)) for d in range(out_ndim)))
    expand = tuple(dn.offset_dims)

    def local(table, idx):
        at = idx[..., component]
        at = jnp.clip(at, 0, size - 1) if clip else at
        here = at - lax.axis_index(rows) * per_rank
        mine = jnp.expand_dims((here >= 0) & (here < per_rank), expand)
        idx = idx.at[..., component].set(jnp.clip(here, 0, per_rank - 1).astype(idx.dtype))
        table, idx = _axes.match_varying([table, idx], ())
        got = eqn.primitive.bind(table, idx, **eqn.primitive.get_bind_params(
            {**params, "slice_sizes": tuple(params["slice_sizes"])}))
        total = lax.psum(jnp.where(mine, got, jnp.zeros((), table.dtype)), rows)
        if clip:
            return total
        valid = jnp.expand_dims((at >= 0) & (at < size), expand)
        return jnp.where(valid, total, jnp.asarray(jnp.nan if fill is None else fill,
                                                   table.dtype))

    where = source_info_util.current().traceback

    def body(table, idx):        # traced anew: its equations keep the gather's source line
        with source_info_util.user_context(where):
            return _axes.invariant_over_unit_axes(local(table, idx), out_spec)

    return jax.shard_map(body, mesh=jax.sharding.get_abstract_mesh(),
                         in_specs=(P(*map(_one, table_spec)), P(*map(_one, index_spec))),
                         out_specs=out_spec)(table, indices)    # manual over every axis



def _specs(x) -> list[tuple]:
    """Per dimension of ``x``, the axes of its (Explicit) type's spec."""
    spec = tuple(core.typeof(x).sharding.spec)
    spec = spec + (None,) * (x.ndim - len(spec))
    return [() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in spec]


def _one(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def _keep_types(outs, like):
    """``outs`` resharded where their type differs from ``like``'s (loop carries, branches)."""
    return [o if core.typeof(o).sharding.spec == core.typeof(x).sharding.spec
            else jax.sharding.reshard(o, core.typeof(x).sharding.spec) for o, x in zip(outs, like)]


def _matched(invals):
    """Operands of one shape resharded to the most sharded one's spec (a replicated operand of
    an elementwise op, a broadcast mask say, is sliced: no communication), or None."""
    arrays = [x for x in invals if hasattr(x, "shape")]
    if len(arrays) < 2 or len({tuple(x.shape) for x in arrays}) != 1:
        return None
    specs = [core.typeof(x).sharding.spec for x in arrays]
    target = max(specs, key=lambda spec: sum(e is not None for e in spec))
    if any(e is not None and e not in target for spec in specs for e in spec):
        return None            # axes the target does not have: not a slice
    return [jax.sharding.reshard(x, target) if hasattr(x, "shape")
            and core.typeof(x).sharding.spec != target else x for x in invals]


def _reduced_output(eqn, invals):
    """A dot's output spec with its operands' layout and the contracted axes reduced."""
    lhs, rhs = (core.typeof(x).sharding.spec for x in invals)
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    pad = lambda spec, n: tuple(spec) + (None,) * (n - len(spec))  # noqa: E731
    lhs, rhs = pad(lhs, len(invals[0].shape)), pad(rhs, len(invals[1].shape))
    reduced = set()
    for i in lc:
        entry = lhs[i]
        reduced |= set(entry if isinstance(entry, tuple) else (entry,)) - {None}
    free_l = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    free_r = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    natural = [lhs[i] for i in lb] + [lhs[d] for d in free_l] + [rhs[d] for d in free_r]

    def drop(entry):
        if entry is None:
            return None
        kept = tuple(a for a in (entry if isinstance(entry, tuple) else (entry,))
                     if a not in reduced)
        return None if not kept else kept[0] if len(kept) == 1 else kept

    return P(*(drop(e) for e in natural))


def retype(closed: core.ClosedJaxpr):
    """``closed``'s function with its values typed by Explicit sharding rules (call it under
    ``jax.sharding.explicit_axes``).

    Raises:
      Unsupported: (when called) a primitive it cannot type.
    """
    def fn(*args):
        return Retyper().eval(closed.jaxpr, closed.consts, list(args))
    return fn
