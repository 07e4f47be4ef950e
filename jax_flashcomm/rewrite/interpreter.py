# long file: the jaxpr walk of the rewrite: one interpreter whose cases share its state
"""The jaxpr interpreter behind :func:`jax_flashcomm.rewrite.rewrite`.

It re-evaluates a traced function's jaxpr equation by equation under the caller's trace,
binding every primitive as it was except:

* the lax collectives ``psum`` (``psum_invariant_p`` / ``psum_p``), ``psum_scatter``
  (``reduce_scatter_p``), ``all_gather`` (``all_gather_p``), ``all_to_all`` (``all_to_all_p``)
  and ``ragged_all_to_all`` (``ragged_all_to_all_p``) the policy selects, which become calls of
  :func:`jax_flashcomm.psum` / :func:`~jax_flashcomm.psum_scatter` /
  :func:`~jax_flashcomm.all_gather` / :func:`~jax_flashcomm.all_to_all` /
  :func:`~jax_flashcomm.ragged_all_to_all` with the policy's config (the ``pvary`` lax put in
  front of the collective goes with it: the flashcomm op makes its operand varying itself, with
  the transpose its ``grad`` mode asks for), or with their matmul, ring collective matmuls; an
  all-to-all of integers (an MoE layer's token counts) under a quantizing config becomes the
  flashcomm op at ``bits=None``: the lax collective itself, or the exchange where XLA has none
  (``ragged_all_to_all`` on CPU);
* the ``dot_general`` and ``reshard`` equations whose Explicit-sharding types imply a collective
  (:mod:`jax_flashcomm.rewrite.explicit`), which become ``shard_map`` islands with the flashcomm
  op (:mod:`jax_flashcomm.rewrite.islands`);
* the higher-order primitives, whose bodies are rewritten the same way and re-bound with the
  same parameters: ``shard_map``, ``jit``, ``scan``, ``while``, ``cond``, ``remat``,
  ``custom_jvp_call`` (body, and the JVP rule's primal part) and ``custom_vjp_call`` (body,
  forward and backward rules; the custom derivatives of jax_flashcomm's own ops are bound
  unchanged).

Other primitives with bodies (``pmap``, ``custom_transpose``, ...) are bound unchanged; the
collectives inside them are reported as kept.
"""

# Over 400 lines: the one evaluator of every rewrite path (shard_map collectives, fusions,
# islands) and their report rows, which share its planning state.

from __future__ import annotations

import collections
import dataclasses
import os

import jax
import numpy as np
from jax_flashcomm import _axes
from jax_flashcomm.allreduce import psum as flash_psum
from jax_flashcomm.alltoall import all_to_all as flash_all_to_all
from jax_flashcomm.alltoall import ragged_all_to_all as flash_ragged_all_to_all
from jax_flashcomm.collective_matmul import all_gather_matmul, matmul_reduce_scatter
from jax_flashcomm.jax_compat import core, source_info_util
from jax_flashcomm.jax_compat import linear_util as lu
from jax_flashcomm.jax_compat import partial_eval as pe
from jax_flashcomm.planner import quantizes, record
from jax_flashcomm.fused_norm import psum_add_rms_norm
from jax_flashcomm.rewrite import explicit, fusion, islands, norm_fusion
from jax_flashcomm.rewrite.higher_order import HANDLERS, bind
from jax_flashcomm.rewrite.policy import QUANTIZABLE_DTYPES, RewritePolicy
from jax_flashcomm.rewrite.report import ReportRow, sent_bytes, short_path
from jax_flashcomm.scatter_gather import all_gather as flash_all_gather
from jax_flashcomm.scatter_gather import psum_scatter as flash_psum_scatter

__all__ = ["Interpreter"]

#: jaxpr primitives rewrite can replace, and their lax names.
REWRITABLE = {"psum_invariant": "psum", "psum": "psum", "reduce_scatter": "psum_scatter",
              "all_gather": "all_gather", "all_to_all": "all_to_all",
              "ragged_all_to_all": "ragged_all_to_all"}
#: The all-to-alls: one row-wise quantization, and an integer operand moved exactly.
EXCHANGES = ("all_to_all", "ragged_all_to_all")
#: Operands of a ragged_all_to_all equation: operand, output, then four offset/size arrays.
RAGGED_INVARS = 6
#: Other collectives: reported as kept.
OTHER_COLLECTIVES = {
    "all_gather_invariant": "no flashcomm equivalent: its result is invariant (replicated)",
    "ppermute": "not a rewrite target",
    "pmax": "not a rewrite target", "pmin": "not a rewrite target",
    "pbroadcast": "not a rewrite target",
}
#: Why collectives on the tangents of a custom_jvp rule are kept.
TANGENT_REASON = ("on the tangents of a custom_jvp rule: flashcomm's ops are custom_vjp "
                  "functions, which JAX cannot transpose there")



@dataclasses.dataclass(frozen=True)
class _Context:
    path: str = ""     # nesting of higher-order primitives
    scope: str = ""    # name stack of the enclosing equations
    frozen: str = ""   # if set, why every collective in here is kept

    def child(self, name: str, eqn=None) -> "_Context":
        scope = self.scope
        if eqn is not None and str(eqn.source_info.name_stack):
            scope = "/".join(s for s in (scope, str(eqn.source_info.name_stack)) if s)
        return _Context("/".join(p for p in (self.path, name) if p), scope, self.frozen)

    def freeze(self, reason: str) -> "_Context":
        return dataclasses.replace(self, frozen=self.frozen or reason)


@dataclasses.dataclass
class _Plan:
    """What to do with one jaxpr's equations (computed before evaluating it)."""

    skip: set = dataclasses.field(default_factory=set)        # eqns not bound (absorbed)
    operand: dict = dataclasses.field(default_factory=dict)   # collective -> operand atom
    kept: dict = dataclasses.field(default_factory=dict)      # collective -> reason
    fused: dict = dataclasses.field(default_factory=dict)     # emitting eqn -> MatmulFusion
    notes: dict = dataclasses.field(default_factory=dict)     # collective -> fusion note
    tangent: set = dataclasses.field(default_factory=set)     # eqns on a JVP rule's tangents
    islands: dict = dataclasses.field(default_factory=dict)   # eqn -> islands.Island
    implied_kept: dict = dataclasses.field(default_factory=dict)  # eqn -> explicit.Kept
    exact_islands: dict = dataclasses.field(default_factory=dict)  # eqn -> islands.Island
    norm: dict = dataclasses.field(default_factory=dict)      # last norm eqn -> NormFusion
    moved_exactly: dict = dataclasses.field(default_factory=dict)  # all-to-all -> why exact
    jaxpr: object = None


_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _is_op_code(path: str) -> bool:
    """Whether ``path`` is in jax_flashcomm but not in its nn layers."""
    return path.startswith(_PACKAGE) and not path.startswith(os.path.join(_PACKAGE, "nn"))


def _call_site(eqn) -> tuple[str, tuple[str, ...]]:
    """``("file:line (function)"`` of the innermost user frame, every user frame as
    ``"/abs/file:line (function)")`` of an equation."""
    tb = eqn.source_info.traceback
    if tb is None:
        return "?", ()
    user = list(source_info_util.user_frames(tb))
    frames = tuple(f"{f.file_name}:{f.start_line} ({f.function_name})" for f in user)
    # the innermost frame outside jax_flashcomm's op code (its nn layers are a model's own)
    first = next((f for f in user if not _is_op_code(f.file_name)), user[0] if user else None)
    site = (f"{short_path(first.file_name)}:{first.start_line} ({first.function_name})"
            if first is not None else "?")
    return site, frames


def _axes_of(eqn) -> tuple:
    p = eqn.params
    axes = p.get("axes", p.get("axis_name", ()))
    return tuple(axes) if isinstance(axes, (tuple, list)) else (axes,)


def _axis_size(eqn, axes) -> int:
    if "axis_size" in eqn.params:
        return int(eqn.params["axis_size"])
    try:
        return _axes.axis_size(axes)
    except (NameError, TypeError, ValueError):
        return 0


def _implied_axis_size(aval, axes) -> int:
    mesh = getattr(getattr(aval, "sharding", None), "mesh", None)
    try:
        return int(np.prod([mesh.shape[a] for a in axes], dtype=np.int64))
    except (AttributeError, KeyError, TypeError):
        return 0


def _outcome(decisions, note: str | None) -> tuple[str, str, str]:
    """``(action, detail, reason)`` of a report row from the recorded plans of a flashcomm
    collective."""
    decision = decisions[0] if decisions else None
    if decision is not None and decision.op in EXCHANGES and decision.path == "exact":
        action, detail, reason = "exact", f"over {decision.transport}", decision.reason
    elif decision is not None and decision.quantized:
        bits = "/".join(f"int{b}" if fmt == "int" else fmt
                        for b, fmt in ((decision.rs_bits, decision.rs_format),
                                       (decision.ag_bits, decision.ag_format))
                        if b)
        action, detail, reason = "quantized", bits, decision.reason
    else:
        action, detail = "exact", "lax"
        reason = decision.reason if decision is not None else "bits=None (exact setting)"
    if note:
        reason = f"{reason}; {note}"
    return action, detail, reason


def _per_byte(plan, itemsize: int) -> tuple[float, float]:
    """Payload bytes per operand byte of a plan's reduce-scatter and all-gather phases."""
    return tuple(1.0 if f is None else f.wire_bytes_per_element() / itemsize
                 for f in plan.group_formats)


def _same_type(a, b) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and getattr(a, "vma", frozenset()) == getattr(b, "vma", frozenset())
            and explicit.entries(a) == explicit.entries(b))


def _on_mesh(x):
    """``x`` typed on the current mesh, the same values.

    ``jax.lax.empty`` (MaxText's ragged output buffer) types its result on no mesh; inside a
    ``shard_map(check_vma=False)`` the exchange cannot then type its result as varying over the
    axes (an AssertionError in JAX's ``get_mat``). A select of ``x`` itself is typed on the
    current mesh and compiles to ``x``.
    """
    mesh = getattr(getattr(core.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or not mesh.empty or jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.numpy.where(True, x, jax.numpy.zeros(x.shape, x.dtype))


def _typed_varying(aval) -> frozenset:
    """The axes a jaxpr variable's type says it varies over."""
    return frozenset(getattr(getattr(aval, "manual_axis_type", None), "varying", ()))


def _widened(eqn, invals):
    """The equation bound on operands that vary over more axes than its types say, or None
    when none does.

    JAX types ``lax.ragged_all_to_all``'s result with its ``output`` operand's varying axes (an
    invariant buffer gives an invariant result); flashcomm's op returns a value varying over the
    axes, as the rows it received are. The equations after it then meet a more varying operand
    than they were typed with: a ``pvary`` drops the axes its operand varies over already (and
    is skipped when none is left), another primitive gets its other operands made varying too
    (``pvary``, no communication), as tracing it on those operands would have done.
    """
    have = [_axes.varying_axes(v) for v in invals]
    typed = [_typed_varying(v.aval) for v in eqn.invars]
    if all(h <= t for h, t in zip(have, typed)):
        return None
    if eqn.primitive.name == "pvary":
        (x,) = invals
        axes = tuple(a for a in eqn.params["axes"] if a not in have[0])
        return bind(eqn.primitive, [x], {**eqn.params, "axes": axes}) if axes else x
    union = frozenset().union(*have)
    mesh = jax.sharding.get_abstract_mesh()
    order = [a for a in getattr(mesh, "axis_names", ()) if a in union]
    order += sorted(union - set(order))
    invals = [v if union <= h else core.pvary(v, tuple(a for a in order if a not in h))
              for v, h in zip(invals, have)]
    return bind(eqn.primitive, invals, eqn.params)


class Interpreter:
    """Evaluates jaxprs with the policy's collectives replaced; appends report rows to
    ``rows`` (a list, or None for no report)."""

    def __init__(self, policy: RewritePolicy, rows: list | None = None):
        self.policy, self.rows = policy, rows

    # --- entry points -----------------------------------------------------------------------

    def run(self, closed: core.ClosedJaxpr, args) -> list:
        return self.eval_jaxpr(closed.jaxpr, closed.consts, args, _Context())

    def retrace(self, closed: core.ClosedJaxpr, ctx: _Context, tangent_invars=None
                ) -> core.ClosedJaxpr:
        """``closed`` rewritten, as a new closed jaxpr of the same type (``tangent_invars``:
        which arguments are JVP tangents, whose collectives are kept)."""
        def fun(*args):
            return self.eval_jaxpr(closed.jaxpr, closed.consts, args, ctx, tangent_invars)

        wrapped = lu.wrap_init(fun, debug_info=closed.jaxpr.debug_info)
        jaxpr, out_avals, consts = pe.trace_to_jaxpr_dynamic(wrapped, closed.in_avals)
        for new, old in zip(out_avals, closed.out_avals):
            if not _same_type(new, old):
                raise RuntimeError(f"rewrite: the rewritten body at {ctx.path or 'top level'} "
                                   f"returns {new.str_short()} where the original returned "
                                   f"{old.str_short()}")
        return core.ClosedJaxpr(jaxpr, consts)

    # --- the evaluation loop ----------------------------------------------------------------

    def eval_jaxpr(self, jaxpr: core.Jaxpr, consts, args, ctx: _Context,
                   tangent_invars=None) -> list:
        env: dict = {}

        def read(v):
            return v.val if isinstance(v, core.Literal) else env[v]

        for v, val in zip(jaxpr.constvars, consts):
            env[v] = val
        if len(args) != len(jaxpr.invars):
            raise TypeError(f"rewrite: the jaxpr takes {len(jaxpr.invars)} arguments, got "
                            f"{len(args)}")
        for v, val in zip(jaxpr.invars, args):
            env[v] = val
        plan = self._plan(jaxpr, ctx, tangent_invars)
        for i, eqn in enumerate(jaxpr.eqns):
            if i in plan.skip:
                continue
            name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
            with (source_info_util.user_context(eqn.source_info.traceback,
                                                name_stack=name_stack),
                  eqn.ctx.manager):
                if i in plan.norm:
                    outs, env[plan.norm[i][0].new_residual] = self._norm(plan.norm[i], read, ctx)
                elif i in plan.islands and plan.islands[i].kind == "norm":
                    outs, env[plan.islands[i].norm.new_residual] = self._island(
                        plan.islands[i], jaxpr, read, ctx)
                else:
                    outs = self._eval_eqn(i, eqn, plan, read, ctx)
            if not eqn.primitive.multiple_results:
                outs = [outs]
            for v, val in zip(eqn.outvars, outs):
                env[v] = val
        return [read(v) for v in jaxpr.outvars]

    def _eval_eqn(self, i, eqn, plan: _Plan, read, ctx: _Context):
        name = eqn.primitive.name
        if i in plan.fused:
            return self._fused(plan.fused[i], eqn, read, ctx)
        if i in plan.operand:
            return self._replace(eqn, [read(plan.operand[i])] + [read(v) for v in eqn.invars[1:]],
                                 ctx, plan.notes.get(i), plan.moved_exactly.get(i))
        if i in plan.islands:
            return self._island(plan.islands[i], plan.jaxpr, read, ctx)
        invals = [read(v) for v in eqn.invars]
        if i in plan.exact_islands:
            self._exact_row(plan.exact_islands[i], plan.jaxpr, ctx)
        if i in plan.implied_kept:
            kept = plan.implied_kept[i]
            self._row(eqn, ctx, "kept", "lax", kept.reason, op=kept.op, axes=kept.axes,
                      shape=kept.shape or None, dtype=kept.dtype)
        if name in REWRITABLE or name in OTHER_COLLECTIVES:
            reason = plan.kept.get(i) or OTHER_COLLECTIVES.get(name, "")
            self._row(eqn, ctx, "kept", "lax", reason)
            return bind(eqn.primitive, invals, eqn.params)
        handler = HANDLERS.get(name)
        if handler is not None:
            return handler(self, eqn, invals,
                           ctx.freeze(TANGENT_REASON) if i in plan.tangent else ctx)
        for sub in core.jaxprs_in_params(eqn.params):
            self._report_unentered(sub, ctx.child(name, eqn), name)
        if not list(core.jaxprs_in_params(eqn.params)):
            widened = _widened(eqn, invals)
            if widened is not None:
                return widened
        return bind(eqn.primitive, invals, eqn.params)

    # --- planning ---------------------------------------------------------------------------

    def _plan(self, jaxpr: core.Jaxpr, ctx: _Context, tangent_invars=None) -> _Plan:
        plan = _Plan(jaxpr=jaxpr)
        users, producer = collections.defaultdict(list), {}
        tangents = {v for v, t in zip(jaxpr.invars, tangent_invars or ()) if t}
        for i, eqn in enumerate(jaxpr.eqns):
            for v in eqn.invars:
                if isinstance(v, core.Var):
                    users[v].append(i)
            for v in eqn.outvars:
                producer[v] = i
            if any(isinstance(v, core.Var) and v in tangents for v in eqn.invars):
                tangents.update(eqn.outvars)
                plan.tangent.add(i)
        for v in jaxpr.outvars:
            if isinstance(v, core.Var):
                users[v].append(None)
        for i, eqn in enumerate(jaxpr.eqns):
            op = REWRITABLE.get(eqn.primitive.name)
            if op is None:
                continue
            if ctx.frozen or i in plan.tangent:
                plan.kept[i] = ctx.frozen or TANGENT_REASON
                continue
            if len(eqn.invars) != (RAGGED_INVARS if op == "ragged_all_to_all" else 1):
                plan.kept[i] = "a multi-operand collective equation"
                continue
            axes = _axes_of(eqn)
            _, frames = _call_site(eqn)
            scope = "/".join(s for s in (ctx.scope, str(eqn.source_info.name_stack)) if s)
            dtype = np.dtype(eqn.invars[0].aval.dtype)
            # an all-to-all of integers (token counts, expert ids) moves exactly
            exact_move = op in EXCHANGES and dtype not in QUANTIZABLE_DTYPES
            selected, why = self.policy.select(
                op, axes, np.float32 if exact_move else dtype, scope, frames,
                eqn.params.get("axis_index_groups"))
            if not selected:
                plan.kept[i] = why
                continue
            if exact_move:
                plan.moved_exactly[i] = f"dtype {dtype} is not quantizable: moved exactly"
            operand = eqn.invars[0]
            j = producer.get(operand)
            if (op != "ragged_all_to_all" and j is not None
                    and jaxpr.eqns[j].primitive.name == "pvary"
                    and len(users[operand]) == 1
                    and set(jaxpr.eqns[j].params["axes"]) <= set(axes)):
                plan.skip.add(j)       # the flashcomm op makes its operand varying itself
                operand = jaxpr.eqns[j].invars[0]
            plan.operand[i] = operand
        if self.policy.fuse_matmul:
            self._plan_fusions(jaxpr, plan, users, producer, ctx)
        if self.policy.fuse_norm:
            self._plan_norms(jaxpr, plan, users, producer)
        self._plan_islands(jaxpr, plan, users, producer, ctx)
        return plan

    def _plan_norms(self, jaxpr, plan: _Plan, users, producer):
        for i in sorted(plan.operand):
            if jaxpr.eqns[i].primitive.name not in ("psum_invariant", "psum"):
                continue
            match, note = norm_fusion.match_psum_norm(jaxpr, i, users, producer)
            if match is None or plan.skip & set(match.eqns):
                plan.notes[i] = f"not fused with a norm: {note or 'overlaps another fusion'}"
                continue
            plan.norm[match.last] = (match, plan.operand.pop(i), jaxpr.eqns[i])
            plan.skip.update({i, *match.eqns} - {match.last})

    def _plan_islands(self, jaxpr, plan: _Plan, users, producer, ctx: _Context):
        """The collectives implied by Explicit sharding (:mod:`.explicit`, :mod:`.islands`)."""
        def select(i, implied):
            if ctx.frozen or i in plan.tangent:
                return False, ctx.frozen or TANGENT_REASON
            eqn = jaxpr.eqns[i]
            _, frames = _call_site(eqn)
            scope = "/".join(s for s in (ctx.scope, str(eqn.source_info.name_stack)) if s)
            return self.policy.select(implied.op, implied.axes, implied.dtype, scope, frames)

        found = islands.plan_islands(jaxpr, users, producer, select, self.policy.fuse_matmul,
                                     lambda i: self._config(jaxpr.eqns[i], ctx),
                                     self.policy.fuse_norm)
        plan.islands, plan.implied_kept = found.islands, found.kept
        plan.exact_islands = found.exact
        plan.skip |= found.skip

    def _plan_fusions(self, jaxpr, plan: _Plan, users, producer, ctx: _Context):
        for i in sorted(plan.operand):
            eqn = jaxpr.eqns[i]
            config = self._config(eqn, ctx)
            if eqn.primitive.name == "all_gather":
                match, note = fusion.match_gather_dot(jaxpr, i, plan.operand[i], users)
            elif eqn.primitive.name == "reduce_scatter":
                aval = eqn.invars[0].aval
                nbytes = int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize
                if quantizes("matmul_reduce_scatter", nbytes, int(eqn.params["axis_size"]),
                             aval.dtype, config):
                    plan.notes[i] = ("not fused: quantized psum_scatter after the dot (there is "
                                     "no quantized reduce-scatter ring)")
                    continue
                match, note = fusion.match_dot_scatter(jaxpr, i, plan.operand[i], producer,
                                                       users)
            else:
                continue
            if match is None or match.dot in plan.fused or match.dot in plan.skip:
                plan.notes[i] = note or "not fused: the dot is already fused"
                continue
            if match.kind == "all_gather_matmul":
                plan.skip.add(i)                       # emitted at the dot
                plan.fused[match.dot] = match
            else:
                plan.skip.add(match.dot)               # emitted at the reduce-scatter
                plan.fused[i] = match
            del plan.operand[i]

    def _config(self, eqn, ctx: _Context):
        """The CommConfig of one collective's call site (the policy's, per site)."""
        _, frames = _call_site(eqn)
        scope = "/".join(s for s in (ctx.scope, str(eqn.source_info.name_stack)) if s)
        return self.policy.config_at(scope, frames)

    # --- replacements -----------------------------------------------------------------------

    def _replace(self, eqn, invals, ctx: _Context, note: str | None, exact_move: str | None):
        """The flashcomm collective in place of a lax one (``invals``: its operands, the first
        one without the ``pvary`` that went with it; ``exact_move``: why an all-to-all moves its
        operand exactly whatever the config)."""
        config = self._config(eqn, ctx)
        if exact_move is not None and not config.exact:
            config = dataclasses.replace(config, bits=None, rs_bits=None, ag_bits=None)
            note = "; ".join(filter(None, (exact_move, note)))
        axes, p = _axes_of(eqn), eqn.params
        x = invals[0]
        with record() as decisions:
            if eqn.primitive.name == "all_to_all":
                # the primitive's semantics are tiled whatever its `tiled`: lax.all_to_all
                # inserts and removes the stacked axis around it
                out = flash_all_to_all(x, axes, p["split_axis"], p["concat_axis"], tiled=True,
                                       config=config)
            elif eqn.primitive.name == "ragged_all_to_all":
                out = flash_ragged_all_to_all(invals[0], _on_mesh(invals[1]), *invals[2:], axes,
                                              config=config)
            elif eqn.primitive.name in ("psum_invariant", "psum"):
                out = flash_psum(x, axes, config=config)
            elif eqn.primitive.name == "reduce_scatter":
                out = flash_psum_scatter(x, axes, scatter_dimension=p["scatter_dimension"],
                                         tiled=p["tiled"], config=config)
            else:
                out = flash_all_gather(x, axes, axis=p["all_gather_dimension"],
                                       tiled=p["tiled"], config=config)
        self._check_type(eqn, out, ctx, loose=eqn.primitive.name == "ragged_all_to_all")
        self._row(eqn, ctx, *_outcome(decisions, note), plans=decisions)
        return out

    def _norm(self, planned, read, ctx: _Context):
        """:func:`~jax_flashcomm.psum_add_rms_norm` in place of psum, add and RMSNorm."""
        match, x, psum_eqn = planned
        axes = _axes_of(psum_eqn)
        with record() as plans:
            out, residual = psum_add_rms_norm(read(x), read(match.residual), read(match.weight),
                                              axes, eps=match.eps,
                                              config=self._config(psum_eqn, ctx))
        for value, var in ((out, match.out), (residual, match.new_residual)):
            if not _same_type(core.typeof(value), var.aval):
                raise RuntimeError(f"rewrite: psum_add_rms_norm at {_call_site(psum_eqn)[0]} "
                                   f"gives {core.typeof(value).str_short()} where the chain "
                                   f"gave {var.aval.str_short()}")
        action, detail, reason = _outcome(plans, None)
        detail = f"psum_add_rms_norm {detail}".strip()
        self._row(psum_eqn, ctx, "fused", detail,
                  f"fused with the residual add and the RMSNorm ({action}); {reason}",
                  plans=plans)
        return out, residual

    def _island(self, island: islands.Island, jaxpr, read, ctx: _Context):
        """A shard_map island in place of a collective implied by Explicit sharding."""
        implied = island.implied
        out, plans = islands.emit(island, jaxpr, [read(v) for v in island.inputs],
                                  self._config(jaxpr.eqns[island.report], ctx))
        self._check_type(jaxpr.eqns[island.at], out[0] if island.kind == "norm" else out, ctx)
        if island.kind == "norm":
            if not _same_type(core.typeof(out[1]), island.norm.new_residual.aval):
                raise RuntimeError(f"rewrite: the fused norm island at "
                                   f"{_call_site(jaxpr.eqns[island.report])[0]} gives a "
                                   f"residual of another type")
            action, detail, reason = _outcome(plans, None)
            self._row(jaxpr.eqns[island.report], ctx, "fused",
                      f"psum_add_rms_norm {detail}".strip(),
                      f"implied by the sharding; fused with the residual add and the RMSNorm "
                      f"({action}); {reason}", op=implied.op, axes=implied.axes,
                      shape=implied.shape, dtype=implied.dtype, axis_size=implied.axis_size,
                      plans=plans)
            return out
        if island.kind in ("all_gather_matmul", "matmul_reduce_scatter"):
            ring = plans[0]
            action = "fused"
            detail = island.kind + (f" int{ring.ag_bits}" if ring.quantized else "")
            reason = f"fused with the dot; {ring.path} over {ring.transport} ({ring.reason})"
        else:
            action, detail, reason = _outcome(plans, island.note)
        where = {"collective": "implied by the sharding", "region": (
            f"the reduction point of an unreduced value ({len(island.eqns) - 1} equations "
            f"before it)")}.get(island.kind, "implied by the sharding")
        self._row(jaxpr.eqns[island.report], ctx, action, detail, f"{where}; {reason}",
                  op=implied.op, axes=implied.axes, shape=implied.shape, dtype=implied.dtype,
                  axis_size=implied.axis_size, plans=plans)
        return out

    def _exact_row(self, island: islands.Island, jaxpr, ctx: _Context):
        """The row of a collective implied by sharding whose config takes the exact path:
        left to XLA, the program's own collective."""
        implied, eqn = island.implied, jaxpr.eqns[island.report]
        config = self._config(eqn, ctx)
        why = ("bits=None (exact setting)" if config.exact else
               f"{implied.nbytes} B below the size policy (min_bytes={config.min_bytes!r})")
        self._row(eqn, ctx, "exact", "xla", f"implied by the sharding; {why}: XLA's own "
                  f"collective, left as it is", op=implied.op, axes=implied.axes,
                  shape=implied.shape, dtype=implied.dtype, axis_size=implied.axis_size)

    def _fused(self, match: fusion.MatmulFusion, eqn, read, ctx: _Context):
        """A ring collective matmul in place of a collective and its dot."""
        x, w = read(match.x), read(match.w)
        collective = match.collective_eqn
        axes = _axes_of(collective)
        ring_axes = axes[0] if len(axes) == 1 else axes
        config = self._config(collective, ctx)
        with record() as plans:
            if match.kind == "all_gather_matmul":
                out = all_gather_matmul(x, w, ring_axes, axis=match.axis, config=config)
            else:
                out = matmul_reduce_scatter(x, w, ring_axes, axis=match.axis, config=config)
        ring = plans[0]
        detail = match.kind + (f" int{ring.ag_bits}" if ring.quantized else "")
        reason = f"fused with the dot; {ring.path} over {ring.transport} ({ring.reason})"
        self._check_type(eqn, out, ctx)
        self._row(collective, ctx, "fused", detail, reason, plans=plans)
        return out

    # --- report -----------------------------------------------------------------------------

    def _row(self, eqn, ctx: _Context, action: str, detail: str, reason: str, *, op=None,
             axes=None, shape=None, dtype=None, axis_size=None, plans=()):
        """One report row; ``op`` ... ``axis_size`` default to the equation's own (a lax
        collective's), and are given for the collectives implied by sharding; ``plans``, the
        flashcomm calls made for it, give the bytes it sends."""
        if self.rows is None:
            return
        aval = eqn.invars[0].aval
        name = eqn.primitive.name
        axes = _axes_of(eqn) if axes is None else tuple(axes)
        shape = tuple(aval.shape if shape is None else shape)
        dtype = np.dtype(aval.dtype if dtype is None else dtype)
        if axis_size is None:
            axis_size = (_axis_size(eqn, axes) if name in REWRITABLE or name in OTHER_COLLECTIVES
                         else _implied_axis_size(aval, axes))
        site, _ = _call_site(eqn)
        scope = "/".join(s for s in (ctx.scope, str(eqn.source_info.name_stack)) if s)
        op = op or REWRITABLE.get(name, name)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        sent = None
        if plans and plans[0].quantized:
            sent = sent_bytes(op, nbytes, axis_size, _per_byte(plans[0], dtype.itemsize))
        self.rows.append(ReportRow(
            primitive=name, op=op, axes=axes, shape=shape, dtype=str(dtype),
            bytes_per_rank=nbytes, axis_size=axis_size, site=site, scope=scope,
            path=ctx.path or "-", action=action, detail=detail, reason=reason, sent=sent))

    def _report_unentered(self, jaxpr: core.Jaxpr, ctx: _Context, primitive: str):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in REWRITABLE or eqn.primitive.name in OTHER_COLLECTIVES:
                self._row(eqn, ctx, "kept", "lax",
                          f"inside {primitive}, which rewrite does not enter")
            for sub in core.jaxprs_in_params(eqn.params):
                self._report_unentered(sub, ctx.child(eqn.primitive.name, eqn), primitive)

    def _check_type(self, eqn, out, ctx: _Context, loose: bool = False):
        """A RuntimeError unless the replacement's result has the original's type (``loose``:
        its shape and dtype; the ragged all-to-all's varies over its axes, see
        :func:`_widened`, and is typed on the current mesh, see :func:`_on_mesh`)."""
        new, old = core.typeof(out), eqn.outvars[0].aval
        same = ((new.shape, new.dtype) == (old.shape, old.dtype) if loose
                else _same_type(new, old))
        if not same:
            site, _ = _call_site(eqn)
            raise RuntimeError(f"rewrite: the flashcomm replacement of {eqn.primitive.name} at "
                               f"{site} ({ctx.path or 'top level'}) gives {new.str_short()}, "
                               f"the original gave {old.str_short()}")
