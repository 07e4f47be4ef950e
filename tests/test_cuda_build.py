"""The CUDA codec kernels without a GPU: they compile, do not spill, and are what XLA calls.

- Every ``ffi/cuda/*.cu`` compiles with nvcc for sm_80, sm_89 and sm_90 with warnings as errors
  (device and host side), and ptxas reports 0 bytes of spill stores and loads for every kernel,
  with the expected set of kernels found for every architecture (so the check cannot pass on
  empty output).
- Lowering for the "cuda" platform emits the four codec ``flashcomm_*`` custom calls (targets
  ``_flashcomm_cuda`` registers), as typed-FFI calls with the codec attributes, including
  ``spikes`` (spike reserving, docs/format.md).

Nothing here runs on a GPU.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess

import jax
import jax.numpy as jnp
import pytest

from jax_flashcomm import codec
from jax_flashcomm.codec import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]
CUDA_SOURCES = sorted((ROOT / "ffi" / "cuda").glob("*.cu"))
ARCHS = ("80", "89", "90")
# Kernel templates instantiated by ffi/cuda/codec_kernels.cu: name -> instances per arch. Every
# template has a kSpiked parameter (spike reserving: spikes = 0 and spikes > 0 are separate
# instances), so each count is (dtypes) x 2.
EXPECTED_KERNELS = {
    "QuantizeKernel": 6,  # (f32, bf16, f16) x (spikes = 0, spikes > 0)
    "DequantizeKernel": 6,
    "DequantizeSumKernel": 6,
    "DequantizeSumQuantizeKernel": 2,  # spikes = 0, spikes > 0
    "QuantizeRotatedKernel": 6,  # rotation (docs/format.md "Rotation"): f32, bf16, f16 x 2
    "DequantizeRotatedKernel": 6,
    "DequantizeSumRotatedKernel": 6,
}
# The codec ops' FFI targets (kernels.TARGETS may list further targets of other ops).
CODEC_TARGETS = (
    "flashcomm_quantize",
    "flashcomm_dequantize",
    "flashcomm_dequantize_sum",
    "flashcomm_dequantize_sum_quantize",
)

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


def _kernel_base(mangled: str) -> str | None:
    # Itanium mangling: <len><name> — take the longest known kernel name that appears.
    hits = [k for k in EXPECTED_KERNELS if f"{len(k)}{k}" in mangled]
    return max(hits, key=len) if hits else None


@pytest.fixture(scope="module")
def ptxas_report(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    assert CUDA_SOURCES, "no ffi/cuda/*.cu sources"
    out_dir = tmp_path_factory.mktemp("cuda_build")
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
    reports = {}
    for src in CUDA_SOURCES:
        cmd = [nvcc, "-std=c++17", "-O3", "--fmad=false", "-ftz=false", "-prec-div=true",
               "-prec-sqrt=true", "-Xptxas=-v",
               "-Werror=all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror,-ffp-contract=off",
               "-Xcompiler=-fPIC", f"-I{ROOT / 'ffi' / 'include'}",
               f"-isystem={jax.ffi.include_dir()}", *gencode,
               "-c", str(src), "-o", str(out_dir / (src.stem + ".o"))]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"nvcc failed on {src.name}:\n{' '.join(cmd)}\n{output}"
        reports[src.name] = (output, parse_ptxas(output))
    return reports


def test_cuda_sources_compile_without_warnings(ptxas_report):
    for name, (output, _) in ptxas_report.items():
        warnings = [ln for ln in output.splitlines()
                    if re.search(r"\bwarning\b", ln, re.IGNORECASE)]
        assert not warnings, f"{name}: {warnings}"


def test_every_kernel_compiled_for_every_arch(ptxas_report):
    _, records = ptxas_report["codec_kernels.cu"]
    for arch in ARCHS:
        found: dict[str, int] = {}
        for r in records:
            if r["arch"] == arch:
                base = _kernel_base(r["name"])
                assert base is not None, f"unexpected kernel {r['name']} on sm_{arch}"
                found[base] = found.get(base, 0) + 1
        assert found == EXPECTED_KERNELS, f"sm_{arch}: {found}"


def test_no_register_spills(ptxas_report):
    checked = 0
    for name, (_, records) in ptxas_report.items():
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
        return y, s, q

    lowered = _lowered_for_cuda(f, x)
    calls = _custom_calls(lowered.as_text())
    assert set(CODEC_TARGETS) <= set(calls), sorted(calls)
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
        (line,) = [ln for ln in hlo if f'custom_call_target="{target}"' in ln]
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
    assert set(_flashcomm_cuda.registrations()) == set(kernels.TARGETS)
