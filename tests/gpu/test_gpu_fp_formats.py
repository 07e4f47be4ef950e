"""The CUDA kernels of the floating-point formats (fp8, mxfp4, nvfp4; ffi/cuda/fp_kernels.cu)
give the CPU kernels' bits: records, decoded values, sums and fused sums into every format, for
f32 / bf16 / f16, group sizes 32 / 128 / 1024, spikes 0 / 1 / 3 and rotations none / signed
Hadamard, on operands with a NaN group and an Inf group. As in test_gpu_codec.py the same
jitted program runs on the GPU and on the CPU device; groups of f32 denormals are left out (the
CPU flushes them, CUDA does not: docs/format.md, "Flush to zero")."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec

from tests.gpu.gpu_support import assert_same_bits, cpu_device, host, on

pytestmark = pytest.mark.gpu

FORMATS = ("fp8", "mxfp4", "nvfp4")
GROUPS = (32, 128, 1024)
CHUNKS = 3


def _operand(dtype, g, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2 * CHUNKS, g)) * np.exp(rng.standard_normal((2 * CHUNKS, 1)) * 3)
    x[0, 5] = np.nan
    x[1, 2] = np.inf
    x[2, 7] *= 500.0
    x[3] = 0.0
    if jnp.dtype(dtype) == jnp.float16:
        x = np.clip(x, -6e4, 6e4)
    return jnp.asarray(x.astype(np.float32)).astype(dtype)


@functools.lru_cache(maxsize=None)
def _program(fmt, spikes, rotation):
    def ops(x, g):
        p = codec.quantize(x, format=fmt, group_size=g, num_chunks=CHUNKS, spikes=spikes,
                           rotation=rotation, backend="ffi")
        c = p.split_groups(CHUNKS)
        out = {"records": p.codes, "dequantize": codec.dequantize(p, backend="ffi"),
               "dequantize_sum": codec.dequantize_sum(c, backend="ffi")}
        for f in FORMATS:
            out[f"fused_{f}"] = codec.dequantize_sum_quantize(c, format=f, spikes=1,
                                                               backend="ffi").codes
        return out

    return jax.jit(lambda xs: {g: ops(x, g) for g, x in zip(GROUPS, xs)})


@pytest.mark.parametrize("rotation", (0, 2))
@pytest.mark.parametrize("spikes", (0, 1, 3))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16, jnp.float16),
                         ids=lambda d: jnp.dtype(d).name)
def test_cuda_fp_formats_bit_identical_to_cpu(gpu, dtype, fmt, spikes, rotation):
    xs = tuple(_operand(dtype, g, seed=g + spikes) for g in GROUPS)
    f = _program(fmt, spikes, rotation)
    got, want = host(f(on(gpu, xs))), host(f(on(cpu_device(), xs)))
    for g in GROUPS:
        for op in got[g]:
            assert_same_bits(got[g][op], want[g][op], f"{op}: {fmt}, group_size {g}, "
                             f"spikes {spikes}, rotation {rotation}")
