"""No file over 400 lines and no function over 80 lines without a one-line reason at its top.

A file over the limit carries ``long file: <reason>`` in a comment (or its docstring) within its
first five lines; a function over the limit carries ``long function: <reason>`` in a comment
(or its docstring) within the three lines after the line that opens it. Checked over the files
git tracks: Python by its syntax tree, C++ / CUDA by matching braces.

Usage: ``python .ci/check_sizes.py [ROOT]``; exits 1 and lists each offender.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

FILE_LIMIT = 400
FUNCTION_LIMIT = 80
FILE_MARK = "long file:"
FUNCTION_MARK = "long function:"
PYTHON = (".py",)
CXX = (".cc", ".h", ".cu", ".cuh", ".cpp")
SKIPPED = ("third_party/",)
_CONTROL = re.compile(r"^\s*(inline\s+namespace|if|for|while|switch|catch|else|do|namespace|"
                      r"struct|class|union|enum|extern|try|return|"
                      r"template\s*<[^>]*>\s*(struct|class))\b")


def tracked_files(root: pathlib.Path) -> list[pathlib.Path]:
    """The files git tracks under ``root`` with a Python or C++ ending (``third_party/`` left
    out)."""
    names = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"],
                           cwd=root, check=True, capture_output=True, text=True).stdout.split()
    return [root / n for n in names if n.endswith(PYTHON + CXX) and not n.startswith(SKIPPED)
            and (root / n).is_file()]


def python_functions(text: str):
    """``(name, first line, last line)`` of every function in Python source ``text``."""
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno


def _strip(line: str) -> str:
    """``line`` without its string literals and ``//`` comment (good enough to count braces)."""
    line = re.sub(r'"(\\.|[^"\\])*"', '""', line)
    line = re.sub(r"'(\\.|[^'\\])'", "''", line)
    return line.split("//", 1)[0]


def cxx_functions(text: str):
    """``(name, first line, last line)`` of every function body in C++ / CUDA source ``text``:
    a ``{`` that closes a statement with parentheses that is not a control statement, and its
    matching ``}``."""
    lines = text.splitlines()
    statement, opened, depth, in_comment, directive = "", [], 0, False, False
    for number, raw in enumerate(lines, 1):
        line = raw
        if directive or raw.lstrip().startswith("#"):  # preprocessor lines, continued or not
            directive = raw.rstrip().endswith("\\")
            continue
        if in_comment:
            if "*/" not in line:
                continue
            line, in_comment = line.split("*/", 1)[1], False
        line = re.sub(r"/\*.*?\*/", "", _strip(line))
        if "/*" in line:
            line, in_comment = line.split("/*", 1)[0], True
        for char in line:
            if char == "{":
                head = statement.strip()
                before = head.split("(")[0]
                is_function = "(" in head and not _CONTROL.match(head) and "=" not in before
                name = before.split()[-1] if is_function and before.split() else ""
                opened.append((name if is_function else None, number, depth))
                depth += 1
                statement = ""
            elif char == "}":
                depth -= 1
                if opened:
                    name, start, _ = opened.pop()
                    if name is not None:
                        yield name, start, number
                statement = ""
            elif char == ";":
                statement = ""
            else:
                statement += char
        statement += " "


def _marked(lines: list[str], start: int, count: int, mark: str) -> bool:
    return any(mark in line for line in lines[start:start + count])


def offenders(root: pathlib.Path) -> list[str]:
    """Every file and function over its limit without its reason, as ``path:line: what``."""
    found = []
    for path in tracked_files(root):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.splitlines()
        rel = path.relative_to(root)
        if len(lines) > FILE_LIMIT and not _marked(lines, 0, 5, FILE_MARK):
            found.append(f"{rel}:1: {len(lines)} lines, no '{FILE_MARK} <reason>' in its first 5")
        functions = python_functions(text) if path.suffix in PYTHON else cxx_functions(text)
        for name, first, last in functions:
            long = last - first + 1 > FUNCTION_LIMIT
            if long and not _marked(lines, first - 1, 4, FUNCTION_MARK):
                found.append(f"{rel}:{first}: {name} is {last - first + 1} lines, no "
                             f"'{FUNCTION_MARK} <reason>' at its top")
    return found


def main(argv: list[str]) -> int:
    root = pathlib.Path(argv[1] if len(argv) > 1 else pathlib.Path(__file__).parents[1]).resolve()
    found = offenders(root)
    for line in found:
        print(line)
    print(f"{len(found)} over the size limits (files {FILE_LIMIT} lines, functions "
          f"{FUNCTION_LIMIT})" if found else "sizes: every file and function within its limit "
          "or says why not")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
