"""The exact all-reduce over the p2p transport (``bits=None, transport="p2p"``, and the
automatic choice's ``exact/p2p``): in one process over the in-process rendezvous, between
processes over shared memory (tests/transport/test_shm.py runs those). Every rank gets the same
bits; f32, bf16, integers and complex values are lax.psum's bits; f16 sums in f32 and rounds
once (lax.psum sums in f16), so it is within half an f16 ulp of the f64 sum per added value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.planner import _plan as planner
from jax_flashcomm.transport import p2p

from tests.support.meshes import make_mesh

EXACT = fc.CommConfig(bits=None, transport="p2p")


def _mesh(n):
    return make_mesh((n,), ("i",), jax.sharding.AxisType.Explicit)


def _sharded(mesh, values):
    return jax.device_put(values, NamedSharding(mesh, P("i")))


def _run(mesh, body, x):
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P()))(x)


def _shards_bits(y):
    shards = [np.asarray(s.data) for s in y.addressable_shards]
    return [s.view(np.uint8).tobytes() for s in shards]


@pytest.mark.parametrize("n", [3, 8])
@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.int32, np.int8, np.uint16,
                                   np.complex64])
@pytest.mark.parametrize("two_shot", [False, True, None])
@pytest.mark.parametrize("per_rank", [1, 1000, 70_000])
def test_ranks_identical_and_lax_bits(n, dtype, two_shot, per_rank):
    mesh = _mesh(n)
    rng = np.random.default_rng(per_rank)
    host = rng.standard_normal(n * per_rank) * 50
    if np.issubdtype(np.dtype(dtype), np.complexfloating):
        host = host + 1j * rng.standard_normal(n * per_rank)
    x = _sharded(mesh, jnp.asarray(host.astype(dtype)))
    y = _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 60_000, two_shot), x)
    ref = _run(mesh, lambda v: lax.psum(v, "i"), x)
    bits = _shards_bits(y)
    assert all(b == bits[0] for b in bits), "ranks differ"
    assert bits[0] == _shards_bits(ref)[0], "not lax.psum's bits"


@pytest.mark.parametrize("dtype", [np.float32, np.int32])
def test_sums_of_many_pieces_with_a_tail_keep_the_bits(dtype):
    # 8 ranks of 2**19 + 5 values: many 16 KiB pieces (cpu_exact_sum.h kPieceBytes) summed in
    # place by several threads, and a tail of scalar elements
    n, per_rank = 8, 2 ** 19 + 5
    mesh = _mesh(n)
    host = (np.random.default_rng(7).standard_normal(n * per_rank) * 1e3).astype(dtype)
    x = _sharded(mesh, jnp.asarray(host))
    y = _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 60_000, True), x)
    bits = _shards_bits(y)
    assert all(b == bits[0] for b in bits), "ranks differ"
    assert bits[0] == _shards_bits(_run(mesh, lambda v: lax.psum(v, "i"), x))[0]


@pytest.mark.parametrize("per_rank", [1000, 70_000])
def test_in_place_sum_leaves_an_operand_still_in_use_intact(per_rank):
    # the in-process two-shot sum writes over its operand: an operand the program reads again
    # (here: returned, and summed a second time) must be copied for it first
    n = 8
    mesh = _mesh(n)
    host = np.random.default_rng(3).standard_normal(n * per_rank).astype(np.float32)
    x = _sharded(mesh, jnp.asarray(host))

    def body(v):
        w = v * 2.0
        first = p2p.exact_all_reduce(w, ("i",), 60_000, True)
        second = p2p.exact_all_reduce(w, ("i",), 60_000, True)
        return first, second, w

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P(), P(), P("i"))))
    first, second, w = f(x)
    np.testing.assert_array_equal(np.asarray(w), host * 2.0)
    want = _run(mesh, lambda v: lax.psum(v * 2.0, "i"), x)
    np.testing.assert_array_equal(np.asarray(first), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(second), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(x), host)  # the program's argument, too


def test_in_place_sum_aliases_its_operand_in_the_program():
    mesh = _mesh(8)
    x = _sharded(mesh, jnp.zeros(8 * 1000, jnp.float32))
    text = jax.jit(jax.shard_map(lambda v: p2p.exact_all_reduce(v * 2.0, ("i",), 60_000, True),
                                 mesh=mesh, in_specs=P("i"), out_specs=P())).lower(x).as_text()
    assert "output_operand_aliases" in text or "output_operand_alias" in text
    one = jax.jit(jax.shard_map(lambda v: p2p.exact_all_reduce(v * 2.0, ("i",), 60_000, False),
                                mesh=mesh, in_specs=P("i"), out_specs=P())).lower(x).as_text()
    assert "output_operand_alias" not in one  # one shot: every rank reads every x to the end


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16])
@pytest.mark.parametrize("two_shot", [False, True])
def test_negative_zeros_sum_to_negative_zero(dtype, two_shot):
    # x_0 + x_1 + x_2 in rank order, as IEEE adds signed zeros (lax.psum on XLA:CPU starts from
    # +0 and gives +0: docs/transport.md, "Bits"); a +0 on any rank makes the sum +0
    mesh = _mesh(3)
    host = np.full((3, 8), -0.0, np.float32)
    host[1, 4:] = 0.0
    y = _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 60_000, two_shot),
             _sharded(mesh, jnp.asarray(host.reshape(-1), dtype)))
    signs = np.signbit(np.asarray(y, np.float32))
    np.testing.assert_array_equal(signs, [True] * 4 + [False] * 4)


@pytest.mark.parametrize("two_shot", [False, True])
def test_f16_sums_in_f32_and_rounds_once(two_shot):
    mesh = _mesh(8)
    host = (np.random.default_rng(0).standard_normal(8 * 5000) * 30).astype(np.float16)
    y = _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 60_000, two_shot),
             _sharded(mesh, jnp.asarray(host)))
    bits = _shards_bits(y)
    assert all(b == bits[0] for b in bits)
    want = host.astype(np.float32).reshape(8, -1).sum(0)  # the f32 sum in rank order, exact here
    np.testing.assert_array_equal(np.asarray(y), want.astype(np.float16))


def _bf16_rne(f32):
    """f32 -> bf16 bits, round to nearest even, NaN kept quiet (XLA's convert)."""
    u = f32.view(np.uint32).astype(np.uint64)
    nearest = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where((u & 0x7FFFFFFF) > 0x7F800000, quiet, nearest)


@pytest.mark.parametrize("two_shot", [False, True])
@pytest.mark.parametrize("n", [3, 8])
def test_bf16_rounds_ties_and_keeps_nan_and_inf(n, two_shot):
    # the vector lanes and the scalar tail (per rank 16 * 1000 + 7 values), ties to even,
    # overflow to inf, inf - inf and NaN inputs
    per_rank = 16 * 1000 + 7
    rng = np.random.default_rng(n)
    host = (rng.standard_normal((n, per_rank)) * 30).astype(np.float32)
    host[:, :64] = np.float32(1.0)
    host[0, :64] = np.float32(1.0) + np.float32(2.0 ** -7) * np.arange(64) / 64
    host[:, 64] = np.float32(3.0e38)                   # sums past bf16's range: inf
    host[0, 65], host[1, 65] = np.inf, -np.inf         # inf - inf: NaN
    host[1, 66] = np.nan
    host[:, per_rank - 1] = np.float32(-3.0e38)        # -inf, in the tail
    x = jnp.asarray(host.reshape(-1)).astype(jnp.bfloat16)
    mesh = _mesh(n)
    y = _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 60_000, two_shot),
             _sharded(mesh, x))
    bits = _shards_bits(y)
    assert all(b == bits[0] for b in bits), "ranks differ"
    rows = np.asarray(x).astype(np.float32).reshape(n, -1)
    acc = rows[0].copy()
    with np.errstate(invalid="ignore", over="ignore"):
        for j in range(1, n):
            acc = acc + rows[j]                        # f32, in rank order
    got = np.frombuffer(bits[0], np.uint16)
    np.testing.assert_array_equal(got, _bf16_rne(acc))
    assert got[64] == 0x7F80 and got[per_rank - 1] == 0xFF80
    assert np.isnan(np.asarray(y)[65]) and np.isnan(np.asarray(y)[66])


def test_run_to_run_identical_and_pytrees():
    mesh = _mesh(3)
    x = _sharded(mesh, jnp.asarray(np.random.default_rng(1).standard_normal((3 * 64, 40)),
                                   jnp.float32))
    f = lambda v: fc.psum({"a": v, "b": (v.astype(jnp.bfloat16), v[:, :3].astype(jnp.int32))},  # noqa: E731
                          "i", config=EXACT)
    with fc.record() as plans:
        first = _run(mesh, f, x)
    assert [(p.path, p.transport) for p in plans] == [("exact", "p2p")] * 3
    again = _run(mesh, f, x)
    ref = _run(mesh, lambda v: lax.psum({"a": v, "b": (v.astype(jnp.bfloat16),
                                                       v[:, :3].astype(jnp.int32))}, "i"), x)
    for a, b, c in zip(jax.tree.leaves(first), jax.tree.leaves(again), jax.tree.leaves(ref)):
        assert _shards_bits(a) == _shards_bits(b)
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_gradient_is_lax_psums():
    mesh = _mesh(3)
    x = _sharded(mesh, jnp.arange(3 * 12, dtype=jnp.float32))

    def loss(body):
        return lambda v: jax.shard_map(lambda u: (body(u) ** 2).sum(), mesh=mesh,
                                       in_specs=P("i"), out_specs=P())(v)
    g = jax.jit(jax.grad(loss(lambda u: fc.psum(u, "i", config=EXACT))))(x)
    ref = jax.jit(jax.grad(loss(lambda u: lax.psum(u, "i"))))(x)
    np.testing.assert_array_equal(np.asarray(g), np.asarray(ref))


def test_fused_norm_uses_the_exact_p2p_sum_where_planned():
    mesh = _mesh(3)
    x = _sharded(mesh, jnp.asarray(np.random.default_rng(2).standard_normal((3 * 4, 64)),
                                   jnp.float32))
    r = jnp.ones((4, 64), jnp.float32)
    w = jnp.full((64,), 0.5, jnp.float32)

    def body(config):
        return lambda v: fc.psum_add_rms_norm(v, r, w, "i", config=config)
    with fc.record() as plans:
        out, h = _run(mesh, body(EXACT), x)
    assert [(p.path, p.transport) for p in plans] == [("exact", "p2p")]
    out_lax, h_lax = _run(mesh, body(fc.CommConfig(bits=None)), x)
    np.testing.assert_array_equal(np.asarray(h), np.asarray(h_lax))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_lax))


@pytest.mark.parametrize("across", [False, True])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.int8, jnp.uint8, jnp.int16, jnp.float64])
def test_every_summed_dtype_plans_the_exact_p2p_sum(monkeypatch, across, dtype):
    monkeypatch.setattr(planner.p2p_transport, "across_processes", lambda: across)
    monkeypatch.setattr(planner.p2p_transport, "unsupported_reason", lambda axes: None)
    p = planner.plan("psum", ("i",), (8, 16), np.dtype(dtype), 2, EXACT, record=False)
    assert (p.path, p.transport) == ("exact", "p2p")


def test_a_dtype_it_does_not_sum_takes_lax_with_a_reason(monkeypatch):
    monkeypatch.setattr(planner.p2p_transport, "unsupported_reason", lambda axes: None)
    p = planner.plan("psum", ("i",), (8, 16), np.dtype(np.bool_), 2, EXACT, record=False)
    assert p.path == "lax" and p.transport is None
    assert "lax.psum" in p.reason and "bool" in p.reason


def test_direct_call_of_a_dtype_it_does_not_sum_is_a_type_error():
    mesh = _mesh(3)
    x = _sharded(mesh, jnp.zeros((3 * 4,), jnp.bool_))
    with pytest.raises(TypeError, match="no exact p2p sum of bool"):
        _run(mesh, lambda v: p2p.exact_all_reduce(v, ("i",), 1000), x)


def test_the_automatic_choice_weighs_exact_p2p_in_one_process():
    mesh = _mesh(3)
    x = _sharded(mesh, jnp.ones((3 * 4, 144), jnp.float32))  # a decode step's 2304 B
    with fc.record() as plans:
        _run(mesh, lambda v: fc.psum(v, "i"), x)
    (p,) = plans
    assert "exact/p2p" in p.reason
    assert p.path in ("exact", "lax") and not p.quantized
    with fc.record() as plans:
        _run(mesh, lambda v: fc.psum(v, "i", transport="xla"), x)
    assert plans[0].path != "exact", "transport='xla' leaves no exact p2p candidate"
