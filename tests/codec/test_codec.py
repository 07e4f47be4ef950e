"""Properties of the codec API: the error bound, non-finite groups, the packing layout,
transformations (jit, vmap, shard_map with check_vma) and input validation."""

import numpy as np
import pytest
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jax_flashcomm import codec
from jax_flashcomm.codec import spec

from tests.support.codec_data import KINDS, structured

BACKENDS = ("ffi", "jnp")
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


def as64(a):
    return np.asarray(a, np.float64)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("bits", [2, 3, 4, 6, 8])
@pytest.mark.parametrize("group_size", [8, 128, 520])
def test_error_within_half_stored_scale(bits, group_size, dtype, backend):
    x = structured(np.random.default_rng(bits + group_size), 3 * len(KINDS), group_size, dtype)
    p = codec.quantize(x, bits=bits, group_size=group_size, backend=backend)
    y = codec.dequantize(p, backend=backend)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = np.abs(as64(y) - as64(x))
    bound = as64(codec.error_bound(p))
    assert np.all(err <= bound), float(np.max(err - bound))
    # the bound is the stored scale's half plus rounding: never looser than 0.51 * scale + ulps
    scale = np.repeat(as64(p.scale), group_size)[: x.size]
    finite_scale = scale > 0
    slack = bound - 0.5 * scale
    top = np.abs(as64(x)) + scale * ((1 << bits) - 1)
    allowed = 0.01 * scale + 2 * float(jnp.finfo(dtype).eps) * top + 4e-38
    clamped = np.repeat(np.asarray(p.zero).view(np.uint16) == spec.BF16_LOWEST_BITS,
                        group_size)[: x.size]
    allowed = allowed + np.where(clamped, float(spec.FLT_MAX_MINUS_BF16_LOWEST), 0.0)
    assert np.all(slack[finite_scale] <= allowed[finite_scale])


@pytest.mark.parametrize("backend", BACKENDS)
def test_exact_on_representable_grids(backend):
    """Values already on a group's grid (integers 0..2^b-1 with min 0) come back exactly."""
    bits = 4
    x = jnp.tile(jnp.arange(16, dtype=jnp.float32), 16)
    y = codec.dequantize(codec.quantize(x, bits=bits, group_size=128, backend=backend),
                         backend=backend)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_group_decodes_to_nan(bad, backend):
    g = 32
    x = np.random.default_rng(1).standard_normal(4 * g).astype(np.float32)
    x[g + 5] = bad  # group 1 only
    p = codec.quantize(jnp.asarray(x), bits=4, group_size=g, backend=backend)
    assert np.isnan(np.asarray(p.scale, np.float32)[1])
    assert np.all(np.asarray(p.codes)[1] == 0) and float(p.zero[1]) == 0.0
    y = np.asarray(codec.dequantize(p, backend=backend))
    assert np.all(np.isnan(y[g:2 * g]))
    others = np.r_[0:g, 2 * g:4 * g]
    assert np.all(np.isfinite(y[others]))
    bound = np.asarray(codec.error_bound(p))
    assert np.all(np.abs(y[others] - x[others]) <= bound[others])


def _pack_reference(codes, bits):
    """LSB-first bit stream: value j occupies bits j*b .. j*b+b-1 of its group."""
    out = np.zeros(len(codes) * bits // 8, np.uint8)
    for j, c in enumerate(codes):
        for t in range(bits):
            pos = j * bits + t
            out[pos // 8] |= ((int(c) >> t) & 1) << (pos % 8)
    return out


@pytest.mark.parametrize("bits", range(2, 9))
def test_packing_is_lsb_first_bitstream(bits):
    g = 16
    levels = (1 << bits) - 1
    q = np.arange(g) % (levels + 1)
    q[0], q[1] = 0, levels  # zero = 0, scale = 1: codes equal the values
    x = jnp.asarray(q.astype(np.float32))
    for backend in BACKENDS:
        p = codec.quantize(x, bits=bits, group_size=g, backend=backend)
        assert float(p.scale[0]) == 1.0 and float(p.zero[0]) == 0.0
        np.testing.assert_array_equal(np.asarray(p.codes)[0], _pack_reference(q, bits))


def test_payload_layout_and_bytes():
    x = jnp.ones((3, 100), jnp.bfloat16)
    p = codec.quantize(x, bits=6, group_size=64, num_chunks=4)
    assert p.codes.shape == (8, 48) and p.codes.dtype == jnp.uint8  # 300 -> 512 values
    assert p.scale.shape == (8,) and p.scale.dtype == jnp.bfloat16
    assert p.nbytes == 8 * 48 + 8 * 4
    assert codec.wire_bytes_per_element(8, 128) == pytest.approx((128 + 4) / 128)
    assert codec.wire_bytes_per_element(4, 128) == pytest.approx((64 + 4) / 128)
    split = p.split_groups(4)
    assert split.codes.shape == (4, 2, 48) and split.scale.shape == (4, 2)
    merged = split.merge_groups()
    assert merged.codes.shape == p.codes.shape
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert len(leaves) == 3 and jax.tree_util.tree_unflatten(treedef, leaves) == p


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_sum_matches_sum_of_decoded_chunks(backend):
    n, g = 4, 64
    x = jax.random.normal(jax.random.key(0), (n * 5 * g,), jnp.float32)
    p = codec.quantize(x, bits=5, group_size=g, num_chunks=n, backend=backend).split_groups(n)
    decoded = [codec.dequantize(p.map_arrays(lambda a, i=i: a[i], shape=(5 * g,)), dtype=jnp.float32)
               for i in range(n)]
    expected = decoded[0]
    for d in decoded[1:]:
        expected = expected + d
    total = codec.dequantize_sum(p, dtype=jnp.float32, backend=backend)
    np.testing.assert_array_equal(np.asarray(total), np.asarray(expected).ravel())
    requant = codec.dequantize_sum_quantize(p, bits=8, backend=backend)
    assert requant.bits == 8 and requant.shape == (5 * g,)
    y = codec.dequantize(requant, dtype=jnp.float32, backend=backend)
    assert np.all(np.abs(as64(y) - as64(total)) <= as64(codec.error_bound(requant)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_jit_vmap_and_shard_map(backend, mesh_factory):
    mesh = mesh_factory((4,), ("x",))
    x = jax.random.normal(jax.random.key(1), (4, 3, 256), jnp.bfloat16)
    roundtrip = lambda a: codec.dequantize(
        codec.quantize(a, bits=4, group_size=64, backend=backend), backend=backend)
    expected = jnp.stack([roundtrip(x[i]) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(jax.jit(jax.vmap(roundtrip))(x)),
                                  np.asarray(expected))
    sharded = jax.device_put(x, NamedSharding(mesh, P("x")))
    f = jax.jit(jax.shard_map(lambda a: roundtrip(a[0])[None], mesh=mesh,
                              in_specs=P("x"), out_specs=P("x")))
    np.testing.assert_array_equal(np.asarray(f(sharded)), np.asarray(expected))


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(bits=1), ValueError, "bits"),
    (dict(bits=9), ValueError, "bits"),
    (dict(bits=4.0), TypeError, "bits"),
    (dict(bits=True), TypeError, "bits"),
    (dict(group_size=12), ValueError, "group_size"),
    (dict(group_size=0), ValueError, "group_size"),
    (dict(backend="cuda"), ValueError, "backend"),
    (dict(num_chunks=0), ValueError, "num_chunks"),
])
def test_bad_arguments_raise_at_trace_time(kwargs, exc, match):
    with pytest.raises(exc, match=match):
        jax.jit(lambda a: codec.quantize(a, **kwargs)).trace(jnp.ones(64))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_, jnp.complex64, jnp.uint8])
def test_bad_dtype_raises(dtype):
    with pytest.raises(TypeError, match="x must have dtype"):
        codec.quantize(jnp.zeros(64, dtype))


def test_empty_and_non_payload_raise():
    with pytest.raises(ValueError, match="empty"):
        codec.quantize(jnp.zeros((0, 8)))
    with pytest.raises(TypeError, match="Payload"):
        codec.dequantize(jnp.zeros(8))
    with pytest.raises(ValueError, match="chunk axis"):
        codec.dequantize_sum(codec.quantize(jnp.ones(64), group_size=8))
    with pytest.raises(TypeError, match="dtype"):
        codec.dequantize(codec.quantize(jnp.ones(64), group_size=8), dtype=jnp.int8)


def test_constants_match_header():
    header = open(__file__.replace("tests/codec/test_codec.py", "ffi/include/flashcomm/codec.h")).read()
    assert f"kMinBits = {spec.MIN_BITS};" in header and f"kMaxBits = {spec.MAX_BITS};" in header
    assert f"kBlock = {spec.BLOCK};" in header
    assert f"kBf16NaN = 0x{spec.BF16_NAN_BITS:04X};" in header


@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_fused_sum_partial_overflow_falls_back(n):
    """Chunks whose running f32 sum overflows (+3e38 ... -3e38) but whose exact sum is finite
    sum to a finite value, identically in the kernel and the twin; chunks that overflow for
    real give Inf."""
    g = 16
    half = (n + 1) // 2
    signs = np.array([1.0] * half + [-1.0] * (n - half), np.float32)
    x = np.outer(signs, np.linspace(1.0, 0.5, g, dtype=np.float32) * 3e38).astype(np.float32)
    p = codec.quantize(jnp.asarray(x.ravel()), bits=8, group_size=g, num_chunks=n)
    p = p.split_groups(n)
    decoded = np.asarray(codec.dequantize_sum(p, dtype=jnp.float32, backend="jnp"))
    np.testing.assert_array_equal(
        decoded.view(np.uint32),
        np.asarray(codec.dequantize_sum(p, dtype=jnp.float32, backend="ffi")).view(np.uint32))
    assert np.all(np.isfinite(decoded))
    exact = x.astype(np.float64).sum(axis=0)
    per_chunk = [codec.error_bound(p.map_arrays(lambda a, i=i: a[i], shape=(g,)))
                 for i in range(n)]
    # each chunk's quantization error, plus n f32 roundings of partial sums of at most n*3e38
    eps32 = float(np.finfo(np.float32).eps)
    bound = (np.sum([np.asarray(b, np.float64) for b in per_chunk], axis=0)
             + n * (eps32 / 2) * n * 3e38)
    assert np.all(np.abs(decoded - exact) <= bound)
    same_sign = np.abs(x)
    total = same_sign.astype(np.float64).sum(axis=0)
    both = codec.quantize(jnp.asarray(same_sign.ravel()), bits=8, group_size=g, num_chunks=n)
    summed = np.asarray(codec.dequantize_sum(both.split_groups(n), dtype=jnp.float32))
    flt_max = float(np.finfo(np.float32).max)
    assert np.all(np.isinf(summed[total > 1.01 * flt_max]))
    assert np.all(np.isfinite(summed[total < 0.99 * flt_max]))


def test_transport_record_bytes_and_round_trip():
    """pack writes each group as [codes, scale, zero] with the bf16s little-endian (docs/format.md,
    "Transport record"; bf16 1.0 is [0x80, 0x3F]), for every bf16 bit pattern (NaN payloads and
    signed zeros included); unpack gives back the same codes and bf16 bits."""
    from jax_flashcomm.transport import wire

    patterns = np.arange(1 << 16, dtype=np.uint16)
    scale = jnp.asarray(patterns.view(jnp.bfloat16))
    zero = jnp.asarray(patterns[::-1].copy().view(jnp.bfloat16))
    codes = jnp.asarray(np.random.RandomState(0).randint(0, 256, (1 << 16, 6)), jnp.uint8)
    p = codec.Payload(codes, scale, zero, bits=3, group_size=16, shape=(1 << 20,),
                      dtype=np.dtype(jnp.bfloat16))
    buf = np.asarray(jax.jit(wire.pack)(p))
    assert buf.shape == (1 << 16, 10) and buf.dtype == np.uint8
    np.testing.assert_array_equal(buf[:, :6], np.asarray(codes))
    np.testing.assert_array_equal(buf[:, 6] | (buf[:, 7].astype(np.uint16) << 8), patterns)
    np.testing.assert_array_equal(buf[:, 8] | (buf[:, 9].astype(np.uint16) << 8), patterns[::-1])
    one = wire.pack(codec.Payload(codes[:1], jnp.ones(1, jnp.bfloat16), zero[:1], bits=3,
                                  group_size=16, shape=(16,), dtype=np.dtype(jnp.bfloat16)))
    assert list(np.asarray(one)[0, 6:8]) == [0x80, 0x3F]
    back = jax.jit(lambda b: wire.unpack(b, bits=3, group_size=16, shape=(1 << 20,),
                                         dtype=jnp.bfloat16))(buf)
    np.testing.assert_array_equal(np.asarray(back.codes), np.asarray(codes))
    np.testing.assert_array_equal(np.asarray(back.scale).view(np.uint16), patterns)
    np.testing.assert_array_equal(np.asarray(back.zero).view(np.uint16), patterns[::-1])


def test_gather_free_selection_equals_argmax_and_take():
    """The twin's spike selection runs without argmax or gather (so a Mosaic kernel runs it):
    first_index is jnp.argmax of a mask (0 where no position holds True) and take_last is
    take_along_axis, bit for bit (signed zeros and NaN payloads included)."""
    from jax_flashcomm.codec import reference

    rng = np.random.default_rng(3)
    mask = rng.random((64, 32)) < 0.1
    mask[0] = False
    got = np.asarray(jax.jit(reference.first_index)(jnp.asarray(mask)))
    assert np.array_equal(got, np.argmax(mask, axis=-1))
    v = rng.standard_normal((64, 32)).astype(np.float32)
    v[1, :4] = [-0.0, np.nan, -np.inf, np.float32(1e-45)]
    v[1, 4] = np.frombuffer(np.uint32(0xFFC00001).tobytes(), np.float32)[0]
    pos = rng.integers(0, 32, (64, 3)).astype(np.int32)
    pos[1] = [0, 1, 4]
    got = np.asarray(jax.jit(reference.take_last)(jnp.asarray(v), jnp.asarray(pos)))
    assert np.array_equal(got.view(np.uint32), np.take_along_axis(v, pos, -1).view(np.uint32))
    keys = np.abs(v)
    keys[2, [5, 9]] = 100.0  # a tie: the lower position first
    sel = np.asarray(jax.jit(reference.select_spikes, static_argnums=1)(jnp.asarray(keys), 2))
    assert list(sel[2]) == [5, 9]
