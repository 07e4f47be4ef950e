"""The quantized fused all-gather-matmul lowers for TPU on a CPU-only machine (jax.export with
platforms=("tpu",), the kernel compiled for Mosaic, not interpreted): its chunks move as the
payload's codes, scale and zero, each in its own buffer (no bitcast between widths), at int8
and int4 with and without rotation; the public ring matmuls over transport="pallas" lower to
their fused kernels, gradients included (docs/tpu.md, "TPU lowering")."""

import jax
import jax.numpy as jnp
import pytest

import jax_flashcomm as fc
from jax_flashcomm.transport import pallas, pallas_rings

from tests.support.tpu_export import export_for_tpu

N = 4
X = ((N * 8, 1024), jnp.bfloat16)
W = ((N * 1024, 256), jnp.bfloat16)


def _export(fn, *shapes):
    return export_for_tpu(fn, *shapes, n=N)


#: ``(bits, group_size, backend, rotation, spikes)`` of the quantized chunks.
QUANTS = {
    "int8": (8, 128, "jnp", 0, 0),
    "int4": (4, 128, "jnp", 0, 0),
    "int8-hadamard": (8, 128, "jnp", 1, 0),
    "int4-signed-hadamard": (4, 128, "jnp", 2, 0),
}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("fmt", sorted(QUANTS))
def test_quantized_all_gather_matmul_lowers_for_tpu(fmt, bidirectional):
    """One tpu_custom_call: the fused kernel with its codec inside."""
    def fn(a, b):
        return pallas_rings.all_gather_matmul(a, b, "x", bidirectional=bidirectional,
                                              quant=QUANTS[fmt])

    assert _export(fn, X, W).count("tpu_custom_call") == 1


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_all_gather_matmul_keeping_the_chunks_lowers_for_tpu(fmt):
    """The VJP's forward kernel (it also returns the decoded chunks) lowers too."""
    def fn(a, b):
        out, gathered = pallas_rings.all_gather_matmul(a, b, "x", quant=QUANTS[fmt],
                                                       keep_gathered=True)
        return out, gathered

    assert _export(fn, X, W).count("tpu_custom_call") == 1


@pytest.mark.parametrize("bits", [None, 8, 4])
def test_public_ring_matmuls_lower_to_the_fused_kernels(bits):
    """fc.all_gather_matmul over transport="pallas" lowers to its fused kernel, and its
    gradient to two (the forward's, and matmul-reduce-scatter's for dx)."""
    kw = dict(transport="pallas", bits=bits, min_bytes=0)

    def forward(a, b):
        return fc.all_gather_matmul(a, b, "x", **kw)

    def grads(a, b):
        return jax.grad(lambda a, b: jnp.sum(forward(a, b).astype(jnp.float32) ** 2),
                        argnums=(0, 1))(a, b)

    assert _export(forward, X, W).count("tpu_custom_call") == 1
    assert _export(grads, X, W).count("tpu_custom_call") == 2
