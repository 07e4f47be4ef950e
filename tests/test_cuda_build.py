"""The CUDA codec kernels without a GPU: they compile, do not spill, and are what XLA calls.

- Every ``ffi/cuda/*.cu`` compiles with nvcc for sm_80, sm_89 and sm_90 with warnings as errors
  (device and host side), and ptxas reports 0 bytes of spill stores and loads for every kernel,
  with the expected set of kernels found in each file for every architecture (so the check
  cannot pass on empty output).
- Lowering for the "cuda" platform emits the four codec ``flashcomm_*`` custom calls (targets
  ``_flashcomm_cuda`` registers), as typed-FFI calls with the codec attributes, including
  ``spikes`` (spike reserving, docs/format.md).

The nvcc output comes from the build when it is there: a FLASHCOMM_CUDA=ON build installs
``cuda_ptxas.log`` next to ``_flashcomm_cuda`` (ffi/cuda/ptxas_log.py), with the sha256 of every
file each .cu was compiled from. The tests use it when those files are unchanged and it covers
sm_80/89/90; otherwise (no CUDA build, or sources edited since) they compile the .cu files
themselves, or skip without nvcc. ``FLASHCOMM_CUDA_PTXAS_LOG=path`` points at another log (e.g.
a plain CMake build dir's). Nothing here runs on a GPU.
"""

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
import jax.numpy as jnp
import pytest

import jax_flashcomm
from jax_flashcomm import codec
from jax_flashcomm.codec import kernels
from jax_flashcomm.transport import p2p, ring

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "ffi" / "cuda").glob("*.cu"))
ARCHS = ("80", "89", "90")
# Kernel templates instantiated by each codec .cu file: name -> instances per arch
# (gather_kernels.cu: tests/test_cuda_gather_build.py). Every template has a kSpiked parameter
# (spike reserving: spikes = 0 and spikes > 0 are separate instances), so each count is
# (dtypes) x 2.
CODEC_KERNELS = {
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


@pytest.fixture(scope="session")
def ptxas_report() -> PtxasReport:
    """Shared by test_cuda_gather_build.py: one report per session, whichever module asks."""
    report = ptxas_outputs()
    if isinstance(report, str):
        pytest.skip(report)
    return report


def test_cuda_sources_compile_without_warnings(ptxas_report):
    for name, output in ptxas_report.outputs.items():
        warnings_ = [ln for ln in output.splitlines()
                     if re.search(r"\bwarning\b", ln, re.IGNORECASE)]
        assert not warnings_, f"{name} ({ptxas_report.origin}): {warnings_}"


def test_every_kernel_compiled_for_every_arch(ptxas_report):
    # Every .cu file has its expected kernels (gather_kernels.cu: test_cuda_gather_build.py).
    assert set(ptxas_report.outputs) == set(CODEC_KERNELS) | {"gather_kernels.cu"}
    for name, expected in CODEC_KERNELS.items():
        records = ptxas_report.records(name)
        for arch in ARCHS:
            found: dict[str, int] = {}
            for r in records:
                if r["arch"] == arch:
                    base = _kernel_base(r["name"], expected)
                    assert base is not None, f"{name}: unexpected kernel {r['name']} on sm_{arch}"
                    found[base] = found.get(base, 0) + 1
            assert found == expected, f"{name}, sm_{arch}: {found}"


def test_build_used_the_codec_flags(ptxas_report):
    """The build's own nvcc commands carry the IEEE flags and every architecture."""
    if not ptxas_report.commands:
        pytest.skip("compiled here with the test's flags (no usable build log)")
    for name, command in ptxas_report.commands.items():
        args = command.split()
        for flag in REQUIRED_FLAGS:
            assert flag in args, f"{name}: {flag} missing from {command}"
        for arch in ARCHS:
            assert f"sm_{arch}" in command, f"{name}: no sm_{arch} in {command}"


def test_no_register_spills(ptxas_report):
    checked = 0
    for name in ptxas_report.outputs:
        records = ptxas_report.records(name)
        assert records, f"{name}: no ptxas -v output parsed"
        for r in records:
            assert {"stores", "loads", "regs"} <= r.keys(), f"{name}: incomplete record {r}"
            assert r["stores"] == 0 and r["loads"] == 0, (
                f"{name}: {r['name']} on sm_{r['arch']} spills "
                f"({r['stores']} B stores, {r['loads']} B loads, {r['regs']} registers)")
            assert r["stack"] == 0, f"{name}: {r['name']} on sm_{r['arch']} uses local memory"
            checked += 1
    assert checked >= sum(EXPECTED_KERNELS.values()) * len(ARCHS)


def _lowered_for_cuda(fn, *args):
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _custom_calls(text: str) -> dict[str, list[str]]:
    calls: dict[str, list[str]] = {}
    for line in text.splitlines():
        m = re.search(r"custom_call @(\w+)", line)
        if m:
            calls.setdefault(m.group(1), []).append(line)
    return calls


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_cuda_lowering_emits_the_ffi_targets(dtype):
    x = jnp.linspace(-3.0, 5.0, 4 * 512, dtype=jnp.float32).reshape(4, 512).astype(dtype)

    def f(x):
        p = codec.quantize(x, bits=4, num_chunks=2, backend="ffi")
        y = codec.dequantize(p, backend="ffi")
        chunked = p.split_groups(2)
        s = codec.dequantize_sum(chunked, backend="ffi")
        q = codec.dequantize_sum_quantize(chunked, bits=8, backend="ffi")
        return y, s, q

    lowered = _lowered_for_cuda(f, x)
    calls = _custom_calls(lowered.as_text())
    assert set(CODEC_TARGETS) <= set(calls), sorted(calls)
    for target in CODEC_TARGETS:
        (line,) = calls[target]
        assert "group_size = 128 : i64" in line, line
        assert "spikes = 0 : i32" in line, line
    # Typed XLA FFI calls (what XLA_FFI_DEFINE_HANDLER_SYMBOL handlers are), one per target.
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines() if "custom-call(" in ln]
    for target in CODEC_TARGETS:
        (line,) = [ln for ln in hlo if f'custom_call_target="{target}"' in ln]
        assert "api_version=API_VERSION_TYPED_FFI" in line, line
    assert "bits = 4 : i32" in calls["flashcomm_quantize"][0]
    assert "out_bits = 8 : i32" in calls["flashcomm_dequantize_sum_quantize"][0]


@pytest.mark.parametrize("rotation", [0, 2])
@pytest.mark.parametrize("spikes", [1, 5, 16])
def test_cuda_lowering_carries_spikes(spikes, rotation):
    """Spike reserving lowers to the same four targets, with the ``spikes`` attribute (the CUDA
    handlers bind it and pick the spiked kernels when it is > 0)."""
    x = jnp.linspace(-3.0, 5.0, 4 * 512, dtype=jnp.float32).reshape(4, 512).astype(jnp.bfloat16)

    def f(x):
        p = codec.quantize(x, bits=4, num_chunks=2, rotation=rotation, spikes=spikes,
                           backend="ffi")
        y = codec.dequantize(p, backend="ffi")
        chunked = p.split_groups(2)
        s = codec.dequantize_sum(chunked, backend="ffi")
        q = codec.dequantize_sum_quantize(chunked, bits=8, backend="ffi")
        q0 = codec.dequantize_sum_quantize(chunked, bits=8, spikes=0, backend="ffi")
        return y, s, q, q0

    lowered = _lowered_for_cuda(f, x)
    calls = _custom_calls(lowered.as_text())
    assert set(CODEC_TARGETS) <= set(calls), sorted(calls)
    fused = calls.pop("flashcomm_dequantize_sum_quantize")
    # per-phase spikes: the output's own count, apart from the input's
    assert sorted(f"out_spikes = {k} : i32" in c for c in fused for k in (0, spikes)) == [
        False, False, True, True], fused
    calls["flashcomm_dequantize_sum_quantize"] = fused[:1]
    for target in CODEC_TARGETS:
        (line,) = calls[target]
        assert f"spikes = {spikes} : i32" in line, line
        if target != "flashcomm_dequantize_sum_quantize":  # no rotation attribute: unrotated
            assert f"rotation = {rotation} : i32" in line, line
    # The spike record widens the codes: G * 4 / 8 + k * (2 + 1) bytes per group at G = 128.
    record = 128 * 4 // 8 + spikes * 3
    assert f"x{record}xui8>" in calls["flashcomm_quantize"][0], calls["flashcomm_quantize"][0]
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines() if "custom-call(" in ln]
    for target in CODEC_TARGETS:
        for line in [ln for ln in hlo if f'custom_call_target="{target}"' in ln]:
            assert "api_version=API_VERSION_TYPED_FFI" in line, line
            assert f"spikes = {spikes} : i32" in line, line


def test_cpu_lowering_uses_the_same_target_names():
    x = jnp.ones((2, 256), jnp.bfloat16)
    text = jax.jit(lambda x: codec.dequantize(codec.quantize(x, bits=4, backend="ffi"),
                                              backend="ffi")).trace(x).lower(
        lowering_platforms=("cpu",)).as_text()
    calls = _custom_calls(text)
    assert {"flashcomm_quantize", "flashcomm_dequantize"} <= set(calls), sorted(calls)


def test_cuda_module_registrations_if_built():
    try:
        from jax_flashcomm import _flashcomm_cuda
    except ImportError as err:
        pytest.skip(f"_flashcomm_cuda not built (FLASHCOMM_CUDA=OFF): {err}")
    # the codec's targets and the p2p transport's (tests/test_cuda_p2p_build.py,
    # tests/test_cuda_ring_build.py)
    assert set(_flashcomm_cuda.registrations()) == (set(kernels.TARGETS) | set(p2p.TARGETS)
                                                    | set(ring.TARGETS))
