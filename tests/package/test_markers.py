"""The README's fast subset (``-m "not slow"``) leaves out the slow tests: the modules marked
``pytestmark = pytest.mark.slow``, the tests marked ``@pytest.mark.slow``, and the tests marked
``model`` (conftest.py's one collection hook marks those; a second hook of the same name would
silently replace it)."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_not_slow_deselects_a_slow_module():
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         "-m", "not slow", "tests/codec/test_spikes.py", "tests/collectives/test_psum.py",
         "tests/models/test_checkpoints.py"],
        cwd=ROOT, capture_output=True, text=True).stdout
    nodes = [line for line in out.splitlines() if "::" in line]
    last = out.strip().splitlines()[-1]
    assert "deselected" in last, out
    # A module marked slow: none of its tests.
    assert not [n for n in nodes if "test_spikes.py" in n], out
    # A test marked slow in a module that is not: it alone is left out.
    assert any("test_psum.py::" in n for n in nodes), out
    assert not [n for n in nodes if "::test_psum_grad" in n], out
    # A test marked `model`: slow through the collection hook.
    assert any("test_checkpoints.py::" in n for n in nodes), out
    assert not [n for n in nodes if "::test_smollm2_config" in n], out
