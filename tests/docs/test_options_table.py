"""docs/layout.md's option table is the one CommConfig gives (jax_flashcomm.config.options_table):
one row per documented option, every field of the dataclass in it, defaults from the dataclass.

Regenerate the block with ``python tests/docs/test_options_table.py``."""

from __future__ import annotations

import dataclasses
import pathlib
import re
import sys

from jax_flashcomm import config

LAYOUT = pathlib.Path(__file__).resolve().parents[2] / "docs" / "layout.md"
BLOCK = re.compile(r"(<!-- options table: jax_flashcomm.config.options_table\(\) -->\n)(.*?)"
                   r"(<!-- end options table -->)", re.S)


def test_the_docs_table_is_the_generated_one():
    found = BLOCK.search(LAYOUT.read_text())
    assert found, "docs/layout.md has no options table block"
    assert found.group(2) == config.options_table(), (
        "docs/layout.md's option table differs from CommConfig: run "
        "python tests/docs/test_options_table.py")


def test_every_field_has_a_row_with_its_default():
    table = config.options_table()
    for field in dataclasses.fields(config.CommConfig):
        row = next(line for line in table.splitlines() if f"`{field.name}`" in line.split("|")[1])
        shown = f'"{field.default}"' if isinstance(field.default, str) else repr(field.default)
        assert f"`{shown}`" in row.split("|")[2], field.name


if __name__ == "__main__":
    text = LAYOUT.read_text()
    if not BLOCK.search(text):
        sys.exit("docs/layout.md has no options table block")
    LAYOUT.write_text(BLOCK.sub(lambda m: m.group(1) + config.options_table() + m.group(3), text))
