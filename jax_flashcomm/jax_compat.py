"""Every use of JAX internals (``jax._src``) in jax_flashcomm, in one place.

Checked against jax/jaxlib 0.10.0-0.10.2 (CI runs 0.10.2). The rest of the package and the
``models``/``benchmarks`` trees import these names from here, never from ``jax._src``, so a JAX
release that moves one of them needs an edit in this file alone.

* :func:`all_gather_invariant`: an all-gather whose result is invariant (replicated) over the
  gathered axes, the type ``lax.psum`` gives its result; ``jax.lax`` does not export it.
* ``ad_util``, ``core``, ``source_info_util``, ``linear_util``, ``partial_eval``,
  ``FlatTree`` / :func:`flat_tree_flatten`: the jaxpr machinery :mod:`jax_flashcomm.rewrite`
  walks and retraces.
"""

from __future__ import annotations

import jax

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

__all__ = ["CHECKED_JAX_VERSIONS", "all_gather_invariant", "ad_util", "core",
           "source_info_util", "linear_util", "partial_eval", "FlatTree", "flat_tree_flatten",
           "jax_version", "distributed_client"]


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


def distributed_client():
    """The key-value client of ``jax.distributed`` (None when it is not initialized).

    Returns:
      An object with ``key_value_set(key, value)`` and ``blocking_key_value_get(key,
      timeout_in_ms)``, or None.
    """
    from jax._src import distributed

    return distributed.global_state.client
