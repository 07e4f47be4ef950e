"""What the installed jaxlib lowers for TPU on a CPU-only machine (jax.export with
platforms=("tpu",), the kernels compiled for Mosaic, not interpreted): the ring step, the
exact ring matmul kernels and the integer codec kernels (int8, int4, rotated; no spikes) lower
to one tpu_custom_call each; the spike and float-format codec kernels stop at the op Mosaic's
lowering does not take (spikes, fp8), and the test names it (docs/tpu.md, "TPU lowering")."""

import jax
import jax.numpy as jnp
import pytest
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.transport import pallas, pallas_rings

N = 4


def _export(fn, *shapes):
    mesh = jax.make_mesh((N,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:N])
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(P("x") for _ in shapes),
                              out_specs=P("x"), check_vma=False))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("x"))) for s, d in shapes]
    with pallas.use_interpret(False):
        return export.export(f, platforms=("tpu",))(*args).mlir_module()


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


#: The integer codec kernels that lower: codes, scale and zero in separate buffers, the twin's
#: barriers dropped and its unsigned sums signed (pallas_kernels.eval_for_mosaic), 1-D constant
#: tables (the signed rotation's) passed as (1, G).
LOWERS = {
    "int8": dict(bits=8, rotation=0, spikes=0),
    "int4": dict(bits=4, rotation=0, spikes=0),
    "int8-hadamard": dict(bits=8, rotation=1, spikes=0),
    "int4-signed-hadamard": dict(bits=4, rotation=2, spikes=0),
}
#: The codec kernels that do not, and the op Mosaic's lowering (this jaxlib) stops at.
STOPS = {
    "int4-spikes": (dict(bits=4, rotation=0, spikes=1), "Only float32 is supported"),
    "fp8": (dict(format="fp8", rotation=0, spikes=0),
            "Only take_along_axis-like gathers supported"),
    "mxfp4": (dict(format="mxfp4", rotation=0, spikes=0),
              "Only take_along_axis-like gathers supported"),
}


def _codec_op(op, opts):
    kw = dict(transport="pallas", min_bytes=0, backend="jnp", **opts)
    return {"psum": lambda a: fc.psum(a, "x", **kw),
            "psum_scatter": lambda a: fc.psum_scatter(a, "x", scatter_dimension=0, tiled=True,
                                                      **kw),
            "all_gather": lambda a: fc.all_gather(a, "x", axis=0, tiled=True, **kw)}[op]


@pytest.mark.parametrize("fmt", sorted(LOWERS))
@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_int_codec_kernels_lower_for_tpu(op, fmt):
    """The integer codec kernels (no spikes) lower to one tpu_custom_call each."""
    assert _export(_codec_op(op, LOWERS[fmt]), X).count("tpu_custom_call") == 1


@pytest.mark.parametrize("fmt", sorted(STOPS))
@pytest.mark.parametrize("op", ["psum", "psum_scatter", "all_gather"])
def test_codec_kernels_stop_at_a_named_op(op, fmt):
    """Spikes and the float formats do not lower yet; the error names why (the spike
    selection's integer argmax/sort, the fp8 codec's table gather)."""
    opts, reason = STOPS[fmt]
    with pytest.raises((NotImplementedError, ValueError), match=reason):
        _export(_codec_op(op, opts), X)
