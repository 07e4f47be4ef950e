"""The size rule (.ci/check_sizes.py): the tree holds it, and the checker finds a long file, a
long Python function and a long C++ function that give no reason, and accepts them with one."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_sizes", ROOT / ".ci" / "check_sizes.py")
check_sizes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check_sizes)


def test_the_tree_holds_the_rule():
    assert check_sizes.offenders(ROOT) == []


def _repo(tmp_path, files: dict) -> pathlib.Path:
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    return tmp_path


def test_long_files_and_functions_need_a_reason(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(85))
    cxx = "".join(f"  int v{i} = {i};\n" for i in range(85))
    repo = _repo(tmp_path, {
        "long.py": "".join(f"a{i} = {i}\n" for i in range(401)),
        "func.py": f"def f():\n{body}",
        "func.cc": f"int f(int a) {{\n{cxx}  return a;\n}}\n",
        "reasoned.py": f"def g():\n    # long function: a table\n{body}",
        "reasoned.cc": f"int g(int a) {{\n  // long function: a table\n{cxx}  return a;\n}}\n",
    })
    found = check_sizes.offenders(repo)
    assert sorted(line.split(":")[0] for line in found) == ["func.cc", "func.py", "long.py"]
    assert any("f is 86 lines" in line for line in found)
