"""Hardening, bad input (docs/reliability.md, "Bad input"): every collective, ring matmul and
codec op raises a clear Python exception at trace time naming the argument (wrong dtypes and
shapes, f64 with x64, payloads whose arrays disagree with their metadata), never a crash or a
silent wrong answer. The accepted edge cases and the rest: test_reliability.py."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import codec
from jax_flashcomm import CommConfig

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
    # long function: the table of bad inputs, one entry per line
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
