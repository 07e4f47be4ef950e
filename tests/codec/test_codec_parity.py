"""The jnp twin and the CPU FFI kernels implement one spec: codes, scales and zeros are
bit-identical, and so are the decoded values and the fused sums."""

import functools

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from hypothesis import given, strategies as st

from jax_flashcomm import codec
from jax_flashcomm.codec import kernels

from tests.support.codec_data import KINDS, every_isa, structured
from tests.support.pairwise import all_pairs

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
BITS = (2, 3, 4, 5, 6, 7, 8)
GROUP_SIZES = (8, 32, 128, 512)



# The FFI side of every parity test runs on every instruction-set build of the CPU kernels
# (codec_data.every_isa: the same executable, each build's kernels, bit-equal results).
@pytest.fixture(autouse=True, scope="module")
def cpu_kernels_built():
    assert kernels.available("cpu"), (
        "the CPU FFI kernels are not built: pip install . first "
        f"({kernels._import_errors.get('cpu')})")


def assert_payloads_equal(a: codec.Payload, b: codec.Payload):
    np.testing.assert_array_equal(np.asarray(a.codes), np.asarray(b.codes), "codes differ")
    np.testing.assert_array_equal(
        np.asarray(a.scale).view(np.uint16), np.asarray(b.scale).view(np.uint16), "scales differ")
    np.testing.assert_array_equal(
        np.asarray(a.zero).view(np.uint16), np.asarray(b.zero).view(np.uint16), "zeros differ")


def assert_bits_equal(a, b):
    """Bit-equal arrays (NaN == NaN when their bits match)."""
    a, b = np.asarray(a), np.asarray(b)
    assert a.dtype == b.dtype and a.shape == b.shape
    width = {2: np.uint16, 4: np.uint32}[a.dtype.itemsize]
    np.testing.assert_array_equal(a.view(width), b.view(width))


def both(fn):
    ffi = jax.jit(lambda *a: fn(*a, backend="ffi"))
    return (lambda *a: every_isa(ffi, *a)), jax.jit(lambda *a: fn(*a, backend="jnp"))


# Every width with every group size, dtype and the other (all pairs), and every width at the
# default group size in bf16; the hypothesis test below draws from the whole grid.
QD_CASES = all_pairs(BITS, GROUP_SIZES, DTYPES,
                     always=lambda b, g, d: g == 128 and d == jnp.bfloat16)


@pytest.mark.parametrize("bits,group_size,dtype", QD_CASES,
                         ids=[f"{b}-{g}-{jnp.dtype(d).name}" for b, g, d in QD_CASES])
def test_quantize_dequantize_bit_identical(bits, group_size, dtype):
    rng = np.random.default_rng(bits * 1000 + group_size)
    x = structured(rng, 2 * len(KINDS), group_size, dtype)
    q_ffi, q_jnp = both(lambda x, backend: codec.quantize(
        x, bits=bits, group_size=group_size, backend=backend))
    p_ffi, p_jnp = q_ffi(x), q_jnp(x)
    assert_payloads_equal(p_ffi, p_jnp)
    d_ffi, d_jnp = both(lambda p, backend: codec.dequantize(p, backend=backend))
    assert_bits_equal(d_ffi(p_ffi), d_jnp(p_ffi))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits,out_bits", [(8, 8), (4, 8), (6, 4), (3, 2), (2, 7)])
def test_fused_sum_ops_bit_identical(bits, out_bits, dtype):
    n, group_size = 4, 64
    rng = np.random.default_rng(bits * 10 + out_bits)
    x = structured(rng, n * 3 * len(KINDS), group_size, dtype)
    payload = codec.quantize(x, bits=bits, group_size=group_size, num_chunks=n).split_groups(n)
    s_ffi, s_jnp = both(lambda p, backend: codec.dequantize_sum(p, backend=backend))
    assert_bits_equal(s_ffi(payload), s_jnp(payload))
    r_ffi, r_jnp = both(lambda p, backend: codec.dequantize_sum_quantize(
        p, bits=out_bits, backend=backend))
    assert_payloads_equal(r_ffi(payload), r_jnp(payload))


def test_batched_leading_axes_match_jnp():
    """Payloads with extra leading axes (as vmap produces) decode group by group."""
    x = structured(np.random.default_rng(0), 3 * 4 * len(KINDS), 32, jnp.bfloat16)
    x = x.reshape(3, 4 * len(KINDS) * 32)
    f = lambda backend: jax.vmap(lambda r: codec.dequantize(
        codec.quantize(r, bits=5, group_size=32, backend=backend), backend=backend))
    assert_bits_equal(jax.jit(f("ffi"))(x), jax.jit(f("jnp"))(x))


SPECIAL = np.array([0.0, -0.0, 1e-40, -1e-42, 1.17549435e-38, 1000.0, 1000.25, 1000.5, 65504.0,
                    -65504.0, 3.0e38, -3.0e38, 1e-30], np.float64)


@st.composite
def operands(draw):
    """An operand of a drawn shape and dtype: Gaussian, uniform or log-uniform values at a
    drawn magnitude, with drawn special values (signed zeros, denormals, offsets, near-max)
    at drawn positions."""
    shape = tuple(draw(st.lists(st.integers(1, 24), min_size=1, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    size = int(np.prod(shape))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    magnitude = draw(st.sampled_from([1e-38, 1e-30, 1e-3, 1.0, 1e3, 1e30, 3e38]))
    dist = draw(st.sampled_from(["normal", "uniform", "loguniform", "offset"]))
    if dist == "normal":
        v = rng.standard_normal(size) * magnitude
    elif dist == "uniform":
        v = rng.uniform(-1, 1, size) * magnitude
    elif dist == "loguniform":
        v = np.sign(rng.standard_normal(size)) * np.exp(rng.uniform(-80, 80, size))
    else:
        v = magnitude * (1 + rng.uniform(0, 1e-3, size))
    n_special = draw(st.integers(0, min(size, 6)))
    for _ in range(n_special):
        v[draw(st.integers(0, size - 1))] = SPECIAL[draw(st.integers(0, len(SPECIAL) - 1))]
    finfo = jnp.finfo(dtype)
    v = np.clip(v, -float(finfo.max), float(finfo.max)).astype(np.float32)
    return jnp.asarray(v.reshape(shape)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("bits", "group_size", "spikes"))
def _roundtrip_both(x, bits, group_size, spikes=0):
    q = dict(bits=bits, group_size=group_size, spikes=spikes)
    p_ffi = codec.quantize(x, backend="ffi", **q)
    p_jnp = codec.quantize(x, backend="jnp", **q)
    return (p_ffi, p_jnp, codec.dequantize(p_ffi, backend="ffi"),
            codec.dequantize(p_jnp, backend="jnp"), codec.error_bound(p_ffi))


@pytest.mark.slow
@given(x=operands(), bits=st.integers(2, 8), group_size=st.sampled_from([8, 16, 24, 128, 256]),
       spikes=st.sampled_from([0, 0, 1, 3, 7]))
def test_hypothesis_parity_and_bound(x, bits, group_size, spikes):
    p_ffi, p_jnp, y_ffi, y_jnp, bound = every_isa(_roundtrip_both, x, bits, group_size, spikes)
    assert_payloads_equal(p_ffi, p_jnp)
    assert_bits_equal(y_ffi, y_jnp)
    err = np.abs(np.asarray(y_ffi, np.float64) - np.asarray(x, np.float64))
    assert np.all(err <= np.asarray(bound, np.float64))


# --- dequantize_into: one payload decoded into a slot of a larger buffer, in place ------------

@functools.partial(jax.jit, static_argnames=("backend",))
def _into(out, p, offset, backend):
    return codec.dequantize_into(out, p, offset, backend=backend)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("rotation,spikes", [(0, 0), (2, 0), (0, 3), (1, 2)],
                         ids=["plain", "rotation", "spikes", "rotation+spikes"])
@pytest.mark.parametrize("bits", [3, 8])
def test_dequantize_into_bit_identical(bits, rotation, spikes, dtype):
    """FFI kernel == jnp twin bit for bit, and the chunk == dequantize of the payload (the
    padding dropped), at traced offsets; everything else in out is kept."""
    rng = np.random.default_rng(bits + 10 * rotation + 100 * spikes)
    x = structured(rng, len(KINDS), 128, dtype).reshape(-1)[: len(KINDS) * 128 - 37]
    x = x.reshape(-1, 3) if x.size % 3 == 0 else x  # any shape; count ends inside a group
    p = codec.quantize(x, bits=bits, group_size=128, backend="ffi", rotation=rotation,
                       spikes=spikes)
    want = np.asarray(codec.dequantize(p, backend="ffi")).reshape(-1)
    count = want.size
    fill = jnp.asarray(rng.standard_normal(3 * count + 11), jnp.float32).astype(dtype)
    out = fill.reshape(-1, 1)  # out may have any shape; it is addressed flat
    for offset in (0, 5, count + 1, 2 * count + 11):
        got_ffi = np.asarray(every_isa(_into, out, p, jnp.int32(offset), "ffi")).reshape(-1)
        got_jnp = np.asarray(_into(out, p, jnp.int32(offset), "jnp")).reshape(-1)
        assert_bits_equal(got_ffi, got_jnp)
        expect = np.asarray(fill).copy()
        expect[offset: offset + count] = want
        assert_bits_equal(got_ffi, expect)


def test_dequantize_into_updates_in_place_in_a_loop():
    """In a fori_loop the call is a custom call aliased to the carried buffer: no copy of it."""
    x = jnp.arange(4 * 256, dtype=jnp.float32).reshape(4, 256).astype(jnp.bfloat16)
    p = codec.quantize(x[0], bits=8, backend="ffi")

    def f(out, p):
        return jax.lax.fori_loop(
            0, 4, lambda i, o: codec.dequantize_into(o, p, i * 256, backend="ffi"), out)

    out = jnp.zeros((4, 256), jnp.bfloat16)
    got = jax.jit(f)(out, p)
    for r in range(4):
        assert_bits_equal(got[r], codec.dequantize(p, backend="ffi"))
    hlo = jax.jit(f).lower(out, p).compile().as_text()
    assert 'custom_call_target="flashcomm_dequantize_into"' in hlo
    assert "output_to_operand_aliasing={{}: (0, {})}" in hlo


def test_dequantize_into_bounds():
    p = codec.quantize(jnp.ones((300,), jnp.float32), bits=4, backend="ffi")
    out = jnp.zeros((1000,), jnp.float32)
    # static offsets and sizes are checked at trace time
    for bad in (-1, 701, 1000):
        with pytest.raises(ValueError, match="out of bounds"):
            codec.dequantize_into(out, p, bad)
    with pytest.raises(ValueError, match="more than out"):
        codec.dequantize_into(jnp.zeros((299,), jnp.float32), p, 0)
    with pytest.raises(TypeError):
        codec.dequantize_into(out, p, 1.5)
    with pytest.raises(TypeError):
        codec.dequantize_into(out, p, True)
    with pytest.raises(TypeError):
        codec.dequantize_into(jnp.zeros((1000,), jnp.int32), p, 0)
    with pytest.raises(ValueError, match="one operand's payload"):
        codec.dequantize_into(out, codec.quantize(jnp.ones((2, 256)), num_chunks=2).split_groups(2),
                              0)
    want = np.asarray(codec.dequantize(p, backend="ffi"))
    np.testing.assert_array_equal(np.asarray(codec.dequantize_into(out, p, 700))[700:], want)
    # a traced offset out of range: the CPU kernel returns an error, nothing is written
    f = jax.jit(lambda o, i: codec.dequantize_into(o, p, i, backend="ffi"))
    for bad in (-1, 701, 2**31 - 1):
        with pytest.raises(jax.errors.JaxRuntimeError, match="out of bounds"):
            jax.block_until_ready(f(out, jnp.int32(bad)))
    np.testing.assert_array_equal(np.asarray(f(out, jnp.int32(700)))[700:], want)
