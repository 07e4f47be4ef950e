"""The README's fast subset (``-m "not slow"``) leaves out the slow modules: conftest.py's one
collection hook marks them (a second hook of the same name would silently replace it)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_not_slow_deselects_a_slow_module():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-m", "not slow", "tests/test_spikes.py"],
        cwd=ROOT, capture_output=True, text=True).stdout
    last = out.strip().splitlines()[-1]
    assert re.match(r"no tests collected \(\d+ deselected\)", last), out
