"""The generated parts of the docs: the block a benchmark writes between two markers of a
hand-written page."""

from __future__ import annotations

from pathlib import Path

__all__ = ["replace_block"]


def replace_block(path: Path, begin: str, end: str, block: str) -> None:
    """Put ``block`` between the ``begin`` and ``end`` markers of ``path``, keeping the rest of
    the page; a missing file becomes a page of just the block. A page without the markers is a
    ValueError (it is not overwritten)."""
    path = Path(path)
    body = f"{begin}\n{block.rstrip(chr(10))}\n{end}"
    if not path.exists():
        path.write_text(body + "\n")
        return
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' markers")
    head, rest = text.split(begin, 1)
    path.write_text(head + body + rest.split(end, 1)[1])
