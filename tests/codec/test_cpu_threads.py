"""Codec calls split over XLA's intra-op thread pool (ffi/cpu/cpu_parallel.h):
the bytes do not depend on the split (one thread == the pool == the jnp twin), the split
happens for large operands, and ``use_cpu_threads`` / ``FLASHCOMM_CPU_THREADS`` set and check
the cap."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec
from jax_flashcomm.codec import kernels

pytestmark = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")

N = 1 << 19  # 1 MiB of bf16: 4 pieces, above the 512 KiB a call needs before it is split


def _leaves(tree):
    return [np.asarray(a) for a in jax.tree.leaves(tree)]


def _ops(dtype, bits, rotation, spikes):
    x = jax.random.normal(jax.random.key(3), (N,), jnp.float32)
    x = x.at[::997].multiply(40.0).astype(dtype)  # outliers, for the spikes

    def run(backend):
        p = codec.quantize(x, bits=bits, rotation=rotation, spikes=spikes, backend=backend)
        chunked = codec.quantize(x, bits=bits, num_chunks=8, rotation=rotation, spikes=spikes,
                                 backend=backend).split_groups(8)
        return (p, codec.dequantize(p, backend=backend),
                codec.dequantize_sum(chunked, backend=backend),
                codec.dequantize_sum_quantize(chunked, bits=4, backend=backend))

    return jax.jit(lambda: run("ffi")), jax.jit(lambda: run("jnp"))


@pytest.mark.parametrize("dtype,bits,rotation,spikes", [
    (jnp.bfloat16, 8, 0, 0), (jnp.bfloat16, 6, 0, 1), (jnp.float32, 4, 1, 0),
    (jnp.bfloat16, 4, 1, 2)])
def test_split_calls_give_the_bytes_of_one_thread_and_of_the_twin(dtype, bits, rotation, spikes):
    ffi_fn, twin_fn = _ops(dtype, bits, rotation, spikes)
    module = kernels.cpu_module()
    with codec.use_cpu_threads(1):
        before = module.cpu_split_calls()
        one = _leaves(ffi_fn())
        assert module.cpu_split_calls() == before  # capped at one thread: never split
    with codec.use_cpu_threads(0):
        before = module.cpu_split_calls()
        pooled = _leaves(ffi_fn())
        assert module.cpu_split_calls() >= before + 4  # every one of the four ops was split
    twin = _leaves(twin_fn())
    assert len(one) == len(pooled) == len(twin)
    for a, b, c in zip(one, pooled, twin):
        assert a.dtype == b.dtype == c.dtype and a.shape == b.shape == c.shape
        assert a.tobytes() == b.tobytes()
        assert a.tobytes() == c.tobytes()


def test_small_calls_stay_on_one_thread():
    module = kernels.cpu_module()
    x = jnp.ones((64 * 1024,), jnp.bfloat16)  # 128 KiB
    before = module.cpu_split_calls()
    jax.block_until_ready(jax.jit(lambda a: codec.quantize(a, bits=8, backend="ffi"))(x))
    assert module.cpu_split_calls() == before


def test_use_cpu_threads_sets_and_restores():
    before = codec.cpu_threads()
    with codec.use_cpu_threads(3):
        assert codec.cpu_threads() == 3
    assert codec.cpu_threads() == before
    for bad in (-1, 1.5, "2"):
        with pytest.raises(ValueError, match="threads must be an int >= 0"):
            with codec.use_cpu_threads(bad):
                pass
    assert codec.cpu_threads() == before


@pytest.mark.parametrize("value,expect", [("1", "1"), ("0", "0"), ("two", "not a count")])
def test_threads_env(value, expect):
    code = ("from jax_flashcomm import codec\n"
            "try:\n    print(codec.cpu_threads())\n"
            "except RuntimeError as err:\n    print(err)\n")
    env = dict(os.environ, FLASHCOMM_CPU_THREADS=value)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout
    assert expect in out, out
    if expect == "not a count":
        assert "FLASHCOMM_CPU_THREADS" in out


def test_split_calls_keep_the_callers_flush_mode():
    """Groups of denormals (docs/format.md, "Flush to zero"): every piece of a split call runs
    under the calling thread's FTZ/DAZ, so the scales are the twin's 0x0000 in every group."""
    x = np.zeros(1 << 18, np.float32)  # 1 MiB: split
    x[127::128] = 1e-40
    x[5::128] = 3e-39
    x = jnp.asarray(x)
    quantize = jax.jit(lambda a: codec.quantize(a, bits=8, backend="ffi"))
    module = kernels.cpu_module()
    before = module.cpu_split_calls()
    pooled = _leaves(quantize(x))
    assert module.cpu_split_calls() > before
    with codec.use_cpu_threads(1):
        one = _leaves(quantize(x))
    twin = _leaves(jax.jit(lambda a: codec.quantize(a, bits=8, backend="jnp"))(x))
    for a, b, c in zip(pooled, one, twin):
        assert a.tobytes() == b.tobytes() == c.tobytes()
    scale = np.asarray(quantize(x).scale).view(np.uint16)
    assert (scale == 0).all()


def test_split_dequantize_into_writes_the_bytes_of_one_thread_and_of_the_twin():
    n = N + 37  # a last group cut short
    x = jax.random.normal(jax.random.key(5), (n,), jnp.float32).astype(jnp.bfloat16)
    payload = codec.quantize(x, bits=6, spikes=1)
    out = jnp.full((n + 1000,), 7.0, jnp.bfloat16)

    def into(backend):
        return jax.jit(lambda o, p: codec.dequantize_into(o, p, 500, backend=backend))

    module = kernels.cpu_module()
    before = module.cpu_split_calls()
    pooled = np.asarray(into("ffi")(out, payload))
    assert module.cpu_split_calls() > before
    with codec.use_cpu_threads(1):
        one = np.asarray(into("ffi")(out, payload))
    twin = np.asarray(into("jnp")(out, payload))
    assert pooled.tobytes() == one.tobytes() == twin.tobytes()
    assert (pooled[:500] == 7.0).all() and (pooled[500 + n:] == 7.0).all()
