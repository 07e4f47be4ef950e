"""All-pairs selection of a parameter grid: the fewest rows (greedily) of the full product such
that every value of every axis meets every value of every other axis in some row.

The suite's parity grids (bits x group size x dtype x ...) grew to thousands of compiled
programs; a fault that needs a particular value of each of two parameters shows in the all-pairs
rows, and CI keeps to its 2-core budget (docs/build.md). ``always`` adds rows of the full
product that must stay (a default configuration, say) whatever the covering picks.
FLASHCOMM_TEST_FULL_GRIDS=1 (set before pytest starts) runs every grid whole instead.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Sequence


def full_grids() -> bool:
    """Whether FLASHCOMM_TEST_FULL_GRIDS=1 asks for every grid whole."""
    return os.environ.get("FLASHCOMM_TEST_FULL_GRIDS") == "1"


def _pairs(row: tuple) -> set:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def all_pairs(*axes: Sequence, always: Callable[..., bool] | None = None) -> list[tuple]:
    """Rows of ``itertools.product(*axes)`` covering every pair of values of two axes.

    Args:
      *axes: the values of each parameter (at least two axes).
      always: a predicate on a row's values; rows it accepts are all kept.

    Returns:
      The rows, in the product's order (deterministic: the same list on every run); the whole
      product when FLASHCOMM_TEST_FULL_GRIDS=1.
    """
    if len(axes) < 2:
        raise ValueError("all_pairs needs at least two axes")
    product = list(itertools.product(*axes))
    if full_grids():
        return product
    pairs = {r: _pairs(r) for r in product}
    keep = {r for r in product if always is not None and always(*r)}
    uncovered = set().union(*pairs.values()).difference(*(pairs[r] for r in keep))
    while uncovered:
        best = max(product, key=lambda r: len(pairs[r] & uncovered))
        keep.add(best)
        uncovered -= pairs[best]
    return [r for r in product if r in keep]
