"""The CUDA kernels of flashcomm_dequantize_into (ffi/cuda/gather_kernels.cu) without a GPU:
they compile for sm_80/89/90 without warnings or spills, every expected kernel is there, and
lowering for "cuda" emits the target as a typed-FFI call aliased to its first operand.
Nothing here runs on a GPU. The nvcc output is the one tests/codec/test_cuda_build.py uses (the
build's cuda_ptxas.log, or compiled once per session when there is none).
"""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jax_flashcomm import codec
from tests.support.cuda_build import ARCHS, _custom_calls, _kernel_base, _lowered_for_cuda

pytestmark = pytest.mark.slow  # nvcc compiles without a build log

SOURCE = "gather_kernels.cu"
EXPECTED = {"DequantizeIntoKernel": 3, "DequantizeIntoRotatedKernel": 3}  # f32, bf16, f16


def test_gather_kernels_compile_clean_for_every_arch(ptxas_report):
    text, records = ptxas_report.outputs[SOURCE], ptxas_report.records(SOURCE)
    assert not [ln for ln in text.splitlines() if "warning" in ln.lower()]
    for arch in ARCHS:
        found: dict[str, int] = {}
        for r in (r for r in records if r["arch"] == arch):
            name = _kernel_base(r["name"], EXPECTED)
            assert name is not None, f"unexpected kernel {r['name']} on sm_{arch}"
            found[name] = found.get(name, 0) + 1
            assert r["stores"] == 0 and r["loads"] == 0 and r["stack"] == 0, r
        assert found == EXPECTED, f"sm_{arch}: {found}"


@pytest.mark.parametrize("rotation,spikes", [(0, 0), (2, 3)])
def test_cuda_lowering_emits_dequantize_into(rotation, spikes):
    x = jnp.linspace(-3.0, 5.0, 1000, dtype=jnp.float32).astype(jnp.bfloat16)

    def f(out, x, i):
        p = codec.quantize(x, bits=4, rotation=rotation, spikes=spikes, backend="ffi")
        return codec.dequantize_into(out, p, i * 1000, backend="ffi")

    lowered = _lowered_for_cuda(f, jnp.zeros((4, 1000), jnp.bfloat16), x, jnp.int32(1))
    (line,) = _custom_calls(lowered.as_text())["flashcomm_dequantize_into"]
    for attr in ("bits = 4 : i32", "group_size = 128 : i64", f"rotation = {rotation} : i32",
                 f"spikes = {spikes} : i32", "count = 1000 : i64"):
        assert attr in line, line
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines()
           if 'custom_call_target="flashcomm_dequantize_into"' in ln]
    assert len(hlo) == 1 and "api_version=API_VERSION_TYPED_FFI" in hlo[0], hlo
    assert "output_to_operand_aliasing={{}: (0, {})}" in hlo[0], hlo[0]
