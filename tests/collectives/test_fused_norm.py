"""jax_flashcomm.psum_add_rms_norm: the exact path equals lax.psum + add + RMSNorm bit for bit;
the quantized path's new residual is within the all-reduce's bound (from the stored scales of
both phases) of residual + the true sum, its output is the RMSNorm of that residual, the FFI and
jnp backends agree bit for bit through the collective, the quantized output decodes to the
output within its bound; 2-D and 3-D, f32 and bf16 weights; bad input; autodiff; the plan."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce, codec
from jax_flashcomm.fused_norm import rms_norm

from tests.support.meshes import make_mesh

N = 4
EPS = 1e-5
SHAPES = [(2, 40, 576), (48, 1024)]     # 3-D (batch, seq, hidden) and 2-D, >= 1 MiB f32 per rank


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((N,), ("tp",), jax.sharding.AxisType.Explicit)


def _data(shape, dtype, wdtype, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, *shape)).astype(np.float32)
    r = rng.standard_normal(shape).astype(np.float32) * 2
    w = (rng.standard_normal(shape[-1]) * 0.3 + 1).astype(np.float32)
    return (jnp.asarray(x, dtype), jnp.asarray(r, dtype), jnp.asarray(w, wdtype))


def _call(mesh, fn, x, r, w, n_out):
    """fn(x_local, r, w) -> n_out arrays, each replicated (out_specs P(): check_vma holds)."""
    f = jax.shard_map(lambda xl, r, w: fn(xl[0], r, w), mesh=mesh,
                      in_specs=(P("tp"), P(), P()), out_specs=(P(),) * n_out)
    x = jax.device_put(x, NamedSharding(mesh, P("tp")))
    return [np.asarray(o) for o in jax.jit(f)(x, r, w)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("dtype,wdtype", [(jnp.float32, jnp.float32), (jnp.bfloat16, jnp.float32),
                                          (jnp.bfloat16, jnp.bfloat16)],
                         ids=["f32-w_f32", "bf16-w_f32", "bf16-w_bf16"])
def test_exact_path_is_lax_psum_add_norm(mesh, shape, dtype, wdtype):
    x, r, w = _data(shape, dtype, wdtype)

    def both(xl, r, w):
        out, h = fc.psum_add_rms_norm(xl, r, w, "tp", eps=EPS, bits=None)
        h_ref = r + lax.psum(xl, "tp")
        return out, h, rms_norm(h_ref, w, EPS), h_ref

    out, h, out_ref, h_ref = _call(mesh, both, x, r, w, 4)
    assert out.dtype == h.dtype == np.dtype(dtype) and out.shape == h.shape == shape
    np.testing.assert_array_equal(h, h_ref)
    np.testing.assert_array_equal(out, out_ref)


def _bounds(xl, axes, config):
    """Per-element bound of the quantized all-reduce: sum over ranks of phase 1's, plus phase 2's."""
    _, p1, p2 = allreduce.two_step(allreduce.vary(xl, axes, config), axes, config)
    return lax.psum(codec.error_bound(p1), axes) + codec.error_bound(p2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{len(s)}d")
@pytest.mark.parametrize("dtype,wdtype", [(jnp.float32, jnp.float32), (jnp.float32, jnp.bfloat16),
                                          (jnp.bfloat16, jnp.bfloat16)],
                         ids=["f32-w_f32", "f32-w_bf16", "bf16-w_bf16"])
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_path_within_bound(mesh, shape, dtype, wdtype, bits):
    x, r, w = _data(shape, dtype, wdtype, seed=bits)
    config = fc.CommConfig(bits=bits, min_bytes=0)

    def run(xl, r, w):
        out, h = fc.psum_add_rms_norm(xl, r, w, "tp", eps=EPS, config=config)
        _, _, p2 = allreduce.two_step(allreduce.vary(xl, ("tp",), config), ("tp",), config)
        out_j, h_j = codec.add_rms_norm(p2, r, w, eps=EPS, backend="jnp")
        return out, h, out_j, h_j, _bounds(xl, ("tp",), config)

    out, h, out_j, h_j, bound = _call(mesh, run, x, r, w, 5)
    # the op is the twin's epilogue of the all-reduce's gathered payload, bit for bit
    np.testing.assert_array_equal(out.view(np.uint8), out_j.view(np.uint8))
    np.testing.assert_array_equal(h.view(np.uint8), h_j.view(np.uint8))
    true_h = np.asarray(r, np.float64) + np.asarray(x, np.float64).sum(0)
    hf = h.astype(np.float64)
    eps_t = float(jnp.finfo(dtype).eps)
    tol = bound + 8 * np.finfo(np.float32).eps * (np.abs(np.asarray(x, np.float64)).sum(0)
                                                   + np.abs(true_h)) + eps_t * np.abs(true_h)
    err = np.abs(hf - true_h)
    assert (err <= tol).all(), float((err - tol).max())
    assert err.max() > 0  # it did quantize
    # the output is the RMSNorm of the new residual (float64 model, one output rounding)
    ref = hf / np.sqrt((hf * hf).mean(-1, keepdims=True) + EPS) * np.asarray(w, np.float64)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=2 * eps_t, atol=1e-6)


def test_quantized_output(mesh):
    x, r, w = _data((16, 512), jnp.bfloat16, jnp.bfloat16)
    config = fc.CommConfig(bits=8, min_bytes=0)

    def run(xl, r, w):
        q, h = fc.psum_add_rms_norm(xl, r, w, "tp", eps=EPS, config=config, out_bits=8,
                                    out_group_size=64)
        out, h2 = fc.psum_add_rms_norm(xl, r, w, "tp", eps=EPS, config=config)
        q_exact, _ = fc.psum_add_rms_norm(xl, r, w, "tp", eps=EPS, bits=None, out_bits=4)
        return (codec.dequantize(q, dtype=jnp.float32), codec.error_bound(q), out, h, h2,
                codec.dequantize(q_exact, dtype=jnp.float32))

    dq, bound, out, h, h2, dq_exact = _call(mesh, run, x, r, w, 6)
    np.testing.assert_array_equal(h, h2)
    assert (np.abs(dq - out.astype(np.float32)) <= bound).all()
    assert dq_exact.shape == (16, 512)


def test_plan_and_record(mesh):
    x, r, w = _data((16, 512), jnp.float32, jnp.float32)
    with fc.record() as plans:
        _call(mesh, lambda xl, r, w: fc.psum_add_rms_norm(xl, r, w, "tp", min_bytes=0),
              x, r, w, 2)
        _call(mesh, lambda xl, r, w: fc.psum_add_rms_norm(xl, r, w, "tp"), x, r, w, 2)
    ops = [p for p in plans if p.op == "psum_add_rms_norm"]
    # the automatic choice keeps a 32 KiB all-reduce exact: lax, or the exact p2p sum
    assert [p.path for p in ops][0] == "quantized", [str(p) for p in plans]
    assert ops[1].path in ("lax", "exact") and not ops[1].quantized, str(ops[1])


@pytest.mark.parametrize("bad,err", [
    (lambda x, r, w: (x, r[..., :-8], w), ValueError),        # shapes differ
    (lambda x, r, w: (x, r.astype(jnp.bfloat16), w), ValueError),  # dtypes differ
    (lambda x, r, w: (x, r, w[:-8]), ValueError),             # weight not (hidden,)
    (lambda x, r, w: (x, r, w.astype(jnp.int32)), TypeError),
])
def test_bad_input(mesh, bad, err):
    x, r, w = _data((16, 512), jnp.float32, jnp.float32)

    def body(xl, r, w):
        return fc.psum_add_rms_norm(*bad(xl, r, w), "tp", min_bytes=0)

    with pytest.raises(err):
        _call(mesh, body, x, r, w, 2)
    with pytest.raises(ValueError, match="eps"):
        _call(mesh, lambda xl, r, w: fc.psum_add_rms_norm(xl, r, w, "tp", eps=-1.0), x, r, w, 2)
    with pytest.raises(ValueError, match="out_group_size"):
        _call(mesh, lambda xl, r, w: fc.psum_add_rms_norm(xl, r, w, "tp", out_bits=8,
                                                           out_group_size=384), x, r, w, 2)


@pytest.mark.parametrize("bits", [None, 8])
def test_grad(mesh, bits):
    x, r, w = _data((16, 512), jnp.float32, jnp.float32)
    rng = np.random.default_rng(5)
    c1, c2 = (jnp.asarray(rng.standard_normal((16, 512)), jnp.float32) for _ in range(2))

    def loss(fused, xl, r, w):
        if fused:
            out, h = fc.psum_add_rms_norm(xl, r, w, "tp", bits=bits, min_bytes=0)
        else:
            h = r + lax.psum(xl, "tp")
            out = rms_norm(h, w, EPS)
        return jnp.sum(out * c1) + jnp.sum(h * c2)

    def grads(fused):
        def body(xl, r, w):
            g = jax.grad(lambda *a: loss(fused, *a), argnums=(0, 1, 2))(xl[0], r, w)
            return g[0][None], g[1], g[2]
        f = jax.shard_map(body, mesh=mesh, in_specs=(P("tp"), P(), P()),
                          out_specs=(P("tp"), P(), P()))
        xs = jax.device_put(x, NamedSharding(mesh, P("tp")))
        return [np.asarray(g) for g in jax.jit(f)(xs, r, w)]

    got, want = grads(True), grads(False)
    for g, e in zip(got, want):
        if bits is None:
            np.testing.assert_array_equal(g, e)
        else:  # the backward is exact math at the quantized forward's residual
            np.testing.assert_allclose(g, e, rtol=0.05, atol=0.05 * np.abs(e).max())


def test_xla_transport_runs_no_separate_dequantize(mesh):
    """On the xla transport the all-reduce's own dequantize is dropped: the compiled program
    decodes the gathered payload once, in the fused kernel; values as on the p2p transport."""
    x, r, w = _data((16, 512), jnp.bfloat16, jnp.bfloat16)

    def body(transport):
        return lambda xl, r, w: fc.psum_add_rms_norm(xl, r, w, "tp", min_bytes=0,
                                                     transport=transport)

    f = jax.jit(jax.shard_map(lambda xl, r, w: body("xla")(xl[0], r, w), mesh=mesh, in_specs=(P("tp"), P(), P()),
                              out_specs=(P(), P())))
    xs = jax.device_put(x, NamedSharding(mesh, P("tp")))
    hlo = f.lower(xs, r, w).compile().as_text()
    assert 'custom_call_target="flashcomm_add_rms_norm"' in hlo
    assert 'custom_call_target="flashcomm_dequantize"' not in hlo
    got = [np.asarray(o) for o in f(xs, r, w)]
    want = _call(mesh, body("p2p"), x, r, w, 2)
    for g, e in zip(got, want):
        np.testing.assert_array_equal(g.view(np.uint16), e.view(np.uint16))


@pytest.mark.parametrize("transport", ["p2p", "xla"])
def test_two_step_without_decode(mesh, transport):
    """two_step(decode=False) stops at the gathered payload on both transports (the p2p call's
    decoded result is empty): the same payload bytes as with the decode, and no sum."""
    x, r, w = _data((16, 512), jnp.float32, jnp.float32)
    config = fc.CommConfig(bits=8, min_bytes=0, transport=transport)

    def body(xl, r, w):
        xv = allreduce.vary(xl, ("tp",), config)
        y0, _, q = allreduce.two_step(xv, ("tp",), config, decode=False)
        assert y0 is None
        _, _, p = allreduce.two_step(xv, ("tp",), config)
        return p.codes, q.codes, p.scale, q.scale

    a, b, c, d = _call(mesh, body, x, r, w, 4)
    np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(c.view(np.uint16), d.view(np.uint16))
