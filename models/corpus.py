"""English text for perplexity checks, from packages available offline.

    .venv/bin/python -m models.corpus [--name NAME] [--out FILE] [--stats]

The default text, ``pydoc-topics``, is the prose of the *Python Language Reference* as shipped
in CPython's standard library module ``pydoc_data.topics`` (the texts behind ``help("if")``,
``help("assignment")``...): every topic in sorted key order, with grammar productions and code
examples (indented blocks), heading underlines and "Related help topics" lines dropped, and each
paragraph's whitespace collapsed to single spaces; paragraphs are joined by a blank line. About
43 000 words of continuous technical English. Licence: PSF License Version 2 (the Python
documentation's licence). It ships with every Python, so nothing is downloaded or installed; the
text follows the Python version (3.11.7 here), so a reference and the run it checks must read the
same file: write it once with ``--out`` and give that file to both.

``idle-help`` is a shorter alternative (~6 000 words): the paragraphs of IDLE's user guide,
``idlelib/help.html``, also in the standard library under the PSF licence.

Rejected candidates: gensim's ``test_data/lee_background.cor`` (ABC news, ~60 000 words, no clear
licence for the text) and its shortened Wikipedia dump (raw wikitext that needs a markup parser).
"""

from __future__ import annotations

import argparse
import html
import re
import sys
from pathlib import Path

from models import cli


def _paragraphs(text: str):
    """Yields blank-line-separated blocks of ``text`` as lists of lines."""
    block: list[str] = []
    for line in text.splitlines() + [""]:
        if line.strip():
            block.append(line)
        elif block:
            yield block
            block = []


def _is_prose(block: list[str]) -> bool:
    first = block[0]
    indent = len(first) - len(first.lstrip())
    if indent >= 3 and not first.lstrip().startswith("* "):
        return False  # grammar productions, code examples, doctests
    if re.fullmatch(r"[*=\-^~]+", first.strip()) or first.startswith("Related help topics:"):
        return False
    return True


def pydoc_topics() -> str:
    """The Language Reference prose of ``pydoc_data.topics`` (see the module docstring)."""
    from pydoc_data.topics import topics

    out = []
    for key in sorted(topics):
        for block in _paragraphs(topics[key]):
            # a heading's underline shares its block with the heading: drop the underline line
            lines = [ln for ln in block if not re.fullmatch(r"\s*[*=\-^~]{3,}\s*", ln)]
            if lines and _is_prose(lines):
                out.append(" ".join(" ".join(lines).split()))
    return "\n\n".join(out) + "\n"


def idle_help() -> str:
    """The ``<p>`` paragraphs of IDLE's user guide, tags stripped and entities unescaped."""
    import idlelib

    src = (Path(idlelib.__file__).parent / "help.html").read_text(encoding="utf-8")
    out = []
    for p in re.findall(r"<p>(.*?)</p>", src, flags=re.S):
        words = html.unescape(re.sub(r"<[^>]+>", "", p)).split()
        if words:
            out.append(" ".join(words))
    return "\n\n".join(out) + "\n"


# name -> (description, source package, licence, function returning the text)
TEXTS = {
    "pydoc-topics": ("Python Language Reference help topics, prose only (~43k words)",
                     "CPython standard library: pydoc_data.topics", "PSF-2.0", pydoc_topics),
    "idle-help": ("IDLE user guide paragraphs (~6k words)",
                  "CPython standard library: idlelib/help.html", "PSF-2.0", idle_help),
}
DEFAULT = "pydoc-topics"


def load_text(name: str | None = None) -> str:
    """The text registered under ``name`` (default: ``DEFAULT``); deterministic per Python."""
    return TEXTS[name or DEFAULT][3]()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m models.corpus",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--name", default=DEFAULT, choices=sorted(TEXTS))
    parser.add_argument("--out", help="file to write (default: stdout)")
    parser.add_argument("--stats", action="store_true", help="print sizes, not the text")
    return parser


def main(argv=None) -> int:
    return cli.run_main(build_parser(), _main, argv)


def _main(args) -> int:
    text = load_text(args.name)
    if args.stats:
        desc, src, lic, _ = TEXTS[args.name]
        print(f"{args.name}: {desc}; {src}; {lic}; {len(text.split())} words, "
              f"{text.count(chr(10) * 2)} paragraphs, {len(text)} chars")
    elif args.out:
        Path(args.out).write_text(text, encoding="utf-8")
    else:
        sys.stdout.buffer.write(text.encode("utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
