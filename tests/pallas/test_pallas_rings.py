"""The ring matmuls over the pallas transport, in interpret mode: the fused kernels and the
ring steps equal lax (within f32 reassociation) and the xla rings bit for bit, quantized
chunks included; gradients; no race."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.transport import pallas, pallas_rings

QUANT = (8, 128, "jnp", 1, 0)  # bits, group size, backend, rotation, spikes


def _run(n, fn, x, w):
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    w = jax.device_put(w, NamedSharding(mesh, P(None, "x")))
    f = jax.shard_map(lambda a, b: jax.tree.map(lambda c: c[None], fn(a, b)), mesh=mesh,
                      in_specs=(P("x"), P(None, "x")), out_specs=P("x"), check_vma=False)
    return jax.tree.map(np.asarray, jax.jit(f)(x, w))


def _operands(n, rows=6, k=128, cols=16):
    kx, kw = jax.random.split(jax.random.key(n))
    return (jax.random.normal(kx, (n * rows, k), jnp.float32),
            jax.random.normal(kw, (k, n * cols), jnp.float32))


def _twin_agmm(x, w, bidirectional, quant):
    """The xla ring (the planner's transport="xla", backend="jnp")."""
    opts = dict(min_bytes=0, bits=quant[0], rotation=quant[3], spikes=0) if quant else \
        dict(bits=None)
    return fc.all_gather_matmul(x, w, "x", bidirectional=bidirectional, transport="xla",
                                backend="jnp", **opts)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_all_gather_matmul(n, bidirectional):
    """Exact: within f32 reassociation of lax.all_gather(x) @ w, and bit-equal to the xla ring."""
    x, w = _operands(n)

    def f(a, b):
        got = pallas_rings.all_gather_matmul(a, b, "x", bidirectional=bidirectional)
        return got, _twin_agmm(a, b, bidirectional, None), lax.all_gather(a, "x", tiled=True) @ b

    got, twin, ref = _run(n, f, x, w)
    np.testing.assert_array_equal(got, twin)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_quantized_all_gather_matmul(n, bidirectional):
    """Chunks quantized once (int8, Hadamard): bit-equal to the xla ring's quantized chunks."""
    x, w = _operands(n)

    def f(a, b):
        got = pallas_rings.all_gather_matmul(a, b, "x", bidirectional=bidirectional,
                                             quant=QUANT)
        return got, _twin_agmm(a, b, bidirectional, QUANT)

    got, twin = _run(n, f, x, w)
    np.testing.assert_array_equal(got, twin)


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_fused_matmul_reduce_scatter(n, bidirectional):
    """Within f32 reassociation of lax.psum_scatter(x @ w), bit-equal to the xla ring."""
    x, w = _operands(n, rows=6 * n, k=32, cols=8)

    def f(a, b):
        got = pallas_rings.matmul_reduce_scatter(a, b, "x", bidirectional=bidirectional)
        twin = fc.matmul_reduce_scatter(a, b, "x", bidirectional=bidirectional, bits=None,
                                        transport="xla")
        return got, twin, lax.psum_scatter(a @ b, "x", scatter_dimension=0, tiled=True)

    got, twin, ref = _run(n, f, x, w)
    np.testing.assert_array_equal(got, twin)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_ring_steps_transport(bidirectional):
    """fc.all_gather_matmul / matmul_reduce_scatter with transport="pallas" (ring steps as
    Pallas DMA kernels) equal the xla rings bit for bit, exact and quantized."""
    n = 4
    x, w = _operands(n, rows=8)

    def f(a, b):
        out = []
        for t in ("pallas", "xla"):
            out.append(fc.all_gather_matmul(a, b, "x", bidirectional=bidirectional, bits=None,
                                            transport=t))
            out.append(fc.all_gather_matmul(a, b, "x", bidirectional=bidirectional, bits=8,
                                            min_bytes=0, backend="jnp", transport=t))
            out.append(fc.matmul_reduce_scatter(a, b, "x", bidirectional=bidirectional,
                                                bits=None, transport=t))
        return out

    out = _run(n, f, x, w)
    for g, t in zip(out[:3], out[3:]):
        np.testing.assert_array_equal(g, t)


def test_gradients_through_pallas_rings():
    """The VJP of all_gather_matmul over the pallas ring steps equals the xla ring's."""
    n = 4
    x, w = _operands(n)

    def grads(t):
        def f(a, b):
            def loss(a, b):
                y = fc.all_gather_matmul(a, b, "x", bits=None, transport=t)
                return jnp.sum(y * y)
            return jax.grad(loss, argnums=(0, 1))(a, b)
        return _run(n, f, x, w)

    for g, t in zip(grads("pallas"), grads("xla")):
        np.testing.assert_array_equal(g, t)


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_fused_rings_no_race(mode):
    """The race detector finds no race in the fused ring kernels."""
    n = 4
    x, w = _operands(n)
    pltpu.reset_tpu_interpret_mode_state()
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)

    def f(a, b):
        return (pallas_rings.all_gather_matmul(a, b, "x", bidirectional=True),
                pallas_rings.all_gather_matmul(a, b, "x", quant=QUANT),
                pallas_rings.matmul_reduce_scatter(jnp.tile(a, (n, 1)), b[:, :16], "x",
                                                   bidirectional=True))

    with pallas.use_interpret(params):
        _run(n, f, x, w)
    assert not pallas.races_found()
