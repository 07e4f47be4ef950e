"""RewritePolicy(fuse_norm=True): ``psum -> add -> RMSNorm`` chains become psum_add_rms_norm.

Exact config: the rewritten program gives the same bits as the original (the op's exact path
is the same lax ops); int8: the same bits as the chain written by hand with
``fc.psum_add_rms_norm``; f32 and bf16 activations, f32 and bf16 weights, 2-D and 3-D;
gradients; the chains that do not match stay unfused with the reason in the report; the
project's Llama.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import RewritePolicy, rewrite

CFG = fc.CommConfig(bits=8, min_bytes=0)
EXACT = fc.CommConfig(bits=None)
N, EPS = 4, 1e-5


def _mesh():
    return jax.make_mesh((N,), ("tp",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:N])


def rms(x, scale, eps=EPS):
    """nn.RMSNorm's expression."""
    x32 = x.astype(jnp.float32)
    normed = x32 * lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def block(x, w, r, s):
    h = r + lax.psum(x @ w, "tp")
    return rms(h, s), h * 2.0


def block_by_hand(config):
    def body(x, w, r, s):
        out, h = fc.psum_add_rms_norm(x @ w, r, s, "tp", eps=EPS, config=config)
        return out, h * 2.0
    return body


def _args(mesh, lead, dtype, weight_dtype):
    rng = np.random.RandomState(0)
    put = lambda a, spec, dt=dtype: jax.device_put(  # noqa: E731
        jnp.asarray(a, dt), NamedSharding(mesh, spec))
    x = put(rng.randn(*lead, 256), P(*(None,) * len(lead), "tp"))
    w = put(rng.randn(256, 128) / 16, P("tp", None))
    r = put(rng.randn(*lead, 128), P())
    s = put(1 + 0.1 * rng.randn(128), P(), weight_dtype)
    return x, w, r, s


def _specs(lead):
    return dict(in_specs=(P(*(None,) * len(lead), "tp"), P("tp", None), P(), P()),
                out_specs=(P(), P()))


CASES = [((8,), jnp.float32, jnp.float32), ((2, 8), jnp.float32, jnp.bfloat16),
         ((2, 8), jnp.bfloat16, jnp.float32), ((8,), jnp.bfloat16, jnp.bfloat16)]


@pytest.mark.parametrize("lead,dtype,weight_dtype", CASES,
                         ids=["2d-f32", "3d-f32-bf16w", "3d-bf16", "2d-bf16-bf16w"])
def test_chain_fused(lead, dtype, weight_dtype):
    mesh = _mesh()
    args = _args(mesh, lead, dtype, weight_dtype)
    plain = jax.shard_map(block, mesh=mesh, **_specs(lead))
    for config in (EXACT, CFG):
        policy = RewritePolicy(config=config, fuse_norm=True)
        report = rewrite(plain, policy).report(*args)
        assert [(r.op, r.action) for r in report] == [("psum", "fused")]
        assert report[0].detail.startswith("psum_add_rms_norm")
        got = jax.jit(rewrite(plain, policy))(*args)
        want = (jax.jit(plain)(*args) if config is EXACT else
                jax.jit(jax.shard_map(block_by_hand(config), mesh=mesh, **_specs(lead)))(*args))
        for g, w in zip(got, want):
            assert jax.typeof(g) == jax.typeof(w)
            np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))
    unfused = jax.jit(rewrite(plain, CFG))(*args)                 # fuse_norm=False: plain psum
    assert rewrite(plain, CFG).report(*args)[0].action == "quantized"
    assert np.abs(np.asarray(unfused[0], np.float32) - np.asarray(got[0], np.float32)).max() < 0.1


def test_gradients_equal_the_direct_op():
    mesh = _mesh()
    args = _args(mesh, (8,), jnp.float32, jnp.float32)
    plain = jax.shard_map(block, mesh=mesh, **_specs((8,)))
    hand = jax.shard_map(block_by_hand(CFG), mesh=mesh, **_specs((8,)))

    def grads(f):
        return jax.jit(jax.grad(lambda *a: sum(jnp.sum(o ** 2) for o in f(*a)),
                                argnums=(0, 1, 2, 3)))(*args)

    for g, w in zip(grads(rewrite(plain, RewritePolicy(config=CFG, fuse_norm=True))),
                    grads(hand)):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def _other_chains(x, w, r, s):
    a = lax.psum(x @ w, "tp") * 2.0                           # not an add
    h = r + lax.psum(x @ w, "tp")
    b = jnp.tanh(h)                                           # an add, no norm
    h2 = r + lax.psum(x @ w, "tp")
    early = h2 * 3.0                                          # used before the norm ends
    c = rms(h2, s)
    h3 = r + lax.psum(x @ w, "tp")
    d = h3 * lax.rsqrt(jnp.mean(h3 * h3, axis=-1, keepdims=True) + EPS) * 0.5   # no weight
    return a + b + c + d + early


def test_unmatched_chains_are_reported_and_unchanged():
    mesh = _mesh()
    args = _args(mesh, (8,), jnp.float32, jnp.float32)
    plain = jax.shard_map(_other_chains, mesh=mesh, in_specs=_specs((8,))["in_specs"],
                          out_specs=P())
    policy = RewritePolicy(config=EXACT, fuse_norm=True)
    rows = rewrite(plain, policy).report(*args)
    assert [r.action for r in rows] == ["exact"] * 4
    reasons = [r.reason.split("not fused with a norm: ")[1] for r in rows]
    assert reasons[0] == "the sum's one use is not an add"
    assert reasons[1].startswith("the sum plus residual is not squared")
    assert reasons[2] == "the sum plus residual is used before the norm ends"
    assert reasons[3] == "the norm's weight is not an f32 or bf16 (hidden,) array"
    np.testing.assert_array_equal(np.asarray(jax.jit(rewrite(plain, policy))(*args)),
                                  np.asarray(jax.jit(plain)(*args)))


def test_policy_rejects_a_non_bool():
    with pytest.raises(TypeError, match="fuse_norm must be a bool"):
        RewritePolicy(fuse_norm="yes")


def test_project_llama_attention_sum_fused():
    """The project's Llama (comm="exact", tiny random checkpoint, TP=4): in the scan body the
    attention's psum is followed by the residual add and the MLP's RMSNorm, and is fused; the
    MLP's psum ends the body (its norm is the next iteration's). The logits are the same bits."""
    from jax_flashcomm.nn import TPComm
    from models.engine import Engine
    from models.llama.params import load_model

    from tests.support.tiny_llama import DictCheckpoint

    mesh = jax.make_mesh((N,), ("tp",), devices=jax.devices()[:N])
    model, _ = load_model(None, tp=N, mesh=mesh, comm=TPComm("exact"), dtype=jnp.float32,
                          ckpt=DictCheckpoint())
    engine = Engine(model, mesh, cache_len=64)
    tokens = engine._put(np.random.RandomState(1).randint(0, 101, (2, 16)).astype(np.int32))
    policy = RewritePolicy(config=EXACT, fuse_norm=True, skip_sites=("VocabParallelEmbedding",))
    rewritten = rewrite(engine._score, policy)
    rows = rewritten.report(engine.state, tokens).where(op="psum")
    assert [r.action for r in rows if r.path.endswith("scan")] == ["fused", "exact"]
    assert "not fused with a norm" in rows[-1].reason
    np.testing.assert_array_equal(np.asarray(jax.jit(rewritten)(engine.state, tokens)),
                                  np.asarray(engine._score(engine.state, tokens)))
