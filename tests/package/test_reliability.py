"""Hardening (docs/reliability.md): bad input raises at trace time naming the argument; the
accepted edge cases (axis size 1, groups larger than the operand, 0-d, empty) have defined
results; NaN/Inf poison exactly the groups that carry them; magnitudes near the dtype's limit
stay finite and within bound; repeated calls are bit-identical on every rank; the quantized
collectives' temporary memory per device, from the compiled executable."""

import dataclasses
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
OPS = {
    "psum": lambda v, **k: fc.psum(v, "i", **{**Q, **k}),
    "pmean": lambda v, **k: fc.pmean(v, "i", **{**Q, **k}),
    "psum_scatter": lambda v, **k: fc.psum_scatter(v, "i", tiled=True, **{**Q, **k}),
    "all_gather": lambda v, **k: fc.all_gather(v, "i", **{**Q, **k}),
}
MM = {
    "all_gather_matmul": lambda x, w, **k: fc.all_gather_matmul(x, w, "i", **k),
    "matmul_reduce_scatter": lambda x, w, **k: fc.matmul_reduce_scatter(x, w, "i", **k),
}
DT_NAMES = {jnp.int32: "int32", jnp.bool_: "bool", jnp.complex64: "complex64",
            jnp.uint8: "uint8"}


def _payload(mutate):
    """Trace dequantize of a quantized operand whose payload ``mutate`` tampered with."""
    def f(x):
        p = codec.quantize(x, bits=4, group_size=128)
        return codec.dequantize(mutate(p))
    return f


# (id, what, op(s), local x (shape, dtype), body(v) or body(x, w), w shape or None, exc, match)
def _cases():
    cases = []
    for dt, name in DT_NAMES.items():
        for op in OPS:
            cases.append((f"{op}-{name}", f"{name} operand", op, ((16, 256), dt),
                          lambda v, op=op: OPS[op](v), None, TypeError,
                          f"x must have dtype float32, bfloat16, float16; got {name}"))
        if dt is not jnp.uint8:
            for op in MM:
                cases.append((f"{op}-{name}", f"{name} operand", op, ((16, 32), dt),
                              lambda x, w, op=op: MM[op](x, w), (32, 32), TypeError,
                              f"{op}: x must have a floating dtype, got {name}"))
    f32 = ((16, 256), jnp.float32)
    mmx = ((16, 32), jnp.float32)
    cases += [
        ("psum-pytree-int-leaf", "pytree with an int leaf", "psum", f32,
         lambda v: fc.psum({"a": v, "b": v.astype(jnp.int32)}, "i", **Q), None, TypeError,
         r"x\['b'\] must have dtype float32, bfloat16, float16; got int32"),
        ("all_gather-pytree-str-leaf", "pytree with a non-array leaf", "all_gather", f32,
         lambda v: fc.all_gather([v, "s"], "i", **Q), None, TypeError,
         r"x\[1\] must be an array, got <class 'str'>"),
        ("psum_scatter-pytree-str-leaf", "pytree with a non-array leaf", "psum_scatter", f32,
         lambda v: fc.psum_scatter({"w": "s"}, "i", tiled=True, **Q), None, TypeError,
         r"x\['w'\] must be an array"),
    ]
    for op in ("psum", "psum_scatter", "all_gather"):
        cases += [
            (f"{op}-bits-1", "bits=1", op, f32, lambda v, op=op: OPS[op](v, bits=1), None,
             ValueError, "bits must be in 2..8, got 1"),
            (f"{op}-bits-9", "bits=9", op, f32, lambda v, op=op: OPS[op](v, bits=9), None,
             ValueError, "bits must be in 2..8, got 9"),
            (f"{op}-bits-float", "bits=4.0", op, f32, lambda v, op=op: OPS[op](v, bits=4.0),
             None, TypeError, "bits must be an int in 2..8, got 4.0"),
            (f"{op}-bits-bool", "bits=True", op, f32, lambda v, op=op: OPS[op](v, bits=True),
             None, TypeError, "bits must be an int in 2..8, got True"),
            (f"{op}-group-100", "group_size=100", op, f32,
             lambda v, op=op: OPS[op](v, group_size=100), None, ValueError,
             "group_size must be a positive multiple of 8, got 100"),
            (f"{op}-group-0", "group_size=0", op, f32,
             lambda v, op=op: OPS[op](v, group_size=0), None, ValueError,
             "group_size must be a positive multiple of 8, got 0"),
            (f"{op}-group-neg", "group_size=-8", op, f32,
             lambda v, op=op: OPS[op](v, group_size=-8), None, ValueError,
             "group_size must be a positive multiple of 8, got -8"),
            (f"{op}-axis-unknown", "unknown axis name 'j'", op, f32,
             lambda v, op=op: getattr(fc, op)(v, "j", **Q), None, ValueError,
             "axis_name='j': axis 'j' is not bound"),
            (f"{op}-axis-int", "positional int axis 0", op, f32,
             lambda v, op=op: getattr(fc, op)(v, 0, **Q), None, TypeError,
             "positional int axes are not supported"),
            (f"{op}-axis-empty", "axis_name=()", op, f32,
             lambda v, op=op: getattr(fc, op)(v, (), **Q), None, ValueError,
             "axis_name is empty"),
            (f"{op}-axis-repeated", "axis_name=('i', 'i')", op, f32,
             lambda v, op=op: getattr(fc, op)(v, ("i", "i"), **Q), None, ValueError,
             "axis_name repeats an axis"),
            (f"{op}-index-groups", "axis_index_groups=[[0, 1], [2, 3]]", op, f32,
             lambda v, op=op: getattr(fc, op)(v, "i", axis_index_groups=[[0, 1], [2, 3]]),
             None, NotImplementedError, "axis_index_groups is not supported"),
            (f"{op}-backend", "backend='tpu'", op, f32,
             lambda v, op=op: OPS[op](v, backend="tpu"), None, ValueError,
             "backend must be one of"),
            (f"{op}-config-type", "config={'bits': 8}", op, f32,
             lambda v, op=op: getattr(fc, op)(v, "i", config={"bits": 8}), None, TypeError,
             "config must be a jax_flashcomm.CommConfig"),
        ]
    cases += [
        ("psum-rs-bits-1", "rs_bits=1", "psum", f32, lambda v: OPS["psum"](v, rs_bits=1),
         None, ValueError, "rs_bits must be in 2..8, got 1"),
        ("psum-ag-bits-9", "ag_bits=9", "psum", f32, lambda v: OPS["psum"](v, ag_bits=9),
         None, ValueError, "ag_bits must be in 2..8, got 9"),
        ("psum-grad", "grad='approx'", "psum", f32, lambda v: OPS["psum"](v, grad="approx"),
         None, ValueError, "grad must be one of"),
        ("psum-min-bytes", "min_bytes=-1", "psum", f32,
         lambda v: fc.psum(v, "i", min_bytes=-1), None, ValueError,
         "min_bytes must be a non-negative int"),
        # shapes not divisible by the axis
        ("psum_scatter-tiled-indivisible", "tiled, 6 rows over 4 ranks", "psum_scatter", f32,
         lambda v: fc.psum_scatter(v[:6], "i", tiled=True, **Q), None, ValueError,
         "scatter_dimension 0 has size 6, not a multiple of the axis size 4"),
        ("psum_scatter-untiled-size", "untiled, dimension 16 != 4 ranks", "psum_scatter",
         f32, lambda v: fc.psum_scatter(v, "i", **Q), None, ValueError,
         "with tiled=False scatter_dimension 0 must have the axis size 4, got 16"),
        ("matmul_reduce_scatter-indivisible", "6 rows over 4 ranks", "matmul_reduce_scatter",
         ((6, 32), jnp.float32), lambda x, w: MM["matmul_reduce_scatter"](x, w), (32, 32),
         ValueError, r"rows not divisible: x.shape\[0\]=6 is not a multiple of the size 4"),
        # dimensions
        ("psum_scatter-0d", "0-d operand", "psum_scatter", f32,
         lambda v: fc.psum_scatter(v[0, 0], "i", **Q), None, ValueError,
         "scatter_dimension=0 is out of range for an operand of rank 0"),
        ("all_gather-0d-tiled", "0-d operand, tiled=True", "all_gather", f32,
         lambda v: fc.all_gather(v[0, 0], "i", tiled=True, **Q), None, ValueError,
         "axis=0 is out of range for an operand of rank 0"),
        ("all_gather-axis-range", "axis=5", "all_gather", f32,
         lambda v: fc.all_gather(v, "i", axis=5, **Q), None, ValueError,
         "axis=5 is out of range"),
        ("psum_scatter-dim-type", "scatter_dimension=0.0", "psum_scatter", f32,
         lambda v: fc.psum_scatter(v, "i", scatter_dimension=0.0, tiled=True, **Q), None,
         TypeError, "scatter_dimension must be an int"),
        ("all_gather_matmul-0d", "0-d x", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x[0, 0], w), (32, 32), ValueError,
         "x must have at least 2 dims"),
        # matmul operands that do not contract
        ("all_gather_matmul-contract", "x (., 32) @ w (48, .)", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x, w), (48, 32), ValueError,
         r"shapes do not contract: x.shape\[-1\]=32"),
        ("matmul_reduce_scatter-contract", "x (., 32) @ w (48, .)", "matmul_reduce_scatter",
         mmx, lambda x, w: MM["matmul_reduce_scatter"](x, w), (48, 32), ValueError,
         r"shapes do not contract: x.shape\[-1\]=32"),
        ("all_gather_matmul-w-3d", "w of rank 3", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x, w[..., None]), (32, 32), ValueError,
         "w must be 2-D"),
        ("all_gather_matmul-axis-contraction", "axis=-1 (the contraction)",
         "all_gather_matmul", mmx, lambda x, w: MM["all_gather_matmul"](x, w, axis=-1),
         (32, 32), ValueError, "is the contraction dimension of x"),
        ("all_gather_matmul-bits-9", "bits=9", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x, w, bits=9), (32, 32), ValueError,
         "bits must be in 2..8, got 9"),
        ("all_gather_matmul-group-12", "group_size=12", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x, w, bits=4, group_size=12), (32, 32),
         ValueError, "group_size must be a positive multiple of 8, got 12"),
        ("all_gather_matmul-axis-unknown", "unknown axis name 'j'", "all_gather_matmul", mmx,
         lambda x, w: fc.all_gather_matmul(x, w, "j"), (32, 32), ValueError,
         "axis 'j' is not bound"),
        ("matmul_reduce_scatter-axis-int", "axis name 3", "matmul_reduce_scatter", mmx,
         lambda x, w: fc.matmul_reduce_scatter(x, w, 3), (32, 32), TypeError,
         "axis_name must be a mesh axis name"),
        ("all_gather_matmul-backend", "backend='tpu'", "all_gather_matmul", mmx,
         lambda x, w: MM["all_gather_matmul"](x, w, bits=8, backend="tpu"), (32, 32),
         ValueError, "backend must be one of"),
    ]
    return cases


CASES = _cases()
PAYLOAD_CASES = [
    ("codes-sliced", lambda p: dataclasses.replace(p, codes=p.codes[:, :10]), ValueError,
     r"payload arrays do not match: codes \(2, 10\), scale \(2,\)"),
    ("scale-dropped-group", lambda p: dataclasses.replace(p, scale=p.scale[:1]), ValueError,
     "payload arrays do not match"),
    ("codes-swapped-with-scale",
     lambda p: dataclasses.replace(p, codes=p.scale, scale=p.codes), TypeError,
     "payload.codes must be a uint8 array, got bfloat16"),
    ("scale-f32", lambda p: dataclasses.replace(p, scale=p.scale.astype(jnp.float32)),
     TypeError, "payload.scale must be a bfloat16 array, got float32"),
    ("shape-too-big", lambda p: dataclasses.replace(p, shape=(1000,)), ValueError,
     r"payload has 2 groups of 128 values, fewer than the 1000 of its shape \(1000,\)"),
    ("bits-changed", lambda p: dataclasses.replace(p, bits=8), ValueError,
     "codes .*groups, 128. for bits=8"),
    ("not-a-payload", lambda p: p.codes, TypeError, "payload must be a jax_flashcomm.codec"),
]


def _mesh4():
    return jax.make_mesh((4,), ("i",), devices=jax.devices()[:4],
                         axis_types=(jax.sharding.AxisType.Explicit,))


def trace_case(mesh, x_spec, body, w_shape):
    """jit(shard_map(body)).trace on abstract inputs: nothing runs, only tracing."""
    (shape, dtype) = x_spec
    x = jax.ShapeDtypeStruct((4 * shape[0], *shape[1:]), dtype,
                             sharding=NamedSharding(mesh, P("i")))
    if w_shape is None:
        f = jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
        return jax.jit(f).trace(x)
    w = jax.ShapeDtypeStruct((w_shape[0], 4 * w_shape[1]), jnp.float32,
                             sharding=NamedSharding(mesh, P(None, "i")))
    f = jax.shard_map(body, mesh=mesh, in_specs=(P("i"), P(None, "i")), out_specs=P("i"))
    return jax.jit(f).trace(x, w)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises_at_trace_time(case):
    _, _, _, x_spec, body, w_shape, exc, match = case
    with pytest.raises(exc, match=match):
        trace_case(_mesh4(), x_spec, body, w_shape)


@pytest.mark.parametrize("op", ["psum", "pmean", "psum_scatter", "all_gather",
                                "all_gather_matmul"])
def test_f64_raises_with_x64(op):
    """f64 exists only with x64 enabled; the quantized ops reject it (the exact ring matmuls
    accept any float, like jnp.matmul)."""
    with jax.enable_x64(True):
        if op == "all_gather_matmul":
            with pytest.raises(TypeError, match=r"all_gather_matmul: x \(quantized with "
                                                r"bits=8\) must have dtype .*got float64"):
                trace_case(_mesh4(), ((16, 32), jnp.float64),
                           lambda x, w: MM[op](x, w, bits=8), (32, 32))
            trace_case(_mesh4(), ((16, 32), jnp.float64), lambda x, w: MM[op](x, w, bits=None),
                       (32, 32))
        else:
            with pytest.raises(TypeError, match="x must have dtype float32, bfloat16, "
                                                "float16; got float64"):
                trace_case(_mesh4(), ((16, 256), jnp.float64), OPS[op], None)


@pytest.mark.parametrize("case", PAYLOAD_CASES, ids=[c[0] for c in PAYLOAD_CASES])
@pytest.mark.parametrize("backend", ["ffi", "jnp"])
def test_mismatched_payload_raises_at_trace_time(case, backend):
    """A Payload is a pytree: arrays that disagree with each other or with its metadata are
    rejected before any kernel (the jnp twin would broadcast them into a wrong result)."""
    _, mutate, exc, match = case

    def f(x):
        p = codec.quantize(x, bits=4, group_size=128, backend=backend)
        return codec.dequantize(mutate(p), backend=backend)

    with pytest.raises(exc, match=match):
        jax.jit(f).trace(jnp.ones(256, jnp.float32))


def test_codec_bad_arguments():
    x = jnp.ones(64)
    with pytest.raises(ValueError, match="bits must be in 2..8, got 9"):
        jax.jit(lambda a: codec.quantize(a, bits=9)).trace(x)
    with pytest.raises(ValueError, match="x is empty"):
        jax.jit(lambda a: codec.quantize(a[:0])).trace(x)
    with pytest.raises(TypeError, match="x must have dtype .*got int32"):
        jax.jit(lambda a: codec.quantize(a.astype(jnp.int32))).trace(x)


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
