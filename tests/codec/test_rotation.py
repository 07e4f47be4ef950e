"""The codec's group rotation (docs/format.md, "Rotation"): jnp twin and CPU kernels
bit-identical (codes, scales, zeros, decoded values, fused sums); the error bound in the
rotated domain and mapped back, elementwise; the collectives with rotation (psum, psum_scatter,
all_gather, quantized all_gather_matmul) within their bounds and identical on every rank;
argument validation; rotation=0 is today's format bit for bit."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce, codec
from jax_flashcomm.codec import kernels, reference
from jax_flashcomm import CommConfig

from tests.support import collective_oracles as oracles
from tests.support.codec_data import bit_view as _bits, every_isa, jit_quantize as _quant
from tests.support.pairwise import all_pairs

pytestmark = pytest.mark.slow  # the exhaustive rotation parity matrix

EPS32 = float(np.finfo(np.float32).eps)
needs_ffi = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")



def _data(rng, shape, kind="outliers"):
    x = rng.standard_normal(shape).astype(np.float32)
    if kind == "outliers":
        x[..., 3] *= 60.0
        x[..., 17] *= -25.0
    elif kind == "heavy":
        x = rng.standard_t(3, shape).astype(np.float32)
    return x



# Each rotation with each group size and dtype, each group size with each dtype (all pairs).
QD_ROWS = all_pairs([1, 2], [8, 32, 128, 2048], [jnp.float32, jnp.bfloat16, jnp.float16])


@needs_ffi
@pytest.mark.parametrize("rotation,group_size,dtype", QD_ROWS,
                         ids=[f"{jnp.dtype(d).name}-{g}-{r}" for r, g, d in QD_ROWS])
def test_parity_quantize_dequantize(rotation, group_size, dtype):
    rng = np.random.default_rng(group_size + rotation)
    x = jnp.asarray(_data(rng, (3, 2 * group_size + 5)), dtype)  # padding exercised
    outs = (jnp.float32, dtype)

    @jax.jit  # every width in one compilation (not a dozen small programs)
    def program(x):
        res = []
        for bits in (2, 3, 4, 8):
            q = dict(bits=bits, group_size=group_size, rotation=rotation)
            pj, pf = (codec.quantize(x, backend=b, **q) for b in ("jnp", "ffi"))
            res.append((pj, pf, [tuple(codec.dequantize(pf, dtype=out, backend=b)
                                       for b in ("jnp", "ffi")) for out in outs]))
        return res

    results = every_isa(program, x)  # every output the same bits on every ISA build
    assert len(results) == 4
    _assert_twin_equals_kernel(results, rotation, outs)


def _assert_twin_equals_kernel(results, rotation, outs):
    """Each ``(jnp payload, FFI payload, [(jnp decode, FFI decode) per output dtype])`` of
    ``results``: the same rotation, codes, scales, zeros and decoded bits."""
    for pj, pf, deq in results:
        assert pj.rotation == pf.rotation == rotation
        for a, b in ((pj.codes, pf.codes), (pj.scale, pf.scale), (pj.zero, pf.zero)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        for (yj, yf), out in zip(deq, outs, strict=True):
            assert yf.dtype == out
            np.testing.assert_array_equal(_bits(yj), _bits(yf))


WIDTH_OUTS = (jnp.float32, jnp.bfloat16, jnp.float16)


def _width_program(rotation, group_size):
    """One jitted program per (rotation, G) with every code width of
    test_parity_every_width_and_group_size, jnp twin and FFI side by side (one compilation
    instead of dozens of small programs and eager ops)."""

    def program(x):
        per_bits = []
        for bits in range(2, 9):
            q = dict(bits=bits, group_size=group_size, rotation=rotation)
            pj = codec.quantize(x, backend="jnp", **q)
            pf = codec.quantize(x, backend="ffi", **q)
            deq = [tuple(codec.dequantize(pf, dtype=out, backend=b) for b in ("jnp", "ffi"))
                   for out in WIDTH_OUTS]
            per_bits.append((pj, pf, deq))
        chunked = codec.quantize(x, bits=4, group_size=group_size, num_chunks=2,
                                 rotation=rotation, backend="ffi").split_groups(2)
        sums = [tuple(codec.dequantize_sum(chunked, dtype=out, backend=b)
                      for b in ("jnp", "ffi")) for out in (jnp.float32, jnp.bfloat16)]
        return per_bits, sums

    return jax.jit(program)


@needs_ffi
@pytest.mark.parametrize("rotation", [1, 2])
@pytest.mark.parametrize("group_size", [16, 64, 256, 512, 1024])
def test_parity_every_width_and_group_size(rotation, group_size):
    """The CPU kernels' register-blocked paths (blocks of 16..128 values, then radix-2/4/8
    passes) at every code width, into every output dtype, saturation included."""
    rng = np.random.default_rng(7 * group_size + rotation)
    x = _data(rng, (4, 2 * group_size))
    x[1] *= 65504.0 / np.abs(x[1]).max()  # f16 outputs saturate at the top of the grid
    x = jnp.asarray(x, jnp.float32)
    # every output (the FFI ones included) bit-equal on every ISA build of the kernels
    per_bits, sums = every_isa(_width_program(rotation, group_size), x)
    assert len(per_bits) == 7
    _assert_twin_equals_kernel(per_bits, rotation, WIDTH_OUTS)
    for yj, yf in sums:
        np.testing.assert_array_equal(_bits(yj), _bits(yf))


@needs_ffi
@pytest.mark.parametrize("rotation", [1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_parity_fused_sums(rotation, dtype):
    rng = np.random.default_rng(7)
    g, n = 128, 4
    xs = [jnp.asarray(_data(rng, (5, 300)), dtype) for _ in range(n)]
    chunked = []
    for x in xs:
        chunked.append(_quant(x, "ffi", bits=4, group_size=g, num_chunks=n, rotation=rotation))
    # the payload received by rank 0 of n: chunk 0 of every rank, stacked on a chunk axis
    stacked = jax.tree.map(lambda *a: jnp.stack([v.reshape(n, -1, *v.shape[1:])[0] for v in a]),
                           *chunked)
    for op in ("dequantize_sum", "dequantize_sum_quantize"):
        fn = getattr(codec, op)
        rj = jax.jit(lambda p: fn(p, backend="jnp"))(stacked)
        rf = every_isa(jax.jit(lambda p: fn(p, backend="ffi")), stacked)
        for a, b in zip(jax.tree.leaves(rj), jax.tree.leaves(rf)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
    # dequantize_sum == inverse rotation of the rotated-domain sum of the decoded chunks
    rot_sum = reference.sum_chunks(stacked.codes, stacked.scale, stacked.zero, 4, g)
    want = reference.unrotate(rot_sum, rotation).astype(dtype).reshape(-1)
    got = codec.dequantize_sum(stacked, backend="ffi")
    np.testing.assert_array_equal(_bits(got), _bits(want))
    # the fused re-quantization stays rotated
    assert codec.dequantize_sum_quantize(stacked, backend="ffi").rotation == rotation


BOUND_CASES = [(g, bits) for g in (32, 128, 512) for bits in (2, 4, 8)]


def _bound_program(backend, rotation):
    """Per (G, bits) of BOUND_CASES: the rotated groups, the decoded codes, the plain-format
    bound of the codes, the dequantized operand and its mapped-back bound (one jitted program
    per test instead of a compilation per step and eager ops)."""

    def program(xs):
        outs = []
        for x, (g, bits) in zip(xs, BOUND_CASES, strict=True):
            p = codec.quantize(x, bits=bits, group_size=g, rotation=rotation, backend=backend)
            groups = jnp.asarray(x, jnp.float32).reshape(-1, g)
            rot = reference.rotate(groups, rotation)
            dec = reference.decode_groups(p.codes, p.scale, p.zero, bits, g)
            plain = dataclasses.replace(p, rotation=0, dtype=np.dtype(np.float32))
            outs.append((rot, dec, codec.error_bound(plain), codec.dequantize(p, backend=backend),
                         codec.error_bound(p)))
        return outs

    return jax.jit(program)


BOUND_ROWS = all_pairs(["jnp", "ffi"], [1, 2], [jnp.float32, jnp.bfloat16, jnp.float16])


@pytest.mark.parametrize(
    "backend,rotation,dtype",
    [pytest.param(b, r, d, marks=[needs_ffi] if b == "ffi" else []) for b, r, d in BOUND_ROWS],
    ids=[f"{jnp.dtype(d).name}-{r}-{b}" for b, r, d in BOUND_ROWS])
def test_error_bound_rotated_and_mapped_back(backend, rotation, dtype):
    rng = np.random.default_rng(3)
    xs = []
    for g, bits in BOUND_CASES:
        xs.append(jnp.asarray(np.concatenate([_data(rng, (4, 2 * g), kind)
                                              for kind in ("gauss", "heavy", "outliers")]),
                              dtype))
    outs = every_isa(_bound_program(backend, rotation), xs)  # FFI: the same bits on every build
    for x, (g, bits), (rot, dec, b_rot, y, b) in zip(xs, BOUND_CASES, outs, strict=True):
        # rotated domain: decoded codes vs the (f32) rotated groups, elementwise
        rot, dec = np.asarray(rot, np.float64), np.asarray(dec, np.float64)
        b_rot = np.asarray(b_rot, np.float64).reshape(-1, g)
        assert np.all(np.abs(dec - rot) <= b_rot)
        # mapped back through the orthonormal inverse: elementwise in the operand's domain
        y, b = np.asarray(y, np.float64), np.asarray(b, np.float64)
        err = np.abs(y - np.asarray(x, np.float64))
        assert np.all(np.isfinite(b)) and np.all(err <= b), float(np.max(err / b))
        # and the group 2-norm of the error is within sqrt(G) * the rotated bound
        gn = np.linalg.norm((y - np.asarray(x, np.float64)).reshape(-1, g), axis=1)
        assert np.all(gn <= b.reshape(-1, g)[:, 0])


def test_twin_under_jit_keeps_the_rotation_scale_rounding():
    """Under jit, XLA reassociated the rotation's RN(1/sqrt(G)) multiply with the encoder's
    ``* pre`` and LLVM contracted the product into the subtraction (one rounding instead of
    two): one code of this input differed from the C++ kernels. The twin rounds the scaled
    butterflies before the encoder reads them, as codec.h does."""
    rows = np.random.default_rng(8).standard_normal((4, 48, 1024)).astype(np.float32)[0]
    for rotation in (1, 2):
        codes = {backend: np.asarray(jax.jit(lambda v, b=backend: codec.quantize(
            v, bits=8, group_size=128, num_chunks=4, backend=b, rotation=rotation).codes)(rows))
            for backend in ("ffi", "jnp")}
        np.testing.assert_array_equal(codes["jnp"], codes["ffi"])


def test_rotation_zero_is_todays_format():
    rng = np.random.default_rng(0)
    x = jnp.asarray(_data(rng, (4, 256)))
    a = codec.quantize(x, bits=4, backend="jnp")
    b = codec.quantize(x, bits=4, backend="jnp", rotation=0)
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(_bits(u), _bits(v))
    assert a == dataclasses.replace(a) and a.rotation == 0


def test_orthonormal_and_signs():
    rng = np.random.default_rng(1)
    # one jitted program per G: rotation r and the inverse of its (f32) result, r = 1, 2
    # (eager, every butterfly of every call would be dispatched and compiled on its own)
    round_trips = jax.jit(lambda v: [(y, reference.unrotate(y, r))
                                     for r in (1, 2) for y in [reference.rotate(v, r)]])
    for g in (8, 128, 1024):
        x = rng.standard_normal((3, g)).astype(np.float32)
        for y, back in round_trips(jnp.asarray(x)):
            y = np.asarray(y, np.float64)
            np.testing.assert_allclose(np.linalg.norm(y, axis=1), np.linalg.norm(x, axis=1),
                                       rtol=1e-5)
            np.testing.assert_allclose(np.asarray(back), x, atol=1e-5)
        # a dense orthonormal Hadamard matrix, checked with numpy (Sylvester construction)
        h = np.array([[1.0]])
        while h.shape[0] < g:
            h = np.block([[h, h], [h, -h]])
        want = x.astype(np.float64) @ h.T / np.sqrt(g)
        np.testing.assert_allclose(np.asarray(round_trips(jnp.asarray(x))[0][0]), want,
                                   rtol=1e-4, atol=1e-4)
    signs = reference.rotation_sign_bits(64)
    assert 20 < int(np.count_nonzero(signs)) < 44  # a balanced, fixed +-1 vector


def test_validation():
    x = jnp.ones((4, 96), jnp.float32)
    with pytest.raises(ValueError, match="power-of-two"):
        codec.quantize(x, bits=4, group_size=96, rotation=1)
    with pytest.raises(ValueError):
        codec.quantize(x, bits=4, group_size=32, rotation=3)
    with pytest.raises(ValueError):
        codec.quantize(x, bits=4, group_size=32, rotation="walsh")
    with pytest.raises(TypeError):
        codec.quantize(x, bits=4, group_size=32, rotation=1.0)
    assert codec.quantize(x, bits=4, group_size=32, rotation="signed_hadamard").rotation == 2
    with pytest.raises(ValueError, match="power-of-two"):
        CommConfig(bits=4, group_size=24, rotation=1)
    assert CommConfig(bits=4, rotation="hadamard").rotation == 1
    # rotation="auto" (the default): Hadamard when both phases have >= 6 bits and G is a
    # power of two, else none
    # "auto" stays as written and resolves per call (CommConfig.resolved_rotation)
    assert CommConfig().rotation == "auto"
    assert CommConfig().resolved_rotation == 1 and CommConfig(bits=6).resolved_rotation == 1
    assert CommConfig(bits=4).resolved_rotation == 0
    assert CommConfig(bits=8, rs_bits=4).resolved_rotation == 0
    assert CommConfig(bits=8, ag_bits=5).resolved_rotation == 0
    assert CommConfig(bits=8, group_size=24).resolved_rotation == 0
    assert CommConfig(bits=None).resolved_rotation == 0
    assert CommConfig(bits=8, rotation=0).rotation == 0
    with pytest.raises(ValueError):
        CommConfig(bits=8, rotation="automatic")


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


@pytest.mark.parametrize("rotation", [1, 2])
@pytest.mark.parametrize("mesh_shape,names,axes",
                         [((4,), ("i",), ("i",)), ((2, 4), ("a", "b"), ("b",))])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_psum_rotated_bound_and_identical(mesh_factory, rotation, mesh_shape, names, axes,
                                          dtype):
    mesh = mesh_factory(mesh_shape, names)
    n_dev = math.prod(mesh_shape)
    g = 128
    local_shape = (3, 200)
    rng = np.random.default_rng(5)
    x = jnp.asarray(_data(rng, (n_dev, *local_shape)), dtype)
    # spikes=0: rotation against the plain format (spikes with rotation: tests/codec/test_spikes.py)
    config = CommConfig(bits=8, rs_bits=4, ag_bits=8, min_bytes=0, rotation=rotation,
                        group_size=g, spikes=0)
    f32 = np.dtype(np.float32)

    def body(xl):
        xl = xl.reshape(local_shape)
        y = fc.psum(xl, axes if len(axes) > 1 else axes[0], config=config)
        y2, p1, p2 = allreduce.two_step(xl, axes, config)
        b1, t1 = codec.bounds.group_bound(p1, f32)
        b2, t2 = codec.bounds.group_bound(p2, f32)
        return tuple(v.reshape(-1)[None] for v in (y, y2, b1, t1, b2, t2))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=(P(names),) * 6))
    y, y2, b1, t1, b2, t2 = [np.asarray(o, np.float64) for o in f(_put(mesh, x))]
    np.testing.assert_array_equal(y, y2)
    red = tuple(names.index(a) for a in axes)
    true, bound = oracles.rotated_psum_bound(mesh_shape, names, axes, x, (b1, t1, b2, t2), g,
                                             dtype)
    err = np.abs(y - true)
    assert np.all(err <= bound), float(np.max(err / bound))
    # identical on every rank of a reduction group
    grid = y.reshape(*mesh_shape, -1)
    for ax in red:
        first = np.take(grid, [0], axis=ax)
        np.testing.assert_array_equal(grid, np.broadcast_to(first, grid.shape))
    # and the rotation helps on outlier channels: compare with the plain codec
    plain = dataclasses.replace(config, rotation=0)
    fp = jax.jit(jax.shard_map(
        lambda xl: fc.psum(xl.reshape(local_shape), axes, config=plain).reshape(-1)[None],
        mesh=mesh, in_specs=P(names), out_specs=P(names)))
    err_plain = np.abs(np.asarray(fp(_put(mesh, x)), np.float64) - true)
    assert np.linalg.norm(err) < np.linalg.norm(err_plain)


def test_psum_scatter_all_gather_rotated(mesh_factory):
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(9)
    x = _data(rng, (4, 8, 256))
    cfg = dict(bits=4, min_bytes=0, group_size=64, spikes=0)  # rotation vs the plain format

    def body(xl):
        xl = xl[0]
        outs = []
        for rot in (0, 2):
            rs = fc.psum_scatter(xl, "i", scatter_dimension=0, tiled=True, rotation=rot, **cfg)
            ag = fc.all_gather(xl, "i", axis=0, tiled=True, rotation=rot, **cfg)
            outs += [rs[None], ag[None]]
        return tuple(outs)

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"),) * 4))
    rs0, ag0, rs2, ag2 = [np.asarray(o, np.float64) for o in f(_put(mesh, x))]
    true_rs = x.astype(np.float64).sum(0).reshape(4, 2, 256)
    true_ag = np.broadcast_to(x.reshape(1, 32, 256), (4, 32, 256))
    for got, plain, true in ((rs2, rs0, true_rs), (ag2, ag0, true_ag)):
        e2, e0 = np.linalg.norm(got - true), np.linalg.norm(plain - true)
        assert e2 < 0.7 * e0, (e2, e0)
    for r in range(1, 4):  # all_gather: identical on every rank
        np.testing.assert_array_equal(ag2[r], ag2[0])


def test_all_gather_matmul_rotated(mesh_factory):
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(11)
    x = _data(rng, (4, 8, 128))
    w = rng.standard_normal((4, 128, 16)).astype(np.float32)

    def body(xl, wl):
        xl, wl = xl[0], wl[0]
        y = fc.all_gather_matmul(xl, wl, "i", bits=4, group_size=128, rotation=2,
                                 spikes=0, min_bytes=0)
        xq = codec.dequantize(codec.quantize(xl, bits=4, group_size=128, rotation=2,
                                             backend="jnp"), backend="jnp")
        want = lax.all_gather(xq, "i", axis=0, tiled=True) @ wl
        return y[None], want[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")),
                              out_specs=(P("i"), P("i"))))
    y, want = f(_put(mesh, x), _put(mesh, w))
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-5, atol=1e-4)
