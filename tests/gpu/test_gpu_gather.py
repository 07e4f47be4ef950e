"""The CUDA gather kernels (``flashcomm_dequantize_into``, the ring all-gather's step) give the
CPU kernel's bits: one payload decoded into a slot of a larger buffer, in place, for f32 /
bf16 / f16 outputs, bits 2..8, plain and rotated groups, spikes, a count that ends inside a
group, static and traced offsets (the offset is read on the device); the rest of the buffer
keeps its bits. A traced out-of-range offset writes nothing on CUDA (the CPU kernel reports an
error instead), so it is checked on the GPU alone."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec

from tests.gpu.gpu_support import assert_same_bits, bits_of, cpu_device, host, on
from tests.support.codec_data import structured

pytestmark = pytest.mark.gpu

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
CASES = (  # (group_size, rotation, spikes)
    (8, 0, 0), (24, 0, 2), (128, 0, 0), (128, 0, 1), (264, 0, 5),
    (8, 1, 0), (128, 2, 1), (1024, 1, 16),
)
OUT_SIZE = 5000


def _name(d):
    return jnp.dtype(d).name


@functools.lru_cache(maxsize=None)
def _program(group_size, rotation, spikes, count):
    def run(src, out, offsets):
        res = {}
        for bits in range(2, 9):
            p = codec.quantize(src[:count], bits=bits, group_size=group_size,
                               rotation=rotation, spikes=spikes, backend="ffi")
            res[bits] = (
                codec.dequantize_into(out, p, 17, backend="ffi"),  # static offset
                codec.dequantize_into(out, p, offsets[0], backend="ffi"),  # traced
                codec.dequantize_into(out, p, offsets[1], backend="ffi"),
            )
        return res
    return jax.jit(run)


@pytest.mark.parametrize("out_dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"g{c[0]}-rot{c[1]}-k{c[2]}")
def test_dequantize_into_bit_identical_to_cpu(gpu, case, out_dtype):
    group_size, rotation, spikes = case
    rng = np.random.default_rng(group_size + 10 * rotation + spikes)
    count = min(OUT_SIZE - 40, 3 * group_size + 5)  # ends inside a group
    src = structured(rng, -(-count // group_size), group_size, jnp.bfloat16)
    out = jnp.asarray(rng.standard_normal(OUT_SIZE) * 100, out_dtype)
    offsets = jnp.asarray([0, OUT_SIZE - count], jnp.int32)
    f = _program(group_size, rotation, spikes, count)
    got = host(f(*on(gpu, (src, out, offsets))))
    want = host(f(*on(cpu_device(), (src, out, offsets))))
    for bits in got:
        assert_same_bits(got[bits], want[bits],
                         f"dequantize_into to {_name(out_dtype)}: group_size {group_size}, "
                         f"bits {bits}, rotation {rotation}, spikes {spikes}")


def test_out_of_range_offset_writes_nothing_on_cuda(gpu):
    """A traced offset past the end: the CUDA kernel leaves the buffer as it was."""
    src = jnp.arange(300, dtype=jnp.float32) / 7
    out = jnp.arange(1000, dtype=jnp.float32)

    @jax.jit
    def f(out, src, offset):
        return codec.dequantize_into(out, codec.quantize(src, backend="ffi"), offset,
                                     backend="ffi")

    got = np.asarray(f(*on(gpu, (out, src, jnp.int32(900)))))
    np.testing.assert_array_equal(bits_of(got), bits_of(np.asarray(out)))
