"""The rewrite on programs shaped like real codebases' (MaxText, eformer / EasyDeL, bonsai).

One minimal test per failure class those codebases hit: a 16-bit float exact all-reduce in an
island, meshes of many axes with size-1 axes named in the specs, ``jax.jit`` / ``.lower`` /
``jax.eval_shape`` before any eager call, the ``auto_axes`` region of ``.at[].get(out_sharding=)``
under Explicit axes, a lookup into a vocab-sharded table, and the warning of every path that
leaves a program unchanged.
"""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import RewriteWarning, rewrite
from jax_flashcomm.rewrite.partitioner import parse_collectives

INT8 = fc.CommConfig(bits=8, min_bytes=0)
EXACT = fc.CommConfig(bits=None)
NAMES = ("data", "fsdp", "tensor")


def _mesh(kind=AxisType.Auto, shape=(1, 1, 4)):
    return jax.make_mesh(shape, NAMES, axis_types=(kind,) * 3,
                         devices=jax.devices()[:int(np.prod(shape))])


def _put(mesh, a, spec, dtype=jnp.float32):
    return jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, spec))


def _mlp_args(mesh, dtype=jnp.float32):
    """Specs that name the size-1 axes, as eformer's and MaxText's logical rules do."""
    rng = np.random.RandomState(0)
    return (_put(mesh, rng.randn(2, 8, 64), P(("data", "fsdp")), dtype),
            _put(mesh, rng.randn(64, 256) / 8, P("fsdp", "tensor"), dtype),
            _put(mesh, rng.randn(256, 64) / 16, P("tensor", "fsdp"), dtype))


def _mlp(mesh):
    def mlp(x, w1, w2):
        h = jax.nn.silu(x @ w1)
        h = lax.with_sharding_constraint(h, NamedSharding(mesh, P(("data", "fsdp"), None,
                                                                  "tensor")))
        return lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P(("data", "fsdp"))))
    return mlp


def _collectives(fn, *args):
    text = jax.jit(fn).lower(*args).compile().as_text()
    return parse_collectives(text, args[0].sharding.mesh)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_size_one_axes_in_specs_rewrite_every_dtype(dtype):
    """A (data=1, fsdp=1, tensor=4) Auto mesh whose specs name the size-1 axes: the all-reduce
    becomes an island in every dtype, the exact path bit-equal to XLA's program, int8 not."""
    mesh = _mesh()
    fn, args = _mlp(mesh), _mlp_args(mesh, dtype)
    ref = np.asarray(jax.jit(fn)(*args), np.float32)
    report = rewrite(fn, INT8).report(*args)
    islands = [r for r in report if r.path != "partitioner"]
    assert [(r.op, r.axes, r.action) for r in islands] == [("psum", ("tensor",), "quantized")]
    exact = np.asarray(rewrite(fn, EXACT)(*args), np.float32)
    np.testing.assert_array_equal(exact, ref)
    assert np.abs(np.asarray(rewrite(fn, INT8)(*args), np.float32) - ref).max() > 0


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_exact_psum_of_16_bit_floats_in_a_partly_manual_shard_map(dtype):
    """fc.psum's exact path in a shard_map manual over one of two axes: compiles (lax.psum of
    bf16 there aborts XLA:CPU's all-reduce promotion) and gives the fully manual psum's bits."""
    mesh = jax.make_mesh((2, 2), ("fsdp", "tensor"), axis_types=(AxisType.Explicit,) * 2,
                         devices=jax.devices()[:4])
    x = _put(mesh, np.random.RandomState(1).randn(4, 8), P(None, "tensor"), dtype)
    with jax.set_mesh(mesh):
        partly = jax.jit(jax.shard_map(lambda v: fc.psum(v, "tensor", bits=None),
                                       in_specs=P(None, "tensor"), out_specs=P(),
                                       axis_names={"tensor"}))(x)
        fully = jax.jit(jax.shard_map(lambda v: lax.psum(v, "tensor"),
                                      in_specs=P(None, "tensor"), out_specs=P()))(x)
    np.testing.assert_array_equal(np.asarray(partly), np.asarray(fully))


def test_jit_lower_and_eval_shape_before_any_eager_call():
    """jax.jit(rewrite(f)) first, its AOT .lower of ShapeDtypeStructs, and jax.eval_shape: the
    eager call's program each time (the shardings come from the jit's arguments)."""
    mesh = _mesh()
    fn, args = _mlp(mesh), _mlp_args(mesh)
    first = np.asarray(jax.jit(rewrite(fn, INT8))(*args))
    eager = np.asarray(rewrite(fn, INT8)(*args))
    np.testing.assert_array_equal(first, eager)
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding) for a in args]
    compiled = jax.jit(rewrite(fn, INT8)).lower(*specs).compile()
    np.testing.assert_array_equal(np.asarray(compiled(*args)), eager)
    assert jax.eval_shape(rewrite(fn, INT8), *args).shape == eager.shape
    assert np.abs(eager - np.asarray(jax.jit(fn)(*args))).max() > 0


def test_inside_a_larger_trace_warns_or_takes_in_shardings():
    """Called inside a larger jitted function the shardings are unknown: a warning that says
    what to do; with in_shardings= the eager call's program."""
    mesh = _mesh()
    fn, args = _mlp(mesh), _mlp_args(mesh)
    eager = np.asarray(rewrite(fn, INT8)(*args))
    with pytest.warns(RewriteWarning, match="in_shardings="):
        jax.jit(lambda *a: rewrite(fn, INT8)(*a) + 1)(*args)
    given = rewrite(fn, INT8, in_shardings=[a.sharding for a in args])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        got = jax.jit(lambda *a: given(*a) + 1)(*args)
    np.testing.assert_array_equal(np.asarray(got), eager + 1)


def _table_args(mesh, vocab=1024, dim=64):
    rng = np.random.RandomState(2)
    return (_put(mesh, rng.randn(vocab, dim), P("tensor", None)),
            _put(mesh, rng.randint(0, vocab, (4, 32)), P(), jnp.int32),
            _put(mesh, rng.randn(dim, vocab) / 8, P(None, "tensor")))


@pytest.mark.parametrize("lookup", ["take", "at_get", "index", "one_hot"])
def test_lookup_into_a_vocab_sharded_table_moves_the_rows_not_the_table(lookup):
    """An embedding lookup (GSPMD): each rank gathers its rows and the looked-up rows are
    all-reduced, as XLA does; the rewrite's program moves no more bytes than XLA's (the table
    all-gather it used to do moved 8x the bytes here, 62x at vocab 32000)."""
    mesh = _mesh()
    gather = {"take": lambda t, i: jnp.take(t, i, axis=0),
              "at_get": lambda t, i: t.at[i].get(),
              "index": lambda t, i: t[i],
              "one_hot": lambda t, i: jax.nn.one_hot(i, t.shape[0], dtype=t.dtype) @ t}[lookup]

    def fn(table, tokens, w):
        x = lax.with_sharding_constraint(gather(table, tokens), NamedSharding(mesh, P()))
        return jnp.einsum("bsd,dv->bsv", x, w)

    args = _table_args(mesh)
    ref = np.asarray(jax.jit(fn)(*args))
    exact, quant = rewrite(fn, EXACT), rewrite(fn, INT8)
    np.testing.assert_array_equal(np.asarray(exact(*args)), ref)
    rows = [r for r in quant.report(*args) if r.path != "partitioner"]
    assert [(r.op, r.shape, r.action) for r in rows] == [("psum", (4, 32, 64), "quantized")]
    xla = sum(c.bytes_per_rank for c in _collectives(fn, *args))
    ours = sum(c.bytes_per_rank for c in _collectives(exact, *args))
    assert ours <= xla
    got = np.asarray(quant(*args))
    assert 0 < np.abs(got - ref).max() < 0.05 * np.abs(ref).max()


def test_take_along_a_sharded_axis_with_size_one_axes():
    """take_along_axis into vocab-sharded logits whose specs name size-1 axes: the local gather
    and an all-reduce of the picked entries, exact bit-equal, nothing else moved."""
    mesh = _mesh()
    rng = np.random.RandomState(4)
    logits = _put(mesh, rng.randn(4, 32, 256), P(("data", "fsdp"), None, "tensor"))
    picks = _put(mesh, rng.randint(0, 256, (4, 32, 1)), P(("data", "fsdp")), jnp.int32)

    def fn(logits, picks):
        got = jnp.take_along_axis(logits, picks, axis=-1)
        return lax.with_sharding_constraint(got, NamedSharding(mesh, P(("data", "fsdp"))))

    rows = [r for r in rewrite(fn, INT8).report(logits, picks) if r.path != "partitioner"]
    assert [(r.op, r.shape, r.action) for r in rows] == [("psum", (4, 32, 1), "quantized")]
    np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(logits, picks)),
                                  np.asarray(jax.jit(fn)(logits, picks)))


def test_lookup_out_of_range_fills_as_xla_does():
    """Indices past the table: jnp.take's fill (NaN) and clip modes, bit-equal to XLA's."""
    mesh = _mesh()
    table, _, _ = _table_args(mesh, vocab=64, dim=16)
    tokens = _put(mesh, np.array([[0, 63, 64, -1, 100, 17]]), P(), jnp.int32)
    for mode in ("fill", "clip"):
        def fn(t, i, mode=mode):
            return lax.with_sharding_constraint(jnp.take(t, i, axis=0, mode=mode),
                                                NamedSharding(mesh, P()))
        np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(table, tokens)),
                                      np.asarray(jax.jit(fn)(table, tokens)))


def test_explicit_lookup_through_auto_axes_is_no_island():
    """Under Explicit axes `.at[].get(out_sharding=)` enters an auto_axes region with a reshard
    that moves no data: no island there, and the rest is rewritten."""
    mesh = _mesh(AxisType.Explicit)
    args = _table_args(mesh)

    def fn(table, tokens, w):
        x = table.at[tokens].get(out_sharding=P())
        h = jnp.einsum("bsd,dv->bsv", x, w, out_sharding=P(None, None, "tensor"))
        return jnp.einsum("bsv,vd->bsd", h, table, out_sharding=P())

    with jax.set_mesh(mesh):
        ref = np.asarray(jax.jit(fn)(*args))
        report = rewrite(fn, INT8).report(*args)
        assert [(r.op, r.action) for r in report] == [("psum", "quantized")]
        np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(*args)), ref)
        assert np.abs(np.asarray(rewrite(fn, INT8)(*args)) - ref).max() > 0


def _unchanged_cases():
    mesh = _mesh()
    args = _mlp_args(mesh)
    explicit = _mesh(AxisType.Explicit)
    ex_args = _mlp_args(explicit)

    def no_collective(x, w1, w2):
        return x * 2.0

    def kept(x, w1, w2):       # an all-to-all reshard: not a pattern the rewrite replaces
        return jax.sharding.reshard(w1, P("tensor", None)) * 2.0

    return {
        "no collective": (no_collective, args, None, "no lax collective"),
        "every collective kept": (kept, ex_args, explicit, "every collective found was kept"),
        "policy excludes all": (_mlp(mesh), args, None, "every collective found was kept"),
    }


@pytest.mark.parametrize("case", ["no collective", "every collective kept",
                                  "policy excludes all"])
def test_every_unchanged_program_warns(case):
    fn, args, mesh, match = _unchanged_cases()[case]
    policy = (fc.RewritePolicy(config=INT8, ops=("all_gather",)) if case == "policy excludes all"
              else INT8)
    with jax.set_mesh(mesh) if mesh is not None else _nullcontext():
        with pytest.warns(RewriteWarning, match=match):
            rewrite(fn, policy)(*args)
        with pytest.warns(RewriteWarning, match=match):
            jax.jit(rewrite(fn, policy))(*args)


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_rewrite_that_changes_something_does_not_warn():
    mesh = _mesh()
    fn, args = _mlp(mesh), _mlp_args(mesh)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RewriteWarning)
        rewrite(fn, INT8)(*args)
        jax.jit(rewrite(fn, INT8))(*args)


def test_report_attributes_the_partitioner_collectives_of_a_scanned_stack():
    """Every dot of a scanned stack goes through one helper (one source line, one op_name, as
    MaxText's dense layers do): each collective XLA inserted is matched to the island of its
    kind in program order, so the rows marked kept are exactly the collectives still in the
    rewritten program."""
    mesh = jax.make_mesh((1, 4), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:4])
    rng = np.random.RandomState(3)
    pin = lambda v, *s: lax.with_sharding_constraint(v, NamedSharding(mesh, P(*s)))  # noqa

    def dense(x, w):
        return jnp.einsum("...d,df->...f", x, w)

    def fn(x, w):
        def layer(x, w):
            h = pin(jax.nn.silu(dense(x, w["up"])), None, None, "tensor")
            return x + pin(dense(h, w["down"]), None, None, "tensor"), None
        return lax.scan(layer, x, w)[0]

    x = _put(mesh, rng.randn(2, 8, 64), P(None, None, "tensor"))
    w = {"up": _put(mesh, rng.randn(3, 64, 256) / 8, P(None, None, "tensor")),
         "down": _put(mesh, rng.randn(3, 256, 64) / 16, P(None, "tensor", None))}
    # the activation's all-gather for the first dot left to XLA, the second dot's all-reduce
    # (a reduce-scatter in the typed program) replaced: one line, one op_name for both
    rewritten = rewrite(fn, fc.RewritePolicy(config=INT8, ops=("psum", "psum_scatter")))
    rows = rewritten.report(x, w).where(path="partitioner")
    assert sorted((r.op, r.action) for r in rows) == [("all_gather", "kept"),
                                                      ("psum", "quantized")]
    left = [c.kind for c in _collectives(rewritten, x, w) if c.dtype == "float32"]
    assert left == ["all-gather"]
    gather = next(r for r in rows if r.op == "all_gather")
    assert "the rewrite left this equation to XLA" in gather.reason
    # with every op: the gather is an island too, and no float collective is left
    everything = rewrite(fn, INT8)
    rows = everything.report(x, w).where(path="partitioner")
    assert sorted((r.op, r.action) for r in rows) == [("all_gather", "quantized"),
                                                      ("psum", "quantized")]
    assert not [c for c in _collectives(everything, x, w) if c.dtype == "float32"]
    np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(x, w)),
                                  np.asarray(jax.jit(fn)(x, w)))


@pytest.mark.parametrize("kind", [AxisType.Auto, AxisType.Explicit])
def test_rms_norm_over_a_sharded_hidden_dimension(kind):
    """An RMSNorm whose hidden dimension is split over tensor (MaxText's base rules shard the
    activations' embed dimension): its reduce_sum is an all-reduce, replaced like a dot's."""
    mesh = jax.make_mesh((1, 4), ("fsdp", "tensor"), axis_types=(kind,) * 2,
                         devices=jax.devices()[:4])
    rng = np.random.RandomState(5)
    x = _put(mesh, rng.randn(4, 32, 256), P(None, None, "tensor"))
    g = _put(mesh, 1 + rng.randn(256) / 8, P("tensor"))

    def fn(x, g):
        y = x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * g
        if kind == AxisType.Auto:
            y = lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, None, "tensor")))
        return y

    with jax.set_mesh(mesh):
        rows = [r for r in rewrite(fn, INT8).report(x, g) if r.path != "partitioner"]
        assert [(r.op, r.shape, r.action) for r in rows] == [("psum", (4, 32), "quantized")]
        ref = np.asarray(jax.jit(fn)(x, g))
        np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(x, g)), ref)
        assert 0 < np.abs(np.asarray(rewrite(fn, INT8)(x, g)) - ref).max() < 0.1


def test_eformer_style_size_one_axes_rewrite_and_report():
    """eformer / EasyDeL's form: a (dp=1, fsdp=1, sp=1, tp=4) Auto mesh, arguments and the
    model's own constraints naming the size-1 axes (P(('fsdp', 'sp'), 'tp'))."""
    mesh = jax.make_mesh((1, 1, 1, 4), ("dp", "fsdp", "sp", "tp"),
                         axis_types=(AxisType.Auto,) * 4, devices=jax.devices()[:4])
    rng = np.random.RandomState(6)
    x = _put(mesh, rng.randn(8, 64), P(("fsdp", "sp"), None))
    w1 = _put(mesh, rng.randn(64, 256) / 8, P(("fsdp", "sp"), "tp"))
    w2 = _put(mesh, rng.randn(256, 64) / 16, P("tp", ("fsdp", "sp")))

    def fn(x, w1, w2):
        h = lax.with_sharding_constraint(jax.nn.gelu(x @ w1),
                                         NamedSharding(mesh, P(("fsdp", "sp"), "tp")))
        return lax.with_sharding_constraint(h @ w2, NamedSharding(mesh, P(("fsdp", "sp"))))

    report = rewrite(fn, INT8).report(x, w1, w2)
    assert [(r.op, r.axes, r.action) for r in report if r.path != "partitioner"] == [
        ("psum", ("tp",), "quantized")]
    assert [r.action for r in report.where(path="partitioner")] == ["quantized"]
    np.testing.assert_array_equal(np.asarray(rewrite(fn, EXACT)(x, w1, w2)),
                                  np.asarray(jax.jit(fn)(x, w1, w2)))


def test_a_program_the_typing_cannot_handle_warns():
    """A primitive with a body the typing does not enter (custom_linear_solve): the program
    runs as written, and the warning names the primitive."""
    mesh = _mesh()
    fn0, args = _mlp(mesh), _mlp_args(mesh)

    def fn(x, w1, w2):
        y = fn0(x, w1, w2)
        return lax.custom_linear_solve(lambda v: 2.0 * v, y, lambda mv, b: b / 2.0)

    with pytest.warns(RewriteWarning, match="could not be typed.*custom_linear_solve"):
        got = rewrite(fn, INT8)(*args)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(jax.jit(fn)(*args)))
