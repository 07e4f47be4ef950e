"""The docs describe what the code does now, for its users: history is git's. No page (nor the
README, nor a doc or comment of the package) tells of work sessions or periods, issue numbers,
commit hashes or dated runs."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "models").rglob("*.md")])
SOURCES = sorted([ROOT / "BUILD", ROOT / "CMakeLists.txt", *(ROOT / "jax_flashcomm").rglob("*.py"), *(ROOT / "models").rglob("*.py"),
                  *(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "ffi").rglob("*.cc"),
                  *(ROOT / "ffi").rglob("*.h"), *(ROOT / "ffi").rglob("*.cu*")])

HISTORY = {
    "a work session": re.compile(r"\b[Ss]essions?\b(?! (?:of|per|key|state|cookie)\b)"),
    "a work period": re.compile(r"\b(?:work )?periods? \d+\b|\bround \d+ of the\b", re.I),
    "an issue number": re.compile(r"\b[Ii]ssues? #?\d+\b|#\d{2,}\b"),
    # 7 to 12 lowercase hex digits with a digit and a letter, not a 0x literal or a digest
    "a commit hash": re.compile(r"(?<![0-9a-fx.])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}"
                                r"(?![0-9a-f])"),
    "a date": re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b"),
}


FLOAT = re.compile(r"\d+(?:e\d+)?f?")  # 38953e38, 0000001f: float literals, not hashes


def history(text: str) -> list[str]:
    """What in ``text`` narrates history: ``["a work session: 'session 7'", ...]``."""
    return [f"{what}: {m.group(0)!r}" for what, pattern in HISTORY.items()
            for m in pattern.finditer(text)
            if not (what == "a commit hash" and FLOAT.fullmatch(m.group(0)))]


@pytest.mark.parametrize("path", PAGES + SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_history(path):
    bad = [f"{path.name}:{n}: {hit}" for n, line in enumerate(path.read_text().splitlines(), 1)
           for hit in history(line)]
    assert not bad, "history belongs in git:\n" + "\n".join(bad)


def test_the_check_catches_what_it_names():
    for text in ("measured in session 7", "Issue 34 asks", "(issue 38)", "as of 10c8723,",
                 "work period 3", "on 2026-11-27 the run"):
        assert history(text), text
    for text in ("a sha256 of cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                 "site 0x2f5ea42d174f8e9b", "a session of the server", "the KV cache",
                 "the decode step", "deadbeef", "1234567", "3.38953e38", "0.015625f",
                 "0000001f"):
        assert not history(text), text
