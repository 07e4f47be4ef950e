# long file: the spiked format's parity, bounds and collectives, sharing one set of outlier data
"""Spike reserving (docs/format.md, "Spike reserving"): the jnp twin and the CPU kernels
bit-identical (codes, spike records, scales, zeros, decoded values, fused sums), the selection
rule, the spikes' stored values, the elementwise error bound (plain and rotated), non-finite
and saturating spikes, tampered records, validation, wire bytes, and the collectives with
spikes within their bounds and identical on every rank."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec
from jax_flashcomm.codec import kernels, reference, spec
from jax_flashcomm import CommConfig

from tests.support.codec_data import bit_view as _bits, every_isa, jit_quantize as _quant

from tests.support import collective_oracles as oracles
from tests.support.meshes import AXIS_TYPES
from tests.support.pairwise import all_pairs

pytestmark = pytest.mark.slow  # the exhaustive spike parity matrix

needs_ffi = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")
BF16_MAX = 3.3895313892515355e38


def _groups(rng, g, dtype):
    """Groups that exercise the rule: outlier channels, ties of equal magnitude and opposite
    sign, a constant group, a NaN, an inf, values past the bf16 range, denormals, zeros."""
    big = 3.0e38 if dtype == np.float32 else 6.0e4
    rows = [rng.standard_normal(g) for _ in range(3)]
    rows[0][3] *= 60.0
    rows[0][g - 1] *= -25.0
    rows[1][[1, 4, g // 2]] = [7.0, -7.0, 7.0]          # ties: lowest positions first
    rows += [np.full(g, 1.5), np.zeros(g)]
    nan = rng.standard_normal(g); nan[g // 3] = np.nan
    inf = rng.standard_normal(g); inf[1] = -np.inf
    huge = rng.standard_normal(g) * 1e3; huge[2] = big; huge[5] = -big
    tiny = rng.standard_normal(g) * 1e-39
    heavy = rng.standard_t(2, g) * 10
    x = np.stack(rows + [nan, inf, huge, tiny, heavy]).astype(np.float32)
    if dtype == np.float32 and g >= 8:
        x[7, 3] = 3.4e38  # rounds past the largest bf16: saturates
    return jnp.asarray(x, dtype)


PARITY_CODES = ((2, 1), (3, 7), (4, 4), (6, 2), (8, 16))  # (bits, spikes), k < G enforced


def _parity_program(rotation, group_size, dtype):
    """One jitted program per (rotation, G, dtype) holding every (bits, k) of the parity test,
    jnp twin and FFI side by side (one compilation instead of ~50 small ones): per (bits, k),
    quantize on both backends, dequantize the FFI payload on both into f32 and into ``dtype``,
    and the fused sums of its chunked form on both."""

    def program(x):
        outs = []
        for bits, k in PARITY_CODES:
            q = dict(bits=bits, group_size=group_size, rotation=rotation,
                     spikes=min(k, group_size - 1))
            pj = codec.quantize(x, backend="jnp", **q)
            pf = codec.quantize(x, backend="ffi", **q)
            deq = [tuple(codec.dequantize(pf, dtype=out, backend=b) for b in ("jnp", "ffi"))
                   for out in (jnp.float32, dtype)]
            if pf.num_groups % 2 == 0:
                chunked = pf.split_groups(pf.num_groups // 2)
            else:
                chunked = pf.map_arrays(lambda a: a[None])
            sums = tuple(codec.dequantize_sum(chunked, dtype=jnp.float32, backend=b)
                         for b in ("jnp", "ffi"))
            requant = tuple(codec.dequantize_sum_quantize(chunked, bits=3, backend=b)
                            for b in ("jnp", "ffi"))
            outs.append((pj, pf, deq, sums, requant))
        return outs

    return jax.jit(program)


# the smallest group, the default, and one past 256 (two-byte spike positions), each with each
# dtype and rotation (all pairs)
PARITY_CASES = all_pairs([0, 2], [8, 128, 512], [jnp.float32, jnp.bfloat16, jnp.float16])


@needs_ffi
@pytest.mark.parametrize("rotation,group_size,dtype", PARITY_CASES,
                         ids=[f"{jnp.dtype(d).name}-{g}-{r}" for r, g, d in PARITY_CASES])
def test_parity_twin_and_kernels(rotation, group_size, dtype):
    rng = np.random.default_rng(group_size + rotation)
    x = _groups(rng, group_size, np.dtype(dtype))
    # every output of the program (the FFI ones included) bit-equal on every ISA build
    results = every_isa(_parity_program(rotation, group_size, dtype), x)
    for (bits, k), (pj, pf, deq, sums, requant) in zip(PARITY_CODES, results, strict=True):
        k = min(k, group_size - 1)
        assert pj.spikes == pf.spikes == k
        assert pj.codes.shape[-1] == spec.record_bytes(group_size, bits, k)
        for a, b in ((pj.codes, pf.codes), (pj.scale, pf.scale), (pj.zero, pf.zero)):
            np.testing.assert_array_equal(_bits(a), _bits(b))
        for yj, yf in deq:  # into f32 and into the operand's dtype
            np.testing.assert_array_equal(_bits(yj), _bits(yf))
        sj, sf = sums
        np.testing.assert_array_equal(_bits(sj), _bits(sf))
        qj, qf = requant
        assert qj.spikes == qf.spikes == k
        for a, b in ((qj.codes, qf.codes), (qj.scale, qf.scale), (qj.zero, qf.zero)):
            np.testing.assert_array_equal(_bits(a), _bits(b))


@needs_ffi
@pytest.mark.parametrize("rotation", [0, 2])
@pytest.mark.parametrize("k_in,k_out", [(0, 1), (0, 3), (2, 0), (1, 4), (4, 1)])
def test_fused_op_spikes_per_phase_parity(rotation, k_in, k_out):
    """dequantize_sum_quantize with an output spike count of its own (per-phase spikes: plain
    to spiked records and back): the FFI kernels of every ISA build give the twin's bits."""
    rng = np.random.default_rng(10 * k_in + k_out)
    x = _groups(rng, 32, np.dtype(jnp.bfloat16))
    x = x[: x.shape[0] // 2 * 2]
    p = _quant(x, "ffi", bits=4, group_size=32, rotation=rotation, spikes=k_in)
    chunked = p.split_groups(2)
    qj, qf = (every_isa(jax.jit(lambda q, b=b: codec.dequantize_sum_quantize(
        q, bits=6, spikes=k_out, backend=b)), chunked) for b in ("jnp", "ffi"))
    assert qj.spikes == qf.spikes == k_out
    assert qf.codes.shape[-1] == spec.record_bytes(32, 6, k_out)
    for a, b in ((qj.codes, qf.codes), (qj.scale, qf.scale), (qj.zero, qf.zero)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


def _record(p):
    """Spike values (f32) and positions of a payload, read with numpy from the wire layout."""
    codes = np.asarray(p.codes)
    nb = spec.group_bytes(p.group_size, p.bits)
    k = p.spikes
    raw = codes[..., nb:nb + 2 * k].astype(np.uint32)
    values = ((raw[..., 0::2] | (raw[..., 1::2] << 8)) << 16).view(np.float32)
    pos_raw = codes[..., nb + 2 * k:].astype(np.uint32)
    if spec.position_bytes(p.group_size) == 2:
        positions = pos_raw[..., 0::2] | (pos_raw[..., 1::2] << 8)
    else:
        positions = pos_raw
    return values, positions


@pytest.mark.parametrize("backend", ["jnp", pytest.param("ffi", marks=needs_ffi)])
@pytest.mark.parametrize("group_size", [16, 128, 1024])
def test_selection_and_stored_values(backend, group_size):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, group_size)).astype(np.float32)
    x[0, [2, 9, 11]] = [5.0, -5.0, 5.0]  # equal magnitudes: positions 2, 9, 11 in that order
    x[1, :] = 2.0                        # all equal: positions 0, 1, 2
    x[2, group_size - 1] = 1e4           # a position that needs two bytes at G = 1024
    k = 3
    p = _quant(x, backend, bits=4, group_size=group_size, spikes=k)
    values, positions = _record(p)
    mag = np.abs(x)
    for r in range(x.shape[0]):
        want = np.argsort(-mag[r], kind="stable")[:k]  # descending |x|, ties to lower index
        np.testing.assert_array_equal(positions[r], want)
        # stored value: x rounded to nearest-even bf16
        want_vals = np.asarray(jnp.asarray(x[r, want]).astype(jnp.bfloat16).astype(jnp.float32))
        np.testing.assert_array_equal(values[r], want_vals)
    # decoding puts the spikes back exactly
    y = np.asarray(codec.dequantize(p, backend=backend))
    for r in range(x.shape[0]):
        np.testing.assert_array_equal(y[r, positions[r]], values[r])
    # the spikes do not widen the range: the scale is that of the remaining values
    plain = _quant(x, backend, bits=4, group_size=group_size)
    assert float(np.asarray(p.scale, np.float32)[0]) < float(np.asarray(plain.scale,
                                                                          np.float32)[0])


@pytest.mark.parametrize("backend", ["jnp", pytest.param("ffi", marks=needs_ffi)])
@pytest.mark.parametrize("rotation", [0, 1, 2])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_error_bound_elementwise(backend, rotation, dtype):
    g = 64
    rng = np.random.default_rng(7 + rotation)
    x = _groups(rng, g, np.dtype(dtype))
    finite = np.all(np.isfinite(np.asarray(x, np.float32)), axis=-1)
    if rotation:  # rotation is for activations: drop groups whose butterflies overflow
        x = x[np.max(np.abs(np.asarray(x, np.float32)), axis=-1) < 1e30]
        finite = np.all(np.isfinite(np.asarray(x, np.float32)), axis=-1)
    codes = ((2, 1), (4, 3), (8, 5))  # (bits, spikes)

    def program(x):  # one compilation for every (bits, k) instead of a jit and eager ops each
        outs = []
        for bits, k in codes:
            p = codec.quantize(x, backend=backend, bits=bits, group_size=g, rotation=rotation,
                               spikes=k)
            outs.append((codec.dequantize(p, backend=backend), codec.error_bound(p)))
        return outs

    outs = every_isa(jax.jit(program), x)  # FFI: the same bits on every ISA build
    for (bits, k), (y, b) in zip(codes, outs, strict=True):
        y = np.asarray(y, np.float64)
        b = np.asarray(b, np.float64)
        x64 = np.asarray(x, np.float64)
        err = np.abs(y[finite] - x64[finite])
        assert np.all(err <= b[finite]), float(np.max(err - b[finite]))
        assert np.all(np.isnan(y[~finite])) and np.all(np.isnan(b[~finite]))


def test_spikes_cut_the_error_of_outlier_groups():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((64, 128)).astype(np.float32)
    x[:, 5] *= 80.0
    err = {}

    @jax.jit  # both spike counts in one compilation, not eager ops
    def round_trips(v):
        return [codec.dequantize(codec.quantize(v, bits=4, group_size=128, spikes=k,
                                                backend="jnp"), backend="jnp") for k in (0, 1)]

    for k, y in zip((0, 1), round_trips(x), strict=True):
        y = np.asarray(y)
        err[k] = np.linalg.norm(y - x) / np.linalg.norm(x)
    assert err[1] * 3 < err[0], err


@pytest.mark.parametrize("backend", ["jnp", pytest.param("ffi", marks=needs_ffi)])
def test_saturated_and_non_finite_spikes(backend):
    x = np.ones((3, 32), np.float32)
    x[0, 4] = 3.4e38          # beyond the largest bf16: stored as 0x7F7F
    x[1, 7] = np.inf          # a non-finite spike makes the whole group NaN
    x[2, 9] = -3.4e38
    p = _quant(x, backend, bits=8, group_size=32, spikes=1)
    values, positions = _record(p)
    assert values[0, 0] == np.float32(BF16_MAX) and positions[0, 0] == 4
    assert values[2, 0] == np.float32(-BF16_MAX)
    assert np.isnan(values[1, 0]) and np.isnan(np.asarray(p.scale, np.float32)[1])
    y = np.asarray(codec.dequantize(p, backend=backend), np.float64)
    assert np.all(np.isnan(y[1])) and np.all(np.isfinite(y[[0, 2]]))
    b = np.asarray(codec.error_bound(p), np.float64)
    assert np.all(np.abs(y[[0, 2]] - x[[0, 2]]) <= b[[0, 2]])


@needs_ffi
@pytest.mark.parametrize("group_size", [16, 24, 40])
def test_the_first_of_equal_magnitudes_is_the_spike(group_size):
    """Two values of the group's largest magnitude (either sign), anywhere: in lanes of one
    vector, of different vectors, in a tail past the last whole vector (24 and 40 on AVX-512);
    the FFI kernels of every build keep the first as the twin does."""
    rng = np.random.default_rng(group_size)
    x = rng.standard_normal((64, group_size)).astype(np.float32)
    for row in range(64):
        a, b = sorted(rng.choice(group_size, 2, replace=False))
        top = 2 * np.abs(x[row]).max()
        x[row, a], x[row, b] = (-top if row % 2 else top), top
    run = lambda x, backend: codec.quantize(  # noqa: E731
        x, bits=4, group_size=group_size, spikes=1, backend=backend).codes
    got = every_isa(jax.jit(lambda x: run(x, "ffi")), jnp.asarray(x))
    want = jax.jit(lambda x: run(x, "jnp"))(jnp.asarray(x))
    assert np.array_equal(np.asarray(got), np.asarray(want))


@needs_ffi
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_non_finite_spikes_in_a_batch_alike(dtype):
    """An Inf and a NaN spike among finite groups (bf16 at G = 128 takes the path that does not
    widen): in every build the records, scales and zeros of the twin."""
    x = np.random.default_rng(11).standard_normal((40, 128)).astype(np.float32)
    x[3, 5], x[21, 100] = np.inf, np.nan
    x = jnp.asarray(x, dtype)
    run = lambda x, backend: codec.quantize(  # noqa: E731
        x, bits=4, spikes=1, backend=backend)
    got = every_isa(jax.jit(lambda x: run(x, "ffi")), x)
    want = jax.jit(lambda x: run(x, "jnp"))(x)
    for a, b in ((got.codes, want.codes), (got.scale, want.scale), (got.zero, want.zero)):
        np.testing.assert_array_equal(_bits(a), _bits(b))


@needs_ffi
def test_tampered_positions_are_skipped_alike():
    """A position >= G (only a tampered record has one) is not written, and a position given
    twice takes the later spike, by either backend, in the dequantize and in the chunk sums."""
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    p = jax.jit(lambda v: codec.quantize(v, bits=4, group_size=16, spikes=2, num_chunks=2,
                                         backend="jnp"))(x)
    codes = np.asarray(p.codes).copy()
    at = spec.group_bytes(16, 4)
    codes[..., at + 4] = 200  # first position of each group
    codes[..., -1, at:at + 6] = [0x80, 0x3F, 0x00, 0x41, 3, 3]  # 1 then 8, both at 3
    tampered = p.map_arrays(lambda a: jnp.asarray(codes) if a is not None and
                            a.dtype == jnp.uint8 else a)
    chunks = tampered.split_groups(2)
    (yj, sj), (yf, sf) = (tuple(np.asarray(v) for v in out) for out in jax.jit(lambda p, c: [
        (codec.dequantize(p, backend=b), codec.dequantize_sum(c, backend=b))
        for b in ("jnp", "ffi")])(tampered, chunks))  # one compilation, not eager ops
    np.testing.assert_array_equal(yj, yf)
    np.testing.assert_array_equal(sj, sf)
    assert np.all(np.isfinite(yj)) and yj.reshape(-1)[-16 + 3] == 8.0


def test_validation():
    x = jnp.ones((4, 64), jnp.float32)
    for bad, err in ((-1, ValueError), (17, ValueError), (32, ValueError), (1.0, TypeError),
                     (True, TypeError), ("2", TypeError)):
        with pytest.raises(err, match="spikes"):
            codec.quantize(x, bits=4, group_size=32, spikes=bad)
    with pytest.raises(ValueError, match="spikes"):
        codec.quantize(x, bits=4, group_size=8, spikes=8)  # k must leave one value
    with pytest.raises(ValueError, match="spikes"):
        CommConfig(bits=4, group_size=8, spikes=8)
    # "auto" (the default): one spike per group in each phase of <= 6 bits, decided per phase
    def phases(c):
        return c.phase1_spikes, c.phase2_spikes

    assert CommConfig().spikes == "auto" and phases(CommConfig()) == (0, 0)  # bits=8
    assert phases(CommConfig(bits=4)) == (1, 1) and phases(CommConfig(bits=6)) == (1, 1)
    assert phases(CommConfig(bits=4, ag_bits=8)) == (1, 0)
    assert phases(CommConfig(bits=8, rs_bits=4)) == (1, 0)
    assert phases(CommConfig(bits=8, ag_bits=6)) == (0, 1)
    assert phases(CommConfig(bits=None)) == (0, 0)
    assert phases(CommConfig(bits=4, spikes=3)) == (3, 3)
    assert phases(CommConfig(bits=4, ag_bits=8, spikes=2)) == (2, 2)
    with pytest.raises(TypeError, match="spikes"):
        CommConfig(bits=4, spikes="many")
    assert codec.quantize(x, bits=4, group_size=32, spikes=None).spikes == 0
    p = codec.quantize(x, bits=4, group_size=32, spikes=2)
    # a payload whose codes do not hold the spike records is rejected at trace time
    wrong = codec.Payload(p.codes[..., :16], p.scale, p.zero, bits=4, group_size=32,
                          shape=p.shape, dtype=p.dtype, spikes=2)
    with pytest.raises(ValueError, match="spikes=2"):
        codec.dequantize(wrong)


def test_wire_bytes_per_element():
    assert spec.wire_bytes_per_element(4, 128, 1) == (64 + 4 + 3) / 128
    assert spec.wire_bytes_per_element(4, 512, 2) == (256 + 4 + 8) / 512  # 2-byte positions
    p = codec.quantize(jnp.ones((4, 128)), bits=4, group_size=128, spikes=1)
    assert p.nbytes == 4 * (64 + 3 + 4)


# --- collectives --------------------------------------------------------------------------------

def _outliers(n_ranks, local, seed, dtype=np.float32):
    x = np.random.default_rng(seed).standard_normal((n_ranks, *local)).astype(np.float32)
    x[..., 3] *= 60.0
    x[..., -2] *= -30.0
    return x.astype(dtype)


BOUND_CASES = all_pairs([((4,), ("i",), ("i",)), ((2, 4), ("a", "b"), ("a", "b"))],
                        [(1, 0), (4, 0), (2, 2)], sorted(AXIS_TYPES))


@pytest.mark.parametrize(
    "mesh_shape,names,axes,spikes,rotation,axis_type",
    [(*m, *sr, AXIS_TYPES[t]) for m, sr, t in BOUND_CASES],
    ids=[f"{t}-{len(m[0])}d-k{sr[0]}-r{sr[1]}" for m, sr, t in BOUND_CASES])
def test_collectives_within_bounds(mesh_factory, mesh_shape, names, axes, spikes, rotation):
    mesh = mesh_factory(mesh_shape, names)
    n_ranks = math.prod(mesh_shape)
    n = math.prod(mesh_shape[names.index(a)] for a in axes)
    x = _outliers(n_ranks, (4, 96), seed=spikes)
    for backend in ("auto", "jnp"):
        config = CommConfig(bits=4, rs_bits=4, ag_bits=8, group_size=32, min_bytes=0,
                            backend=backend, spikes=spikes)
        if rotation:  # the rotated psum's bound is checked in test_rotation.py's way below
            continue
        y, true, bound = oracles.psum_check(mesh, axes, x, config)
        assert np.all(np.abs(np.asarray(y, np.float64) - true) <= bound)
        x_rs = _outliers(n_ranks, (n * 2, 64), seed=3)
        y, true, bound = oracles.psum_scatter_check(mesh, axes, x_rs, config, 0, True)
        assert np.all(np.abs(np.asarray(y, np.float64) - true) <= bound)
        y, true, bound = oracles.all_gather_check(mesh, axes, x, config, 0, True)
        assert np.all(np.abs(np.asarray(y, np.float64) - true) <= bound)
    if rotation:
        _rotated_psum_bound(mesh, mesh_shape, names, axes, x, spikes, rotation)


def test_auto_spikes_decided_per_phase(mesh_factory):
    """rs_bits=4, ag_bits=8 with spikes="auto": the 4-bit phase's payloads carry one spike per
    group and the 8-bit phase's none; the psum stays within the bound of those payloads and,
    on outlier channels, beats the same mix without spikes."""
    from jax_flashcomm import allreduce

    mesh = mesh_factory((4,), ("i",))
    x = _outliers(4, (4, 96), seed=5)
    config = CommConfig(bits=4, ag_bits=8, group_size=32, min_bytes=0)
    assert (config.phase1_spikes, config.phase2_spikes) == (1, 0)

    def body(v):
        y, p1, p2 = allreduce.two_step(v[0], ("i",), config)
        assert (p1.spikes, p2.spikes) == (1, 0)
        return y[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))
    jax.eval_shape(f, oracles.put(mesh, x))  # traces body: the payloads' spike counts
    y, true, bound = oracles.psum_check(mesh, ("i",), x, config)
    err = np.abs(np.asarray(y, np.float64) - true)
    assert np.all(err <= bound)
    y0, _, _ = oracles.psum_check(mesh, ("i",), x, dataclasses.replace(config, spikes=0))
    err0 = np.abs(np.asarray(y0, np.float64) - true)
    assert np.sqrt(np.mean(err ** 2)) < np.sqrt(np.mean(err0 ** 2))


def _rotated_psum_bound(mesh, mesh_shape, names, axes, x, spikes, rotation):
    from jax_flashcomm import allreduce

    g = 32
    local = x.shape[1:]
    config = CommConfig(bits=4, ag_bits=8, group_size=g, min_bytes=0, rotation=rotation,
                        spikes=spikes)

    def body(xl):
        xl = xl.reshape(local)
        y, p1, p2 = allreduce.two_step(xl, axes, config)
        b1, t1 = codec.rotated_domain_bound(p1)
        b2, t2 = codec.rotated_domain_bound(p2)
        return tuple(v.reshape(-1)[None] for v in (y, b1, t1, b2, t2))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=(P(names),) * 5))
    y, b1, t1, b2, t2 = [np.asarray(o, np.float64) for o in f(oracles.put(mesh, x))]
    true, bound = oracles.rotated_psum_bound(mesh_shape, names, axes, x, (b1, t1, b2, t2), g,
                                             np.float32)
    assert np.all(np.abs(y - true) <= bound)
    for r in range(1, y.shape[0]):  # one reduction group here: identical everywhere
        np.testing.assert_array_equal(y[r], y[0])


def test_all_gather_matmul_with_spikes(mesh_factory):
    mesh = mesh_factory((4,), ("i",))
    x = _outliers(4, (8, 128), seed=11)
    w = np.random.default_rng(12).standard_normal((4, 128, 16)).astype(np.float32)
    q = dict(bits=4, group_size=32, spikes=2)

    def body(xl, wl):
        y = fc.all_gather_matmul(xl[0], wl[0], "i", min_bytes=0, **q)
        deq = codec.dequantize(codec.quantize(xl[0], backend="jnp", **q), backend="jnp")
        gathered = jax.lax.all_gather(deq, "i", axis=0, tiled=True)
        return y[None], (gathered @ wl[0])[None], (jnp.abs(gathered) @ jnp.abs(wl[0]))[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P("i")),
                              out_specs=(P("i"),) * 3))
    y, ref, mag = (np.asarray(a, np.float64) for a in f(oracles.put(mesh, x),
                                                        oracles.put(mesh, w)))
    # the same dequantized rows, dotted in another order: f32 dot rounding, 2 K u |x||w|
    assert np.all(np.abs(y - ref) <= 2 * 128 * oracles.EPS32 / 2 * mag + 1e-30)
