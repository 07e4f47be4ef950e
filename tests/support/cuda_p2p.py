"""Helpers of the CUDA peer-to-peer build tests (tests/transport/test_cuda_p2p_build.py and
tests/transport/test_cuda_ring_build.py): the CUDA module, the FFI handlers' bindings read from
the sources, a host-side compile of a handler file, a mesh, an HLO attribute."""

from __future__ import annotations

import math
import os
import pathlib
import re
import shutil
import subprocess

import jax
import pytest

from tests.support.cuda_build import ROOT, _nvcc

# One binding entry: .Arg<T>(), .Ret<T>(), .Ctx<T>(), .Attr<T>("name") (T nests one level).
_ENTRY = re.compile(r"\.(Arg|Ret|Attr|Ctx)<((?:[^<>]|<[^<>]*>)*)>\(\s*(?:\"(\w+)\")?\s*\)")


def _cuda_module():
    try:
        from jax_flashcomm import _flashcomm_cuda
    except ImportError as err:
        pytest.skip(f"_flashcomm_cuda not built (FLASHCOMM_CUDA=OFF): {err}")
    return _flashcomm_cuda


def _bindings(path: pathlib.Path) -> dict[str, list[tuple[str, str, str]]]:
    """handler symbol -> its binding entries, the file's FLASHCOMM_P2P_* macros expanded."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text())
    macros = {m[1]: m[2].replace("\\\n", " ")
              for m in re.finditer(r"#define (FLASHCOMM_(?:P2P|SHM)_\w+)((?:[^\n]*\\\n)*[^\n]*)", text)}
    out = {}
    for m in re.finditer(r"XLA_FFI_DEFINE_HANDLER_SYMBOL\(\s*(\w+),(.*?)\);", text, re.S):
        body = re.sub(r"//[^\n]*", "", m[2])
        for name, definition in macros.items():
            body = body.replace(name, definition)
        out[m[1]] = [(e[1], re.sub(r"\s+", "", e[2]), e[3] or "") for e in _ENTRY.finditer(body)]
    return out


def compile_host_source(source: pathlib.Path, out: pathlib.Path):
    """Compiles a plain-C++ CUDA handler file with g++ -Wall -Wextra -Werror (as the build's
    FLASHCOMM_WERROR=ON does), against nvcc's CUDA headers; skips without nvcc or g++."""
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
           f"-I{ROOT / 'ffi' / 'include'}", f"-I{ROOT / 'ffi' / 'cuda'}",
           "-isystem", str(ROOT / "third_party" / "xla_ffi" / "include"),
           "-isystem", str(cuda_include), "-c", str(source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"


def _mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Explicit,) * len(shape),
                         devices=jax.devices()[:math.prod(shape)])


def _attr(line: str, name: str) -> str:
    m = re.search(rf"\b{name} = (-?\d+) : i(?:32|64)", line)
    assert m, f"no {name} in {line}"
    return m[1]
