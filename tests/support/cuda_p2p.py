"""Helpers of the CUDA peer-to-peer build tests (tests/transport/test_cuda_p2p_build.py and
tests/transport/test_cuda_ring_build.py): the CUDA module, the FFI handlers' bindings read from
the sources, a host-side compile of a handler file, a mesh, an HLO attribute (also one field
of a group-format attribute)."""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import pathlib
import re
import shlex
import shutil
import subprocess

import jax
import pytest

from tests.support.cuda_build import ROOT, _nvcc

# A handler's binding: its contexts (.Ctx<T>()), then the op's builder of flashcomm/bindings.h
# (bind::Name<...>(...): every operand, result and attribute, the same for CPU and CUDA).
_CTX = re.compile(r"\.Ctx<((?:[^<>]|<[^<>]*>)*)>\(\s*\)")
_BUILDER = re.compile(r"bind::(\w+)(?:<([^<>()]*)>)?\(")
# The macros that define several handlers at once (the collectives, the ring steps), in the
# platform's collective_handlers.h and handlers.h.
_MACRO_USE = re.compile(r"(FLASHCOMM_DEFINE_\w+)\((.*?)\);", re.S)


def _split_args(text: str) -> list[str]:
    """A macro call's arguments: ``text`` split at its top-level commas."""
    args, depth, cur = [], 0, ""
    for ch in text:
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
            continue
        depth += (ch in "(<[") - (ch in ")>]")
        cur += ch
    return [*args, cur.strip()]


def _define_bodies(text: str):
    """``(symbol, binding text)`` of every XLA_FFI_DEFINE_HANDLER_SYMBOL in ``text``."""
    for m in re.finditer(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+),(.*?)\);", text, re.S):
        yield m[1], m[2]


def _bindings(path: pathlib.Path) -> dict[str, list[tuple[str, str, str]]]:
    """handler symbol -> its binding: ``("Ctx", T, "")`` per context, then ``("Bind", builder,
    peers)`` (peers: the builder's template argument, "" for none). The FLASHCOMM_DEFINE_*
    macros of the platform's collective_handlers.h and handlers.h are expanded."""
    text = re.sub(r"//[^\n]*", "", re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.S))
    macros = {}
    for header in (path.with_name("collective_handlers.h"), path.with_name("handlers.h")):
        if not header.is_file():
            continue
        for m in re.finditer(r"#define (FLASHCOMM_DEFINE_\w+)\(([^)]*)\)((?:[^\n]*\\\n)*[^\n]*)",
                             header.read_text()):
            macros[m[1]] = ([p.strip() for p in m[2].split(",")], m[3].replace("\\\n", " "))
    for m in _MACRO_USE.finditer(text):
        if m[1] not in macros:
            continue
        params, body = macros[m[1]]
        args = _split_args(m[2])
        body = re.sub(r"//[^\n]*", "", body)
        for param, arg in zip(params, args):
            if param == "...":
                body = body.replace("__VA_ARGS__", ", ".join(args[len(params) - 1:]))
            else:
                body = re.sub(rf"(?<![\w]){param}(?![\w])", arg, body)
        text += "\n" + body.replace("##", "") + ";"
    out = {}
    for symbol, body in _define_bodies(text):
        entries = [("Ctx", re.sub(r"\s+", "", c).replace("xla::ffi::", "ffi::"), "")
                   for c in _CTX.findall(body)]
        builder = _BUILDER.search(body)
        if builder:
            peers = (builder[2] or "").rsplit("::", 1)[-1]
            entries.append(("Bind", builder[1], peers))
        out[symbol] = entries
    return out


def _cuda_module():
    try:
        from jax_flashcomm import _flashcomm_cuda
    except ImportError as err:
        pytest.skip(f"_flashcomm_cuda not built (FLASHCOMM_CUDA=OFF): {err}")
    return _flashcomm_cuda


def same_builders(cpu_source: pathlib.Path, cuda_source: pathlib.Path, handlers) -> dict:
    """Asserts that each of ``handlers`` (symbols without their platform suffix) binds through
    the same builder on both platforms and that the CUDA file declares no command-buffer trait;
    returns handler -> (its builder entry, the CPU contexts, the CUDA contexts)."""
    cpu, cuda = _bindings(cpu_source), _bindings(cuda_source)
    assert {h + "Cpu" for h in handlers} <= set(cpu), sorted(cpu)
    assert set(cuda) == {h + "Cuda" for h in handlers}, sorted(cuda)
    out = {}
    for h in handlers:
        cpu_sig = [e for e in cpu[h + "Cpu"] if e[0] != "Ctx"]
        cuda_sig = [e for e in cuda[h + "Cuda"] if e[0] != "Ctx"]
        assert cuda_sig == cpu_sig and len(cpu_sig) == 1, (h, cpu_sig, cuda_sig)
        kinds = [e[0] for e in cuda[h + "Cuda"]]
        assert kinds[-1] == "Bind" and set(kinds[:-1]) <= {"Ctx"}, (h, kinds)  # contexts first
        out[h] = (cpu_sig[0], [e[1] for e in cpu[h + "Cpu"] if e[0] == "Ctx"],
                  [e[1] for e in cuda[h + "Cuda"] if e[0] == "Ctx"])
    # Not CUDA-graph safe (host reads and waits per call): no command-buffer trait.
    assert "CmdBuffer" not in cuda_source.read_text()
    return out


HOST_LOG = "cuda_host_build.log"
WARNING_FLAGS = ("-Wall", "-Wextra", "-Werror")


def built_with_warnings_as_errors(source: pathlib.Path) -> str | None:
    """Where the installed CUDA build compiled ``source`` as it is here (the sha256 of every
    input it read) with ``-Wall -Wextra -Werror`` (FLASHCOMM_WERROR=ON, as CI builds), the
    log that says so (``cuda_host_build.log`` next to the module); else None."""
    spec = importlib.util.find_spec("jax_flashcomm._flashcomm_cuda")
    if spec is None or not spec.origin:
        return None
    log = pathlib.Path(spec.origin).with_name(HOST_LOG)
    if not log.is_file():
        return None
    rel = source.resolve().relative_to(ROOT).as_posix()
    section, inside = [], False
    for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
        if line == f"# source: {rel}":
            inside = True
        elif inside and line.startswith("# end: "):
            break
        elif inside:
            section.append(line)
    command = next((ln[len("# command: "):] for ln in section if ln.startswith("# command: ")),
                   "")
    inputs = [ln[len("# input: "):].split(" ", 1) for ln in section if ln.startswith("# input: ")]
    if not inputs or not all(f in shlex.split(command) for f in WARNING_FLAGS):
        return None
    for digest, path in inputs:
        f = ROOT / path
        if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
            return None
    return str(log)


def compile_host_source(source: pathlib.Path, out: pathlib.Path):
    """Compiles a plain-C++ CUDA handler file with g++ -Wall -Wextra -Werror (as the build's
    FLASHCOMM_WERROR=ON does), against nvcc's CUDA headers; skips without nvcc or g++. Where the
    installed build already compiled this very source with those flags (CI's build), its log
    is the evidence and nothing is compiled again."""
    if built_with_warnings_as_errors(source) is not None:
        return
    nvcc, cxx = _nvcc(), shutil.which("g++")
    if nvcc is None or cxx is None:
        pytest.skip("needs nvcc (for the CUDA headers) and g++")
    candidates = [pathlib.Path(nvcc).resolve().parents[1] / "include",
                  pathlib.Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "include",
                  pathlib.Path("/usr/local/cuda/include")]
    cuda_include = next((c for c in candidates if (c / "cuda_runtime_api.h").is_file()), None)
    if cuda_include is None:
        pytest.skip(f"no cuda_runtime_api.h under {[str(c) for c in candidates]}")
    cmd = [cxx, "-std=c++17", "-O3", "-Wall", "-Wextra", "-Werror", "-ffp-contract=off", "-fPIC",
           f"-I{ROOT / 'ffi' / 'include'}", f"-I{ROOT / 'ffi'}", f"-I{ROOT / 'ffi' / 'cuda'}",
           "-isystem", str(ROOT / "third_party" / "xla_ffi" / "include"),
           "-isystem", str(cuda_include), "-c", str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:math.prod(shape)])


def _attr(line: str, name: str, field: str | None = None) -> str:
    """The integer attribute ``name`` of a custom call's text line, or the field ``field`` of
    its dictionary attribute ``name`` (a GroupFormat: ``fmt``, ``out_fmt``)."""
    if field is not None:
        m = re.search(rf"\b{name} = \{{([^{{}}]*)\}}", line)
        assert m, f"no {name} in {line}"
        return _attr(m[1], field)
    m = re.search(rf"\b{name} = (-?\d+) : i(?:32|64)", line)
    assert m, f"no {name} in {line}"
    return m[1]
