"""Keep the CUDA build's nvcc output, so the tests read it instead of compiling the kernels again.

nvcc runs with -Xptxas=-v (registers, spills and stack per kernel and architecture) and the
build's warning flags; tests/codec/test_cuda_build.py checks that output (docs/cuda.md, "Build time").

  ptxas_log.py run ROOT LOGDIR -- COMPILER ARGS...
      The CUDA_COMPILER_LAUNCHER of CMakeLists.txt. Runs the compile, passes its stdout and
      stderr on unchanged and returns its exit code. After a successful compile it writes
      LOGDIR/<source file name>.log: the source, the command, the sha256 of every input file
      under ROOT (from nvcc's depfile, -MF) and the output. The tests compare those hashes with
      the files they see, so a log older than the sources is never used.
  ptxas_log.py combine OUT LOGDIR SOURCE...
      Concatenates the logs of SOURCE... into OUT (installed as jax_flashcomm/cuda_ptxas.log;
      the handlers' host compiles, logged by the same launcher, as cuda_host_build.log).
      A missing log becomes a "# missing:" line, which makes the tests compile instead: a log
      never fails the build.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import subprocess
import sys

HEADER = "# jax_flashcomm cuda_ptxas.log v1: nvcc output of the CUDA build, per source file"


def _arg_after(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args[:-1]):
        if a == flag:
            return args[i + 1]
    return None


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _inputs(depfile: str | None, root: str) -> list[str] | None:
    """Paths (relative to root) of the depfile's dependencies under root; None if unknown."""
    if not depfile or not os.path.isfile(depfile):
        return None
    with open(depfile, encoding="utf-8", errors="replace") as f:
        text = f.read().replace("\\\n", " ")
    _, _, deps = text.partition(": ")
    rels = set()
    for dep in re.split(r"(?<!\\)\s+", deps.strip()):
        path = os.path.realpath(dep.replace("\\ ", " "))
        if dep and os.path.commonpath([path, root]) == root:
            rels.add(os.path.relpath(path, root))
    return sorted(rels)


def run(root: str, logdir: str, cmd: list[str]) -> int:
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    sys.stdout.buffer.write(proc.stdout)
    sys.stderr.buffer.write(proc.stderr)
    source = _arg_after(cmd, "-c")
    if source is None:
        return proc.returncode
    log = os.path.join(logdir, os.path.basename(source) + ".log")
    try:
        if os.path.exists(log):
            os.remove(log)
        if proc.returncode != 0:
            return proc.returncode
        root = os.path.realpath(root)
        inputs = _inputs(_arg_after(cmd, "-MF"), root)
        lines = [f"# source: {os.path.relpath(os.path.realpath(source), root)}",
                 f"# command: {shlex.join(cmd)}"]
        if inputs is None:
            lines.append("# inputs: unknown")
        else:
            lines += [f"# input: {_sha256(os.path.join(root, p))} {p}" for p in inputs]
        output = (proc.stdout + proc.stderr).decode("utf-8", errors="replace")
        os.makedirs(logdir, exist_ok=True)
        with open(log + ".tmp", "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n" + output.rstrip("\n") + "\n")
        os.replace(log + ".tmp", log)
    except OSError as err:  # the log is a convenience: never fail a good compile for it
        print(f"ptxas_log.py: could not write {log}: {err}", file=sys.stderr)
    return proc.returncode


def combine(out: str, logdir: str, sources: list[str]) -> int:
    parts = [HEADER]
    for source in sources:
        name = os.path.basename(source)
        path = os.path.join(logdir, name + ".log")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                parts.append(f.read().rstrip("\n"))
            parts.append(f"# end: {name}")
        else:
            parts.append(f"# missing: {name}")
    with open(out + ".tmp", "w", encoding="utf-8") as f:
        f.write("\n".join(parts) + "\n")
    os.replace(out + ".tmp", out)
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 4 and argv[0] == "run" and argv[3] == "--":
        return run(argv[1], argv[2], argv[4:])
    if len(argv) >= 3 and argv[0] == "combine":
        return combine(argv[1], argv[2], argv[3:])
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
