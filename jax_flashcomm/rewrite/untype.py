"""A rewritten GSPMD program back in the Auto form it was written in.

The rewrite reads a GSPMD program typed with Explicit axes (:mod:`.gspmd`), but emitting it in
that form would change more than its collectives: under Explicit axes JAX pins every value's
sharding with a constraint, XLA keeps the reshards the typing needed (a scan carry brought back
to its initial layout, an operand sliced or gathered to type an equation), and the constraints
change what XLA fuses, so that its excess-precision rewrites (a bf16 residual stream kept in
f32 between two ops) differ: the exact policy would no longer give the unmodified program's
bits. :func:`untype` evaluates the rewritten, typed jaxpr again on the Auto mesh:

* a ``reshard`` made from one of the program's own ``with_sharding_constraint`` equations is
  that constraint again; every other ``reshard`` (the typing's own, and the entry into and exit
  from ``explicit_axes``) is dropped: a reshard never changes a value;
* the sharding parameters of the other equations (``out_sharding``, ``sharding``) are dropped,
  so XLA's partitioner chooses their layouts as it did;
* an island (``shard_map``) is bound again on the Auto mesh with its specs: its operands and
  results keep the layouts the rewrite chose for it;
* ``jit`` and ``checkpoint`` bodies are evaluated in place, ``scan`` / ``while`` / ``cond``
  bodies through ``lax.scan`` / ``lax.while_loop`` / ``lax.switch``; a ``custom_jvp`` is bound
  again with its bodies untyped, a ``custom_vjp`` made anew with its primal untyped and the
  typed program's derivative.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm.jax_compat import core
from jax_flashcomm.jax_compat import linear_util as lu
from jax_flashcomm.rewrite.gspmd import CONSTRAINT_SCOPE, Retyper

__all__ = ["untype"]

_SHARDING_PARAMS = ("out_sharding", "sharding")


def _is_constraint(eqn) -> bool:
    return CONSTRAINT_SCOPE in str(eqn.source_info.name_stack)


class _Untyper(Retyper):
    """The typing's evaluator (its loops and bodies), with the equations bound untyped."""

    def __init__(self, mesh):
        self.mesh = mesh                  # the concrete Auto mesh of the arguments

    def eqn(self, jaxpr, eqn, invals, users):
        name, params = eqn.primitive.name, eqn.params
        if name == "reshard":
            if _is_constraint(eqn):
                return lax.with_sharding_constraint(
                    invals[0], NamedSharding(self.mesh, params["dst_sharding"].spec))
            return invals[0]
        if name == "shard_map":
            return self.island(params, invals)
        if name == "custom_jvp_call":
            return self.custom_jvp(eqn, invals)
        if name == "custom_vjp_call":
            return self.custom_vjp(eqn, invals)
        if name in ("jit", "pjit", "remat2", "checkpoint", "scan", "while", "cond"):
            return super().eqn(jaxpr, eqn, invals, users)
        if any(core.jaxprs_in_params(params)):
            raise NotImplementedError(f"untype: {name}")   # the typing refused these already
        return self.bind(jaxpr, eqn, invals, users)

    def bind(self, jaxpr, eqn, invals, users):
        params = {k: (None if k in _SHARDING_PARAMS else v) for k, v in eqn.params.items()}
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))

    def closed(self, closed: core.ClosedJaxpr) -> core.ClosedJaxpr:
        """``closed`` traced again untyped."""
        avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in closed.jaxpr.invars]
        return jax.make_jaxpr(lambda *a: self.eval(closed.jaxpr, closed.consts, list(a)))(*avals)

    def custom_jvp(self, eqn, invals):
        """The primal and the JVP rule untyped; the rule is the program's own."""
        params = dict(eqn.params)
        params["call_jaxpr"] = self.closed(params["call_jaxpr"])
        jvp = params["jvp_jaxpr_fun"]

        def untyped_jvp(*zeros):
            jaxpr, consts, out_zeros = jvp.call_wrapped(*zeros)
            new = self.closed(core.ClosedJaxpr(jaxpr, consts))
            return new.jaxpr, new.consts, out_zeros

        params["jvp_jaxpr_fun"] = lu.wrap_init(untyped_jvp, debug_info=jvp.debug_info)
        return eqn.primitive.bind(*invals, **eqn.primitive.get_bind_params(params))

    def custom_vjp(self, eqn, invals):
        """A custom_vjp again, its primal untyped; its backward rule is the typed program's
        (the original rules, differentiated inside ``explicit_axes`` with the equation's types:
        they were traced for typed values)."""
        primal = self.closed(eqn.params["call_jaxpr"])
        in_specs = tuple(_spec_of(v.aval) for v in eqn.invars)
        out_specs = tuple(_spec_of(v.aval) for v in eqn.outvars)
        mesh = self.mesh

        def original(*args):
            return tuple(eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(
                dict(eqn.params))))

        @jax.custom_vjp
        def call(*args):
            return tuple(core.eval_jaxpr(primal.jaxpr, primal.consts, *args))

        def fwd(*args):
            return call(*args), args

        def bwd(args, cts):
            def typed(args, cts):
                return jax.vjp(original, *args)[1](tuple(cts))

            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return jax.sharding.explicit_axes(typed, axes=tuple(mesh.axis_names),
                                                  in_sharding=(in_specs, out_specs))(args, cts)

        call.defvjp(fwd, bwd)
        return list(call(*invals))

    def island(self, params, invals):
        body = params["jaxpr"]
        closed = body if isinstance(body, core.ClosedJaxpr) else core.ClosedJaxpr(body, ())
        manual = set(params.get("newly_manual_axes") or params["mesh"].axis_names)

        def run(*args):
            return tuple(core.eval_jaxpr(closed.jaxpr, closed.consts, *args))

        outs = jax.shard_map(run, mesh=self.mesh, in_specs=tuple(params["in_specs"]),
                             out_specs=tuple(params["out_specs"]),
                             axis_names=manual,
                             check_vma=params["check_vma"])(*invals)
        return list(outs)


def _spec_of(aval):
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    return P() if spec is None else P(*spec)


def untype(closed: core.ClosedJaxpr, mesh):
    """``closed`` (a rewritten program typed with Explicit axes) as a function evaluated on
    the Auto mesh ``mesh``, with the layouts left to XLA's partitioner but for the program's
    own constraints and the islands'."""
    def fn(*args):
        return _Untyper(mesh).eval(closed.jaxpr, closed.consts, list(args))
    return fn
