"""Adopt flashcomm without editing a model: rewrite its lax collectives.

>>> rewritten = rewrite(f, RewritePolicy(config=CommConfig(bits=8, min_bytes=0)))
>>> y = jax.jit(rewritten)(x)                  # f with quantized collectives
>>> print(rewritten.report(x))                 # every collective found, and what was done

``f`` is any function whose traced jaxpr has ``lax.psum`` / ``lax.psum_scatter`` /
``lax.all_gather`` inside a ``jax.shard_map`` (or ``nnx.shard_map``), at any depth of ``jit``,
``scan``, ``while_loop``, ``cond``, ``checkpoint``, ``custom_jvp`` and ``custom_vjp``; or the
function that runs inside a shard_map itself; or a model written with sharding in types
(Explicit mesh axes, no shard_map), whose collectives are implied by ``dot_general`` /
``reshard`` types and replaced by shard_map islands (:mod:`jax_flashcomm.rewrite.explicit`,
:mod:`jax_flashcomm.rewrite.islands`). See :mod:`jax_flashcomm.rewrite.interpreter` for what is
replaced and ``docs/rewrite.md`` for the limits.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType

from jax_flashcomm.rewrite.gspmd import Unsupported, auto_axes_of, in_specs, retype
from jax_flashcomm.rewrite.interpreter import Interpreter
from jax_flashcomm.rewrite.partitioner import inserted_collectives, partitioner_mesh, \
    partitioner_rows
from jax_flashcomm.rewrite.policy import REWRITABLE_OPS, RewritePolicy, as_policy
from jax_flashcomm.rewrite.report import Report, ReportRow

__all__ = ["rewrite", "Rewritten", "RewritePolicy", "Report", "ReportRow", "REWRITABLE_OPS"]


class Rewritten:
    """``fn`` with its collectives rewritten by ``policy``; made by :func:`rewrite`.

    Calling it traces ``fn`` at the arguments' types and evaluates the rewritten jaxpr in the
    caller's trace, or under ``jax.jit`` when called eagerly (wrap it in ``jax.jit`` to compile
    once). :meth:`report` traces
    abstractly and returns the :class:`Report`.
    """

    def __init__(self, fn, policy: RewritePolicy, with_report: bool):
        if not callable(fn):
            raise TypeError(f"rewrite: fn must be callable, got {type(fn).__name__}")
        self.fn, self.policy, self.with_report = fn, policy, with_report
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        rows = [] if self.with_report else None
        gspmd = self._gspmd(args, kwargs)
        if gspmd is not None and rows is None:
            out = self._compiled(args, kwargs, gspmd)
        else:
            out = self._run(args, kwargs, rows, gspmd)
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
        inserted, seconds = inserted_collectives(self.fn, args, kwargs, mesh)
        rows.extend(partitioner_rows(inserted, rows, self._unsupported))
        return Report(rows, compile_seconds=seconds)

    def _gspmd(self, args, kwargs):
        """``(mesh, argument specs)`` of a call whose arguments are sharded over a mesh of Auto
        axes only (GSPMD; a mesh with Explicit axes too is typed already).

        Under a trace (``jax.jit``, ``jax.grad``) Auto shardings are not in the arguments'
        types: the specs are those of the last call outside a trace (or :meth:`report`) with
        the same shapes and dtypes, else None (the program is left to XLA's partitioner).
        """
        flat, tree = jax.tree.flatten((args, kwargs))
        key = (tree, tuple((tuple(np.shape(x)), str(jax.typeof(x).dtype)) for x in flat))
        seen = self.__dict__.setdefault("_gspmd_seen", {})
        if any(isinstance(leaf, jax.core.Tracer) for leaf in flat):
            return seen.get(key)
        mesh = partitioner_mesh(flat)
        if mesh is not None and AxisType.Explicit in mesh.axis_types:
            mesh = None    # Explicit axes too: those are typed already; Auto ones stay with XLA
        found = None if mesh is None else (mesh, in_specs(flat, mesh))
        if found is not None:
            seen[key] = found
        return found

    def _compiled(self, args, kwargs, gspmd):
        """A GSPMD call outside any trace: jitted once per argument signature."""
        flat, tree = jax.tree.flatten((args, kwargs))
        key = (tree, tuple((leaf.shape, str(leaf.dtype)) for leaf in flat), gspmd[1])
        cache = self.__dict__.setdefault("_gspmd_cache", {})
        if key not in cache:
            cache[key] = jax.jit(lambda a, k: self._run(a, k, None, gspmd))
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
        traced = any(isinstance(leaf, jax.core.Tracer) for leaf in flat)
        outs = run(*flat) if traced else jax.jit(run)(*flat)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    def _run_gspmd(self, closed, leaves, rows, mesh, specs):
        """The GSPMD program typed with Explicit axes (:mod:`.gspmd`), then rewritten."""
        def explicit(*values):
            typed = jax.make_jaxpr(retype(closed))(*values)
            return Interpreter(self.policy, rows).run(typed, list(values))

        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return jax.sharding.explicit_axes(explicit, axes=auto_axes_of(mesh),
                                              in_sharding=tuple(specs))(*leaves)

    def __repr__(self):
        return f"rewrite({getattr(self.fn, '__name__', self.fn)!r}, {self.policy})"


def rewrite(fn, policy: RewritePolicy | None = None, *, report: bool = False) -> Rewritten:
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

    Returns:
      A :class:`Rewritten` callable with ``fn``'s signature.
    """
    return Rewritten(fn, as_policy(policy), bool(report))


def _report(fn, policy: RewritePolicy | None = None):
    """``rewrite.report(fn, policy)(*args)``: the :class:`Report` of rewriting ``fn``."""
    return Rewritten(fn, as_policy(policy), False).report


rewrite.report = _report
