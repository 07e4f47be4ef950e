"""The ring matmuls over the pallas transport, in interpret mode: the fused kernels and the
ring steps equal lax (within f32 reassociation) and the xla rings bit for bit, quantized
chunks included; the public ops run the fused kernels where they fit (the ring steps
elsewhere), gradients included; no race."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec
from jax_flashcomm.transport import pallas, pallas_base, pallas_rings

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
    opts = dict(min_bytes=0, bits=quant[0], rotation=quant[3], spikes=quant[4]) if quant else \
        dict(bits=None)
    return fc.all_gather_matmul(x, w, "x", bidirectional=bidirectional, transport="xla",
                                backend="jnp", **opts)


def _kernel_names(jaxpr) -> list:
    """The names of the pallas_calls in a jaxpr, nested ones included."""
    names = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            names.append(eqn.params["name"])
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names += _kernel_names(sub)
    return names


def _traced(n, fn, x, w):
    """``(kernel names, plans)`` of ``fn`` traced as :func:`_run` runs it."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    w = jax.device_put(w, NamedSharding(mesh, P(None, "x")))
    f = jax.shard_map(fn, mesh=mesh, in_specs=(P("x"), P(None, "x")), out_specs=P("x"),
                      check_vma=False)
    with fc.planner.record() as plans:
        jaxpr = jax.make_jaxpr(f)(x, w)
    return _kernel_names(jaxpr.jaxpr), plans


FUSED = {"flashcomm_pallas_all_gather_matmul", "flashcomm_pallas_matmul_reduce_scatter"}


def _public_ops(transport, bidirectional):
    """The public ring matmuls: exact and int8 all-gather-matmul, exact matmul-reduce-scatter."""
    def f(a, b):
        kw = dict(bidirectional=bidirectional, transport=transport)
        return (fc.all_gather_matmul(a, b, "x", bits=None, **kw),
                fc.all_gather_matmul(a, b, "x", bits=8, min_bytes=0, **kw),
                fc.matmul_reduce_scatter(a, b, "x", bits=None, **kw))
    return f


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


#: Quantized chunks: each payload array in its own buffer and DMA (codes, scale, zero).
QUANTS = {"int8-hadamard": QUANT, "int4-signed-hadamard": (4, 128, "jnp", 2, 0),
          "int4-spikes": (4, 128, "jnp", 0, 1)}


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("fmt", sorted(QUANTS))
def test_fused_quantized_all_gather_matmul(n, bidirectional, fmt):
    """Chunks quantized once: bit-equal to the xla ring's quantized chunks."""
    x, w = _operands(n)
    quant = QUANTS[fmt]

    def f(a, b):
        got = pallas_rings.all_gather_matmul(a, b, "x", bidirectional=bidirectional,
                                             quant=quant)
        return got, _twin_agmm(a, b, bidirectional, quant)

    got, twin = _run(n, f, x, w)
    np.testing.assert_array_equal(got, twin)


def test_fused_quantized_ring_keeps_the_twins_rounding():
    """On data where evaluating the twin without its optimization barriers changes a code
    (XLA:CPU reassociates the rotation's scale), the interpreted kernel still equals the xla
    ring: it keeps the barriers (they are dropped only for Mosaic)."""
    n = 4
    x = jax.random.normal(jax.random.key(0), (n * 8, 128), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (128, n * 16), jnp.float32)

    def codes(a):
        return codec.quantize(a, bits=8, group_size=128, backend="jnp", rotation=1).codes

    closed = jax.make_jaxpr(codes)(x[:8])
    barrier_free = jax.jit(lambda a: pallas_base.eval_for_mosaic(closed.jaxpr, closed.consts,
                                                                 a)[0])
    assert any((np.asarray(jax.jit(codes)(c)) != np.asarray(barrier_free(c))).any()
               for c in jnp.split(x, n))

    def f(a, b):
        return (pallas_rings.all_gather_matmul(a, b, "x", quant=QUANT),
                _twin_agmm(a, b, False, QUANT))

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


GRAD_OPS = {
    "agmm": lambda a, b, **kw: fc.all_gather_matmul(a, b, "x", bits=None, **kw),
    "agmm-int8": lambda a, b, **kw: fc.all_gather_matmul(a, b, "x", bits=8, min_bytes=0, **kw),
    "mrs": lambda a, b, **kw: fc.matmul_reduce_scatter(a, b, "x", bits=None, **kw),
}


@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("op", sorted(GRAD_OPS))
def test_gradients_through_pallas_rings(op, bidirectional):
    """The VJPs over the pallas transport (the fused kernels forward and backward) equal the
    xla rings' bit for bit."""
    n = 4
    x, w = _operands(n, rows=8)

    def grads(t):
        def f(a, b):
            def loss(a, b):
                y = GRAD_OPS[op](a, b, transport=t, bidirectional=bidirectional)
                return jnp.sum(y * y)
            return jax.grad(loss, argnums=(0, 1))(a, b)
        return f

    names, _ = _traced(n, grads("pallas"), x, w)
    assert set(names) == FUSED  # the forward's kernel and the other one in the backward
    for g, t in zip(_run(n, grads("pallas"), x, w), _run(n, grads("xla"), x, w)):
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
                pallas_rings.all_gather_matmul(a, b, "x", bidirectional=True, quant=QUANT,
                                               keep_gathered=True),
                pallas_rings.matmul_reduce_scatter(jnp.tile(a, (n, 1)), b[:, :16], "x",
                                                   bidirectional=True))

    with pallas.use_interpret(params):
        _run(n, f, x, w)
    assert not pallas.races_found()


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("bidirectional", [False, True])
def test_public_ops_run_the_fused_kernels(n, bidirectional):
    """fc.all_gather_matmul / matmul_reduce_scatter with transport="pallas" on 2-D operands run
    the fused kernels (no ring-step kernel), their plans say so, and they equal the xla
    transport bit for bit, exact and int8."""
    x, w = _operands(n, rows=8)
    names, plans = _traced(n, _public_ops("pallas", bidirectional), x, w)
    assert sorted(names) == sorted(["flashcomm_pallas_all_gather_matmul"] * 2
                                   + ["flashcomm_pallas_matmul_reduce_scatter"])
    assert [p.transport for p in plans] == ["pallas"] * 3
    assert all(f"the fused ring kernel flashcomm_pallas_{p.op}" in p.reason for p in plans)
    got = _run(n, _public_ops("pallas", bidirectional), x, w)
    for g, t in zip(got, _run(n, _public_ops("xla", bidirectional), x, w)):
        np.testing.assert_array_equal(g, t)


def test_public_ops_take_ring_steps_where_the_fused_kernel_does_not_fit():
    """A 3-D x runs a Pallas DMA kernel per ring step, its plan names why, and it still equals
    the xla transport bit for bit."""
    n = 4
    x, w = _operands(n, rows=8)
    x = x.reshape(n * 4, 2, -1)

    def ops(transport):
        def f(a, b):
            kw = dict(transport=transport, bidirectional=True)
            return (fc.all_gather_matmul(a, b, "x", bits=8, min_bytes=0, **kw),
                    fc.matmul_reduce_scatter(a, b, "x", bits=None, **kw))
        return f

    names, plans = _traced(n, ops("pallas"), x, w)
    assert names and set(names) == {"flashcomm_pallas_ring_step"}
    assert all("per ring step, not the fused kernel: x is 3-D" in p.reason for p in plans)
    for g, t in zip(_run(n, ops("pallas"), x, w), _run(n, ops("xla"), x, w)):
        np.testing.assert_array_equal(g, t)


def test_public_ops_take_ring_steps_beyond_the_vmem_budget():
    """Under a VMEM budget the fused kernels' buffers exceed, the public ops run a DMA kernel
    per ring step, their plans say why, and they still equal the xla transport bit for bit."""
    n = 2
    x, w = _operands(n, rows=8)
    with pallas.vmem_budget(64 << 10):
        names, plans = _traced(n, _public_ops("pallas", True), x, w)
        got = _run(n, _public_ops("pallas", True), x, w)
    assert names and set(names) == {"flashcomm_pallas_ring_step"}
    assert all("exceed the VMEM budget (65536 B" in p.reason for p in plans)
    for g, t in zip(got, _run(n, _public_ops("xla", True), x, w)):
        np.testing.assert_array_equal(g, t)
