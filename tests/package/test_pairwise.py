"""tests/support/pairwise.py: the rows the parity grids keep cover every pair of values."""

import itertools

import pytest

from tests.support.pairwise import all_pairs


def _covered(rows, axes):
    for i, j in itertools.combinations(range(len(axes)), 2):
        seen = {(r[i], r[j]) for r in rows}
        assert seen == set(itertools.product(axes[i], axes[j])), (i, j)


@pytest.mark.parametrize("axes", [((2, 3, 4, 5, 6, 7, 8), (8, 32, 128, 512), ("f32", "bf16", "f16")),
                                  ((0, 1), ("a", "b", "c"), (True, False), ("x", "y")),
                                  ((1, 2), (3, 4))])
def test_every_pair_is_covered_by_fewer_rows(axes):
    rows = all_pairs(*axes)
    _covered(rows, axes)
    full = list(itertools.product(*axes))
    assert set(rows) <= set(full) and len(set(rows)) == len(rows)
    assert rows == [r for r in full if r in rows]           # the product's order
    if len(axes) > 2:
        assert len(rows) < len(full)
    assert rows == all_pairs(*axes)                           # deterministic


def test_always_keeps_its_rows():
    axes = ((2, 4, 8), (32, 128), ("f32", "bf16"))
    rows = all_pairs(*axes, always=lambda b, g, d: g == 128 and d == "bf16")
    assert {(b, 128, "bf16") for b in (2, 4, 8)} <= set(rows)
    _covered(rows, axes)


def test_full_grids_on_request(monkeypatch):
    axes = ((2, 4, 8), (32, 128), ("f32", "bf16"))
    assert len(all_pairs(*axes)) < 12
    monkeypatch.setenv("FLASHCOMM_TEST_FULL_GRIDS", "1")
    assert all_pairs(*axes) == list(itertools.product(*axes))


def test_one_axis_is_an_error():
    with pytest.raises(ValueError, match="at least two axes"):
        all_pairs((1, 2, 3))
