"""The CUDA codec kernels without a GPU: they compile, do not spill, and are what XLA calls.

- Every ``ffi/cuda/*.cu`` compiles with nvcc for sm_80, sm_89 and sm_90 with warnings as errors
  (device and host side), and ptxas reports 0 bytes of spill stores and loads for every kernel,
  with the expected set of kernels found in each file for every architecture (so the check
  cannot pass on empty output).
- Lowering for the "cuda" platform emits the four codec ``flashcomm_*`` custom calls (targets
  ``_flashcomm_cuda`` registers), as typed-FFI calls with the group-format attributes, including
  ``spikes`` (spike reserving, docs/format.md).

The nvcc output comes from the build when it is there: a FLASHCOMM_CUDA=ON build installs
``cuda_ptxas.log`` next to ``_flashcomm_cuda`` (ffi/cuda/ptxas_log.py), with the sha256 of every
file each .cu was compiled from. The tests use it when those files are unchanged and it covers
sm_80/89/90; otherwise (no CUDA build, or sources edited since) they compile the .cu files
themselves, or skip without nvcc. ``FLASHCOMM_CUDA_PTXAS_LOG=path`` points at another log (e.g.
a plain CMake build dir's). Nothing here runs on a GPU.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest

from jax_flashcomm import codec
from jax_flashcomm.codec import fp_kernels, kernels
from jax_flashcomm.transport import exchange, p2p, ring_steps, shm
from tests.support.cuda_build import (ARCHS, CODEC_KERNELS, CODEC_TARGETS, EXPECTED_KERNELS,
                                       REQUIRED_FLAGS, _custom_calls, _kernel_base,
                                       _lowered_for_cuda)
from tests.support.cuda_p2p import _attr

pytestmark = pytest.mark.slow  # nvcc compiles without a build log


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
    assert _attr(calls["flashcomm_quantize"][0], "fmt", "bits") == "4"
    assert _attr(calls["flashcomm_dequantize_sum_quantize"][0], "out_fmt", "bits") == "8"


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
    assert sorted(_attr(c, "out_fmt", "spikes") == str(k) for c in fused for k in (0, spikes)) == [
        False, False, True, True], fused
    calls["flashcomm_dequantize_sum_quantize"] = fused[:1]
    for target in CODEC_TARGETS:
        (line,) = calls[target]
        assert _attr(line, "fmt", "spikes") == str(spikes), line
        if target != "flashcomm_dequantize_sum_quantize":  # its rotation field is 0: unrotated
            assert _attr(line, "fmt", "rotation") == str(rotation), line
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


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4", "nvfp4"])
def test_cuda_lowering_emits_the_fp_format_targets(fmt):
    x = jnp.linspace(-3.0, 5.0, 4 * 512, dtype=jnp.float32).reshape(4, 512)

    def f(x):
        p = codec.quantize(x, format=fmt, spikes=1, num_chunks=2, backend="ffi")
        chunked = p.split_groups(2)
        return (codec.dequantize(p, backend="ffi"), codec.dequantize_sum(chunked, backend="ffi"),
                codec.dequantize_sum_quantize(chunked, format="fp8", backend="ffi"))

    calls = _custom_calls(_lowered_for_cuda(f, x).as_text())
    assert set(fp_kernels.TARGETS) <= set(calls), sorted(calls)
    fid = codec.spec.FORMATS.index(fmt)
    assert _attr(calls["flashcomm_fp_quantize"][0], "fmt", "format") == str(fid)
    assert _attr(calls["flashcomm_fp_dequantize_sum_quantize"][0], "out_fmt", "format") == "1"


def test_cuda_module_registrations_if_built():
    try:
        from jax_flashcomm import _flashcomm_cuda
    except ImportError as err:
        pytest.skip(f"_flashcomm_cuda not built (FLASHCOMM_CUDA=OFF): {err}")
    # the codec's targets and the p2p transport's (tests/transport/test_cuda_p2p_build.py,
    # tests/transport/test_cuda_ring_build.py, tests/transport/test_cuda_shm_build.py)
    assert set(_flashcomm_cuda.registrations()) == (set(kernels.TARGETS) | set(p2p.TARGETS)
                                                    | set(fp_kernels.TARGETS)
                                                    | set(ring_steps.TARGETS) | set(shm.TARGETS)
                                                    | set(exchange.TARGETS)
                                                    | {"flashcomm_shm_ring_start",
                                                       "flashcomm_shm_ring_done"})
