"""Hardening (docs/reliability.md): the accepted edge cases (axis size 1, groups larger than
the operand, 0-d, empty) have defined results; NaN/Inf poison exactly the groups that carry
them; magnitudes near the dtype's limit stay finite and within bound; repeated calls are
bit-identical on every rank; the quantized collectives' temporary memory per device, from the
compiled executable. Bad input: test_bad_input.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec
from jax_flashcomm import CommConfig

from tests.support import collective_oracles as oracles
from tests.support.meshes import AXIS_TYPES
from tests.support.pairwise import all_pairs

pytestmark = pytest.mark.slow  # the reliability matrices

Q = dict(min_bytes=0)  # take the quantized path whatever the size


# --- accepted edge cases: defined results ---------------------------------------------------------

def test_axis_size_one_is_exact_identity(mesh_factory):
    """Over an axis of size 1 there is nothing to communicate: the lax op runs (bit-equal to
    lax, i.e. the identity / a stack of one) and the decision says why."""
    mesh = mesh_factory((1, 4), ("s", "b"))
    x = np.random.default_rng(0).standard_normal((4, 3, 128)).astype(np.float32)

    def body(v):
        v = v[0]
        return tuple(r[None] for r in (
            fc.psum(v, "s", **Q), fc.psum_scatter(v, "s", tiled=True, **Q),
            fc.all_gather(v, "s", **Q)[0], fc.pmean(v, "s", **Q)))

    with fc.record() as decisions:
        f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("s", "b")),
                                  out_specs=(P(("s", "b")),) * 4))
        outs = f(oracles.put(mesh, x))
    for o in outs:
        np.testing.assert_array_equal(np.asarray(o), x)
    assert [d.reason for d in decisions] == ["axis size 1: nothing to communicate"] * 4


def test_group_larger_than_operand(mesh_factory):
    """group_size 1024 on 15 values per rank: one zero-padded group per chunk, the same bound
    as any other operand."""
    mesh = mesh_factory((4,), ("i",))
    x = np.random.default_rng(1).standard_normal((4, 3, 5)).astype(np.float32)
    config = CommConfig(bits=6, group_size=1024, min_bytes=0)
    for y, true, bound in (oracles.psum_check(mesh, ("i",), x, config),
                           oracles.all_gather_check(mesh, ("i",), x, config, 0, False),
                           oracles.psum_scatter_check(mesh, ("i",), np.tile(x, (1, 4, 1)),
                                                      config, 0, True)):
        err = np.abs(y.astype(np.float64) - true)
        assert np.all(err <= bound) and err.max() > 0  # quantized, and within the bound


def test_scalars(mesh_factory):
    """0-d operands: psum and pmean (flattened to one padded group) and all_gather (a vector
    of N) work like their lax namesakes, within the bound; psum_scatter of a 0-d operand is an
    error (there is no dimension to scatter), as in lax."""
    mesh = mesh_factory((8,), ("i",))
    x = (np.random.default_rng(2).standard_normal(8) * 10).astype(np.float32)
    config = CommConfig(bits=8, min_bytes=0)
    y, true, bound = oracles.psum_check(mesh, ("i",), x, config)
    assert y.shape == (8,) and np.all(np.abs(y - true) <= bound)
    y, true, bound = oracles.all_gather_check(mesh, ("i",), x, config, 0, False)
    assert y.shape == (8, 8) and np.all(np.abs(y - true) <= bound)


@pytest.mark.parametrize("local", [(0,), (4, 0), (0, 128)], ids=str)
def test_empty_operands(mesh_factory, local):
    """Empty operands: nothing to quantize or send; the result has lax's shape and dtype
    (psum, all_gather: the lax op runs and the decision records it; psum_scatter: an empty
    result built without a collective)."""
    mesh = mesh_factory((4,), ("i",))
    scat = (4 * local[0], *local[1:])  # a scatter dimension divisible by 4
    x = jax.device_put(jnp.zeros((4, *scat), jnp.float32), NamedSharding(mesh, P("i")))

    def body(v):
        v = v[0]
        ours = (fc.psum(v[: local[0]], "i", **Q), fc.psum_scatter(v, "i", tiled=True, **Q),
                fc.all_gather(v[: local[0]], "i", **Q))
        ref = (lax.psum(v[: local[0]], "i"), lax.psum_scatter(v, "i", tiled=True),
               lax.all_gather(v[: local[0]], "i"))
        for a, b in zip(ours, ref):
            assert a.shape == b.shape and a.dtype == b.dtype
        return tuple(r[None] for r in ours)

    with fc.record() as decisions:
        jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"),) * 3))(x)
    # psum and all_gather record why they ran lax; psum_scatter builds the empty result itself
    # (XLA rejects a reduce-scatter whose scattered dimension has size 0)
    assert [d.reason for d in decisions] == ["empty operand: nothing to communicate"] * 2


@pytest.mark.parametrize("bits", [None, 8])
def test_empty_matmul_rows(mesh_factory, bits):
    mesh = mesh_factory((4,), ("i",))
    x = jax.device_put(jnp.zeros((0, 32)), NamedSharding(mesh, P("i")))
    w = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P(None, "i")))
    f = jax.jit(jax.shard_map(lambda a, b: fc.all_gather_matmul(a, b, "i", bits=bits),
                              mesh=mesh, in_specs=(P("i"), P(None, "i")),
                              out_specs=P(None, "i")))
    assert f(x, w).shape == (0, 16)
    g = jax.jit(jax.shard_map(lambda a, b: fc.matmul_reduce_scatter(a, b, "i"), mesh=mesh,
                              in_specs=(P(None, "i"), P("i")), out_specs=P("i")))
    xs = jax.device_put(jnp.zeros((0, 32)), NamedSharding(mesh, P(None, "i")))
    ws = jax.device_put(jnp.ones((32, 16)), NamedSharding(mesh, P("i")))
    assert g(xs, ws).shape == (0, 16)


# --- non-finite values ---------------------------------------------------------------------------

G = 32
# (rank, flat position in the rank's operand, value): groups 0 (NaN on rank 1), 2 (+Inf on
# rank 2 and -Inf on rank 0, same group) and 4 (-Inf in the zero-padded tail group on rank 3)
POISON = [(1, 3, np.nan), (2, 70, np.inf), (0, 72, -np.inf), (3, 149, -np.inf)]


def _poisoned(shape, seed=3):
    x = np.random.default_rng(seed).standard_normal((4, *shape)).astype(np.float32)
    flat = x.reshape(4, -1)
    for r, pos, val in POISON:
        flat[r, pos] = val
    return x


def _check_poison(y, true, bound, bad):
    """``bad``: boolean mask of the output elements in a poisoned group: exactly those NaN,
    every other element finite and within its bound."""
    assert np.all(np.isnan(y[bad])), "a poisoned group has a non-NaN element"
    assert np.all(np.isfinite(y[~bad])), "a non-finite value outside the poisoned groups"
    err = np.abs(y[~bad].astype(np.float64) - true[~bad])
    assert np.all(err <= bound[~bad]), float(np.max(err - bound[~bad]))


# Each backend with each dtype, each on one axis type, both axis types for each (all pairs).
DTYPE_IDS = {jnp.float32: "f32", jnp.bfloat16: "bf16", jnp.float16: "f16"}
BACKEND_ROWS = all_pairs(["auto", "jnp"], list(DTYPE_IDS), sorted(AXIS_TYPES))


@pytest.mark.parametrize("backend,dtype,axis_type",
                         [(b, d, AXIS_TYPES[t]) for b, d, t in BACKEND_ROWS],
                         ids=[f"{t}-{DTYPE_IDS[d]}-{b}" for b, d, t in BACKEND_ROWS])
def test_non_finite_poison_exactly_their_groups(mesh_factory, backend, dtype):
    """psum: the wire format's groups are runs of G elements of the flattened, zero-padded
    operand (docs/format.md); phase 1 marks a group holding NaN/Inf on any rank, its f32 sum is
    NaN, phase 2 marks it again, so exactly the output groups that carry a non-finite input on
    some rank are NaN (all G elements), on every rank. psum_scatter and all_gather likewise for
    their one quantization."""
    mesh = mesh_factory((4,), ("i",))
    config = CommConfig(bits=4, group_size=G, min_bytes=0, backend=backend)
    shape = (5, 30)  # 150 values per rank: padded to 256 (2 chunks of 4 groups)
    x = _poisoned(shape).astype(dtype)
    bad_groups = {pos // G for _, pos, _ in POISON}
    y, true, bound = oracles.psum_check(mesh, ("i",), x, config)
    bad = np.isin(np.arange(150) // G, list(bad_groups)).reshape(shape)
    _check_poison(y.astype(np.float32), true, bound, np.broadcast_to(bad, y.shape))

    # all_gather: rank r's slot is poisoned exactly in rank r's poisoned groups
    y, true, bound = oracles.all_gather_check(mesh, ("i",), x, config, 0, False)
    bad = np.zeros((4, 150), bool)
    for r, pos, _ in POISON:
        bad[r, (pos // G) * G:(pos // G + 1) * G] = True
    _check_poison(y.astype(np.float32), true, bound,
                  np.broadcast_to(bad.reshape(4, *shape)[None], y.shape))

    # psum_scatter (tiled over the 8 rows of (8, 30)): rank i keeps rows 2i, 2i+1 = 60 values
    # padded to 64: groups [0, 32) and [32, 60); a poisoned group is poisoned for the sum
    xs = _poisoned((8, 30)).astype(dtype)
    y, true, bound = oracles.psum_scatter_check(mesh, ("i",), xs, config, 0, True)
    bad = np.zeros((4, 60), bool)
    for _, pos, _ in POISON:
        row, col = divmod(pos, 30)
        keeper, offset = divmod(row, 2)
        g = (offset * 30 + col) // G
        bad[keeper, g * G:min((g + 1) * G, 60)] = True
    _check_poison(y.astype(np.float32), true, bound, bad.reshape(4, 2, 30))


def test_non_finite_quantized_all_gather_matmul(mesh_factory):
    """Quantized all_gather_matmul: a poisoned group (here: half a row) makes exactly the output
    rows of that row NaN; every other row is bit-identical to the run on clean input."""
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((16, 32)).astype(np.float32)
    w = rng.standard_normal((32, 8)).astype(np.float32)
    dirty = x.copy()
    dirty[1, 5], dirty[6, 31], dirty[13, 0] = np.nan, np.inf, -np.inf
    f = jax.jit(jax.shard_map(
        lambda a, b: fc.all_gather_matmul(a, b, "i", bits=4, group_size=16, spikes=0,
                                     min_bytes=0), mesh=mesh,
        in_specs=(P("i"), P(None, "i")), out_specs=P(None, "i")))
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    y = np.asarray(f(put(dirty, P("i")), put(w, P(None, "i"))))
    clean = np.asarray(f(put(x, P("i")), put(w, P(None, "i"))))
    rows = np.zeros(16, bool)
    rows[[1, 6, 13]] = True
    assert np.all(np.isnan(y[rows]))
    np.testing.assert_array_equal(y[~rows], clean[~rows])


# --- magnitudes near the dtype's limit -------------------------------------------------------------

TOP = {jnp.float32: 3e38, jnp.bfloat16: 3e38, jnp.float16: 6e4}


@pytest.mark.parametrize("backend,dtype,top,axis_type",
                         [(b, d, TOP[d], AXIS_TYPES[t]) for b, d, t in BACKEND_ROWS],
                         ids=[f"{t}-{DTYPE_IDS[d]}-{b}" for b, d, t in BACKEND_ROWS])
def test_near_dtype_limit(mesh_factory, dtype, top, backend):
    """Values up to 3e38 (f32, bf16) or 6e4 (f16) whose partial sums in rank order stay finite
    (rank 1 nearly cancels rank 0, rank 3 rank 2): scales, bounds and results finite, every
    element within its bound, for all three collectives. Groups span up to 2 * top, more than
    FLT_MAX: the codec handles them in halves."""
    mesh = mesh_factory((4,), ("i",))
    rng = np.random.default_rng(5)
    u = rng.uniform(-top, top, (2, 4, 256))
    e = rng.uniform(-0.01 * top, 0.01 * top, (2, 4, 256))
    x = np.stack([u[0], -u[0] + e[0], u[1], -u[1] + e[1]]).astype(np.float32).astype(dtype)
    x[0, 0, :8] = top  # a whole block at the limit
    x[1, 0, :8] = -top
    # rotation=0: a rotated group overflows past FLT_MAX / sqrt(G) and decodes to NaN by design
    # (docs/format.md, "Rotation"); the default rotation is for activations
    config = CommConfig(bits=8, group_size=128, min_bytes=0, backend=backend, rotation=0)
    for y, true, bound in (oracles.psum_check(mesh, ("i",), x, config),
                           oracles.all_gather_check(mesh, ("i",), x, config, 0, True),
                           oracles.psum_scatter_check(mesh, ("i",), x, config, 0, True)):
        assert np.all(np.isfinite(bound)), "a scale overflowed"
        assert np.all(np.isfinite(np.asarray(y, np.float32)))
        err = np.abs(np.asarray(y, np.float64) - true)
        assert np.all(err <= bound), float(np.max(err - bound))


def test_sum_beyond_f16_range_saturates(mesh_factory):
    """Four ranks of 6e4 in f16: the exact sum 2.4e5 is finite in f32 (where the sums are
    accumulated: no Inf in the scales or sums) but not in f16; the result saturates to f16's
    largest finite value, where lax.psum in f16 overflows to Inf."""
    mesh = mesh_factory((4,), ("i",))
    x = np.full((4, 256), 6e4, np.float16)
    config = CommConfig(bits=8, min_bytes=0)
    y, ref, y2, b1, b2 = oracles.run("psum", mesh, ("i",), x, config)
    assert np.all(np.isfinite(b1)) and np.all(np.isfinite(b2))
    np.testing.assert_array_equal(y, np.full_like(y, np.finfo(np.float16).max))
    assert np.all(np.isinf(ref))


def test_f32_partial_sum_overflow_stays_finite(mesh_factory):
    """+3e38, +3e38, -3e38, -3e38 on 4 ranks (exact sum 0) overflow a plain f32 running sum in
    rank order; the fused sum's fallback (docs/format.md) adds those elements scaled by 2^-s and
    scales back, so the result is finite and within the bound where lax.psum gives +Inf. The
    same magnitudes relative to f16 are summed in f32 without overflow."""
    mesh = mesh_factory((4,), ("i",))
    signs = np.array([1.0, 1.0, -1.0, -1.0], np.float32)[:, None]
    x = signs * np.ones((4, 256), np.float32)
    x[:, 1::2] *= 0.5
    config = CommConfig(bits=8, min_bytes=0, rotation=0)  # see test_near_dtype_limit
    ref = oracles.run("psum", mesh, ("i",), (3e38 * x).astype(np.float32), config)[1]
    assert np.all(np.isinf(ref[:, 0::2]))  # the plain f32 ring overflows
    for dtype, big in ((np.float32, 3e38), (np.float16, 6e4)):
        y, true, bound = oracles.psum_check(mesh, ("i",), (big * x).astype(dtype), config)
        assert np.all(np.isfinite(y.astype(np.float32)))
        assert np.all(np.abs(y.astype(np.float64) - true) <= bound)


# --- determinism ----------------------------------------------------------------------------------

def test_determinism_100_calls(mesh_factory):
    """100 calls of each collective give bit-identical outputs, and every rank holds the same
    bits (psum: the replicated sum; all_gather: the gathered array)."""
    mesh = mesh_factory((2, 4), ("a", "b"))
    rng = np.random.default_rng(6)
    x = oracles.put(mesh, rng.standard_normal((8, 16, 256)).astype(np.float32))
    w = rng.standard_normal((256, 16)).astype(np.float32)

    def body(v):
        v = v[0]
        return tuple(r[None] for r in (
            fc.psum(v, ("a", "b"), rs_bits=4, ag_bits=8, min_bytes=0),
            fc.psum_scatter(v, "b", tiled=True, bits=4, min_bytes=0),
            fc.all_gather(v, "b", bits=6, min_bytes=0),
            fc.all_gather_matmul(v, w, "b", bits=4, group_size=64, backend="ffi",
                                 spikes=0, min_bytes=0),
            fc.matmul_reduce_scatter(v, w, "b", bidirectional=True)))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(("a", "b")),
                              out_specs=(P(("a", "b")),) * 5))
    first = [np.asarray(o) for o in f(x)]
    for _ in range(99):
        for a, b in zip(first, f(x)):
            np.testing.assert_array_equal(a, np.asarray(b))
    psum, _, gathered = first[0], first[1], first[2]
    for r in range(1, 8):
        np.testing.assert_array_equal(psum[r], psum[0])
    for r in (1, 2, 3):  # the gather ran over b: ranks 0..3 and 4..7
        np.testing.assert_array_equal(gathered[r], gathered[0])
        np.testing.assert_array_equal(gathered[4 + r], gathered[4])


# --- memory ---------------------------------------------------------------------------------------

def _memory(op, mesh, axes, local, dtype, bits):
    """The compiled executable's memory analysis of one collective inside shard_map.

    The executable is the SPMD-partitioned per-device program (every device runs the same
    module on its shard), so its sizes are per device: argument_size_in_bytes equals the local
    operand's bytes, which the test asserts before it compares temp_size_in_bytes."""
    names = mesh.axis_names
    n_dev = mesh.devices.size
    x = jax.ShapeDtypeStruct((n_dev * local[0], *local[1:]), dtype,
                             sharding=NamedSharding(mesh, P(names)))
    opts = dict(bits=bits, min_bytes=0)

    def body(v):
        if op == "psum":
            return fc.psum(v, axes, **opts)
        if op == "psum_scatter":
            return fc.psum_scatter(v, axes, scatter_dimension=1, tiled=True, **opts)
        return fc.all_gather(v, axes, axis=1, tiled=True, **opts)

    rest = tuple(a for a in names if a not in axes)
    out = {"psum": P(rest if rest else None), "psum_scatter": P(names),
           "all_gather": P(names)}[op]
    if op == "psum" and rest:
        out = P(rest)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=out)).lower(
        x).compile().memory_analysis()


MEMORY_CASES = [(op, shape, axes) for op in ("psum", "psum_scatter", "all_gather")
                for shape, axes in (((8,), ("i",)), ((2,), ("i",)), ((2, 4), ("b",)))]


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("op,mesh_shape,axes", MEMORY_CASES,
                         ids=[f"{c[0]}-{'x'.join(map(str, c[1]))}" for c in MEMORY_CASES])
def test_peak_temp_memory(op, mesh_shape, axes, dtype, bits):
    """Temporary memory per device <= 2x the operand, for all three collectives. all_gather's
    output is N times the operand; the ring decodes each received payload into it in place
    (flashcomm_dequantize_into), so its temp is about three payloads whatever N
    (docs/reliability.md, "Memory")."""
    names = ("i",) if len(mesh_shape) == 1 else ("a", "b")
    mesh = jax.make_mesh(mesh_shape, names, devices=jax.devices()[:math.prod(mesh_shape)],
                         axis_types=(jax.sharding.AxisType.Explicit,) * len(names))
    local = (1, 256, 1024)  # 1 MiB of f32 per device, 2048 groups of 128
    m = _memory(op, mesh, axes, local, dtype, bits)
    operand = math.prod(local) * jnp.dtype(dtype).itemsize
    assert m.argument_size_in_bytes == operand  # the per-device figure
    assert m.temp_size_in_bytes <= 2 * operand, m.temp_size_in_bytes / operand
