# long file: the rewrite end to end over the model shapes it adopts, sharing their fixtures
"""jax_flashcomm.rewrite: lax-collective models rewritten into flashcomm ones.

Rewritten outputs are bit-equal to calling flashcomm directly with the same CommConfig and
within its error bound of lax (tests/support/collective_oracles.py); the report lists exactly the
collectives present; the rewritten jaxpr differs from the original only in the collective
equations; gradients equal the direct flashcomm version's; nested jit/scan/while/cond/remat/
custom_jvp/custom_vjp; both forms (a function calling shard_map, the body of one); the JAX
docs' TP MLP with matmul fusion, an NNX model under nnx.shard_map, the project's Llama.
"""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import Report, RewritePolicy, rewrite

from tests.support import collective_oracles as oracles

CFG = fc.CommConfig(bits=8, min_bytes=0)
N = 4


def _mesh(axis_type=jax.sharding.AxisType.Explicit, n=N, name="i"):
    return jax.make_mesh((n,), (name,), axis_types=(axis_type,), devices=jax.devices()[:n])


def _put(mesh, x, spec):
    return jax.device_put(x, NamedSharding(mesh, spec))


def _normal(seed, shape, scale=1.0):
    return np.asarray(np.random.RandomState(seed).randn(*shape) * scale, np.float32)


def _equal(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


# --- the jaxpr diff ---------------------------------------------------------------------------

#: Equations a rewrite may replace: lax collectives, the pvary lax puts before them, and the
#: custom_vjp calls flashcomm's ops are made of.
_LAX_COLLECTIVES = {"psum_invariant", "psum", "reduce_scatter", "all_gather", "pvary"}
_FLASH_CALLS = {"_qpsum", "_vary", "_qpsum_scatter", "_qall_gather", "_agmm", "_mrs"}


def _skeleton(jaxpr):
    """The equations of a jaxpr (recursively) without the collectives, as comparable tuples."""
    out = []
    for eqn in jaxpr.eqns:
        name = eqn.primitive.name
        if name in _LAX_COLLECTIVES:
            continue
        if name == "custom_vjp_call" and (
                eqn.params["call_jaxpr"].jaxpr.debug_info.func_name in _FLASH_CALLS):
            continue
        subs = tuple(_skeleton(s) for s in jax.extend.core.jaxprs_in_params(eqn.params))
        plain = tuple(sorted((k, repr(v)) for k, v in eqn.params.items()
                             if not list(jax.extend.core.jaxprs_in_params({k: v}))
                             and k not in ("jvp_jaxpr_fun", "fwd_jaxpr_thunk", "bwd",
                                           "out_trees")))
        out.append((name, tuple(v.aval.str_short() for v in eqn.outvars), plain, subs))
    return out


def _count(jaxpr, names):
    n = sum(eqn.primitive.name in names for eqn in jaxpr.eqns)
    return n + sum(_count(s, names) for e in jaxpr.eqns
                   for s in jax.extend.core.jaxprs_in_params(e.params))


def _flash_calls(jaxpr):
    n = sum(e.primitive.name == "custom_vjp_call"
            and e.params["call_jaxpr"].jaxpr.debug_info.func_name in _FLASH_CALLS
            for e in jaxpr.eqns)
    return n + sum(_flash_calls(s) for e in jaxpr.eqns
                   for s in jax.extend.core.jaxprs_in_params(e.params))


# --- a plain-lax TP model: the three collectives, per rank ------------------------------------

def _per_rank_body(psum, psum_scatter, all_gather):
    """Per-rank rows in, per-rank rows out (the layout of tests/support/collective_oracles.py)."""
    def body(v):
        v = v[0]
        return (psum(v, "i")[None],
                psum_scatter(v, "i", scatter_dimension=1, tiled=True)[None],
                all_gather(v, "i", axis=0, tiled=True)[None])
    return body


def test_rewritten_plain_lax_equals_flashcomm_and_is_within_lax_bound(axis_type):
    mesh = _mesh(axis_type)
    x = _normal(0, (N, 8, 64))
    specs = dict(mesh=mesh, in_specs=P("i"), out_specs=(P("i"),) * 3)
    plain = jax.shard_map(_per_rank_body(lax.psum, lax.psum_scatter, lax.all_gather), **specs)
    direct = jax.shard_map(_per_rank_body(
        lambda v, a: fc.psum(v, a, config=CFG),
        lambda v, a, **k: fc.psum_scatter(v, a, config=CFG, **k),
        lambda v, a, **k: fc.all_gather(v, a, config=CFG, **k)), **specs)
    xs = _put(mesh, x, P("i"))
    out = jax.jit(rewrite(plain, CFG))(xs)
    _equal(out, jax.jit(direct)(xs))
    checks = (oracles.psum_check(mesh, ("i",), x, CFG),
              oracles.psum_scatter_check(mesh, ("i",), x, CFG, scatter_dimension=1, tiled=True),
              oracles.all_gather_check(mesh, ("i",), x, CFG, axis=0, tiled=True))
    lax_out = jax.jit(plain)(xs)
    for y, lax_y, (y_oracle, true, bound) in zip(out, lax_out, checks):
        oracles.assert_same(y, y_oracle)
        err = np.abs(np.asarray(y, np.float64) - true)
        assert (err <= bound).all() and err.max() > 0          # quantized, within the bound
        assert np.abs(np.asarray(lax_y, np.float64) - true).max() < 1e-4


def test_report_lists_exactly_the_collectives_and_jaxpr_changes_only_there():
    """Known counts: 3 psum (one under a named scope, one of an int), 1 psum_scatter, 2
    all_gather (tiled and stacked), 1 ppermute, 1 all_gather_invariant."""
    from jax_flashcomm.jax_compat import all_gather_invariant

    mesh = _mesh()

    def body(x, w, counts):
        y = x @ w
        a = lax.psum(y, "i")
        with jax.named_scope("head"):
            b = lax.psum(2.0 * y, "i")
        c = lax.psum(counts, "i")
        s = lax.psum_scatter(y, "i", scatter_dimension=0, tiled=True)
        g = lax.all_gather(s, "i", axis=0, tiled=True)
        st = lax.all_gather(s, "i", axis=0, tiled=False)
        r = lax.ppermute(s, "i", [(k, (k + 1) % N) for k in range(N)])
        inv = all_gather_invariant(s, ("i",), axis=0, tiled=True)
        return a + b + inv, c, g, st.sum(0) + r

    f = jax.shard_map(body, mesh=mesh, in_specs=(P(), P(None, "i"), P()),
                      out_specs=(P(), P(), P("i"), P("i")))
    x = _put(mesh, _normal(1, (8, 32)), P())
    w = _put(mesh, _normal(2, (32, 4 * N)), P(None, "i"))
    counts = _put(mesh, np.arange(3, dtype=np.int32), P())
    policy = RewritePolicy(config=CFG, ops=("psum", "psum_scatter"), skip_sites=("head",))
    report = rewrite(f, policy).report(x, w, counts)
    assert isinstance(report, Report) and len(report) == 8
    assert report.counts("op") == {"psum": 3, "psum_scatter": 1, "all_gather": 2,
                                   "ppermute": 1, "all_gather_invariant": 1}
    assert report.counts() == {"quantized": 2, "kept": 6}
    quantized = report.where(action="quantized")
    assert [r.op for r in quantized] == ["psum", "psum_scatter"]
    assert all(r.shape == (8, 4) and r.dtype == "float32" and r.bytes_per_rank == 128
               and r.axis_size == N and r.path == "shard_map" and "test_rewrite.py:" in r.site
               for r in quantized)
    reasons = {r.op + r.scope: r.reason for r in report.where(action="kept")}
    assert "skip_sites" in reasons["psumhead"] and "excludes all_gather" in reasons["all_gather"]
    assert "not quantizable" in reasons["psum"] and "invariant" in reasons["all_gather_invariant"]
    table = str(report)
    assert table.splitlines()[0].split()[:3] == ["#", "op", "axes"]
    assert table.splitlines()[-2] == "8 collectives: 6 kept, 2 quantized"
    assert table.splitlines()[-1].startswith("bytes sent per rank")

    original = jax.make_jaxpr(f)(x, w, counts).jaxpr
    rewritten = jax.make_jaxpr(rewrite(f, policy))(x, w, counts).jaxpr
    assert _skeleton(rewritten) == _skeleton(original)
    # the two selected collectives became flashcomm calls; the other four lax ones remain
    assert _count(original, {"psum_invariant", "reduce_scatter", "all_gather"}) == 6
    assert _count(rewritten, {"psum_invariant", "reduce_scatter", "all_gather"}) == 4
    assert _flash_calls(rewritten) == 2 and _flash_calls(original) == 0
    # the rewritten program computes what the direct flashcomm program computes
    direct = jax.shard_map(_direct_body, mesh=mesh, in_specs=(P(), P(None, "i"), P()),
                           out_specs=(P(), P(), P("i"), P("i")))
    _equal(jax.jit(rewrite(f, policy))(x, w, counts), jax.jit(direct)(x, w, counts))


def _direct_body(x, w, counts):
    """The body of the report test written with flashcomm at the two rewritten sites."""
    from jax_flashcomm.jax_compat import all_gather_invariant

    y = x @ w
    a = fc.psum(y, "i", config=CFG)
    b = lax.psum(2.0 * y, "i")
    c = lax.psum(counts, "i")
    s = fc.psum_scatter(y, "i", scatter_dimension=0, tiled=True, config=CFG)
    g = lax.all_gather(s, "i", axis=0, tiled=True)
    st = lax.all_gather(s, "i", axis=0, tiled=False)
    r = lax.ppermute(s, "i", [(k, (k + 1) % N) for k in range(N)])
    inv = all_gather_invariant(s, ("i",), axis=0, tiled=True)
    return a + b + inv, c, g, st.sum(0) + r


def test_default_choice_and_exact_rewrite_is_the_original_program():
    """policy=None: flashcomm's defaults (the automatic choice): these small messages stay
    exact (lax, or the exact p2p sum), bit-equal to lax; bits=None rewrites to the identical lax program."""
    mesh = _mesh()
    f = jax.shard_map(lambda v: lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    x = _put(mesh, _normal(3, (N * 4, 32)), P("i"))
    report = rewrite(f).report(x)
    # exact: lax.psum, or the exact p2p sum (lax's bits for f32)
    assert report.counts() == {"exact": 1}, report.counts()
    assert report[0].reason.startswith(("auto: lax", "auto: exact/p2p")), report[0].reason
    _equal(jax.jit(rewrite(f))(x), jax.jit(f)(x))
    exact = rewrite(f, fc.CommConfig(bits=None))
    assert str(jax.make_jaxpr(exact)(x)) == str(jax.make_jaxpr(f)(x))
    out, rep = rewrite(f, CFG, report=True)(x)
    assert rep.counts() == {"quantized": 1} and out.shape == (4, 32)


# --- nesting and autodiff ---------------------------------------------------------------------

# Plain int8: the toy's tanh activations are bounded, where the default Hadamard rotation costs
# accuracy (docs/accuracy.md), and the gradient sanity bound below is the one of plain groups.
GRAD_CFG = fc.CommConfig(bits=8, min_bytes=0, grad="quantized", rotation=0)


@jax.custom_vjp
def _copy_to_tp(x):
    """Megatron's f: identity forward, all-reduce of the cotangent."""
    return x


_copy_to_tp.defvjp(lambda x: (x, None), lambda _, g: (lax.psum(g, "i"),))


@jax.custom_vjp
def _copy_to_tp_flash(x):
    return x


_copy_to_tp_flash.defvjp(lambda x: (x, None),
                         lambda _, g: (fc.psum(g, "i", config=GRAD_CFG),))


def _nested_model(psum, copy):
    """jit in scan, cond, remat and a custom_vjp around row-parallel matmuls."""
    def body(x, w):
        i = lax.axis_index("i").astype(x.dtype)

        def step(c, _):
            return jax.jit(lambda c: psum(jnp.tanh(copy(c) @ w) * (i + 1) / N, "i"))(c), None

        x, _ = lax.scan(step, x, None, length=2)
        x = lax.cond(x.sum() > 0, lambda a: psum(a @ w / N, "i"), lambda a: a @ w, x)
        return jax.checkpoint(lambda a: psum(jnp.sin(a @ w) / N, "i"))(x)
    return body


def test_nested_bodies_and_gradients_match_direct_flashcomm():
    mesh = _mesh()
    specs = dict(mesh=mesh, in_specs=(P(), P()), out_specs=P())
    plain = jax.shard_map(_nested_model(lax.psum, _copy_to_tp), **specs)
    direct = jax.shard_map(_nested_model(lambda v, a: fc.psum(v, a, config=GRAD_CFG),
                                         _copy_to_tp_flash), **specs)
    x = _put(mesh, _normal(4, (8, 32)), P())
    w = _put(mesh, _normal(5, (32, 32), 0.2), P())
    rewritten = rewrite(plain, GRAD_CFG)
    report = rewritten.report(x, w)
    assert [r.path for r in report] == ["shard_map/scan/jit(<lambda>)", "shard_map/cond[1]",
                                        "shard_map/remat"]
    assert report.counts() == {"quantized": 3}
    _equal(jax.jit(rewritten)(x, w), jax.jit(direct)(x, w))

    def loss(fn):
        return lambda x, w: jnp.sum(fn(x, w) ** 2)

    grads = jax.jit(jax.grad(loss(rewritten), argnums=(0, 1)))(x, w)
    _equal(grads, jax.jit(jax.grad(loss(direct), argnums=(0, 1)))(x, w))
    lax_grads = jax.jit(jax.grad(loss(plain), argnums=(0, 1)))(x, w)
    for g, h in zip(grads, lax_grads):
        err = np.abs(np.asarray(g) - np.asarray(h)).max()
        assert 0 < err < 0.1 * np.abs(np.asarray(h)).max()      # int8 noise, not a bug


def test_while_loop_custom_jvp_and_the_inside_shard_map_form():
    mesh = _mesh()

    def model(psum):
        @jax.custom_jvp
        def reduce(x):
            return psum(x, "i")

        reduce.defjvp(lambda p, t: (reduce(p[0]), lax.psum(t[0], "i")))

        def body(x, w, n):
            step = lambda c: (c[0] + 1, reduce(jnp.tanh(c[1] @ w)))
            return lax.while_loop(lambda c: c[0] < n, step, (0, x))[1]
        return body

    specs = dict(mesh=mesh, in_specs=(P(), P(None, "i"), P()), out_specs=P())
    x = _put(mesh, _normal(6, (8, 32)), P())
    w = _put(mesh, _normal(7, (32, 32 * N), 0.2), P(None, "i"))
    n = _put(mesh, np.int32(3), P())
    direct = jax.jit(jax.shard_map(model(lambda v, a: fc.psum(v, a, config=CFG)), **specs))
    outside = rewrite(jax.shard_map(model(lax.psum), **specs), CFG)
    assert [r.path for r in outside.report(x, w, n)] == ["shard_map/while/custom_jvp"]
    inside = jax.shard_map(rewrite(model(lax.psum), CFG), **specs)
    expected = direct(x, w, n)
    _equal(jax.jit(outside)(x, w, n), expected)
    _equal(jax.jit(inside)(x, w, n), expected)
    # the inside form's report: traced inside the caller's shard_map, top level
    rows = []

    def body(x, w, n):
        out, report = rewrite(model(lax.psum), CFG, report=True)(x, w, n)
        rows.extend(report)
        return out

    jax.jit(jax.shard_map(body, **specs)).lower(x, w, n)
    assert [(r.path, r.action) for r in rows] == [("while/custom_jvp", "quantized")]


# --- the JAX docs' TP MLP with matmul fusion ----------------------------------------------------

def _docs_mlp(x, w1, w2):
    """The sequence-parallel TP MLP of the JAX shard_map docs, with lax collectives: gather
    the sequence, column-parallel matmul, row-parallel matmul, reduce-scatter the sequence."""
    x = lax.all_gather(x, "i", axis=0, tiled=True)
    h = jax.nn.relu(x @ w1)
    return lax.psum_scatter(h @ w2, "i", scatter_dimension=0, tiled=True)


@pytest.mark.parametrize("bits", [None, 8])
def test_docs_tp_mlp_fused_equals_ring_ops(bits):
    mesh = _mesh()
    specs = dict(mesh=mesh, in_specs=(P("i"), P(None, "i"), P("i", None)), out_specs=P("i"))
    x = _put(mesh, _normal(8, (16, 64)), P("i"))
    w1 = _put(mesh, _normal(9, (64, 128), 0.125), P(None, "i"))
    w2 = _put(mesh, _normal(10, (128, 64), 0.09), P("i", None))
    plain = jax.shard_map(_docs_mlp, **specs)
    config = fc.CommConfig(bits=bits, min_bytes=0)

    def direct_body(x, w1, w2):
        if bits is None:
            h = jax.nn.relu(fc.all_gather_matmul(x, w1, "i"))
            return fc.matmul_reduce_scatter(h, w2, "i")
        h = jax.nn.relu(fc.all_gather_matmul(x, w1, "i", config=config))
        return fc.psum_scatter(h @ w2, "i", scatter_dimension=0, tiled=True, config=config)

    rewritten = rewrite(plain, RewritePolicy(config=config, fuse_matmul=True))
    report = rewritten.report(x, w1, w2)
    assert [r.action for r in report] == (["fused", "fused"] if bits is None
                                          else ["fused", "quantized"])
    assert report[0].detail == ("all_gather_matmul" if bits is None else "all_gather_matmul int8")
    out = jax.jit(rewritten)(x, w1, w2)
    _equal(out, jax.jit(jax.shard_map(direct_body, **specs))(x, w1, w2))
    err = np.abs(np.asarray(out) - np.asarray(jax.jit(plain)(x, w1, w2))).max()
    assert err < (1e-5 if bits is None else 0.05)
    fused_jaxpr = jax.make_jaxpr(rewritten)(x, w1, w2).jaxpr
    assert _flash_calls(fused_jaxpr) == 2
    if bits is None:  # gradients through the fused rings: those of the direct ring ops
        def grads(fn):
            with jax.set_mesh(mesh):
                return jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))(
                    x, w1, w2)

        _equal(grads(rewritten), grads(jax.shard_map(direct_body, **specs)))


def test_fusion_left_undone_says_why():
    mesh = _mesh()

    def body(x, w):
        g = lax.all_gather(x, "i", axis=0, tiled=True)
        return (g @ w) + g.sum()                       # the gathered value has two uses

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))
    x = _put(mesh, _normal(11, (8, 16)), P("i"))
    w = _put(mesh, _normal(12, (16, 16)), P())
    report = rewrite(f, RewritePolicy(config=CFG, fuse_matmul=True)).report(x, w)
    assert report[0].action == "quantized" and "not fused: the gathered value has other uses" \
        in report[0].reason


# --- code the project did not write for it ------------------------------------------------------

class _NNXRowParallel(nnx.Module):
    """An NNX TP MLP written with lax collectives, as users write them."""

    def __init__(self, d, f, rngs):
        self.up = nnx.Linear(d, f, use_bias=False, rngs=rngs,
                             kernel_metadata={"out_sharding": (None, "i")})
        self.down = nnx.Linear(f, d, use_bias=False, rngs=rngs,
                               kernel_metadata={"out_sharding": ("i", None)})

    def __call__(self, x):
        return lax.psum(self.down(jax.nn.gelu(self.up(x))), "i")


def test_nnx_shard_map_model():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        model = _NNXRowParallel(32, 64 * N, nnx.Rngs(0))
    specs = nnx.StateSharding({nnx.PathContains("up"): P(None, "i"),
                               nnx.PathContains("down"): P("i", None)})

    @nnx.shard_map(mesh=mesh, in_specs=(specs, P()), out_specs=P())
    def run(m, x):
        return m(x)

    @nnx.shard_map(mesh=mesh, in_specs=(specs, P()), out_specs=P())
    def run_direct(m, x):
        return fc.psum(m.down(jax.nn.gelu(m.up(x))), "i", config=CFG)

    x = _put(mesh, _normal(13, (8, 32)), P())
    rewritten = rewrite(run, CFG)                 # the module is an argument, like x
    report = rewritten.report(model, x)
    assert report.counts() == {"quantized": 1}
    assert report[0].site.endswith("(_NNXRowParallel.__call__)")
    out = jax.jit(rewritten)(model, x)
    _equal(out, jax.jit(run_direct)(model, x))
    ref = np.asarray(jax.jit(run)(model, x))
    assert 0 < np.abs(np.asarray(out) - ref).max() < 0.02 * np.abs(ref).max()


def test_llama_exact_rewritten_equals_flash():
    """The project's Llama, tiny random checkpoint, TP=4: comm="exact" rewritten (every
    row-parallel all-reduce, not the embedding's exact sum) is comm="flash", bit for bit."""
    from jax_flashcomm.nn import TPComm
    from models.engine import Engine
    from models.llama.params import load_model
    from tests.support.tiny_llama import TINY, DictCheckpoint

    mesh = _mesh(n=4, name="tp")
    tokens = np.random.RandomState(1).randint(0, TINY.vocab_size, (2, 16)).astype(np.int32)

    def engine(comm):
        model, _ = load_model(None, tp=4, mesh=mesh, comm=comm, dtype=jnp.float32,
                              ckpt=DictCheckpoint())
        return Engine(model, mesh, cache_len=64)

    exact, flash = engine(TPComm("exact")), engine(TPComm("quantized", config=CFG))
    policy = RewritePolicy(config=CFG, skip_sites=("VocabParallelEmbedding",))
    tok = exact._put(tokens)
    rewritten = rewrite(exact._score, policy)
    report = rewritten.report(exact.state, tok)
    assert report.counts() == {"quantized": 2, "kept": 2}   # scan body: o-proj and down-proj
    assert {r.op for r in report.where(action="kept")} == {"psum", "all_gather_invariant"}
    _equal(jax.jit(rewritten)(exact.state, tok), flash._score(flash.state, tok))


# --- errors -----------------------------------------------------------------------------------

def test_policy_and_input_errors():
    with pytest.raises(ValueError, match="unknown ops"):
        RewritePolicy(ops=("psum", "pmax"))
    with pytest.raises(ValueError, match="sites is empty"):
        RewritePolicy(sites=())
    with pytest.raises(TypeError, match="config must be a jax_flashcomm.CommConfig"):
        RewritePolicy(config={"bits": 8})
    with pytest.raises(TypeError, match="fuse_matmul must be a bool"):
        RewritePolicy(fuse_matmul="yes")
    with pytest.raises(TypeError, match="axes must hold non-empty strings"):
        RewritePolicy(axes=("i", 0))
    with pytest.raises(TypeError, match="policy must be a RewritePolicy"):
        rewrite(lambda x: x, policy={"bits": 8})
    with pytest.raises(TypeError, match="fn must be callable"):
        rewrite(3)
    assert RewritePolicy(ops="psum", sites="mlp").ops == ("psum",)
    mesh = _mesh()
    f = jax.shard_map(lambda v: lax.psum(v, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    x = _put(mesh, _normal(14, (N, 8)), P("i"))
    report = rewrite(f, RewritePolicy(config=CFG, axes=("j",))).report(x)
    assert report[0].action == "kept" and "not all in policy.axes" in report[0].reason
