"""The import-linter contracts (pyproject.toml, [tool.importlinter]) hold on the tree, and break
when a lower layer imports a higher one: each case copies the package, adds one upward import
and runs the same contracts on the copy."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# lint-imports on a copy of the tree: the editable install's finder would resolve
# jax_flashcomm to this checkout, so the driver drops it and puts the copy first.
_DRIVER = textwrap.dedent("""
    import sys
    sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in type(f).__module__.lower()]
    sys.path.insert(0, sys.argv[1])
    sys.argv = ["lint-imports", "--config", sys.argv[2], "--no-logo", "--no-cache"]
    from importlinter.cli import lint_imports_command
    sys.exit(lint_imports_command())
""")

#: (module file, an import of a higher layer it must not make, the contract that says so)
UPWARD = [
    ("jax_flashcomm/costs/_model.py", "from jax_flashcomm import planner", "layers"),
    ("jax_flashcomm/transport/base.py", "from jax_flashcomm import allreduce", "layers"),
    ("jax_flashcomm/planner/_plan.py", "from jax_flashcomm import tune", "layers"),
    ("jax_flashcomm/codec/spec.py", "from jax_flashcomm import config", "layers"),
    ("jax_flashcomm/nn/comm.py", "from jax_flashcomm import rewrite", "layers"),
    ("jax_flashcomm/allreduce.py", "import models", "library-alone"),
]


def _lint(tree: pathlib.Path) -> subprocess.CompletedProcess:
    config = tree / "pyproject.toml"
    return subprocess.run([sys.executable, "-c", _DRIVER, str(tree), str(config)], cwd=tree,
                          capture_output=True, text=True, timeout=300)


def _copy(tmp_path: pathlib.Path) -> pathlib.Path:
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.pyc")
    for name in ("jax_flashcomm", "models", "benchmarks"):
        shutil.copytree(ROOT / name, tree / name, ignore=ignore)
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    return tree


def test_the_contracts_hold_on_a_copy_of_the_tree(tmp_path):
    result = _lint(_copy(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("path,statement,contract", UPWARD, ids=[u[0] for u in UPWARD])
def test_an_upward_import_breaks_a_contract(tmp_path, path, statement, contract):
    tree = _copy(tmp_path)
    target = tree / path
    lines = target.read_text().splitlines(keepends=True)
    at = next(i for i, line in enumerate(lines) if line.startswith(("from ", "import "))
              and "__future__" not in line)
    lines.insert(at, statement + "  # noqa\n")
    target.write_text("".join(lines))
    result = _lint(tree)
    assert result.returncode != 0, result.stdout
    assert "0 broken" not in result.stdout, result.stdout
    assert contract_name(contract) in result.stdout.replace("\n", " ")


def contract_name(contract_id: str) -> str:
    """The name of the contract ``contract_id`` in pyproject.toml (what lint-imports prints)."""
    import tomllib

    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    name = next(c["name"] for c in contracts["contracts"] if c["id"] == contract_id)
    return name.split(":")[0][:40]
