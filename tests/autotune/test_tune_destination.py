"""python -m jax_flashcomm.tune checks where the table goes before measuring: a folder, a path
under a regular file or a cache folder that is a file is an argparse error (exit 2) at once,
and a failed write leaves no temporary file."""

import os
import subprocess
import sys

import pytest

from jax_flashcomm.costs import _table as tuning

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tune(*args, env=None):
    return subprocess.run([sys.executable, "-m", "jax_flashcomm.tune", "--quick", *args],
                          capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, **(env or {})})


@pytest.mark.parametrize("where, match", [
    ("dir", "is a folder"), ("under_file", "is a file, not a folder")])
def test_bad_out_is_an_error_before_measuring(tmp_path, where, match):
    (tmp_path / "afile").write_text("x")
    out = {"dir": tmp_path, "under_file": tmp_path / "afile" / "t.json"}[where]
    got = _tune("--out", str(out))
    assert got.returncode == 2 and match in got.stderr and "tuning on" not in got.stdout


def test_a_cache_folder_that_is_a_file_is_an_error(tmp_path):
    (tmp_path / "afile").write_text("x")
    got = _tune(env={tuning.CACHE_ENV: str(tmp_path / "afile")})
    assert got.returncode == 2 and "the cache" in got.stderr


def test_a_failed_save_leaves_no_temporary_file(tmp_path, monkeypatch):
    table = tuning.Table(key={"k": 1})

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tuning.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        tuning.save(table, tmp_path / "t.json")
    assert list(tmp_path.iterdir()) == []
