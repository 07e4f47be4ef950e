"""The package's JSON files (tuning tables, policies) are read by one function: deep nesting,
bad JSON and bad UTF-8 are a ValueError naming the file, for every kind of file."""

from __future__ import annotations

import pytest

from jax_flashcomm import CommPolicy
from jax_flashcomm.costs import _table

LOADERS = {"tuning table": _table.load, "policy": CommPolicy.load}
BAD = {"nested": ("[" * 200_000 + "]" * 200_000).encode(), "not JSON": b"{not json",
       "not UTF-8": b'{"a": "\xff"}'}


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("loader", list(LOADERS))
def test_a_bad_file_is_a_value_error_naming_it(tmp_path, loader, kind):
    path = tmp_path / "file.json"
    path.write_bytes(BAD[kind])
    with pytest.raises(ValueError, match=r"file\.json: not") as err:
        LOADERS[loader](path)
    assert str(path) in str(err.value)
