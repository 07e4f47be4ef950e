"""All-pairs selection of a parameter grid: the fewest rows (greedily) of the full product such
that every value of every axis meets every value of every other axis in some row.

The suite's parity grids (bits x group size x dtype x ...) grew to thousands of compiled
programs; a fault that needs a particular value of each of two parameters shows in the all-pairs
rows, and CI keeps to its 2-core budget (docs/build.md). ``always`` adds rows of the full
product that must stay (a default configuration, say) whatever the covering picks.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence


def _pairs(row: tuple) -> set:
    return {(i, row[i], j, row[j]) for i, j in itertools.combinations(range(len(row)), 2)}


def all_pairs(*axes: Sequence, always: Callable[..., bool] | None = None) -> list[tuple]:
    """Rows of ``itertools.product(*axes)`` covering every pair of values of two axes.

    Args:
      *axes: the values of each parameter (at least two axes).
      always: a predicate on a row's values; rows it accepts are all kept.

    Returns:
      The rows, in the product's order (deterministic: the same list on every run).
    """
    if len(axes) < 2:
        raise ValueError("all_pairs needs at least two axes")
    product = list(itertools.product(*axes))
    keep = {r for r in product if always is not None and always(*r)}
    uncovered = set().union(*(_pairs(r) for r in product))
    for r in keep:
        uncovered -= _pairs(r)
    while uncovered:
        best = max(product, key=lambda r: len(_pairs(r) & uncovered))
        keep.add(best)
        uncovered -= _pairs(best)
    return [r for r in product if r in keep]
