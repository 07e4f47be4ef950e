"""Hypothesis properties: shapes x dtypes x bits x group sizes x mesh shapes for the fused codec
op and every collective, against the jnp twin (bit-identical) and against lax (exact setting
bit-equal; quantized within the elementwise bound from the stored scales, tests/support/collective_oracles).

Example counts follow the active hypothesis profile (tests/conftest.py, ``HYPOTHESIS_PROFILE``):
each collective property runs ``profile.max_examples // 4`` examples, at least 10 (CI profile:
10 each; thorough: 125 each) and the fused codec property half the CI profile's count (15) or
all of the thorough one's (500), so

    HYPOTHESIS_PROFILE=thorough .venv/bin/pytest tests/collectives/test_fuzz_collectives.py

runs 4 * 125 + 500 = 1000 examples (docs/reliability.md has the times).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec
from jax_flashcomm import CommConfig

from tests.support import collective_oracles as oracles
from tests.support.meshes import make_mesh

pytestmark = pytest.mark.slow  # hypothesis fuzzing

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
GROUP_SIZES = (8, 16, 24, 64, 128, 256)
DIM_SIZES = (1, 2, 3, 8, 17, 40, 130)

_PROFILE_EXAMPLES = settings.default.max_examples
COLLECTIVE_EXAMPLES = max(10, _PROFILE_EXAMPLES // 4)
# The fused codec op compiles one small program per example: CI runs half the profile's count,
# the thorough profile (>= 500) all of it.
FUSED_EXAMPLES = _PROFILE_EXAMPLES if _PROFILE_EXAMPLES >= 500 else _PROFILE_EXAMPLES // 2
_collective = settings(max_examples=COLLECTIVE_EXAMPLES, deadline=None,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@functools.lru_cache(maxsize=None)
def _mesh(shape, names):
    return make_mesh(shape, names, jax.sharding.AxisType.Explicit)


def _values(rng, shape, dtype, n_ranks, magnitude, kind):
    """Per-rank operands whose sums over up to ``n_ranks`` ranks stay finite in ``dtype``."""
    size = (n_ranks, *shape)
    if kind == "normal":
        v = rng.standard_normal(size) * magnitude
    elif kind == "outliers":
        v = rng.standard_normal(size) * magnitude * 1e-2
        mask = rng.random(size) < 0.02
        v[mask] = rng.choice([-1.0, 1.0], int(mask.sum())) * magnitude
    elif kind == "offset":
        v = magnitude * (1.0 + rng.uniform(0.0, 1e-3, size))
    elif kind == "constant":
        v = np.full(size, magnitude * rng.standard_normal())
    else:  # "loguniform": magnitudes spread over many decades in one group
        v = np.sign(rng.standard_normal(size)) * magnitude * np.exp(rng.uniform(-30, 0, size))
    limit = float(jnp.finfo(dtype).max) / (2 * n_ranks)
    return np.clip(v, -limit, limit).astype(np.float32).astype(dtype)


@st.composite
def collective_case(draw, min_rank=0):
    shape_, names, axes = draw(st.sampled_from(oracles.MESH_CASES))
    local = tuple(draw(st.lists(st.sampled_from(DIM_SIZES), min_size=min_rank, max_size=3)))
    dtype = draw(st.sampled_from(DTYPES))
    exact = draw(st.integers(0, 9)) == 0  # ~10% of the examples: the bits=None setting
    bits = None if exact else draw(st.integers(2, 8))
    g = draw(st.sampled_from(GROUP_SIZES))
    magnitudes = [1e-3, 1.0, 1e2] if dtype == jnp.float16 else [1e-30, 1e-3, 1.0, 1e3, 1e30]
    magnitude = draw(st.sampled_from(magnitudes))
    kind = draw(st.sampled_from(["normal", "outliers", "offset", "constant", "loguniform"]))
    seed = draw(st.integers(0, 2**31 - 1))
    return shape_, names, axes, local, dtype, bits, g, magnitude, kind, seed


def _setup(case):
    shape_, names, axes, local, dtype, bits, g, magnitude, kind, seed = case
    mesh = _mesh(shape_, names)
    n_ranks = math.prod(shape_)
    x = _values(np.random.default_rng(seed), local, dtype, n_ranks, magnitude, kind)
    return mesh, axes, x, bits, g


def _spikes(seed, g):
    """Spike reserving in about half the examples (k in 1..3, below G), from the drawn seed."""
    return min([0, 0, 1, 3][seed % 4], g - 1)


def _configs(bits, g, rs_bits=None, spikes=0):
    if bits is None:
        return [CommConfig(bits=None)]
    return [CommConfig(bits=bits, rs_bits=rs_bits, group_size=g, min_bytes=0, backend=b,
                       spikes=spikes) for b in ("auto", "jnp")]


def _assert_within(y, true, bound):
    y64 = np.asarray(y, np.float64)
    assert np.all(np.isfinite(y64)) and np.all(np.isfinite(bound))
    err = np.abs(y64 - true)
    assert np.all(err <= bound), float(np.max(err - bound))


# --- psum ---------------------------------------------------------------------------------------

@_collective
@given(case=collective_case(), rs_bits=st.one_of(st.none(), st.integers(2, 8)))
def test_fuzz_psum(case, rs_bits):
    mesh, axes, x, bits, g = _setup(case)
    if bits is None:
        _exact(mesh, axes, x, "psum")  # bits=None is lax.psum, bit for bit
        return
    results = []
    for config in _configs(bits, g, rs_bits, _spikes(case[-1], g)):
        y, true, bound = oracles.psum_check(mesh, axes, x, config)
        _assert_within(y, true, bound)
        results.append(y)
    oracles.assert_same(results[0], results[1])  # FFI kernels == jnp twin


@functools.lru_cache(maxsize=None)
def _exact_program(op, mesh, axes, local, dtype, opts):
    names = mesh.axis_names
    opts = dict(opts)

    def body(v):
        v = v.reshape(local)
        y = getattr(fc, op)(v, axes, bits=None, **opts)
        ref = getattr(lax, op)(v, axes, **_nonnegative(opts, v.ndim))
        return y[None], ref[None]

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                 out_specs=(P(names), P(names))))


def _nonnegative(opts, ndim):
    """lax.psum_scatter(scatter_dimension=-1) passes tracing and then fails MLIR verification
    (jax 0.10.2): the reference gets non-negative dimensions; jax_flashcomm normalizes them."""
    opts = dict(opts)
    if "scatter_dimension" in opts:
        opts["scatter_dimension"] %= ndim
    if "axis" in opts:
        opts["axis"] %= ndim if opts["tiled"] else ndim + 1
    return opts


def _exact(mesh, axes, x, op, **opts):
    """The bits=None setting of ``op`` and the lax op: asserts bit-equality, returns lax's."""
    f = _exact_program(op, mesh, tuple(axes), tuple(x.shape[1:]), np.dtype(x.dtype),
                       tuple(sorted(opts.items())))
    y, ref = (np.asarray(a) for a in f(oracles.put(mesh, jnp.asarray(x))))
    oracles.assert_same(y, ref)
    return ref


# --- psum_scatter -------------------------------------------------------------------------------

@_collective
@given(case=collective_case(min_rank=1), data=st.data())
def test_fuzz_psum_scatter(case, data):
    mesh, axes, x, bits, g = _setup(case)
    n = math.prod(mesh.shape[a] for a in axes)
    local = list(x.shape[1:])
    dim = data.draw(st.integers(-len(local), len(local) - 1), label="scatter_dimension")
    tiled = data.draw(st.booleans(), label="tiled")
    # make the scattered dimension fit: N (untiled) or a multiple of N (tiled)
    local[dim] = n * data.draw(st.sampled_from([1, 2, 3, 5]), label="per_rank") if tiled else n
    x = _values(np.random.default_rng(case[-1]), tuple(local), x.dtype, mesh.devices.size,
                case[7], case[8])
    _check_both_transports(case, mesh, axes, x, bits, g, "psum_scatter",
                           dict(scatter_dimension=dim, tiled=tiled), (dim, tiled))


def _check_both_transports(case, mesh, axes, x, bits, g, op, lax_kwargs, oracle_args):
    """The exact op against lax for ``bits=None``; else the quantized op within its error bound
    under both configs of :func:`_configs`, which give the same bits."""
    if bits is None:
        _exact(mesh, axes, x, op, **lax_kwargs)
        return
    check = getattr(oracles, f"{op}_check")
    results = []
    for config in _configs(bits, g, spikes=_spikes(case[-1], g)):
        y, true, bound = check(mesh, axes, x, config, *oracle_args)
        _assert_within(y, true, bound)
        results.append(y)
    oracles.assert_same(results[0], results[1])


# --- all_gather ---------------------------------------------------------------------------------

@_collective
@given(case=collective_case(), data=st.data())
def test_fuzz_all_gather(case, data):
    mesh, axes, x, bits, g = _setup(case)
    ndim = x.ndim - 1
    tiled = ndim > 0 and data.draw(st.booleans(), label="tiled")
    out_ndim = ndim if tiled else ndim + 1
    axis = data.draw(st.integers(-out_ndim, out_ndim - 1), label="axis")
    _check_both_transports(case, mesh, axes, x, bits, g, "all_gather",
                           dict(axis=axis, tiled=tiled), (axis, tiled))


# --- collective matmuls -------------------------------------------------------------------------

U32 = float(jnp.finfo(jnp.float32).eps) / 2


#: The ring format these tests derive their bounds for: plain groups, every size quantized.
RING_QUANT = dict(rotation=0, spikes=0, min_bytes=0)


@functools.lru_cache(maxsize=None)
def _matmul_programs(op, n, m, k, c, dtype, bidirectional, bits, g):
    """(ours, unfused lax reference, reference on |.|) for a 1-D ring of n devices."""
    mesh = _mesh((n,), ("i",))
    if op == "ag":
        specs = ((P("i", None), P(None, "i")), P(None, "i"))

        def ours(x, w):
            return fc.all_gather_matmul(x, w, "i", bidirectional=bidirectional, bits=bits,
                                        group_size=g, backend="jnp", **RING_QUANT)

        def ref(x, w):
            if bits is not None:  # the quantized op gathers dequantize(quantize(chunk))
                x = _dequantized(x, bits, g, bidirectional)
            return lax.all_gather(x, "i", tiled=True) @ w

        def ours_ffi(x, w):
            return fc.all_gather_matmul(x, w, "i", bidirectional=bidirectional, bits=bits,
                                        group_size=g, backend="ffi", **RING_QUANT)
    else:
        specs = ((P(None, "i"), P("i", None)), P("i", None))

        def ours(x, w):
            return fc.matmul_reduce_scatter(x, w, "i", bidirectional=bidirectional)

        def ref(x, w):
            return lax.psum_scatter(x @ w, "i", tiled=True)

        ours_ffi = ours
    wrap = lambda f: jax.jit(jax.shard_map(f, mesh=mesh, in_specs=specs[0],  # noqa: E731
                                           out_specs=specs[1]))
    return mesh, specs, wrap(ours), wrap(ours_ffi), wrap(ref)


@_collective
@given(op=st.sampled_from(["ag", "rs"]), n=st.sampled_from([2, 4, 8]),
       m=st.sampled_from([1, 2, 3, 4, 5, 6]), k=st.sampled_from([8, 16, 24]), c=st.sampled_from([1, 8]),
       dtype=st.sampled_from([jnp.float32, jnp.bfloat16]), bidirectional=st.booleans(),
       bits=st.one_of(st.none(), st.integers(2, 8)), g=st.sampled_from([8, 16, 32]),
       seed=st.integers(0, 2**31 - 1))
def test_fuzz_collective_matmuls(op, n, m, k, c, dtype, bidirectional, bits, g, seed):
    """Ring == unfused lax pair up to reassociation (tests/collectives/test_collective_matmul.py's bound);
    quantized all_gather_matmul == gathering dequantize(quantize(chunk)) likewise, with the
    jnp and FFI codec backends bit-identical."""
    if op == "rs":
        bits = None
    rng = np.random.default_rng(seed)
    if op == "ag":
        xs, ws = (n * m, k), (k, n * c)
    else:
        xs, ws = (n * m, n * k), (n * k, c)
    x = rng.standard_normal(xs).astype(np.float32).astype(dtype)
    w = rng.standard_normal(ws).astype(np.float32).astype(dtype)
    mesh, specs, ours, ours_ffi, ref = _matmul_programs(op, n, m, k, c, np.dtype(dtype),
                                                        bidirectional, bits, g)
    put = lambda a, s: jax.device_put(jnp.asarray(a), NamedSharding(mesh, s))  # noqa: E731
    args = (put(x, specs[0][0]), put(w, specs[0][1]))
    got = np.asarray(ours(*args), np.float32)
    want = np.asarray(ref(*args), np.float32)
    xa = np.abs(x.astype(np.float32))
    if bits is not None:
        np.testing.assert_array_equal(got, np.asarray(ours_ffi(*args), np.float32))
        chunks = [_dequantized(jnp.asarray(x[r * m:(r + 1) * m]), bits, g, bidirectional)
                  for r in range(n)]
        xa = np.abs(np.concatenate([np.asarray(a, np.float32) for a in chunks]))
    # |x| (|dequantized x| when quantized) @ |w| through the exact reference: the sum S
    _, _, _, _, exact_ref = _matmul_programs(op, n, m, k, c, np.dtype(dtype), bidirectional,
                                             None, g)
    sums = np.asarray(exact_ref(put(xa.astype(dtype), specs[0][0]),
                                put(np.abs(w.astype(np.float32)).astype(dtype), specs[0][1])),
                      np.float32)
    kc = max(xs[-1], ws[1], xs[0])
    u = float(jnp.finfo(dtype).eps) / 2
    tol = 2 * ((n + 1) * u + kc * U32) * sums
    assert got.shape == want.shape
    err = np.abs(got - want)
    assert np.all(err <= tol), float(np.max(err - tol))


def _dequantized(x, bits, g, bidirectional):
    """What the quantized ring gathers for a local chunk: each piece that travels (the whole
    chunk, or its two halves when bidirectional: the upper one a row longer if the chunk's rows
    are odd, one piece if it has one row) quantized once and dequantized."""
    rt = lambda a: codec.dequantize(codec.quantize(a, bits=bits, group_size=g, backend="jnp"),  # noqa: E731
                                    backend="jnp")
    if not bidirectional or x.shape[0] < 2:
        return rt(x)
    h = x.shape[0] // 2
    return jnp.concatenate([rt(x[:h]), rt(x[h:])])


# --- the fused codec op --------------------------------------------------------------------------

@settings(max_examples=FUSED_EXAMPLES, deadline=None)
@given(chunks=st.integers(1, 8), groups=st.integers(1, 4), g=st.sampled_from(GROUP_SIZES),
       bits=st.integers(2, 8), out_bits=st.integers(2, 8), dtype=st.sampled_from(DTYPES),
       magnitude=st.sampled_from([1e-30, 1e-3, 1.0, 1e3]), seed=st.integers(0, 2**31 - 1))
def test_fuzz_dequantize_sum_quantize(chunks, groups, g, bits, out_bits, dtype, magnitude, seed):
    """The fused op of the two-step all-reduce: FFI == jnp twin bit for bit (codes, scales,
    zeros), and the decoded sum within (sum of the chunks' bounds + f32 rounding + the output
    quantization's bound) of the exact sum of the chunks' operands."""
    rng = np.random.default_rng(seed)
    if dtype == jnp.float16:
        magnitude = min(magnitude, 1e3)
    x = (rng.standard_normal((chunks, groups * g)) * magnitude).astype(np.float32).astype(dtype)
    out = _fused(jnp.asarray(x), bits, out_bits, g, _spikes(seed, g))
    p_in, p_ffi, p_jnp, y, b_in, b_out = out
    for a, b in zip(jax.tree.leaves(p_ffi), jax.tree.leaves(p_jnp)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    x64 = np.asarray(x, np.float64)
    true = x64.sum(0)
    b_in = np.asarray(b_in, np.float64)
    bound = (b_in.sum(0) + chunks * oracles.EPS32 * (np.abs(x64).sum(0) + b_in.sum(0))
             + np.asarray(b_out, np.float64))
    err = np.abs(np.asarray(y, np.float64) - true)
    assert np.all(err <= bound), float(np.max(err - bound))


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 4))
def _fused(x, bits, out_bits, g, spikes=0):
    p = codec.quantize(x, bits=bits, group_size=g, backend="jnp",
                       spikes=spikes)  # (chunks * groups, ...)
    chunked = p.split_groups(x.shape[0])
    p_ffi = codec.dequantize_sum_quantize(chunked, bits=out_bits, backend="ffi")
    p_jnp = codec.dequantize_sum_quantize(chunked, bits=out_bits, backend="jnp")
    y = codec.dequantize(p_ffi, backend="ffi")
    return (p, p_ffi, p_jnp, y, codec.error_bound(p).reshape(x.shape),
            codec.error_bound(p_ffi))
