"""jax_flashcomm.all_to_all / ragged_all_to_all against lax and NumPy: the exact setting
bit-equal to lax.all_to_all (ragged: to a NumPy reference, XLA:CPU has no ragged-all-to-all);
quantized elements within the bound from the stored scales; what is sent is what is decoded;
the xla and p2p transports give the same bits; empty and uneven sends; non-finite tokens
poison only their group; plans; errors; VJPs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import alltoall, codec

from tests.support.meshes import make_mesh

N = 4


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((N,), ("ep",), jax.sharding.AxisType.Explicit)


def _run(mesh, f, *xs, out=P("ep")):
    xs = [jax.device_put(x, NamedSharding(mesh, P("ep"))) for x in xs]
    return jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * len(xs),
                                 out_specs=out))(*xs)


def _x(shape, seed=0, dtype=jnp.float32):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32).astype(dtype)


A2A_CASES = [(0, 1, True), (1, 0, True), (2, 0, True), (0, 2, True), (0, 0, False),
             (1, 2, False), (2, 1, False)]


@pytest.mark.parametrize("split,concat,tiled", A2A_CASES)
def test_exact_is_lax_and_quantized_within_bound(mesh, split, concat, tiled):
    shape = [N * 3, 8, 200]                # 200: rows padded to whole groups of 128
    if not tiled:
        shape[split] = N
    x = _x((N * shape[0], *shape[1:]))

    def body(xl):
        ref = lax.all_to_all(xl, "ep", split, concat, tiled=tiled)
        exact = fc.all_to_all(xl, "ep", split, concat, tiled=tiled, bits=None)
        y, bound = alltoall.all_to_all_with_bound(xl, "ep", split, concat, tiled=tiled, bits=8,
                                                  min_bytes=0)
        y2 = fc.all_to_all(xl, "ep", split, concat, tiled=tiled, bits=8, min_bytes=0)
        return (jnp.all(exact == ref)[None], jnp.all(jnp.abs(y - ref) <= bound)[None],
                jnp.all(y == y2)[None], jnp.all(bound > 0)[None])

    for flag in _run(mesh, body, x):
        assert bool(jnp.all(flag))


@pytest.mark.parametrize("opts", [dict(bits=8), dict(bits=4), dict(format="fp8"),
                                  dict(bits=8, rotation=0, spikes=2)])
def test_transports_agree_and_decode_what_was_sent(mesh, opts):
    """xla and p2p give the same bits, equal to decoding this rank's own quantization of each
    row that it sent (one quantization end to end)."""
    x = _x((N * N * 2, 5, 256), seed=1, dtype=jnp.bfloat16)
    cfg = fc.CommConfig(min_bytes=0, **opts)

    def body(xl):
        a = fc.all_to_all(xl, "ep", 0, 0, tiled=True, config=cfg, transport="xla")
        b = fc.all_to_all(xl, "ep", 0, 0, tiled=True, config=cfg, transport="p2p")
        p = fc.plan("all_to_all", ("ep",), xl.shape, xl.dtype, N, cfg)
        local = codec.dequantize(codec.quantize(
            xl, bits=p.ag_bits, group_size=p.group_size, rotation=p.rotation,
            spikes=p.ag_spikes, format=p.ag_format))
        sent_back = lax.all_to_all(local, "ep", 0, 0, tiled=True)  # exact move of the decoded
        return jnp.all(a == b)[None], jnp.all(a == sent_back)[None]

    same, decoded = _run(mesh, body, x)
    assert bool(jnp.all(same)) and bool(jnp.all(decoded))


def test_pytree_vmap_and_plan(mesh):
    x = {"a": _x((N * N, 256)), "b": [_x((N * N, 3, 128), seed=2)]}
    with fc.record() as plans:
        y = _run(mesh, lambda t: fc.all_to_all(t, "ep", 0, 0, tiled=True, bits=8, min_bytes=0),
                 x)
    ref = _run(mesh, lambda t: jax.tree.map(lambda v: lax.all_to_all(v, "ep", 0, 0, tiled=True),
                                            t), x)
    assert jax.tree.structure(y) == jax.tree.structure(ref)
    assert all(float(jnp.max(jnp.abs(a - b))) < 0.05 for a, b in
               zip(jax.tree.leaves(y), jax.tree.leaves(ref)))
    assert [p.op for p in plans] == ["all_to_all"] * 2 and all(p.quantized for p in plans)
    assert all(p.transport == "p2p" for p in plans)  # CPU, one process: the exchange

    xv = _x((N * 3, N, 256), seed=3)
    batched = _run(mesh, lambda v: jax.vmap(
        lambda r: fc.all_to_all(r, "ep", 0, 0, tiled=False, bits=8, min_bytes=0,
                                transport="xla"))(v), xv)
    lax_b = _run(mesh, lambda v: jax.vmap(lambda r: lax.all_to_all(r, "ep", 0, 0))(v), xv)
    assert float(jnp.max(jnp.abs(batched - lax_b))) < 0.05


def test_non_finite_rows_poison_only_their_group(mesh):
    x = np.array(_x((N * N, 512), seed=4))
    x[1, 5] = np.nan         # rank 0's row 1: group 0 of the row sent to rank 1
    x[N + 2, 300] = np.inf   # rank 1's row 2: group 2 of the row sent to rank 2
    y = np.asarray(_run(mesh, lambda v: fc.all_to_all(v, "ep", 0, 0, tiled=True, bits=8,
                                                       min_bytes=0, rotation=0), x))
    ref = np.asarray(_run(mesh, lambda v: lax.all_to_all(v, "ep", 0, 0, tiled=True), x))
    bad = ~np.isfinite(y)
    want = np.zeros_like(bad)
    want[1 * N + 0, 0:128] = True          # rank 1 got rank 0's row at its slot 0
    want[2 * N + 1, 256:384] = True        # rank 2 got rank 1's row at slot 1
    assert np.array_equal(bad, want)
    assert np.max(np.abs(y[~bad] - ref[~bad])) < 0.05


def test_gradients(mesh):
    x = _x((N * N * 2, 256), seed=5)
    w = _x((N * N * 2, 256), seed=6)

    def loss(fn):
        return lambda xl, wl: jnp.sum(fn(xl) * wl)

    def grads(fn):
        return _run(mesh, lambda xl, wl: jax.grad(loss(fn))(xl, wl), x, w)

    ref = grads(lambda v: lax.all_to_all(v, "ep", 0, 1 - 1, tiled=True))
    exact_ct = grads(lambda v: fc.all_to_all(v, "ep", 0, 0, tiled=True, bits=8, min_bytes=0))
    q_ct = grads(lambda v: fc.all_to_all(v, "ep", 0, 0, tiled=True, bits=8, min_bytes=0,
                                         grad="quantized"))
    assert bool(jnp.all(exact_ct == ref))          # the cotangent all-to-all is lax's
    assert 0 < float(jnp.max(jnp.abs(q_ct - ref))) < 0.05


def test_bad_arguments_raise_at_trace_time(mesh):
    x = _x((N * 6, 256))
    with pytest.raises(ValueError, match="not a multiple of the axis size"):
        _run(mesh, lambda v: fc.all_to_all(v, "ep", 1, 0, tiled=True), _x((N * 2, 6)))
    with pytest.raises(ValueError, match="must have the axis size"):
        _run(mesh, lambda v: fc.all_to_all(v, "ep", 0, 0), x)
    with pytest.raises(ValueError, match="out of range"):
        _run(mesh, lambda v: fc.all_to_all(v, "ep", 0, 3, tiled=True), x)
    with pytest.raises(TypeError):
        _run(mesh, lambda v: fc.all_to_all(v.astype(jnp.int32), "ep", 0, 0, tiled=True, bits=8,
                                           min_bytes=0), _x((N * N, 256)))


# --- ragged ---------------------------------------------------------------------------------------

def _layout(sends):
    """Per rank (input_offsets, send_sizes, output_offsets, recv_sizes) of the send matrix
    ``sends[i, j]`` (rows rank i sends rank j), rows packed in sender order at each receiver."""
    n = sends.shape[0]
    rows = []
    for i in range(n):
        inoff = np.concatenate([[0], np.cumsum(sends[i])[:-1]])
        outoff = np.array([sends[:i, j].sum() for j in range(n)])
        rows.append((inoff, sends[i], outoff, sends[:, i]))
    return [np.stack([r[k] for r in rows]).astype(np.int32) for k in range(4)]


def _ragged_reference(x, out, sends, meta):
    inoff, send, outoff, _ = meta
    ref = out.copy()
    for i in range(sends.shape[0]):
        for j in range(sends.shape[0]):
            n = send[i, j]
            ref[j, outoff[i, j]:outoff[i, j] + n] = x[i, inoff[i, j]:inoff[i, j] + n]
    return ref


SENDS = {
    "uneven": np.array([[1, 2, 0, 3], [0, 0, 0, 0], [4, 1, 1, 1], [2, 0, 5, 0]]),
    "one expert": np.array([[0, 0, 6, 0], [0, 0, 6, 0], [0, 0, 2, 0], [0, 0, 1, 0]]),
    "nothing": np.zeros((4, 4), int),
}


@pytest.mark.parametrize("case", list(SENDS))
def test_ragged_exact_and_quantized(mesh, case):
    sends = SENDS[case]
    rows_in, rows_out, hidden = 8, 16, (3, 100)
    x = np.asarray(_x((N, rows_in, *hidden), seed=7))
    out = np.full((N, rows_out, *hidden), -7.0, np.float32)
    meta = _layout(sends)
    ref = _ragged_reference(x, out, sends, meta)

    def body(xl, ol, a, b, c, d, **kw):
        return fc.ragged_all_to_all(xl[0], ol[0], a[0], b[0], c[0], d[0], "ep", **kw)[None]

    args = [x, out, *meta]
    exact = np.asarray(_run(mesh, lambda *v: body(*v, bits=None), *args))
    q = np.asarray(_run(mesh, lambda *v: body(*v, bits=8, min_bytes=0), *args))
    assert np.array_equal(exact, ref)
    untouched = ref == -7.0
    assert np.array_equal(q[untouched], ref[untouched])   # rows no peer wrote keep output's
    assert np.max(np.abs(q - ref), initial=0.0) < 0.05


def test_ragged_plans_and_gradient(mesh):
    sends = SENDS["uneven"]
    meta = _layout(sends)
    x = np.asarray(_x((N, 8, 128), seed=8))
    out = np.zeros((N, 16, 128), np.float32)
    ct = np.asarray(_x((N, 16, 128), seed=9))

    def grads(**kw):
        def body(xl, ol, a, b, c, d, cl):
            f = lambda xx, oo: jnp.sum(fc.ragged_all_to_all(
                xx, oo, a[0], b[0], c[0], d[0], "ep", **kw) * cl[0])
            gx, go = jax.grad(f, argnums=(0, 1))(xl[0], ol[0])
            return gx[None], go[None]
        return [np.asarray(g) for g in _run(mesh, body, x, out, *meta, ct)]

    with fc.record() as plans:
        gx, go = grads(bits=None)
    assert plans[0].path == "exact" and plans[0].transport == "p2p"
    assert "ragged-all-to-all" in plans[0].reason
    # the operand's cotangent: ct's rows sent back where they came from; output's: unwritten rows
    want_gx = np.zeros_like(x)
    inoff, send, outoff, _ = meta
    for i in range(N):
        for j in range(N):
            n = send[i, j]
            want_gx[i, inoff[i, j]:inoff[i, j] + n] = ct[j, outoff[i, j]:outoff[i, j] + n]
    written = _ragged_reference(np.ones_like(x), np.zeros_like(out), sends, meta) == 1
    assert np.array_equal(gx, want_gx)
    assert np.array_equal(go, np.where(written, 0, ct))
    qgx, qgo = grads(bits=8, min_bytes=0, grad="quantized")
    assert 0 < np.max(np.abs(qgx - want_gx)) < 0.05 and np.array_equal(qgo, go)


def test_ragged_bad_arguments(mesh):
    x = np.zeros((N, 8, 128), np.float32)
    out = np.zeros((N, 16, 128), np.float32)
    meta = _layout(SENDS["uneven"])
    with pytest.raises(ValueError, match="one entry per rank"):
        _run(mesh, lambda xl, ol: fc.ragged_all_to_all(
            xl[0], ol[0], *(jnp.zeros(3, jnp.int32),) * 4, "ep")[None], x, out)
    with pytest.raises(ValueError, match="rows differ"):
        _run(mesh, lambda xl, ol: fc.ragged_all_to_all(
            xl[0], ol[0][:, :64], *(jnp.zeros(N, jnp.int32),) * 4, "ep")[None], x, out)
    with pytest.raises(ValueError, match="XLA:CPU does not implement"):
        _run(mesh, lambda xl, ol: fc.ragged_all_to_all(
            xl[0], ol[0], *(jnp.zeros(N, jnp.int32),) * 4, "ep", transport="xla",
            min_bytes=0)[None], x, out)
    bad = [m.copy() for m in meta]
    bad[1][0, 2] = 40          # rank 0 sends more rows than it has
    bad[3][2, 0] = 40
    with pytest.raises(Exception, match="outside the sender"):
        jax.block_until_ready(_run(mesh, lambda xl, ol, a, b, c, d: fc.ragged_all_to_all(
            xl[0], ol[0], a[0], b[0], c[0], d[0], "ep", bits=None)[None], x, out, *bad))


def test_exact_rows_over_the_exchange(mesh):
    """bits=None with transport="p2p", and an automatic choice of exact on CPU, move the rows
    as they are over the exchange: lax's bits and lax's cotangents; bits=None alone is lax."""
    x = _x((N * N * 2, 3, 64), seed=10)
    ref = _run(mesh, lambda v: lax.all_to_all(v, "ep", 0, 2, tiled=True), x)
    for opts, path in ((dict(bits=None, transport="p2p"), "exact"), (dict(bits=None), "lax"),
                       (dict(), None)):
        with fc.record() as plans:
            y = _run(mesh, lambda v: fc.all_to_all(v, "ep", 0, 2, tiled=True, **opts), x)
        if path is None:   # the automatic choice: exact on this small operand, over p2p
            assert plans[0].path in ("exact", "quantized"), plans[0]
            if plans[0].path == "quantized":
                continue
            path = "exact"
        assert plans[0].path == path, plans[0]
        assert (plans[0].transport == "p2p") == (path == "exact")
        assert bool(jnp.all(y == ref))
    w = _x(ref.shape, seed=11)
    g = _run(mesh, lambda v, wl: jax.grad(lambda a: jnp.sum(fc.all_to_all(
        a, "ep", 0, 2, tiled=True, bits=None, transport="p2p") * wl))(v), x, w)
    g_ref = _run(mesh, lambda v, wl: jax.grad(lambda a: jnp.sum(lax.all_to_all(
        a, "ep", 0, 2, tiled=True) * wl))(v), x, w)
    assert bool(jnp.all(g == g_ref))


def test_ragged_gradient_with_an_invariant_output(mesh):
    """An output buffer that does not vary over the axis (a plain zeros): the cotangents take
    the primals' types."""
    def body(xl):
        one = jnp.ones(N, jnp.int32)
        y = fc.ragged_all_to_all(xl, jnp.zeros((N, 8)), jnp.arange(N, dtype=jnp.int32), one,
                                 lax.axis_index("ep") * one, one, "ep", bits=None)
        return jnp.sum(y)[None]

    x = _x((N * N, 8), seed=12)
    f = jax.shard_map(body, mesh=mesh, in_specs=P("ep"), out_specs=P("ep"))
    g = jax.jit(jax.grad(lambda v: f(v).sum()))(jax.device_put(x, NamedSharding(mesh, P("ep"))))
    assert bool(jnp.all(g == 1.0))


def test_ragged_under_check_vma_false_with_an_empty_output():
    """shard_map(check_vma=False), as MaxText runs its MoE layer, and an output buffer from
    lax.empty (typed on no mesh): the result's type carries no varying axes, gradients pass a
    custom_vjp after it."""
    mesh = make_mesh((N,), ("ep",), jax.sharding.AxisType.Auto)

    @jax.custom_vjp
    def ident(y):
        return y
    ident.defvjp(lambda y: (y, None), lambda _, g: (g,))

    def body(x, io, ss, oo, rs):
        y = fc.ragged_all_to_all(x, lax.empty((N, 8), x.dtype), io, ss, oo, rs, "ep",
                                 bits=None)
        return ident(y)

    ones = jnp.ones(N * N, jnp.int32)
    offs = jnp.tile(jnp.arange(N, dtype=jnp.int32), N)        # row j to rank j
    lands = jnp.repeat(jnp.arange(N, dtype=jnp.int32), N)     # at the sender's rank
    x = jnp.arange(N * N * 8, dtype=jnp.float32).reshape(N * N, 8)
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("ep"),) * 5, out_specs=P("ep"),
                      check_vma=False)
    with jax.set_mesh(mesh):
        y = jax.jit(f)(x, offs, ones, lands, ones)
        g = jax.jit(jax.grad(lambda v: jnp.sum(f(v, offs, ones, lands, ones))))(x)
    # rank r's row j goes to rank j's row r: the global (N, N) blocks transposed
    want = np.asarray(x).reshape(N, N, 8).transpose(1, 0, 2).reshape(N * N, 8)
    assert np.array_equal(np.asarray(y), want)
    assert bool(jnp.all(g == 1.0))


def test_pallas_transport_is_refused_for_the_all_to_alls(mesh):
    with pytest.raises(ValueError, match="an all-to-all moves over 'xla' or 'p2p'"):
        _run(mesh, lambda v: fc.all_to_all(v, "ep", 0, 0, tiled=True, bits=8, min_bytes=0,
                                           transport="pallas"), _x((N * N, 128)))


def test_ragged_quantized_rows_are_the_senders_codes_and_nan_stays_in_its_group(mesh):
    """Each received row is its sender's own quantization decoded (so within the stored
    bound), bit for bit; a NaN poisons only its group of its row."""
    sends = SENDS["uneven"]
    meta = _layout(sends)
    x = np.array(_x((N, 8, 300), seed=13))
    x[2, 3, 140] = np.nan                      # rank 2's row 3: group 1 (values 128..255)
    out = np.zeros((N, 16, 300), np.float32)
    cfg = fc.CommConfig(8, min_bytes=0)
    p = fc.plan("ragged_all_to_all", (), (8, 384), np.float32, N, cfg)

    def decoded(rows):
        padded = jnp.pad(jnp.asarray(rows), ((0, 0), (0, 84)))
        q = codec.quantize(padded, bits=8, group_size=128, rotation=p.rotation,
                           spikes=p.ag_spikes)
        return np.asarray(codec.dequantize(q))[:, :300], np.asarray(codec.error_bound(q))[:, :300]

    dec = np.stack([decoded(x[i])[0] for i in range(N)])
    bound = np.stack([decoded(np.nan_to_num(x[i]))[1] for i in range(N)])
    want = _ragged_reference(dec, out, sends, meta)
    got = np.asarray(_run(mesh, lambda xl, ol, a, b, c, d: fc.ragged_all_to_all(
        xl[0], ol[0], a[0], b[0], c[0], d[0], "ep", config=cfg)[None], x, out, *meta))
    assert np.array_equal(got, want, equal_nan=True)
    exact = _ragged_reference(np.nan_to_num(x), out, sends, meta)
    room = _ragged_reference(bound, np.zeros_like(out), sends, meta)
    finite = np.isfinite(got)
    assert np.all(np.abs(got[finite] - exact[finite]) <= room[finite])
    # rank 2's rows 0-3 go to rank 0 (send_sizes[2] = [4, 1, 1, 1]): one row there, one group
    bad = np.argwhere(~finite)
    assert {tuple(b) for b in bad[:, :2]} == {(0, 1 + 3)}  # after rank 0's 1 row to itself
    assert set(bad[:, 2]) == set(range(128, 256))


def test_ragged_under_vmap(mesh):
    """vmap over a batch of ragged exchanges: exact == NumPy; quantized == the unbatched call
    per element, bit for bit."""
    def body(x):
        one = jnp.ones(N, jnp.int32)
        offs = jnp.arange(N, dtype=jnp.int32)
        lands = lax.axis_index("ep") * one

        def f(r, **kw):
            return fc.ragged_all_to_all(r, jnp.zeros((N, 8)), offs, one, lands, one, "ep", **kw)
        q = dict(bits=8, min_bytes=0)
        return (jax.vmap(lambda r: f(r, bits=None))(x), jax.vmap(lambda r: f(r, **q))(x),
                jnp.stack([f(x[i], **q) for i in range(x.shape[0])]))

    x = jnp.arange(N * 3 * N * 8, dtype=jnp.float32).reshape(N * 3, N, 8)
    exact, quant, looped = (np.asarray(a) for a in _run(mesh, body, x,
                                                        out=(P("ep"),) * 3))
    want = np.asarray(x).reshape(N, 3, N, 8).transpose(2, 1, 0, 3).reshape(exact.shape)
    assert np.array_equal(exact, want)
    assert np.array_equal(quant, looped)
