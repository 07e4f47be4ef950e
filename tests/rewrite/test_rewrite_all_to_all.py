"""jax_flashcomm.rewrite of the all-to-alls: lax.all_to_all and lax.ragged_all_to_all inside a
shard_map become fc.all_to_all / fc.ragged_all_to_all.

The exact setting (bits=None) is bit-equal to lax.all_to_all (tiled and stacked) and, for the
ragged op (XLA:CPU has no ragged-all-to-all: the original cannot run here), to a NumPy
reference; int8 is bit-equal to calling fc's op directly, within fc.alltoall's
all_to_all_with_bound of lax, and for the ragged op equal to moving each rank's own decoded rows
(one quantization end to end) and within codec.error_bound of their payload; integer
all-to-alls (an MoE layer's token counts) move exactly under a quantizing config; the report
lists every site; jax.jit and jax.grad of the rewritten program.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import alltoall, codec
from jax_flashcomm.rewrite import RewritePolicy, rewrite

N = 4
EXACT = fc.CommConfig(bits=None)
INT8 = fc.CommConfig(bits=8, min_bytes=0)


@pytest.fixture(scope="module")
def mesh():
    return jax.make_mesh((N,), ("ep",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:N])


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P("ep")))


def _x(shape, seed=0):
    return np.asarray(np.random.RandomState(seed).randn(*shape), np.float32)


# --- all_to_all -------------------------------------------------------------------------------

CASES = [(0, 1, True), (1, 0, True), (0, 0, False), (1, 2, False)]


def _a2a_program(mesh, split, concat, tiled):
    def body(x, counts):
        if not tiled:
            x = x.reshape(x.shape[:split] + (N, -1) + x.shape[split + 1:])
        y = lax.all_to_all(x, "ep", split, concat, tiled=tiled)
        c = lax.all_to_all(counts, "ep", 0, 0, tiled=True)    # int32: the token counts
        return jnp.tanh(y) * 2.0, c

    def f(x, counts):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=(P("ep"), P("ep")))(x, counts)
    return f


def _a2a_args(mesh, split):
    shape = [N * 2, 3, 256] if split == 0 else [2, N * 3, 256]
    shape[0] *= N
    return _put(mesh, _x(shape)), _put(mesh, np.arange(N * N, dtype=np.int32) * 7)


@pytest.mark.parametrize("split,concat,tiled", CASES)
def test_exact_is_bit_equal_and_int8_within_bound(mesh, split, concat, tiled):
    f = _a2a_program(mesh, split, concat, tiled)
    x, counts = _a2a_args(mesh, split)
    with jax.set_mesh(mesh):
        ref = jax.jit(f)(x, counts)
        exact = jax.jit(rewrite(f, EXACT))(x, counts)
        quant = jax.jit(rewrite(f, INT8))(x, counts)

        def direct(xl, cl):   # the same program written with flashcomm's op, and the bound
            if not tiled:
                xl = xl.reshape(xl.shape[:split] + (N, -1) + xl.shape[split + 1:])
            got = fc.all_to_all(xl, "ep", split, concat, tiled=tiled, config=INT8)
            moved = lax.all_to_all(xl, "ep", split, concat, tiled=tiled)
            _, bound = alltoall.all_to_all_with_bound(xl, "ep", split, concat, tiled=tiled,
                                                      config=INT8)
            return jnp.tanh(got) * 2.0, moved, got, bound

        want, moved, raw, bound = jax.jit(jax.shard_map(
            direct, mesh=mesh, in_specs=(P("ep"), P("ep")), out_specs=(P("ep"),) * 4))(x, counts)
    for a, b in zip(exact, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(np.asarray(quant[0]), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(quant[1]), np.asarray(ref[1]))  # counts exact
    # the quantized exchange itself within the codec's bound of lax's
    err = np.abs(np.asarray(raw) - np.asarray(moved))
    assert np.all(err <= np.asarray(bound)) and np.all(np.asarray(bound) > 0)
    # tanh is 1-Lipschitz: the rewritten layer's output within 2 x the bound of the original's
    assert np.all(np.abs(np.asarray(quant[0]) - np.asarray(ref[0])) <= 2 * np.asarray(bound))


def test_report_rows(mesh):
    f = _a2a_program(mesh, 0, 1, True)
    x, counts = _a2a_args(mesh, 0)
    with jax.set_mesh(mesh):
        exact = rewrite(f, EXACT).report(x, counts)
        quant = rewrite(f, INT8).report(x, counts)
        kept = rewrite(f, RewritePolicy(config=INT8, ops="psum")).report(x, counts)
    assert [(r.op, r.primitive, r.action, r.dtype) for r in exact] == [
        ("all_to_all", "all_to_all", "exact", "float32"),
        ("all_to_all", "all_to_all", "exact", "int32")]
    floats, ints = quant.rows
    assert (floats.action, floats.detail, floats.path) == ("quantized", "int8", "shard_map")
    assert floats.shape == (8, 3, 256) and floats.bytes_per_rank == 8 * 3 * 256 * 4
    assert floats.axis_size == N and floats.axes == ("ep",)
    assert "test_rewrite_all_to_all.py" in floats.site
    # every slice but this rank's own, at the int8 wire bytes (codes, scales)
    assert floats.xla_sent == 3 * 8 * 3 * 256 and floats.rewrite_sent < floats.xla_sent / 3
    assert (ints.action, ints.detail) == ("exact", "lax")
    assert "dtype int32 is not quantizable: moved exactly" in ints.reason
    assert [r.action for r in kept] == ["kept", "kept"]
    assert "excludes all_to_all" in kept[0].reason
    assert "quantized int8" in str(quant) and "all_to_all" in str(quant)


def test_jit_and_grad(mesh):
    f = _a2a_program(mesh, 0, 1, True)
    x, counts = _a2a_args(mesh, 0)

    def loss(g):
        return lambda xx: jnp.sum(g(xx, counts)[0] ** 2)

    def direct(xx, cc):      # the program written with flashcomm's op
        def body(xl, cl):
            return (jnp.tanh(fc.all_to_all(xl, "ep", 0, 1, tiled=True, config=INT8)) * 2.0,
                    lax.all_to_all(cl, "ep", 0, 0, tiled=True))
        return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                             out_specs=(P("ep"), P("ep")))(xx, cc)

    with jax.set_mesh(mesh):
        ref = jax.jit(jax.grad(loss(f)))(x)
        exact = jax.jit(jax.grad(loss(rewrite(f, EXACT))))(x)
        quant = jax.jit(jax.grad(loss(rewrite(f, INT8))))(x)
        want = jax.jit(jax.grad(loss(direct)))(x)
        eager = rewrite(f, EXACT)(x, counts)         # an eager call runs under jax.jit
    np.testing.assert_array_equal(np.asarray(exact), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(quant), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(eager[0]), np.asarray(jax.jit(f)(x, counts)[0]))
    # straight-through quantizer, exact cotangent all-to-all: within 2% of the exact gradient
    # on average (it is the exact one evaluated at the quantized activations)
    diff = np.abs(np.asarray(quant) - np.asarray(ref)).mean()
    assert diff < 0.02 * np.abs(np.asarray(ref)).mean()


def test_axis_index_groups_and_body_form(mesh):
    """The function that runs inside a shard_map, rewritten; an all-to-all fc cannot take
    (axis_index_groups) is kept with its reason."""
    x, counts = _a2a_args(mesh, 0)

    def body(xl, cl):
        return lax.all_to_all(xl, "ep", 0, 1, tiled=True), cl

    rw = rewrite(body, EXACT)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(rw, mesh=mesh, in_specs=(P("ep"), P("ep")),
                                    out_specs=(P("ep"), P("ep"))))(x, counts)
        ref = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("ep"), P("ep")),
                                    out_specs=(P("ep"), P("ep"))))(x, counts)
    np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(ref[0]))
    policy = RewritePolicy(config=INT8)
    assert policy.select("all_to_all", ("ep",), np.float32, "", (), [[0, 1], [2, 3]]) == (
        False, "axis_index_groups is not supported by flashcomm")


# --- ragged_all_to_all ------------------------------------------------------------------------

ROWS, H = 12, 256          # rows per rank in the operand and the output; values per row


def _sizes(seed):
    """``S[r, j]``: rows rank r sends to rank j (each rank sends at most ROWS, receives at most
    ROWS)."""
    rng = np.random.RandomState(seed)
    while True:
        s = rng.randint(0, 4, size=(N, N))
        if s.sum(1).max() <= ROWS and s.sum(0).max() <= ROWS:
            return s


def _metas(s):
    """Per rank: input_offsets, send_sizes, output_offsets, recv_sizes (each (N,))."""
    input_offsets = np.concatenate([np.zeros((N, 1), int), np.cumsum(s, 1)[:, :-1]], 1)
    landed = np.concatenate([np.zeros((1, N), int), np.cumsum(s, 0)[:-1]], 0)  # [r, j]
    return [np.asarray(a, np.int32) for a in (input_offsets, s, landed, s.T)]


def _numpy_ragged(x, s, fill):
    """``x`` (N, ROWS, ...) moved as lax.ragged_all_to_all moves it; ``fill`` elsewhere."""
    out = np.full(x.shape, fill, x.dtype)
    input_offsets, _, landed, _ = _metas(s)
    for r in range(N):
        for j in range(N):
            k, a, b = s[r, j], input_offsets[r, j], landed[r, j]
            out[j, b:b + k] = x[r, a:a + k]
    return out


def _ragged_program(mesh):
    def body(x, io, ss, oo, rs):
        out = jnp.full((ROWS, H), -1.0, x.dtype)
        y = lax.ragged_all_to_all(x * 2.0, out, io, ss, oo, rs, axis_name="ep")
        return y + 1.0

    def f(x, io, ss, oo, rs):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))(
            x, io, ss, oo, rs)
    return f


def _ragged_args(mesh, s, seed=0):
    x = _x((N * ROWS, H), seed)
    return (_put(mesh, x), *[_put(mesh, m.reshape(-1)) for m in _metas(s)])


@pytest.mark.parametrize("seed", [0, 1])
def test_ragged_exact_equals_numpy_and_int8_within_bound(mesh, seed):
    s = _sizes(seed)
    f = _ragged_program(mesh)
    args = _ragged_args(mesh, s, seed)
    x = np.asarray(args[0]).reshape(N, ROWS, H)
    with jax.set_mesh(mesh):
        exact = np.asarray(jax.jit(rewrite(f, EXACT))(*args)).reshape(N, ROWS, H)
        quant = np.asarray(jax.jit(rewrite(f, INT8))(*args)).reshape(N, ROWS, H)
        plans = []

        def decoded(xl):     # each rank's own quantization of what it sends, and its bound
            p = fc.plan("ragged_all_to_all", ("ep",), (ROWS, H), jnp.float32, N, INT8)
            plans.append(p)
            q = codec.quantize(xl * 2.0, bits=p.ag_bits, group_size=p.group_size,
                               rotation=p.rotation, spikes=p.ag_spikes, format=p.ag_format)
            return codec.dequantize(q), codec.error_bound(q)

        dec, bound = jax.jit(jax.shard_map(decoded, mesh=mesh, in_specs=P("ep"),
                                           out_specs=(P("ep"), P("ep"))))(args[0])
    want = _numpy_ragged(2.0 * x, s, -1.0) + 1.0
    np.testing.assert_array_equal(exact, want)
    # one quantization end to end: the received rows are the sender's decoded rows, exactly
    np.testing.assert_array_equal(
        quant, _numpy_ragged(np.asarray(dec).reshape(N, ROWS, H), s, -1.0) + 1.0)
    b = _numpy_ragged(np.asarray(bound).reshape(N, ROWS, H), s, 0.0)
    assert np.all(np.abs(quant - want) <= b + 1e-6)   # + 1.0 rounds once in f32
    assert plans[0].quantized and plans[0].transport == "p2p"  # XLA:CPU: no ragged-all-to-all


def test_ragged_report_jit_and_grad(mesh):
    s = _sizes(2)
    f = _ragged_program(mesh)
    args = _ragged_args(mesh, s, 2)
    x = np.asarray(args[0]).reshape(N, ROWS, H)
    t = _x((N * ROWS, H), 5)
    with jax.set_mesh(mesh):
        rows = rewrite(f, INT8).report(*args).rows
        exact_rows = rewrite(f, EXACT).report(*args).rows
        grads = {}
        for name, cfg in (("exact", EXACT), ("int8", INT8)):
            rw = rewrite(f, cfg)
            grads[name] = np.asarray(jax.jit(jax.grad(
                lambda xx, rw=rw: jnp.sum(rw(xx, *args[1:]) * t)))(args[0]))
    (row,) = rows
    assert (row.op, row.primitive, row.action, row.detail) == (
        "ragged_all_to_all", "ragged_all_to_all", "quantized", "int8")
    assert row.shape == (ROWS, H) and row.axis_size == N and row.path == "shard_map"
    (erow,) = exact_rows
    assert (erow.action, erow.detail) == ("exact", "over p2p")
    assert "XLA:CPU has no ragged-all-to-all" in erow.reason
    # d/dx sum(y * t): each sent row gets 2 x the cotangent of the row it landed in; unsent 0
    input_offsets, _, landed, _ = _metas(s)
    want = np.zeros_like(x)
    tt = t.reshape(N, ROWS, H)
    for r in range(N):
        for j in range(N):
            k, a, b = s[r, j], input_offsets[r, j], landed[r, j]
            want[r, a:a + k] = 2.0 * tt[j, b:b + k]
    np.testing.assert_array_equal(grads["exact"].reshape(N, ROWS, H), want)
    # the default grad mode moves the cotangents exactly: the same gradient
    np.testing.assert_array_equal(grads["int8"].reshape(N, ROWS, H), want)


def test_ragged_integer_operand_moves_exactly(mesh):
    """An integer ragged all-to-all under a quantizing config: fc's op at bits=None, which runs
    on CPU over the exchange (lax's does not compile there)."""
    s = _sizes(3)

    def body(x, io, ss, oo, rs):
        return lax.ragged_all_to_all(x, jnp.zeros((ROWS, 2), x.dtype), io, ss, oo, rs,
                                     axis_name="ep")

    def f(x, *m):
        return jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"))(x, *m)

    ids = np.arange(N * ROWS * 2, dtype=np.int32).reshape(N * ROWS, 2)
    args = (_put(mesh, ids), *[_put(mesh, m.reshape(-1)) for m in _metas(s)])
    with jax.set_mesh(mesh):
        got = np.asarray(jax.jit(rewrite(f, INT8))(*args)).reshape(N, ROWS, 2)
        (row,) = rewrite(f, INT8).report(*args).rows
    np.testing.assert_array_equal(got, _numpy_ragged(ids.reshape(N, ROWS, 2), s, 0))
    assert (row.action, row.dtype) == ("exact", "int32")
    assert "moved exactly" in row.reason


def test_gspmd_all_to_all_is_reported(mesh):
    """A resharding XLA's partitioner turns into an all-to-all (Auto axes) is a report row, kept:
    the rewrite has no island for it."""
    auto = jax.make_mesh((N,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:N])

    def f(x):
        y = jnp.sin(x)
        return jax.lax.with_sharding_constraint(y, NamedSharding(auto, P(None, "ep"))) * 2.0

    x = jax.device_put(_x((N * 4, N * 64)), NamedSharding(auto, P("ep", None)))
    report = rewrite(f, INT8).report(x)
    a2a = report.where(op="all_to_all")
    assert a2a and all(r.path == "partitioner" and r.action == "kept" for r in a2a)
    assert "all-to-all" in a2a[0].reason
