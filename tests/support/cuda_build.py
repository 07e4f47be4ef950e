"""The CUDA build's ptxas report (nvcc's -Xptxas=-v output per ffi/cuda/*.cu: from the build's
cuda_ptxas.log when it matches the sources, else compiled once per session) and lowering
helpers, shared by tests/codec/test_cuda_build.py, tests/transport/test_cuda_gather_build.py,
tests/transport/test_cuda_p2p_build.py and tests/transport/test_cuda_ring_build.py (the
``ptxas_report`` fixture is in tests/conftest.py)."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import hashlib
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import tempfile
import warnings

import jax

import jax_flashcomm

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_SOURCES = sorted((ROOT / "ffi" / "cuda").glob("*.cu"))
ARCHS = ("80", "89", "90")
# Kernel templates instantiated by each codec .cu file: name -> instances per arch
# (gather_kernels.cu: tests/transport/test_cuda_gather_build.py). Every template has a kSpiked
# parameter (spike reserving: spikes = 0 and spikes > 0 are separate instances), so each count
# is (dtypes) x 2.
CODEC_KERNELS = {
    # the floating-point formats (docs/format.md): f32, bf16, f16 (the fused sum has no dtype)
    "fp_kernels.cu": {"FpQuantizeKernel": 3, "FpDequantizeKernel": 3, "FpDequantizeSumKernel": 3,
                      "FpDequantizeSumQuantizeKernel": 1},
    "codec_quantize.cu": {
        "QuantizeKernel": 6,  # (f32, bf16, f16) x (spikes = 0, spikes > 0)
        "QuantizeRotatedKernel": 6,  # rotation (docs/format.md "Rotation"): f32, bf16, f16 x 2
    },
    "codec_dequantize.cu": {"DequantizeKernel": 6, "DequantizeRotatedKernel": 6},
    "codec_dequantize_sum.cu": {
        "DequantizeSumKernel": 6,
        "DequantizeSumRotatedKernel": 6,
        "DequantizeSumQuantizeKernel": 4,  # (input, output) x (spikes = 0, spikes > 0)
    },
    # the fused all-reduce epilogue (docs/fused_norm.md): (f32, bf16, f16) x (f32, bf16
    # weights) x (spikes = 0, spikes > 0)
    "norm_kernels.cu": {"AddRmsNormKernel": 12},
    # the exact all-reduce's sum between processes (ffi/cuda/shm_handlers.cc): f32, bf16, f16
    "sum_kernels.cu": {"SumRanksKernel": 3},
}
EXPECTED_KERNELS = {k: n for per_file in CODEC_KERNELS.values() for k, n in per_file.items()}
# The codec ops' FFI targets (kernels.TARGETS may list further targets of other ops).
CODEC_TARGETS = (
    "flashcomm_quantize",
    "flashcomm_dequantize",
    "flashcomm_dequantize_sum",
    "flashcomm_dequantize_sum_quantize",
)
# The flags the codec's bit-exactness relies on (docs/cuda.md), and the ptxas report.
REQUIRED_FLAGS = ("-O3", "--fmad=false", "-ftz=false", "-prec-div=true", "-prec-sqrt=true",
                  "-Xptxas=-v")
BUILD_LOG = "cuda_ptxas.log"
_LOG_HEADER = "# jax_flashcomm cuda_ptxas.log v1"

_ENTRY = re.compile(r"Compiling entry function '(?P<name>[^']+)' for 'sm_(?P<arch>\d+)'")
_SPILL = re.compile(
    r"(?P<stack>\d+) bytes stack frame, (?P<stores>\d+) bytes spill stores, "
    r"(?P<loads>\d+) bytes spill loads")
_REGS = re.compile(r"Used (?P<regs>\d+) registers")


def _nvcc() -> str | None:
    for cand in (shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc"),
                 "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def parse_ptxas(text: str) -> list[dict]:
    """One record per (kernel, arch) from ``-Xptxas=-v`` output."""
    records, current = [], None
    for line in text.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = {"name": m["name"], "arch": m["arch"]}
            records.append(current)
            continue
        if current is None:
            continue
        m = _SPILL.search(line)
        if m:
            current.update({k: int(v) for k, v in m.groupdict().items()})
        m = _REGS.search(line)
        if m:
            current["regs"] = int(m["regs"])
    return records


def _kernel_base(mangled: str, expected=EXPECTED_KERNELS) -> str | None:
    # Itanium mangling: <len><name> — take the longest known kernel name that appears.
    hits = [k for k in expected if f"{len(k)}{k}" in mangled]
    return max(hits, key=len) if hits else None


@dataclasses.dataclass
class PtxasReport:
    """nvcc's output per .cu file name, where it came from, and the build's commands."""
    outputs: dict[str, str]
    origin: str
    commands: dict[str, str] = dataclasses.field(default_factory=dict)

    def records(self, name: str) -> list[dict]:
        return parse_ptxas(self.outputs[name])


def _log_candidates() -> list[pathlib.Path]:
    paths = []
    if os.environ.get("FLASHCOMM_CUDA_PTXAS_LOG"):
        paths.append(pathlib.Path(os.environ["FLASHCOMM_CUDA_PTXAS_LOG"]))
    # Next to the module without importing it: in an editable install the built files live
    # in site-packages, not in the source package.
    spec = importlib.util.find_spec("jax_flashcomm._flashcomm_cuda")
    if spec is not None and spec.origin:
        paths.append(pathlib.Path(spec.origin).with_name(BUILD_LOG))
    paths.append(pathlib.Path(jax_flashcomm.__file__).with_name(BUILD_LOG))
    return paths


def _read_build_log(path: pathlib.Path) -> tuple[PtxasReport | None, str]:
    """The log's report if it matches the sources here, else (None, why not)."""
    text = path.read_text(encoding="utf-8", errors="replace")
    if not text.startswith(_LOG_HEADER):
        return None, "not a cuda_ptxas.log"
    sections: dict[str, dict] = {}
    current = None
    for line in text.splitlines()[1:]:
        if line.startswith("# source: "):
            current = {"inputs": {}, "lines": [], "command": "", "known": True}
            sections[pathlib.PurePosixPath(line[len("# source: "):]).name] = current
        elif line.startswith("# missing: "):
            return None, f"no output for {line[len('# missing: '):]}"
        elif line.startswith("# end: "):
            current = None
        elif current is None:
            continue
        elif line.startswith("# command: "):
            current["command"] = line[len("# command: "):]
        elif line.startswith("# input: "):
            digest, rel = line[len("# input: "):].split(" ", 1)
            current["inputs"][rel] = digest
        elif line == "# inputs: unknown":
            current["known"] = False
        else:
            current["lines"].append(line)
    if set(sections) != {src.name for src in CUDA_SOURCES}:
        return None, f"built {sorted(sections)}, sources are {[s.name for s in CUDA_SOURCES]}"
    for name, sec in sections.items():
        if not sec["known"] or not sec["inputs"]:
            return None, f"{name}: inputs not recorded"
        for rel, digest in sec["inputs"].items():
            f = ROOT / rel
            if not f.is_file() or hashlib.sha256(f.read_bytes()).hexdigest() != digest:
                return None, f"{name}: {rel} changed since the build"
        archs = {r["arch"] for r in parse_ptxas("\n".join(sec["lines"]))}
        if not set(ARCHS) <= archs:
            return None, f"{name}: built for sm_{sorted(archs)}, not sm_{list(ARCHS)}"
    return PtxasReport({n: "\n".join(s["lines"]) for n, s in sections.items()},
                       f"build log {path}", {n: s["command"] for n, s in sections.items()}), ""


def _compile(nvcc: str, src: pathlib.Path, out_dir: pathlib.Path) -> str:
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    cmd = [nvcc, "-std=c++17", *REQUIRED_FLAGS,
           "-Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror,-ffp-contract=off",
           "-Xcompiler=-fPIC", f"-I{ROOT / 'ffi' / 'include'}",
           f"-isystem={ROOT / 'third_party' / 'xla_ffi' / 'include'}", *gencode,
           "-c", str(src), "-o", str(out_dir / (src.stem + ".o"))]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{' '.join(cmd)}\n{output}"
    return output


@functools.lru_cache(maxsize=None)
def ptxas_outputs() -> PtxasReport | str:
    """nvcc's output for every ffi/cuda/*.cu: from the build's log when it matches the
    sources, else compiled here (in parallel, once per session); a str says why it skips."""
    assert CUDA_SOURCES, "no ffi/cuda/*.cu sources"
    stale = []
    for path in _log_candidates():
        if path.is_file():
            report, why = _read_build_log(path)
            if report is not None:
                return report
            stale.append(f"{path}: {why}")
    nvcc = _nvcc()
    if nvcc is None:
        return "no usable build log and nvcc not found (set CUDA_HOME or put nvcc on PATH)"
    if stale:
        warnings.warn(f"compiling the CUDA kernels again: {'; '.join(stale)}", stacklevel=2)
    workers = max(1, min(len(CUDA_SOURCES), os.cpu_count() or 1))
    with tempfile.TemporaryDirectory(prefix="flashcomm_cuda_") as out_dir, \
            concurrent.futures.ThreadPoolExecutor(workers) as pool:
        outputs = list(pool.map(lambda src: _compile(nvcc, src, pathlib.Path(out_dir)),
                                CUDA_SOURCES))
    return PtxasReport(dict(zip((s.name for s in CUDA_SOURCES), outputs)), "compiled here")


def _lowered_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _custom_calls(text: str) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.search(r"custom_call @(\w+)", line)
        if m:
            calls.setdefault(m.group(1), []).append(line)
    return calls
