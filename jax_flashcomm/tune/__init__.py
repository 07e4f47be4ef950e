"""Measuring this machine for the automatic choice.

* ``python -m jax_flashcomm.tune`` (:mod:`._measure`) times the collectives on every path, the
  codec and the link here, and writes the table the planner reads (:mod:`jax_flashcomm.costs`);
* step rows (:mod:`._steps`): :func:`measure_in_step` times a collective inside a model's own
  step on each path, :func:`measure_steps` whole variants of a step; the choice trusts these
  rows most;
* :func:`progress`, the one-line progress bar the measuring commands print.
"""

from jax_flashcomm._progress import progress
from jax_flashcomm.tune._measure import (TOLERANCE, main, measure_codec, measure_collectives,
                                         measure_link, measure_mesh, model_check)
from jax_flashcomm.tune._steps import (STEP_OPS, candidate_config, count_calls, measure_in_step,
                                       measure_steps)

__all__ = ["main", "measure_codec", "measure_collectives", "measure_link", "measure_mesh",
           "model_check", "TOLERANCE", "measure_in_step", "measure_steps", "candidate_config",
           "count_calls", "STEP_OPS", "progress"]
