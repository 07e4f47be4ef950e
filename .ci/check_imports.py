"""Private names across modules: what import-linter (pyproject.toml, [tool.importlinter]) cannot
see, since it checks which modules import which, not the names they take.

In ``models/``, ``benchmarks/`` and ``examples/`` it flags every private name (``_x``, not a
dunder) taken from a module of ``jax_flashcomm``, ``models`` or ``benchmarks`` other than the
file's own module:

* ``from jax_flashcomm.x import _name`` and ``from jax_flashcomm import _module``;
* ``import jax_flashcomm._x`` (a private module anywhere in the dotted path);
* ``mod._name``, where ``mod`` is bound in the file by an import of one of those packages
  (``from jax_flashcomm import scatter_gather`` ... ``scatter_gather._decode_gathered``).

``jax_flashcomm``'s own files may use its internals (its layers are import-linter's business).
``ALLOWED`` would list uses left until ``jax_flashcomm`` gives them public names. Exits 1 on a
finding, printing ``path:line: what``; the whole run takes well under a second.

    .venv/bin/python .ci/check_imports.py
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECKED = ("models", "benchmarks", "examples")
PACKAGES = ("jax_flashcomm", "models", "benchmarks")

#: (file, "module.name") pairs allowed for now: a private name that has no public one yet, each
#: with the reason (none today: add one only with an issue to give it a public name).
ALLOWED: set[tuple[str, str]] = set()


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, own: str, is_package: bool) -> str:
    """The absolute module of ``from <module> import ...`` (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = own.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def check_file(path: Path) -> list[str]:
    rel = path.relative_to(ROOT).as_posix()
    own = _module_of(path)
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
    found: list[tuple[int, str]] = []
    bound: dict[str, str] = {}  # local name -> the dotted name it was imported as

    def ours(module: str) -> bool:
        return module.split(".")[0] in PACKAGES and module != own

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not ours(alias.name):
                    continue
                parts = alias.name.split(".")
                if any(_private(p) for p in parts):
                    found.append((node.lineno, alias.name))
                if alias.asname:
                    bound[alias.asname] = alias.name
                else:
                    bound[parts[0]] = parts[0]
        elif isinstance(node, ast.ImportFrom):
            module = _resolve(node, own, path.name == "__init__.py")
            if not ours(module):
                continue
            if any(_private(p) for p in module.split(".")):
                found.append((node.lineno, module))
            for alias in node.names:
                full = f"{module}.{alias.name}"
                if _private(alias.name) and full != own:
                    found.append((node.lineno, full))
                bound[alias.asname or alias.name] = full
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in bound:
                full = ".".join([bound[base.id], *reversed(chain)])
                found.append((node.lineno, full))
    return [f"{rel}:{line}: private name {name}" for line, name in sorted(set(found))
            if (rel, name) not in ALLOWED
            and not any((rel, name.rsplit(".", k)[0]) in ALLOWED for k in range(1, 3))]


def main() -> int:
    files = sorted(p for d in CHECKED for p in (ROOT / d).rglob("*.py"))
    problems = [msg for p in files for msg in check_file(p)]
    for msg in problems:
        print(msg)
    print(f"check_imports: {len(files)} files, "
          f"{len(problems) or 'no'} private name{'s' if len(problems) != 1 else ''} across modules")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
