"""How :class:`jax_flashcomm.rewrite.interpreter.Interpreter` enters higher-order primitives.

Each handler rewrites the bodies of one primitive (``shard_map``, ``jit``, ``scan``, ``while``,
``cond``, ``remat``, ``custom_jvp_call``, ``custom_vjp_call``) through the interpreter and binds
the primitive again with the same parameters; :data:`HANDLERS` maps primitive names to them.
The custom derivatives of jax_flashcomm's own ops are bound unchanged.
"""

from __future__ import annotations

import os

from jax_flashcomm.jax_compat import ad_util, core, flat_tree_flatten
from jax_flashcomm.jax_compat import linear_util as lu
from jax_flashcomm.jax_compat import partial_eval as pe

__all__ = ["HANDLERS", "bind"]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def bind(primitive, invals, params):
    return primitive.bind(*invals, **primitive.get_bind_params(params))


def _is_flashcomm_internal(closed) -> bool:
    """Whether a custom_jvp/custom_vjp body is one of jax_flashcomm's own ops."""
    src = getattr(closed.jaxpr.debug_info, "func_src_info", None) or ""
    return _PACKAGE_DIR in src


def _shard_map(self, eqn, invals, ctx):
    params = dict(eqn.params)
    body = params.pop("jaxpr")
    out_specs = params.pop("out_specs")
    inner = ctx.child("shard_map", eqn)

    def fun(*args):
        outs = self.eval_jaxpr(body, (), args, inner)
        return flat_tree_flatten(outs).with_aux(out_specs)

    params["subfuns"] = (fun,)
    params["debug_info"] = body.debug_info
    return eqn.primitive.bind(*invals, **params)


def _jit(self, eqn, invals, ctx):
    params = dict(eqn.params)
    params["jaxpr"] = self.retrace(params["jaxpr"], ctx.child(f"jit({params['name']})", eqn))
    return bind(eqn.primitive, invals, params)


def _hoisted(closed: core.ClosedJaxpr) -> tuple[core.ClosedJaxpr, list]:
    """``closed`` with its consts turned into leading arguments, and the consts."""
    if not closed.consts:
        return closed, []
    return pe.close_jaxpr(pe.convert_constvars_jaxpr(closed.jaxpr)), list(closed.consts)


def _scan(self, eqn, invals, ctx):
    params = dict(eqn.params)
    body, consts = _hoisted(self.retrace(params["jaxpr"], ctx.child("scan", eqn)))
    params["jaxpr"] = body
    params["num_consts"] += len(consts)
    return bind(eqn.primitive, [*consts, *invals], params)


def _while(self, eqn, invals, ctx):
    params = dict(eqn.params)
    inner = ctx.child("while", eqn)
    cond, cond_consts = _hoisted(self.retrace(params["cond_jaxpr"], inner))
    body, body_consts = _hoisted(self.retrace(params["body_jaxpr"], inner))
    nc, nb = params["cond_nconsts"], params["body_nconsts"]
    args = [*cond_consts, *invals[:nc], *body_consts, *invals[nc:]]
    params.update(cond_jaxpr=cond, body_jaxpr=body, cond_nconsts=nc + len(cond_consts),
                  body_nconsts=nb + len(body_consts))
    return bind(eqn.primitive, args, params)


def _cond(self, eqn, invals, ctx):
    params = dict(eqn.params)
    params["branches"] = tuple(self.retrace(b, ctx.child(f"cond[{k}]", eqn))
                               for k, b in enumerate(params["branches"]))
    return bind(eqn.primitive, invals, params)


def _remat(self, eqn, invals, ctx):
    params = dict(eqn.params)
    closed = self.retrace(pe.close_jaxpr(params["jaxpr"]), ctx.child("remat", eqn))
    params["jaxpr"] = pe.convert_constvars_jaxpr(closed.jaxpr)
    return bind(eqn.primitive, [*closed.consts, *invals], params)


def _custom_jvp(self, eqn, invals, ctx):
    """The primal body and the JVP rule's primal computation are rewritten; collectives on the
    rule's tangents are kept: flashcomm's collectives are custom_vjp functions, which JAX
    cannot transpose inside a JVP rule (reverse-mode differentiation would fail)."""
    params = dict(eqn.params)
    if _is_flashcomm_internal(params["call_jaxpr"]):
        return bind(eqn.primitive, invals, params)
    inner = ctx.child("custom_jvp", eqn)
    params["call_jaxpr"] = self.retrace(params["call_jaxpr"], inner)
    jvp_fun = params["jvp_jaxpr_fun"]
    lazy = type(self)(self.policy)  # JVP rules are traced under autodiff, after this report

    def rewritten_jvp(*zeros):
        jaxpr, consts, out_zeros = jvp_fun.call_wrapped(*zeros)
        n_tangents = sum(not z for z in zeros)
        tangent_invars = [False] * (len(jaxpr.invars) - n_tangents) + [True] * n_tangents
        new = lazy.retrace(core.ClosedJaxpr(jaxpr, consts), inner.child("jvp"), tangent_invars)
        return new.jaxpr, new.consts, out_zeros

    params["jvp_jaxpr_fun"] = lu.wrap_init(rewritten_jvp, debug_info=jvp_fun.debug_info)
    return bind(eqn.primitive, invals, params)


def _custom_vjp(self, eqn, invals, ctx):
    params = dict(eqn.params)
    if _is_flashcomm_internal(params["call_jaxpr"]):
        return bind(eqn.primitive, invals, params)
    inner = ctx.child("custom_vjp", eqn)
    params["call_jaxpr"] = self.retrace(params["call_jaxpr"], inner)
    fwd_thunk, bwd = params["fwd_jaxpr_thunk"], params["bwd"]
    lazy = type(self)(self.policy)  # the rules are traced under autodiff, after this report

    def rewritten_fwd(*nonzeros):
        jaxpr, consts = fwd_thunk.call_wrapped(*nonzeros)
        new = lazy.retrace(core.ClosedJaxpr(jaxpr, consts), inner.child("fwd"))
        return new.jaxpr, new.consts

    def rewritten_bwd(*args):
        if any(isinstance(a, (ad_util.Zero, ad_util.SymbolicZero)) for a in args):
            return bwd.call_wrapped(*args)  # symbolic-zero cotangents: the rule as written
        zero_avals: list = []

        def dense_bwd(*a):
            outs = list(bwd.call_wrapped(*a))
            zero_avals[:] = [o.aval if isinstance(o, ad_util.Zero) else None for o in outs]
            return [o for o in outs if not isinstance(o, ad_util.Zero)]

        avals = [core.typeof(a) for a in args]
        traced_jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(
            lu.wrap_init(dense_bwd, debug_info=bwd.debug_info), avals)
        dense = iter(lazy.eval_jaxpr(traced_jaxpr, consts, args, inner.child("bwd")))
        return [ad_util.Zero(z) if z is not None else next(dense) for z in zero_avals]

    params["fwd_jaxpr_thunk"] = lu.wrap_init(rewritten_fwd, debug_info=fwd_thunk.debug_info)
    params["bwd"] = lu.wrap_init(rewritten_bwd, debug_info=bwd.debug_info)
    return bind(eqn.primitive, invals, params)


HANDLERS = {"shard_map": _shard_map, "jit": _jit, "pjit": _jit, "scan": _scan,
             "while": _while, "cond": _cond, "remat2": _remat, "checkpoint": _remat,
             "custom_jvp_call": _custom_jvp, "custom_vjp_call": _custom_vjp}
