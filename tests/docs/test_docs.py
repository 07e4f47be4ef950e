"""The docs' re-run commands work on any clone: they use the environment the README sets up
(``.venv/bin/python``, ``.venv/bin/pip``) and name no path of one machine."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "models").rglob("*.md")])
# Scripts whose docstrings and JSON records carry re-run commands.
SCRIPTS = sorted([*(ROOT / "benchmarks").rglob("*.py"), *(ROOT / "models").rglob("*.py"),
                  *(ROOT / "examples").glob("*.py"), *(ROOT / "docs").glob("**/*.json")])
# A bare interpreter or pip at the start of a command (line start, after `, $, ( or a
# VAR=value prefix): it would run whatever python the reader's PATH has first.
BARE = re.compile(r"(?:^|[`$(]|\w=\S+ )\s*(python3?|pip3?|pytest)\s")
# The one bare interpreter a reader needs: the one that creates the environment.
ALLOWED_BARE = re.compile(r"python3 -m venv (\.venv|refvenv)")
MACHINE_PATH = re.compile(r"(?<![\w.~])/(work|home|root|mnt|scratch|Users)/")


def _lines(path):
    return enumerate(path.read_text().splitlines(), 1)


@pytest.mark.parametrize("path", DOCS + SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_commands_use_the_readme_environment(path):
    bad = [f"{path.name}:{n}: {line.strip()}" for n, line in _lines(path)
           if BARE.search(line) and not ALLOWED_BARE.search(line)]
    assert not bad, "commands outside .venv:\n" + "\n".join(bad)


@pytest.mark.parametrize("path", DOCS + SCRIPTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_machine_specific_paths(path):
    bad = [f"{path.name}:{n}: {line.strip()}" for n, line in _lines(path)
           if MACHINE_PATH.search(line)]
    assert not bad, "machine-specific paths:\n" + "\n".join(bad)


def test_the_checks_catch_what_they_name():
    assert BARE.search("`python benchmarks/codec.py`")
    assert BARE.search("FLASHCOMM_CPU_ISA=avx2 python benchmarks/allreduce.py")
    assert BARE.search("pip install -e .")
    assert not BARE.search("`.venv/bin/python benchmarks/codec.py`")
    assert MACHINE_PATH.search("run /work/main/.venv/bin/python x.py")
    assert not MACHINE_PATH.search("~/.cache/jax_flashcomm/models, /tmp/x and ./work/y")
