"""jax_flashcomm.nn.moe on 4 CPU ranks of an expert axis: the exact block equals the dense
reference (both dispatch modes, top-1 and top-2, with and without shared experts); tokens past
the capacity are dropped in the stated order; all tokens to one expert and ranks that receive
nothing; gradients match the reference's; a quantized combine within the codec's bound; int8
dispatch closer than int4; the NNX module and the tiny decoder."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec, nn
from jax_flashcomm.nn import moe

from tests.support.meshes import make_mesh

N, T, D, F, E = 4, 16, 128, 64, 8      # ranks, tokens per rank, width, expert width, experts
NO_DROP = float(E)                     # capacity_factor = n_experts: capacity = tokens * top_k


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((N,), ("ep",), jax.sharding.AxisType.Explicit)


def _weights(seed=0, shared=0):
    m = nn.EPMoE(D, F, E, ep=N, shared_ffn_dim=shared, rngs=nnx.Rngs(seed))
    return m.weights()


def _x(seed=1):
    return jax.random.normal(jax.random.key(seed), (N * T, D), jnp.float32)


def _specs(weights):
    return {k: P("ep") if k in ("gate_up", "down") else P() for k in weights}


def _block(mesh, weights, **kw):
    """``x -> moe_block`` over the mesh (global arrays in and out, tokens sharded)."""
    f = jax.shard_map(lambda w, x: moe.moe_block(w, x, "ep", **kw), mesh=mesh,
                      in_specs=(_specs(weights), P("ep")), out_specs=P("ep"))
    placed = {k: jax.device_put(v, NamedSharding(mesh, s))
              for (k, v), s in zip(weights.items(), _specs(weights).values())}
    return lambda x: f(placed, jax.device_put(x, NamedSharding(mesh, P("ep"))))


@pytest.mark.parametrize("mode", moe.DISPATCH_MODES)
@pytest.mark.parametrize("top_k,shared", [(1, 0), (2, 0), (2, 32)])
def test_exact_equals_dense_reference(mesh, mode, top_k, shared):
    w, x = _weights(shared=shared), _x()
    y = jax.jit(_block(mesh, w, top_k=top_k, mode=mode, capacity_factor=NO_DROP))(x)
    ref = moe.moe_reference(w, x, top_k=top_k)
    np.testing.assert_allclose(y, ref, atol=2e-5, rtol=2e-5)


def _dropping_reference(w, x, top_k, capacity):
    """The capacity rule in NumPy: per source rank, first choices then second choices, tokens in
    order, the first ``capacity`` assignments of each expert kept."""
    outs = np.asarray(jax.vmap(moe.swiglu, in_axes=(None, 0, 0))(x, w["gate_up"], w["down"]))
    gates, experts = (np.asarray(a) for a in moe.route(w["router"], x, top_k))
    y, dropped = np.zeros(x.shape, np.float32), 0
    for r in range(N):
        used = np.zeros(E, int)
        for c in range(top_k):
            for t in range(r * T, (r + 1) * T):
                e = experts[t, c]
                if used[e] < capacity:
                    y[t] += gates[t, c] * outs[e, t]
                else:
                    dropped += 1
                used[e] += 1
    return y, dropped


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_assignments_past_it(mesh, top_k):
    w, x = _weights(seed=2), _x(seed=3)
    capacity = 2
    y = jax.jit(_block(mesh, w, top_k=top_k, mode="capacity", capacity=capacity))(x)
    ref, dropped = _dropping_reference(w, x, top_k, capacity)
    assert dropped > 0
    np.testing.assert_allclose(y, ref, atol=2e-5, rtol=2e-5)


def _skewed(w, x, favour=None, avoid=None):
    """Router and tokens that send every token to expert ``favour`` (top-1), or never to the
    experts ``avoid``: feature 0 of every token is 4, and router row 0 decides."""
    x = x.at[:, 0].set(4.0)
    row = jnp.zeros(E)
    if favour is not None:
        row = row.at[favour].set(25.0)
    if avoid is not None:
        row = row.at[jnp.asarray(avoid)].set(-25.0)
    return {**w, "router": w["router"].at[0].set(row)}, x


@pytest.mark.parametrize("mode", moe.DISPATCH_MODES)
def test_all_tokens_to_one_expert_and_empty_ranks(mesh, mode):
    w, x = _weights(seed=4), _x(seed=5)
    hot, x_hot = _skewed(w, x, favour=5)           # everything to rank 2; ranks 0, 1, 3 idle
    assert np.all(np.asarray(moe.route(hot["router"], x_hot, 1)[1]) == 5)
    cold, x_cold = _skewed(w, x, avoid=[4, 5, 6, 7])  # ranks 2 and 3 receive nothing
    assert np.all(np.asarray(moe.route(cold["router"], x_cold, 2)[1]) < 4)
    for wt, xt, k in ((hot, x_hot, 1), (cold, x_cold, 2)):
        y = jax.jit(_block(mesh, wt, top_k=k, mode=mode, capacity_factor=NO_DROP))(xt)
        np.testing.assert_allclose(y, moe.moe_reference(wt, xt, top_k=k), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("mode", moe.DISPATCH_MODES)
def test_gradients_match_the_reference(mesh, mode):
    w, x = _weights(seed=6, shared=32), _x(seed=7)
    ct = jax.random.normal(jax.random.key(8), x.shape)
    block = _block(mesh, w, top_k=2, mode=mode, capacity_factor=NO_DROP)
    g = jax.jit(jax.grad(lambda x: jnp.sum(block(x) * ct)))(x)
    g_ref = jax.grad(lambda x: jnp.sum(moe.moe_reference(w, x, top_k=2) * ct))(x)
    assert np.all(np.isfinite(g))
    np.testing.assert_allclose(g, g_ref, atol=5e-5, rtol=5e-5)
    q = _block(mesh, w, top_k=2, mode=mode, capacity_factor=NO_DROP,
               dispatch_config=fc.CommConfig(bits=8, min_bytes=0))
    gq = jax.jit(jax.grad(lambda x: jnp.sum(q(x) * ct)))(x)
    assert np.all(np.isfinite(gq)) and 0 < np.abs(gq - g).max() < 0.05 * np.abs(g).max()


@pytest.mark.parametrize("mode", moe.DISPATCH_MODES)
def test_int8_combine_within_the_codec_bound(mesh, mode):
    """Exact dispatch, int8 combine (no rotation, no spikes): each token's output is the gate
    sum of its experts' rows, each decoded within ``codec.error_bound`` of its quantization,
    so the error is at most the gate-weighted sum of those bounds (the gates sum to one)."""
    w, x = _weights(seed=9), _x(seed=10)
    cfg = fc.CommConfig(bits=8, min_bytes=0, rotation=0, spikes=0)
    y = jax.jit(_block(mesh, w, top_k=2, mode=mode, capacity_factor=NO_DROP,
                       combine_config=cfg))(x)
    ref = moe.moe_reference(w, x, top_k=2)
    outs = jax.vmap(moe.swiglu, in_axes=(None, 0, 0))(x, w["gate_up"], w["down"])  # (E, t, D)
    bounds = codec.error_bound(codec.quantize(outs, bits=8, group_size=128)).reshape(outs.shape)
    gates, experts = moe.route(w["router"], x, 2)
    tokens = jnp.arange(x.shape[0])[:, None]
    bound = jnp.sum(gates[..., None] * bounds[experts, tokens], axis=1)
    err = jnp.abs(y - ref)
    assert float(err.max()) > 0
    assert bool(jnp.all(err <= bound + 1e-5 * (1 + jnp.abs(ref))))


def _rel(y, ref):
    return float(jnp.sqrt(jnp.mean((y - ref) ** 2) / jnp.mean(ref ** 2)))


@pytest.mark.parametrize("mode", moe.DISPATCH_MODES)
def test_int8_dispatch_closer_than_int4(mesh, mode):
    w, x = _weights(seed=11), _x(seed=12)
    ref = moe.moe_reference(w, x, top_k=2)
    errs = {}
    for name, cfg in (("int8", dict(bits=8)), ("int4", dict(bits=4)),
                      ("fp8", dict(format="fp8"))):
        y = jax.jit(_block(mesh, w, top_k=2, mode=mode, capacity_factor=NO_DROP,
                           dispatch_config=fc.CommConfig(min_bytes=0, **cfg)))(x)
        errs[name] = _rel(y, ref)
    assert 0 < errs["int8"] < 1e-2 and errs["fp8"] < 5e-2, errs
    assert errs["int8"] * 4 < errs["int4"], errs


def test_module_under_shard_call(mesh):
    m = nn.place(nn.EPMoE(D, F, E, ep=N, top_k=2, mode="ragged", shared_ffn_dim=32,
                          rngs=nnx.Rngs(13)), mesh)
    x = _x(seed=14).reshape(N, T // 2, 2, D)[..., 0, :].reshape(N * T // 2, D)
    y = nn.shard_call(m, mesh, (P("ep"),), P("ep"))(x)
    np.testing.assert_allclose(y, moe.moe_reference(m.weights(), x, top_k=2), atol=2e-5,
                               rtol=2e-5)
    specs = nn.param_specs(nnx.state(m))
    assert specs["gate_up"].get_value() == P("ep", None, None)
    assert specs["router"].get_value() == P(None, None)


def test_decoder_exact_matches_dense(mesh):
    params = moe.moe_decoder_init(jax.random.key(15), vocab=64, d_model=64, n_layers=2,
                                  n_experts=E, ffn_dim=32)
    heads = params.pop("n_heads")
    ids = jax.random.randint(jax.random.key(16), (N * 2, 8), 0, 64)
    specs = moe.moe_decoder_specs(params)
    f = jax.jit(jax.shard_map(
        lambda p, i: moe.moe_decoder_logits(p, i, "ep", n_heads=heads, mode="ragged"),
        mesh=mesh, in_specs=(specs, P("ep")), out_specs=P("ep")))
    placed = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params, specs)
    logits = f(placed, jax.device_put(ids, NamedSharding(mesh, P("ep"))))
    dense = moe.moe_decoder_logits(params, ids, n_heads=heads)
    np.testing.assert_allclose(logits, dense, atol=1e-4, rtol=1e-4)


def test_errors():
    with pytest.raises(ValueError, match="not a multiple of ep"):
        nn.EPMoE(D, F, 6, ep=4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="mode must be one of"):
        nn.EPMoE(D, F, E, ep=4, mode="dense", rngs=nnx.Rngs(0))
    assert moe.expert_capacity(16, 2, 8, 1.25) == 5
