"""Parity of the ring collective matmuls with the unfused lax pairs, values and gradients.

Tolerance (why it is this and not a looser atol). Every element of every output and gradient is
a sum of at most ``kc`` products (kc = the longest contraction: K, the output columns, or all
rows) plus at most N-1 cross-rank additions. Two summation orders of the same terms each differ
from the exact sum by at most gamma * S, with S = sum of |terms| (Higham, gamma_n ~ n*u), so they
differ from each other by at most 2 * gamma * S. S is computed exactly as the same reference
function on |x|, |w| (and |cotangent|) in f32. In bf16 the dots accumulate in f32 and round once
(XLA:CPU upcasts bf16 dots: convert -> f32 dot -> convert), and the reduce-scatter adds round to
bf16 at most N times on the way, so

    |ring - reference| <= 2 * ((N + 1) * u_dtype + kc * u_f32) * S       (u = eps / 2).

For f32 that is 2 * (kc + N + 1) * u * S: reassociation only.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm import all_gather_matmul, matmul_reduce_scatter
from tests.support.meshes import AXIS_TYPES
from tests.support.pairwise import all_pairs

U32 = float(jnp.finfo(jnp.float32).eps) / 2

# (mesh shape, mesh axis names, ring axis, other axis or None)
MESHES = {
    "1d-2": ((2,), ("i",), "i", None),
    "1d-4": ((4,), ("i",), "i", None),
    "1d-8": ((8,), ("i",), "i", None),
    "2d-2x4-ring-a": ((2, 4), ("a", "b"), "a", "b"),
    "2d-2x4-ring-b": ((2, 4), ("a", "b"), "b", "a"),
}


def _problem(op, ring, other, n, dtype, seed=0, m=4):
    """Global operands, specs and the (ours, reference) local functions for one case.

    1-D meshes: x is (rows, K) and the ring runs over axis 0. 2-D meshes: x is (batch, rows, K)
    with the batch sharded over the other axis (w replicated over it) and the ring over axis 1.
    """
    rng = np.random.default_rng(seed)
    lead = () if other is None else (4,)  # batch: divisible by either other-axis size
    ax = len(lead)
    bspec = () if other is None else (other,)
    if op == "ag":
        k, c = 16, 8  # contraction, columns per rank (m: rows per rank)
        xs, ws = lead + (n * m, k), (k, n * c)
        in_specs = (P(*bspec, ring, None), P(None, ring))
        out_spec = P(*bspec, None, ring)
        out_shape = lead + (n * m, n * c)

        def ours(x, w, bidirectional):
            return all_gather_matmul(x, w, ring, axis=ax, bidirectional=bidirectional)

        def ref(x, w):
            return lax.all_gather(x, ring, axis=ax, tiled=True) @ w
    else:
        k, c = 8, 16  # contraction per rank, columns (m: output rows per rank)
        xs, ws = lead + (n * m, n * k), (n * k, c)
        in_specs = (P(*bspec, None, ring), P(ring, None))
        out_spec = P(*bspec, ring, None)
        out_shape = lead + (n * m, c)

        def ours(x, w, bidirectional):
            return matmul_reduce_scatter(x, w, ring, axis=ax, bidirectional=bidirectional)

        def ref(x, w):
            return lax.psum_scatter(x @ w, ring, scatter_dimension=ax, tiled=True)

    x = rng.standard_normal(xs).astype(dtype)
    w = rng.standard_normal(ws).astype(dtype)
    ct = rng.standard_normal(out_shape).astype(dtype)
    kc = max(math.prod(xs[:-1]), xs[-1], ws[1])
    return x, w, ct, in_specs, out_spec, ours, ref, kc


def _value_and_vjp(fn, mesh, in_specs, out_spec, x, w, ct):
    sm = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)

    def f(x, w, ct):
        y, vjp = jax.vjp(sm, x, w)
        return (y,) + vjp(ct)

    put = lambda a, spec: jax.device_put(a, NamedSharding(mesh, spec))  # noqa: E731
    with jax.set_mesh(mesh):
        args = (put(x, in_specs[0]), put(w, in_specs[1]), put(ct, out_spec))
        return [np.asarray(r, np.float32) for r in jax.jit(f)(*args)]


def _check_parity(mesh, mesh_cfg, op, dtype, bidirectional, m=4):
    _, _, ring, other = mesh_cfg
    n = math.prod(mesh.shape[a] for a in (ring if isinstance(ring, tuple) else (ring,)))
    x, w, ct, in_specs, out_spec, ours, ref, kc = _problem(op, ring, other, n, dtype, m=m)
    got = _value_and_vjp(lambda a, b: ours(a, b, bidirectional), mesh, in_specs, out_spec,
                         x, w, ct)
    want = _value_and_vjp(ref, mesh, in_specs, out_spec, x, w, ct)
    f32 = lambda a: np.abs(np.asarray(a, np.float32))  # noqa: E731
    sums = _value_and_vjp(ref, mesh, in_specs, out_spec, f32(x), f32(w), f32(ct))
    u = float(jnp.finfo(dtype).eps) / 2
    for name, g, r, s in zip(("value", "dx", "dw"), got, want, sums):
        assert g.shape == r.shape, name
        tol = 2 * ((n + 1) * u + kc * U32) * s
        err = np.abs(g - r)
        worst = np.unravel_index(np.argmax(err - tol), err.shape)
        assert np.all(err <= tol), (
            f"{name}: |ring - ref| = {err[worst]} > bound {tol[worst]} at {worst}")


# Both ops on every mesh, each (op, mesh) with each dtype, direction and axis type (all pairs).
PARITY_ROWS = [(op, mesh_id, d, b, t) for (op, mesh_id), d, b, t in all_pairs(
    [(op, m) for op in ("ag", "rs") for m in sorted(MESHES)], ("f32", "bf16"), ("uni", "bidi"),
    sorted(AXIS_TYPES))]


@pytest.mark.parametrize(
    "op,mesh_id,dtype,bidirectional,axis_type",
    [(op, m, {"f32": np.float32, "bf16": jnp.bfloat16}[d], b == "bidi", AXIS_TYPES[t])
     for op, m, d, b, t in PARITY_ROWS],
    ids=["-".join(r) for r in PARITY_ROWS])
def test_parity_with_unfused_reference(mesh_factory, op, mesh_id, dtype, bidirectional):
    """Values and both gradients equal the unfused pair up to reassociation (module docstring)."""
    cfg = MESHES[mesh_id]
    mesh = mesh_factory(cfg[0], cfg[1])
    _check_parity(mesh, cfg, op, dtype, bidirectional)


ODD_ROWS = all_pairs(["ag", "rs"], [1, 3, 5], sorted(AXIS_TYPES))


@pytest.mark.parametrize("op,rows,axis_type", [(o, r, AXIS_TYPES[t]) for o, r, t in ODD_ROWS],
                         ids=[f"{t}-{o}-{r}" for o, r, t in ODD_ROWS])
@pytest.mark.parametrize("mesh_id", ["2d-2x4-ring-b"])
def test_bidirectional_odd_local_rows(mesh_factory, op, mesh_id, rows):
    """An odd local chunk is split unevenly (the backward half a row longer; one row goes one
    way), with the unidirectional ring's parity, values and gradients."""
    cfg = MESHES[mesh_id]
    mesh = mesh_factory(cfg[0], cfg[1])
    _check_parity(mesh, cfg, op, np.float32, True, m=rows)


@pytest.mark.parametrize("op", ["ag", "rs"])
def test_parity_tuple_axis_name(mesh_factory, op):
    """A ring over both axes of a 2x4 mesh (axis_name=('a', 'b')), like lax collectives."""
    mesh = mesh_factory((2, 4), ("a", "b"))
    _check_parity(mesh, ((2, 4), ("a", "b"), ("a", "b"), None), op, np.float32, False)


def test_single_device_axis_is_plain_matmul(mesh_factory):
    """N = 1: no permute at all, the result is x @ w."""
    mesh = mesh_factory((1,), ("i",))
    x, w, ct, in_specs, out_spec, ours, ref, _ = _problem("ag", "i", None, 1, np.float32)
    for bidirectional in (False, True):
        got = _value_and_vjp(lambda a, b: ours(a, b, bidirectional), mesh, in_specs, out_spec,
                             x, w, ct)
        np.testing.assert_array_equal(got[0], np.asarray(jnp.asarray(x) @ jnp.asarray(w)))


# ---------------------------------------------------------------------------------------------
# Input validation: trace-time errors that name the argument
# ---------------------------------------------------------------------------------------------


def _trace(fn, mesh, x, w, in_specs, out_spec):
    sm = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_spec)
    spec = lambda a, s: jax.ShapeDtypeStruct(  # noqa: E731
        a.shape, a.dtype, sharding=NamedSharding(mesh, s))
    with jax.set_mesh(mesh):
        return jax.eval_shape(sm, spec(x, in_specs[0]), spec(w, in_specs[1]))


@pytest.fixture
def mesh4(mesh_factory):
    return mesh_factory((4,), ("i",))


AG_SPECS = (P("i", None), P(None, "i")), P(None, "i")
RS_SPECS = (P(None, "i"), P("i", None)), P("i", None)


@pytest.mark.parametrize(
    "fn, x_shape, w_shape, specs, match",
    [
        (lambda x, w: all_gather_matmul(x, w, "nope"), (8, 16), (16, 8), AG_SPECS,
         "axis 'nope' is not bound"),
        (lambda x, w: matmul_reduce_scatter(x, w, "nope"), (8, 16), (16, 8), RS_SPECS,
         "axis 'nope' is not bound"),
        (lambda x, w: all_gather_matmul(x, w, "i"), (8, 16), (12, 8), AG_SPECS,
         r"do not contract: x.shape\[-1\]=16 .* w.shape\[0\]=12"),
        (lambda x, w: matmul_reduce_scatter(x, w, "i"), (8, 16), (8, 8), RS_SPECS,
         r"do not contract: x.shape\[-1\]=4 .* w.shape\[0\]=2"),
        (lambda x, w: matmul_reduce_scatter(x, w, "i"), (6, 16), (16, 8), RS_SPECS,
         r"rows not divisible: x.shape\[0\]=6 .* size 4"),
        (lambda x, w: all_gather_matmul(x, w, "i", axis=1), (8, 16), (16, 8), AG_SPECS,
         "axis=1 is the contraction dimension"),
        (lambda x, w: all_gather_matmul(x, w, "i"), (8, 16), (16, 8, 1), (
            (P("i", None), P(None, "i", None)), P(None, "i")), "w must be 2-D"),
    ],
    ids=["ag-axis", "rs-axis", "ag-contract", "rs-contract", "rs-rows",
         "ag-axis-is-contraction", "w-3d"],
)
def test_invalid_inputs_raise_value_error(mesh4, fn, x_shape, w_shape, specs, match):
    x, w = np.zeros(x_shape, np.float32), np.zeros(w_shape, np.float32)
    with pytest.raises(ValueError, match=match):
        _trace(fn, mesh4, x, w, *specs)


@pytest.mark.parametrize("bad", ["x", "w"])
@pytest.mark.parametrize("fn", [all_gather_matmul, matmul_reduce_scatter])
def test_non_float_dtype_raises_type_error(mesh4, fn, bad):
    x = np.zeros((8, 16), np.int32 if bad == "x" else np.float32)
    w = np.zeros((16, 8) if fn is all_gather_matmul else (4, 8),
                 np.int32 if bad == "w" else np.float32)
    specs = AG_SPECS if fn is all_gather_matmul else RS_SPECS
    with pytest.raises(TypeError, match=f"{bad} must have a floating dtype, got int32"):
        _trace(lambda a, b: fn(a, b, "i"), mesh4, x, w, *specs)


def test_axis_name_type_error(mesh4):
    with pytest.raises(TypeError, match="axis_name must be a mesh axis name"):
        _trace(lambda a, b: all_gather_matmul(a, b, 3), mesh4, np.zeros((8, 16), np.float32),
               np.zeros((16, 8), np.float32), *AG_SPECS)


# ---------------------------------------------------------------------------------------------
# Quantized all-gather-matmul: one quantization whatever N is
# ---------------------------------------------------------------------------------------------


ONE_Q_ROWS = all_pairs([2, 4, 8], ["uni", "bidi"], sorted(AXIS_TYPES))


@pytest.mark.slow
@pytest.mark.parametrize("n,bidirectional,axis_type",
                         [(n, b == "bidi", AXIS_TYPES[t]) for n, b, t in ONE_Q_ROWS],
                         ids=[f"{t}-{n}-{b}" for n, b, t in ONE_Q_ROWS])
def test_quantized_is_one_quantization(mesh_factory, n, bidirectional):
    """bits=4: the value (and dw) equal gathering dequantize(quantize(chunk)) up to f32
    reassociation (bound of the module docstring), dx passes straight through (= the exact dx),
    and the error against the exact product is at most one quantization: (|error| of each chunk,
    from codec.error_bound) @ |w|, the same bound for every N. A row is one group (K = 16 =
    group_size), so the halves of the bidirectional ring hold the same groups as the chunk."""
    _check_quantized(mesh_factory((n,), ("i",)), n, bidirectional, rows=4)


@pytest.mark.parametrize("rows,axis_type", [(1, AXIS_TYPES["explicit"]),
                                            (3, AXIS_TYPES["auto"]),
                                            (5, AXIS_TYPES["explicit"])],
                         ids=["explicit-1", "auto-3", "explicit-5"])
def test_quantized_bidirectional_odd_rows(mesh_factory, rows):
    """The same with an odd local chunk, split unevenly between the two directions."""
    _check_quantized(mesh_factory((4,), ("i",)), 4, True, rows=rows)


def _check_quantized(mesh, n, bidirectional, rows):
    from jax_flashcomm import codec

    x, w, ct, in_specs, out_spec, _, ref, kc = _problem("ag", "i", None, n, np.float32, m=rows)
    q = dict(bits=4, group_size=16, backend="jnp")

    def deq(a):
        return codec.dequantize(codec.quantize(a, **q), backend="jnp")

    def ours(a, b):
        return all_gather_matmul(a, b, "i", bidirectional=bidirectional, bits=4, group_size=16,
                                 spikes=0, min_bytes=0)

    def qref(a, b):
        return lax.all_gather(deq(a), "i", tiled=True) @ b

    def err_bound(a, b):
        e = codec.error_bound(codec.quantize(a, **q))
        return lax.all_gather(e, "i", tiled=True) @ jnp.abs(b)

    run = lambda f, *a: _value_and_vjp(f, mesh, in_specs, out_spec, *a)  # noqa: E731
    got, want_q, want = run(ours, x, w, ct), run(qref, x, w, ct), run(ref, x, w, ct)
    # Groups are runs of 16 row-major elements and a chunk is 4 * 16 = 64 of them, so quantizing
    # the global x gives the same groups as quantizing each chunk: |deq(x)| gives the sums.
    xq = np.asarray(deq(jnp.asarray(x)))
    sums_q = run(ref, np.abs(xq), np.abs(w), np.abs(ct))
    sums = run(ref, np.abs(x), np.abs(w), np.abs(ct))
    bound = lambda s: 2 * (kc + n + 1) * U32 * s  # noqa: E731
    assert np.all(np.abs(got[0] - want_q[0]) <= bound(sums_q[0])), "value: gathered dequantized"
    assert np.all(np.abs(got[1] - want[1]) <= bound(sums[1])), "dx is straight-through (exact)"
    assert np.all(np.abs(got[2] - want_q[2]) <= bound(sums_q[2])), "dw uses the dequantized x"
    one_q = run(err_bound, x, w, ct)[0]
    err = np.abs(got[0] - want[0])
    assert np.all(err <= one_q + bound(sums_q[0]) + bound(sums[0])), "more than one quantization"
    assert err.max() > 0, "the quantized path was not taken"


def test_quantized_needs_valid_bits(mesh4):
    with pytest.raises(ValueError, match="bits must be in 2..8"):
        _trace(lambda a, b: all_gather_matmul(a, b, "i", bits=1), mesh4,
               np.zeros((8, 16), np.float32), np.zeros((16, 8), np.float32), *AG_SPECS)
