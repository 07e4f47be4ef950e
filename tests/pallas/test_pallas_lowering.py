"""What the installed jaxlib lowers for TPU on a CPU-only machine (jax.export with
platforms=("tpu",), the kernels compiled for Mosaic, not interpreted): the ring step, the
exact ring matmul kernels and the codec kernels of every format (integer, fp8, mxfp4, nvfp4;
rotated; with spikes) lower to one tpu_custom_call each (docs/tpu.md, "TPU lowering")."""

import jax
import jax.numpy as jnp
import pytest

import jax_flashcomm as fc
from jax_flashcomm.transport import pallas, pallas_rings

from tests.support.tpu_export import export_for_tpu

N = 4


def _export(fn, *shapes):
    return export_for_tpu(fn, *shapes, n=N)


X = ((N * 8, 1024), jnp.bfloat16)
W = ((N * 1024, 256), jnp.bfloat16)
RINGS = {
    "ring_step": (lambda a: pallas_rings.shift(a, ("x",), 1), X),
    "all_gather_matmul": (lambda a, b: pallas_rings.all_gather_matmul(a, b.reshape(1024, 256),
                                                                      "x"), X, W),
    "all_gather_matmul_bidirectional": (
        lambda a, b: pallas_rings.all_gather_matmul(a, b.reshape(1024, 256), "x",
                                                    bidirectional=True), X, W),
    "matmul_reduce_scatter": (
        lambda a, b: pallas_rings.matmul_reduce_scatter(a, b.reshape(1024, 256), "x"), X, W),
    "matmul_reduce_scatter_bidirectional": (
        lambda a, b: pallas_rings.matmul_reduce_scatter(a, b.reshape(1024, 256), "x",
                                                        bidirectional=True), X, W),
}


@pytest.mark.parametrize("name", sorted(RINGS))
def test_exact_rings_lower_for_tpu(name):
    """Each exact ring kernel lowers to Mosaic: one tpu_custom_call in the exported module."""
    fn, *shapes = RINGS[name]
    assert _export(fn, *shapes).count("tpu_custom_call") == 1


#: The codec kernels, every format the twin has: codes, scales and zeros in separate buffers,
#: the twin's barriers dropped and its unsigned sums signed (pallas_base.eval_for_mosaic),
#: 1-D constant tables (the signed rotation's) passed as (1, G); the spike selection and the
#: float formats' decode are integer and bit arithmetic (no argmax, no gather).
LOWERS = {
    "int8": dict(bits=8, rotation=0, spikes=0),
    "int4": dict(bits=4, rotation=0, spikes=0),
    "int8-hadamard": dict(bits=8, rotation=1, spikes=0),
    "int4-signed-hadamard": dict(bits=4, rotation=2, spikes=0),
    "int4-spikes": dict(bits=4, rotation=0, spikes=1),
    "int8-2-spikes-hadamard": dict(bits=8, rotation=1, spikes=2),
    "fp8": dict(format="fp8", rotation=0, spikes=0),
    "fp8-spikes": dict(format="fp8", rotation=0, spikes=1),
    "mxfp4": dict(format="mxfp4", rotation=0, spikes=0),
    "mxfp4-signed-hadamard": dict(format="mxfp4", rotation=2, spikes=0),
    "nvfp4": dict(format="nvfp4", rotation=0, spikes=0),
    "rs4-ag8": dict(rs_bits=4, ag_bits=8, rotation=1, spikes=0),
}


def _codec_op(op, opts):
    kw = dict(transport="pallas", min_bytes=0, backend="jnp", **opts)
    return {"psum": lambda a: fc.psum(a, "x", **kw),
            "psum_scatter": lambda a: fc.psum_scatter(a, "x", scatter_dimension=0, tiled=True,
                                                      **kw),
            "all_gather": lambda a: fc.all_gather(a, "x", axis=0, tiled=True, **kw)}[op]


@pytest.mark.parametrize("fmt", sorted(LOWERS))
@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_codec_kernels_lower_for_tpu(op, fmt):
    """Each codec kernel lowers to one tpu_custom_call."""
    assert _export(_codec_op(op, LOWERS[fmt]), X).count("tpu_custom_call") == 1
