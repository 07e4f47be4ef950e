"""The CUDA kernel of the fused all-reduce epilogue (flashcomm_add_rms_norm[_quantize],
ffi/cuda/norm_kernels.cu) gives the CPU kernels' bits: new residual, normalised output and the
quantized output, for f32 / bf16 / f16 residuals, f32 and bf16 weights, 2-D and 3-D operands
whose rows straddle groups, rotation none / Hadamard / signed Hadamard and spikes 0 / 1.

Without a GPU: the CUDA lowering emits both targets with their attributes (the GPU test itself
skips)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec

from tests.gpu.gpu_support import assert_same_bits, cpu_device, host, on
from tests.support.cuda_build import _custom_calls, _lowered_for_cuda

pytestmark = pytest.mark.gpu

CASES = [((3, 7, 576), 1, 0), ((5, 200), 0, 1), ((4, 256), 2, 1), ((2, 3, 4096), 1, 0)]


def _operands(shape, dtype, wdtype, rotation, spikes):
    rng = np.random.default_rng(sum(shape))
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    r = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]) * 0.5 + 1, wdtype)
    p = codec.quantize(x, bits=8, rotation=rotation, spikes=spikes, backend="jnp")
    return p, r, w


@jax.jit
def _fused(p, r, w):
    out = codec.add_rms_norm(p, r, w, eps=1e-5, backend="ffi")
    if r.shape[-1] % 64:
        return out
    q, h = codec.add_rms_norm(p, r, w, eps=1e-5, out_bits=8, out_group_size=64, backend="ffi")
    return out, (q.codes, q.scale, q.zero, h)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("wdtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape,rotation,spikes", CASES)
def test_cuda_fused_norm_bit_identical_to_cpu(gpu, dtype, wdtype, shape, rotation, spikes):
    args = _operands(shape, dtype, wdtype, rotation, spikes)
    got = host(_fused(*on(gpu, args)))
    want = host(_fused(*on(cpu_device(), args)))
    assert_same_bits(got, want, f"add_rms_norm {jnp.dtype(dtype).name} {shape}")


def test_cuda_lowering_emits_the_norm_targets():
    args = _operands((4, 256), jnp.bfloat16, jnp.float32, 1, 1)
    calls = _custom_calls(_lowered_for_cuda(_fused, *args).as_text())
    (plain,) = calls["flashcomm_add_rms_norm"]
    (quant,) = calls["flashcomm_add_rms_norm_quantize"]
    for line in (plain, quant):
        assert "rotation = 1 : i32" in line and "spikes = 1 : i32" in line, line
    out_fmt = re.search(r"out_fmt = \{([^{}]*)\}", quant)
    assert out_fmt and "bits = 8 : i32" in out_fmt[1] and "group_size = 64 : i64" in out_fmt[1], quant
