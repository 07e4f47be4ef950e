"""Every use of JAX internals (``jax._src``) in jax_flashcomm, in one place.

Checked against jax/jaxlib 0.10.0-0.10.2 (CI runs 0.10.2). The rest of the package and the
``models``/``benchmarks`` trees import these names from here, never from ``jax._src``, so a JAX
release that moves one of them needs an edit in this file alone.

* :func:`all_gather_invariant`: an all-gather whose result is invariant (replicated) over the
  gathered axes, the type ``lax.psum`` gives its result; ``jax.lax`` does not export it.
* :func:`psum`: ``lax.psum`` that XLA:CPU compiles in every dtype inside a partly manual
  ``shard_map`` (a 16-bit float psum there aborts XLA's all-reduce promotion).
* :func:`jit_arguments`: the arguments of the ``jax.jit`` call that is tracing a function
  now, which carry the Auto-axis shardings that its tracers' types leave out.
* :func:`current_trace`, :func:`is_trace_entry`, :func:`is_jit_entry`,
  :func:`trace_started_in`, :func:`is_jax_frame`: the trace a primitive goes to now, and the
  Python frames where JAX starts tracing a function (call-site identities
  of the p2p transport, :mod:`jax_flashcomm.transport.identity`).
* ``ad_util``, ``core``, ``source_info_util``, ``linear_util``, ``partial_eval``,
  ``FlatTree`` / :func:`flat_tree_flatten`: the jaxpr machinery :mod:`jax_flashcomm.rewrite`
  walks and retraces.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import AxisType

#: The JAX versions this module was run against (0.11.0: its names read from the 0.11.0 source,
#: not run: the package index here serves up to 0.10.2).
CHECKED_JAX_VERSIONS = ("0.10.0", "0.10.1", "0.10.2")

from jax._src import ad_util, core, source_info_util  # noqa: E402
from jax._src import linear_util  # noqa: E402
from jax._src.interpreters import partial_eval  # noqa: E402
try:  # jax 0.10
    from jax._src.tree_util import FlatTree  # noqa: E402
    flat_tree_flatten = FlatTree.flatten
except ImportError:  # pragma: no cover - jax 0.11 moved it (checked against the 0.11.0 source)
    from jax._src.flattree import FlatTree  # noqa: E402
    from jax._src.flattree import flatten as flat_tree_flatten  # noqa: E402

try:  # Varying -> Invariant all-gather (what psum's result type needs); not re-exported by lax.
    from jax._src.lax.parallel import all_gather_invariant as _all_gather_invariant
except ImportError:  # pragma: no cover - a JAX without it
    _all_gather_invariant = None

__all__ = ["CHECKED_JAX_VERSIONS", "all_gather_invariant", "psum", "jit_arguments", "ad_util",
           "core",
           "source_info_util", "linear_util", "partial_eval", "FlatTree", "flat_tree_flatten",
           "jax_version", "distributed_client", "current_trace", "is_trace_entry",
           "is_jit_entry", "trace_started_in", "is_jax_frame"]

_JAX_DIR = os.path.dirname(jax.__file__) + os.sep
_TRACE_ENTRY_FILE = partial_eval.__file__


def current_trace():
    """The trace that primitives bound now go to (a jaxpr trace, a vmap trace, eager)."""
    return core.trace_ctx.trace


def is_trace_entry(code) -> bool:
    """Whether ``code`` is where JAX starts tracing a function into a jaxpr (jit, shard_map,
    scan / cond / while bodies, custom VJPs): the frames it calls are that function's."""
    return code.co_filename == _TRACE_ENTRY_FILE and code.co_name.startswith("trace_to_")


def is_jit_entry(code) -> bool:
    """Whether ``code`` is where ``jax.jit`` traces the function it wraps (pjit's
    ``_trace_for_jit``: a jit's jaxpr is cached and reused by every program that calls it)."""
    return code.co_name == "_trace_for_jit" and code.co_filename.endswith(
        ("jax/_src/pjit.py", "jax\\_src\\pjit.py"))


def trace_started_in(frame):
    """The trace a :func:`is_trace_entry` frame made (its local ``trace``), or None."""
    return frame.f_locals.get("trace")


def is_jax_frame(code) -> bool:
    """Whether ``code`` is JAX's own (its tracing plumbing), not the program's."""
    return code.co_filename.startswith(_JAX_DIR)


def jax_version() -> str:
    """The running JAX's version string."""
    return jax.__version__


def all_gather_invariant(x, axes, *, axis: int = 0, tiled: bool = False):
    """All-gather over mesh ``axes`` whose result is invariant (replicated) over them.

    Args:
      x: this rank's operand, varying over ``axes``.
      axes: a mesh axis name or a tuple of them.
      axis: where the gathered dimension goes.
      tiled: concatenate along ``axis`` (True) or stack on a new dimension ``axis`` (False).

    Returns:
      The gathered array, of the type ``lax.psum`` gives its result.
    """
    if _all_gather_invariant is None:  # pragma: no cover
        raise RuntimeError(f"jax {jax.__version__} has no all_gather_invariant; jax_flashcomm "
                           f"was checked against {CHECKED_JAX_VERSIONS}")
    return _all_gather_invariant(x, axes, axis=axis, tiled=tiled)


def psum(x, axes):
    """``lax.psum(x, axes)``, summed in f32 for a 16-bit float ``x`` inside a shard_map that is
    manual over some of the mesh's axes only.

    There, jax 0.10 lowers the all-reduce's reduction with a ``Sharding`` custom call, and XLA's
    all-reduce promotion (bf16 / f16 to f32) aborts the process cloning it ("Invalid binary
    instruction opcode copy"). Summing in f32 and rounding once is what that promotion computes
    on CPU, so the bits are XLA's; elsewhere it is ``lax.psum`` as it is.

    Args:
      x: this rank's operand.
      axes: a mesh axis name or a tuple of them.

    Returns:
      ``lax.psum``'s result.
    """
    dtype = jnp.result_type(x)
    mesh = jax.sharding.get_abstract_mesh()
    partly_manual = (AxisType.Manual in mesh.axis_types
                     and any(t != AxisType.Manual for t in mesh.axis_types))
    if partly_manual and dtype in (jnp.bfloat16, jnp.float16):
        return lax.psum(x.astype(jnp.float32), axes).astype(dtype)
    return lax.psum(x, axes)


def jit_arguments(fn):
    """The array leaves of the ``jax.jit`` call tracing ``fn`` itself right now, or None.

    A value sharded over Auto mesh axes has no spec in its type, so under ``jax.jit`` a
    function sees only its arguments' shapes; the jit call's own arguments (arrays, or
    ``jax.ShapeDtypeStruct``s with shardings for ``.lower``) still carry them, in the frame of
    the JAX function that traces the jitted function. None when ``fn`` is not the jitted
    function itself (called inside a larger traced function, say), when the jit has static
    arguments, or when that frame is not found (another JAX version).

    Args:
      fn: the function being traced.

    Returns:
      ``(leaves, in_shardings)``: the flat arguments (positional, then keyword) and the jit's
      flat ``in_shardings`` leaves (None when it has none), or None.
    """
    import sys

    frame = sys._getframe(1)
    while frame is not None and not is_jit_entry(frame.f_code):
        frame = frame.f_back
    if frame is None:
        return None
    local = frame.f_locals
    fun, info = local.get("fun"), local.get("ji")
    if fun is not fn and getattr(fun, "__wrapped__", None) is not fn:
        return None
    if info is None or info.static_argnums or info.static_argnames:
        return None
    leaves = jax.tree.leaves((tuple(local.get("args", ())), dict(local.get("kwargs", {}))))
    shardings = None
    if getattr(info, "user_specified_in_shardings", False):
        shardings = tuple(info.in_shardings_leaves)
    return leaves, shardings


def distributed_client():
    """The key-value client of ``jax.distributed`` (None when it is not initialized).

    Returns:
      An object with ``key_value_set(key, value)`` and ``blocking_key_value_get(key,
      timeout_in_ms)``, or None.
    """
    from jax._src import distributed

    return distributed.global_state.client


#: JAX platform names -> the kernel module that serves them (``jax.default_backend()`` says
#: ``"gpu"`` or ``"cuda"`` for NVIDIA GPUs).
_KERNEL_PLATFORMS = {"cpu": "cpu", "gpu": "cuda", "cuda": "cuda"}


def kernel_platform_name(jax_platform: str | None = None) -> str | None:
    """The kernel platform (``"cpu"`` or ``"cuda"``) of a JAX platform name.

    Args:
      jax_platform: a JAX platform name (default: ``jax.default_backend()``).

    Returns:
      ``"cpu"``, ``"cuda"``, or None for a platform without kernels (TPU, ...).
    """
    return _KERNEL_PLATFORMS.get(jax.default_backend() if jax_platform is None else jax_platform)
