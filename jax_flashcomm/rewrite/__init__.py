"""Adopt flashcomm without editing a model: rewrite its lax collectives.

>>> rewritten = rewrite(f, RewritePolicy(config=CommConfig(bits=8, min_bytes=0)))
>>> y = jax.jit(rewritten)(x)                  # f with quantized collectives
>>> print(rewritten.report(x))                 # every collective found, and what was done

``f`` is any function whose traced jaxpr has ``lax.psum`` / ``lax.psum_scatter`` /
``lax.all_gather`` / ``lax.all_to_all`` / ``lax.ragged_all_to_all`` inside a ``jax.shard_map``
(or ``nnx.shard_map``), at any depth of ``jit``, ``scan``, ``while_loop``, ``cond``,
``checkpoint``, ``custom_jvp`` and ``custom_vjp``; or the function that runs inside a shard_map
itself; or a model written with sharding in types (Explicit mesh axes, no shard_map), whose
collectives are implied by ``dot_general`` / ``reshard`` types and replaced by shard_map islands
(:mod:`jax_flashcomm.rewrite.explicit`, :mod:`jax_flashcomm.rewrite.islands`). See
:mod:`jax_flashcomm.rewrite.interpreter` for what is replaced and ``docs/rewrite.md`` for the
limits.
"""

from __future__ import annotations

import functools
import warnings

import jax
import numpy as np
from jax.sharding import AxisType, NamedSharding

from jax_flashcomm import jax_compat
from jax_flashcomm.rewrite.gspmd import Unsupported, auto_axes_of, in_specs, retype
from jax_flashcomm.rewrite.interpreter import Interpreter
from jax_flashcomm.rewrite.partitioner import inserted_collectives, partitioner_mesh, \
    partitioner_rows
from jax_flashcomm.rewrite.policy import REWRITABLE_OPS, RewritePolicy, as_policy
from jax_flashcomm.rewrite.report import Report, ReportRow
from jax_flashcomm.rewrite.untype import untype

__all__ = ["rewrite", "Rewritten", "RewritePolicy", "RewriteWarning", "Report", "ReportRow",
           "REWRITABLE_OPS"]


class Rewritten:
    """``fn`` with its collectives rewritten by ``policy``; made by :func:`rewrite`.

    Calling it traces ``fn`` at the arguments' types and evaluates the rewritten jaxpr in the
    caller's trace, or under ``jax.jit`` when called eagerly (wrap it in ``jax.jit`` to compile
    once). :meth:`report` traces
    abstractly and returns the :class:`Report`.
    """

    def __init__(self, fn, policy: RewritePolicy, with_report: bool, in_shardings=None):
        if not callable(fn):
            raise TypeError(f"rewrite: fn must be callable, got {type(fn).__name__}")
        self.fn, self.policy, self.with_report = fn, policy, with_report
        self.in_shardings = in_shardings
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        rows: list = []
        gspmd = self._gspmd(args, kwargs)
        self._unsupported = None
        if gspmd is not None and not self.with_report and not _traced((args, kwargs)):
            out = self._compiled(args, kwargs, gspmd)
        else:
            out = self._run(args, kwargs, rows, gspmd)
            self._warn_if_unchanged(rows, gspmd, (args, kwargs))
        return (out, Report(rows)) if self.with_report else out

    def report(self, *args, **kwargs) -> Report:
        """The report of a call with these arguments (arrays or ``jax.ShapeDtypeStruct``s);
        nothing runs.

        For arguments sharded over Auto mesh axes (GSPMD) the function is also compiled once,
        and the collectives XLA's partitioner inserted are rows too (``path="partitioner"``),
        each with what the rewrite did at its equation; ``Report.compile_seconds`` is what that
        compile took (None when there was none).
        """
        rows: list = []
        gspmd = self._gspmd(args, kwargs)
        self._unsupported = None
        jax.make_jaxpr(lambda a, k: self._run(a, k, rows, gspmd))(args, kwargs)
        mesh = partitioner_mesh(jax.tree.leaves((args, kwargs)))
        if mesh is None:
            return Report(rows)
        try:
            inserted, seconds = inserted_collectives(self.fn, args, kwargs, mesh)
        except jax.errors.JaxRuntimeError as e:  # e.g. XLA:CPU has no ragged-all-to-all
            warnings.warn(f"rewrite({getattr(self.fn, '__qualname__', self.fn)}).report: the "
                          f"collectives XLA's partitioner inserts are not listed: the program "
                          f"as written does not compile here ({str(e).splitlines()[0]})",
                          RewriteWarning, stacklevel=2)
            return Report(rows)
        rows.extend(partitioner_rows(inserted, rows, self._unsupported))
        return Report(rows, compile_seconds=seconds)

    def _gspmd(self, args, kwargs):
        """``(mesh, argument specs)`` of a call whose arguments are sharded over a mesh of Auto
        axes only (GSPMD; a mesh with Explicit axes too is typed already), else None.

        Under a trace (``jax.jit``, ``jax.grad``) Auto shardings are not in the arguments'
        types: they come from the ``jax.jit`` call that traces this function directly (its
        arguments, or its ``in_shardings``), else from the last call with the same shapes and
        dtypes, else from the ``in_shardings`` given to :func:`rewrite`; with none of these
        the program is left to XLA's partitioner, with a warning.
        """
        flat, tree = jax.tree.flatten((args, kwargs))
        key = (tree, tuple((tuple(np.shape(x)), str(jax.typeof(x).dtype)) for x in flat))
        seen = self.__dict__.setdefault("_gspmd_seen", {})
        if _traced(flat):
            found = self._gspmd_of(_jit_leaves(self, flat)) or seen.get(key)
            if found is None and self.in_shardings is not None:
                found = self._gspmd_of(_placed(flat, self.in_shardings))
            if found is not None:
                seen[key] = found
            return found
        found = self._gspmd_of(flat)
        if found is not None:
            seen[key] = found
        return found

    @staticmethod
    def _gspmd_of(leaves):
        if leaves is None:
            return None
        mesh = partitioner_mesh(leaves)
        if mesh is None or AxisType.Explicit in mesh.axis_types:
            return None    # Explicit axes too: those are typed already; Auto ones stay with XLA
        return mesh, in_specs(leaves, mesh)

    def _warn_if_unchanged(self, rows, gspmd, arguments):
        """A warning naming the program and why, when the rewrite replaced nothing."""
        if any(r.action != "kept" for r in rows):
            return
        name = getattr(self.fn, "__qualname__", None) or repr(self.fn)
        auto_mesh = _auto_mesh_of(jax.tree.leaves(arguments))
        if gspmd is None and auto_mesh is not None:
            why = ("its arguments are sharded over Auto mesh axes (GSPMD), whose shardings are "
                   "not in their types under this trace; call it with jax.jit(rewritten) "
                   "directly, or once outside any trace, or pass in_shardings= to rewrite")
        elif getattr(self, "_unsupported", None):
            why = f"the GSPMD program could not be typed with Explicit axes ({self._unsupported})"
        elif rows:
            kept = "; ".join(sorted({f"{r.op} at {r.site}: {r.reason}" for r in rows})[:3])
            why = f"every collective found was kept ({kept})"
        else:
            why = ("it has no lax collective inside a shard_map, no collective implied by "
                   "Explicit sharding and no argument sharded over Auto mesh axes")
        warnings.warn(f"rewrite({name}): the program is unchanged: {why}", RewriteWarning,
                      stacklevel=3)

    def _compiled(self, args, kwargs, gspmd):
        """A GSPMD call outside any trace: jitted once per argument signature."""
        flat, tree = jax.tree.flatten((args, kwargs))
        key = (tree, tuple((leaf.shape, str(leaf.dtype)) for leaf in flat), gspmd[1])
        cache = self.__dict__.setdefault("_gspmd_cache", {})
        if key not in cache:
            def run(a, k):
                rows: list = []
                out = self._run(a, k, rows, gspmd)
                self._warn_if_unchanged(rows, gspmd, (a, k))
                return out
            cache[key] = jax.jit(run)
        return cache[key](args, kwargs)

    def _run(self, args, kwargs, rows, gspmd=None):
        closed, out_shape = jax.make_jaxpr(self.fn, return_shape=True)(*args, **kwargs)
        flat = jax.tree.leaves((args, kwargs))
        if len(flat) != len(closed.jaxpr.invars):
            raise TypeError(f"rewrite: {len(flat)} array leaves in the arguments but the traced "
                            f"function takes {len(closed.jaxpr.invars)}")

        def run(*leaves):
            if gspmd is not None:
                try:
                    return self._run_gspmd(closed, leaves, rows, *gspmd)
                except Unsupported as e:      # typed nothing yet: the program as it was
                    self._unsupported = str(e)
            return Interpreter(self.policy, rows).run(closed, list(leaves))

        # An eager call evaluates the rewritten program the way jax.jit(fn) would (eager
        # shard_map binds reject what traced ones accept, e.g. a nested shard_map over an
        # Explicit mesh); under a trace it is evaluated in the caller's.
        traced = _traced(flat)
        outs = run(*flat) if traced else jax.jit(run)(*flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    def _run_gspmd(self, closed, leaves, rows, mesh, specs):
        """The GSPMD program typed with Explicit axes (:mod:`.gspmd`), rewritten, and evaluated
        back in its Auto form (:mod:`.untype`)."""
        def explicit(*values):
            typed = jax.make_jaxpr(retype(closed))(*values)
            return Interpreter(self.policy, rows).run(typed, list(values))

        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            rewritten = jax.make_jaxpr(jax.sharding.explicit_axes(
                explicit, axes=auto_axes_of(mesh), in_sharding=tuple(specs)))(*leaves)
        return untype(rewritten, mesh)(*leaves)

    def __repr__(self):
        return f"rewrite({getattr(self.fn, '__name__', self.fn)!r}, {self.policy})"


class RewriteWarning(UserWarning):
    """A rewrite that leaves its program unchanged, and why."""


def _traced(tree) -> bool:
    return any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(tree))


def _jit_leaves(fn, flat):
    """The leaves of the ``jax.jit`` call tracing ``fn``, matched one to one with ``flat``."""
    found = jax_compat.jit_arguments(fn)
    if found is None:
        return None
    leaves, shardings = found
    if len(leaves) != len(flat) or any(tuple(np.shape(a)) != tuple(np.shape(b))
                                       for a, b in zip(leaves, flat)):
        return None
    if shardings is not None and len(shardings) == len(leaves):
        leaves = [jax.ShapeDtypeStruct(np.shape(a), jax.typeof(b).dtype, sharding=s)
                  if isinstance(s, NamedSharding) else a
                  for a, b, s in zip(leaves, flat, shardings)]
    return leaves


def _placed(flat, in_shardings):
    """``flat``'s shapes with the shardings of ``rewrite(..., in_shardings=)`` (one per leaf,
    or one for all)."""
    shardings = jax.tree.leaves(in_shardings, is_leaf=lambda s: isinstance(s, NamedSharding))
    if len(shardings) == 1:
        shardings = shardings * len(flat)
    if len(shardings) != len(flat) or not all(isinstance(s, NamedSharding) for s in shardings):
        raise ValueError(f"rewrite: in_shardings must give one NamedSharding per array leaf of "
                         f"the arguments ({len(flat)}), or one for all; got {in_shardings!r}")
    return [jax.ShapeDtypeStruct(np.shape(x), jax.typeof(x).dtype, sharding=s)
            for x, s in zip(flat, shardings)]


def _auto_mesh_of(leaves):
    """The (abstract) mesh of the first leaf typed on a mesh with an Auto axis of size > 1."""
    for leaf in leaves:
        sharding = getattr(leaf, "sharding", None) if not isinstance(leaf, jax.core.Tracer) \
            else None
        if not isinstance(sharding, NamedSharding):
            try:
                sharding = jax.typeof(leaf).sharding
            except TypeError:
                continue
        mesh = getattr(sharding, "mesh", None)
        if mesh is not None and any(t == AxisType.Auto and mesh.shape[n] > 1
                                    for n, t in zip(mesh.axis_names, mesh.axis_types)):
            return mesh
    return None


def rewrite(fn, policy: RewritePolicy | None = None, *, report: bool = False,
            in_shardings=None) -> Rewritten:
    """``fn`` with its lax collectives replaced by the flashcomm ones the policy picks.

    Args:
      fn: a function that calls ``jax.shard_map`` (or ``nnx.shard_map``), or the function that
        runs inside one (then call the result inside the shard_map), or one written with
        Explicit sharding (``out_sharding=``, ``reshard``, unreduced types; call it under the
        mesh, ``jax.set_mesh``). Its arguments must be arrays (pytrees of them): bind the
        others with ``functools.partial``.
      policy: a :class:`RewritePolicy`; a :class:`~jax_flashcomm.CommConfig` (every collective,
        that config); or None (every collective, the flashcomm defaults, size policy included).
      report: when True, each call returns ``(outputs, Report)`` (outside ``jax.jit`` only:
        a report is not an array). ``rewrite(fn, policy).report(*args)`` gives the report
        without running anything.
      in_shardings: for a GSPMD program (arguments sharded over Auto mesh axes) traced inside
        a larger traced function, where its arguments' shardings are not in their types: a
        ``NamedSharding`` per array leaf of the arguments, or one for all. Not needed for
        ``jax.jit(rewritten)``, ``.lower`` and eager calls, which see the arguments.

    Returns:
      A :class:`Rewritten` callable with ``fn``'s signature.
    """
    return Rewritten(fn, as_policy(policy), bool(report), in_shardings)


def _report(fn, policy: RewritePolicy | None = None):
    """``rewrite.report(fn, policy)(*args)``: the :class:`Report` of rewriting ``fn``."""
    return Rewritten(fn, as_policy(policy), False).report


rewrite.report = _report
rewrite.RewriteWarning = RewriteWarning
