"""The fused epilogue's FFI kernel (flashcomm_add_rms_norm[_quantize], every CPU ISA build) and
its jnp twin (jax_flashcomm.codec.norm) give the same bits: new residual, normalised output and
the quantized output's codes, scales and zeros; and both match an independent float64 /
numpy-f32 model of the order of operations docs/fused_norm.md specifies."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec
from jax_flashcomm.codec import norm
from tests.support.pairwise import all_pairs

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
WEIGHTS = (jnp.float32, jnp.bfloat16)
# (shape, bits, group_size, rotation, spikes): hidden a multiple of 16 or not, of G or not,
# rows straddling groups, 2-D and 3-D, rotation and spikes of the all-gather phase.
CASES = [
    ((3, 7, 576), 8, 128, 1, 0),
    ((5, 200), 8, 128, 0, 1),
    ((4, 256), 4, 64, 2, 1),
    ((3, 8), 8, 128, 1, 0),
    ((2, 3, 4096), 8, 128, 0, 0),
]


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype != np.uint8 else a


def _operands(shape, dtype, wdtype, seed):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal(shape) * 3, dtype)
    r = jnp.asarray(rng.standard_normal(shape), dtype)
    w = jnp.asarray(rng.standard_normal(shape[-1]) * 0.5 + 1, wdtype)
    return x, r, w


@functools.lru_cache(maxsize=None)
def _jitted(backend, out_bits=None, out_group_size=128):
    return jax.jit(lambda p, r, w: norm.add_rms_norm(p, r, w, eps=1e-5, backend=backend,
                                                     out_bits=out_bits,
                                                     out_group_size=out_group_size))


def _run(p, r, w, backend, **kw):
    return _jitted(backend, **kw)(p, r, w)


# Every case with every operand dtype and weight dtype, and each dtype with each weight dtype
# (all pairs).
NORM_ROWS = all_pairs(CASES, WEIGHTS, DTYPES)


@pytest.mark.parametrize(
    "case,wdtype,dtype", NORM_ROWS,
    ids=["x".join(map(str, c[0])) + f"-b{c[1]}-g{c[2]}-r{c[3]}-k{c[4]}-w_{jnp.dtype(w).name}-"
         f"{jnp.dtype(d).name}" for c, w, d in NORM_ROWS])
def test_fused_norm_bit_identical(dtype, wdtype, case):
    shape, bits, g, rot, k = case
    x, r, w = _operands(shape, dtype, wdtype, sum(shape))
    p = codec.quantize(x, bits=bits, group_size=g, rotation=rot, spikes=k)
    for isa in codec.cpu_isas():
        with codec.use_cpu_isa(isa):
            a = _run(p, r, w, "ffi")
        b = _run(p, r, w, "jnp")
        for u, v, name in zip(a, b, ("out", "new residual")):
            assert u.shape == v.shape == shape and u.dtype == v.dtype == dtype
            np.testing.assert_array_equal(_bits(u), _bits(v), err_msg=f"{name} on {isa}")


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("out_bits,out_g", [(8, 64), (4, 32), (8, 128)])
def test_fused_norm_quantized_output_bit_identical(dtype, out_bits, out_g):
    x, r, w = _operands((6, 512), dtype, jnp.bfloat16, out_bits)
    p = codec.quantize(x, bits=8, rotation=1)
    (qa, ha), (qb, hb) = (_run(p, r, w, b, out_bits=out_bits, out_group_size=out_g)
                          for b in ("ffi", "jnp"))
    for field in ("codes", "scale", "zero"):
        np.testing.assert_array_equal(_bits(getattr(qa, field)), _bits(getattr(qb, field)))
    np.testing.assert_array_equal(_bits(ha), _bits(hb))
    # the quantized output is the codec's quantize of the written output
    out, _ = _run(p, r, w, "ffi")
    ref = codec.quantize(out, bits=out_bits, group_size=out_g, backend="jnp")
    np.testing.assert_array_equal(np.asarray(qa.codes), np.asarray(ref.codes))
    assert qa.shape == (6, 512) and qa.bits == out_bits and qa.rotation == 0


def _numpy_model(d, r, w, eps, dtype):
    """docs/fused_norm.md step by step in numpy f32 (one rounding per step)."""
    f32 = np.float32
    hidden = d.shape[-1]
    h = (d + r.astype(f32)).astype(dtype)
    hf = h.astype(f32)
    out = np.empty_like(hf)
    for i in range(hf.shape[0]):
        acc = np.zeros(16, f32)
        for j in range(hidden):
            acc[j % 16] = f32(acc[j % 16] + f32(hf[i, j] * hf[i, j]))
        for half in (8, 4, 2, 1):
            acc = (acc[:half] + acc[half:2 * half]).astype(f32)
        ms = f32(f32(acc[0] + f32(f32(eps) * f32(hidden))) * (f32(1) / f32(hidden)))
        inv = f32(1) / f32(np.sqrt(ms))
        out[i] = (hf[i] * inv).astype(f32) * w.astype(f32)
    return out.astype(dtype), h


@pytest.mark.parametrize("dtype", (jnp.float32, jnp.bfloat16), ids=lambda d: jnp.dtype(d).name)
def test_fused_norm_matches_the_specified_order(dtype):
    x, r, w = _operands((4, 200), dtype, jnp.float32, 3)
    p = codec.quantize(x, bits=8, rotation=1)
    d = np.asarray(codec.dequantize(p, dtype=jnp.float32))
    out_ref, h_ref = _numpy_model(d, np.asarray(r), np.asarray(w), 1e-5, np.dtype(dtype))
    out, h = _run(p, r, w, "ffi")
    np.testing.assert_array_equal(_bits(h), _bits(h_ref))
    np.testing.assert_array_equal(_bits(out), _bits(out_ref))


def test_fused_norm_non_finite_group_gives_nan_rows():
    x = np.ones((2, 256), np.float32)
    x[0, 3] = np.inf
    p = codec.quantize(jnp.asarray(x), bits=8)
    r, w = jnp.zeros((2, 256)), jnp.ones(256)
    for backend in ("ffi", "jnp"):
        out, h = _run(p, r, w, backend)
        assert np.isnan(np.asarray(h)[0, :128]).all() and np.isfinite(np.asarray(h)[1]).all()
        assert np.isnan(np.asarray(out)[0]).all() and np.isfinite(np.asarray(out)[1]).all()


@pytest.mark.parametrize("bad,err", [
    (dict(r=jnp.zeros((4, 100))), ValueError),            # not the payload's shape
    (dict(w=jnp.ones(100)), ValueError),                  # not (hidden,)
    (dict(w=jnp.ones(128, jnp.int32)), TypeError),        # weight dtype
    (dict(r=jnp.zeros((4, 128), jnp.int32)), TypeError),  # residual dtype
    (dict(eps=-1.0), ValueError),
    (dict(eps=float("nan")), ValueError),
    (dict(out_bits=8, out_group_size=96), ValueError),    # 128 % 96
    (dict(out_bits=9), ValueError),
])
def test_fused_norm_bad_input(bad, err):
    p = codec.quantize(jnp.ones((4, 128)), bits=8)
    r, w = bad.pop("r", jnp.zeros((4, 128))), bad.pop("w", jnp.ones(128))
    eps = bad.pop("eps", 1e-5)
    with pytest.raises(err):
        norm.add_rms_norm(p, r, w, eps=eps, **bad)
