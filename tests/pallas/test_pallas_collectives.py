"""transport="pallas" in Pallas's TPU interpret mode on CPU devices: psum, psum_scatter and
all_gather equal the xla transport with the jnp twin (backend="jnp") bit for bit, codes and
results; the race detector finds no race in either DMA execution mode; a non-finite group
poisons only itself."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.allreduce import two_step
from jax_flashcomm.transport import pallas, wire

FORMATS = {"int8": dict(bits=8), "int4": dict(bits=4), "fp8": dict(format="fp8")}


def _mesh(n):
    return jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])


def _run(n, fn, x):
    """``fn`` per rank under shard_map (check_vma=False: the interpreter needs it)."""
    mesh = _mesh(n)
    x = jax.device_put(x, NamedSharding(mesh, P("x")))
    f = jax.shard_map(lambda a: jax.tree.map(lambda b: b[None], fn(a[0])), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"), check_vma=False)
    return jax.tree.map(np.asarray, jax.jit(f)(x))


def _ops(a, transport, opts):
    """psum, psum_scatter, all_gather of ``a`` and the codes each sent, over ``transport``."""
    kw = dict(transport=transport, backend="jnp", min_bytes=0, **opts)
    y, p1, p2 = two_step(a, ("x",), fc.CommConfig(**kw))
    np.testing.assert_equal(y.shape, a.shape)
    y = fc.psum(a, "x", **kw)
    s = fc.psum_scatter(a, "x", scatter_dimension=1, tiled=True, **kw)
    g = fc.all_gather(a, "x", axis=1, tiled=True, **kw)
    return [y, wire.pack(p1), wire.pack(p2), s, g]


def _operand(n, dtype=jnp.float32, shape=(4, 96)):
    x = jax.random.normal(jax.random.key(n), (n, *shape), jnp.float32) * 4
    x = x.at[0, 1, 7].set(jnp.inf)          # a non-finite group on rank 0
    return x.astype(dtype)


def _bits(a):
    return a.view(np.uint8) if a.dtype != np.uint8 else a


@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_bit_equal_to_the_jnp_twin(n, fmt):
    """Every output (sum, phase-1 and phase-2 codes, scatter, gather) is the xla transport's
    with the jnp twin, bit for bit, at 2, 4 and 8 devices."""
    if n == 8 and fmt != "int8":
        pytest.skip("8 devices: int8 here, the other formats in the slow variant")
    x = _operand(n)
    got = _run(n, lambda a: _ops(a, "pallas", FORMATS[fmt]), x)
    want = _run(n, lambda a: _ops(a, "xla", FORMATS[fmt]), x)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, i
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"output {i}")


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_bit_equal_8_devices(fmt):
    """The other formats at 8 devices, bit for bit."""
    x = _operand(8)
    got = _run(8, lambda a: _ops(a, "pallas", FORMATS[fmt]), x)
    want = _run(8, lambda a: _ops(a, "xla", FORMATS[fmt]), x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.slow
@pytest.mark.parametrize("opts", [dict(bits=8, rotation=2), dict(bits=4, spikes=2),
                                  dict(format="nvfp4", spikes=1), dict(format="mxfp4")],
                         ids=["int8-signed-rotation", "int4-spikes", "nvfp4-spikes", "mxfp4"])
def test_rotation_spikes_and_fp4_bit_equal(opts):
    """Rotation, spikes and the FP4 formats run in the kernels too, bit for bit (bf16)."""
    x = _operand(4, jnp.bfloat16)
    got = _run(4, lambda a: _ops(a, "pallas", opts), x)
    want = _run(4, lambda a: _ops(a, "xla", opts), x)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("mode", ["eager", "on_wait"])
def test_no_race(mode):
    """The race detector finds no race in the three kernels, in both DMA execution modes."""
    pltpu.reset_tpu_interpret_mode_state()
    params = pltpu.InterpretParams(detect_races=True, dma_execution_mode=mode)
    with pallas.use_interpret(params):
        out = _run(4, lambda a: _ops(a, "pallas", dict(bits=8)), _operand(4))
    assert not pallas.races_found()
    want = _run(4, lambda a: _ops(a, "xla", dict(bits=8)), _operand(4))
    for g, w in zip(out, want):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_non_finite_group_poisons_only_itself():
    """The inf on rank 0 makes its group of the sum non-finite; every other group is finite."""
    n, g = 4, 128
    x = _operand(n)
    y = _run(n, lambda a: fc.psum(a, "x", transport="pallas", backend="jnp", min_bytes=0,
                                  bits=8), x)[0]
    flat = y.reshape(-1)
    groups = np.pad(flat, (0, -flat.size % g)).reshape(-1, g)
    bad = ~np.isfinite(groups).all(axis=1)
    assert bad.tolist() == [i == (1 * 96 + 7) // g for i in range(len(groups))]


def test_check_vma_is_a_clear_error():
    """Under check_vma=True the interpreter cannot run: a ValueError that says so."""
    mesh = _mesh(2)
    x = jax.device_put(_operand(2), NamedSharding(mesh, P("x")))
    f = jax.shard_map(lambda a: fc.psum(a, "x", transport="pallas", min_bytes=0), mesh=mesh,
                      in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ValueError, match="check_vma=False"):
        jax.jit(f)(x)


def _big_operand(n, dtype, shape, scale=1.0):
    """Normal values, with row 0 at +-1e38..2e38 (+2, +2, -2, -1, ... x 1e38 over the ranks;
    times ``scale``): the f32 sum in rank order overflows at its second term while the true
    sum and every chunk are finite, so the sum's scaled fallback gives it."""
    x = jax.random.normal(jax.random.key(n + 1), (n, *shape), jnp.float32) * 4
    big = jnp.array([2.0, 2.0, -2.0, -1.0] * (n // 4 + 1))[:n] * 1e38 * scale
    x = x.at[:, 0].set(big[:, None] + x[:, 0] * 1e35 * scale)
    return x.astype(dtype)


def _check_overflow_fallback(n, opts, dtype, shape):
    # rotated, a group of such values overflows in the butterflies: 1/G of them
    x = _big_operand(n, dtype, shape, 1 / 128 if opts.get("rotation") else 1.0)
    got = _run(n, lambda a: _ops(a, "pallas", opts), x)
    want = _run(n, lambda a: _ops(a, "xla", opts), x)
    if n >= 4 and not opts.get("rotation"):  # the plain sum overflows, the fallback not
        assert np.isfinite(got[0][:, 0]).all() and np.abs(got[0][:, 0]).max() > 1e37
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"output {i}")


def test_overflow_fallback_bit_equal():
    """Operands whose plain sum overflows: the sum's overflow fallback gives the twin's bits
    (the rotations: the slow variant)."""
    _check_overflow_fallback(4, dict(bits=8, rotation=0), jnp.float32, (4, 256))


def test_interpreted_codec_keeps_the_twins_barriers():
    """On data where evaluating the twin without its optimization barriers (as for Mosaic,
    pallas_base.eval_for_mosaic) changes a rotated code under XLA:CPU, the interpreted kernels
    keep the barriers and equal the xla transport."""
    from jax_flashcomm import codec
    from jax_flashcomm.transport import pallas_base

    x = jax.random.normal(jax.random.key(0), (4, 8, 128), jnp.float32)

    def codes(a):
        return codec.quantize(a, bits=8, group_size=128, backend="jnp", rotation=1).codes

    closed = jax.make_jaxpr(codes)(x[0])
    free = jax.jit(lambda a: pallas_base.eval_for_mosaic(closed.jaxpr, closed.consts, a)[0])
    assert any((np.asarray(jax.jit(codes)(c)) != np.asarray(free(c))).any() for c in x)
    opts = dict(bits=8, rotation=1)
    got = _run(4, lambda a: _ops(a, "pallas", opts), x)
    want = _run(4, lambda a: _ops(a, "xla", opts), x)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"output {i}")


_BARRIER_OPTS = {"int8-h": dict(bits=8, rotation=1), "int4-sh": dict(bits=4, rotation=2),
                 "int8": dict(bits=8, rotation=0)}
_BARRIER_SHAPES = [(4, 96), (3, 256), (2, 1000)]
_DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
# Every option with every shape and every dtype (18 cases, ~90 s on 2 cores) under
# FLASHCOMM_TEST_PALLAS_ALL=1; by default each option once, the three shapes and both dtypes
# among them (the interpreted kernels run the twin as it is: this is the fallback's check).
if os.environ.get("FLASHCOMM_TEST_PALLAS_ALL") == "1":
    _BARRIER_CASES = [(o, sh, d) for o in _BARRIER_OPTS for sh in _BARRIER_SHAPES
                      for d in _DTYPES]
else:
    _BARRIER_CASES = [("int8-h", (4, 96), "f32"), ("int4-sh", (3, 256), "bf16"),
                      ("int8", (2, 1000), "bf16")]


@pytest.mark.slow
@pytest.mark.parametrize("name,shape,dtype_name", _BARRIER_CASES)
def test_overflow_fallback_bit_equal_shapes(name, shape, dtype_name):
    """As above, over shapes, dtypes, rotations and bit widths (4 devices)."""
    _check_overflow_fallback(4, _BARRIER_OPTS[name], _DTYPES[dtype_name], shape)


@pytest.mark.parametrize("opts", [dict(bits=8), dict(format="fp8", spikes=1)],
                         ids=["int8", "fp8-spikes"])
def test_tiles_of_groups_keep_the_bits(opts):
    """With a VMEM budget below an operand's buffers, each op runs one kernel per tile of
    whole groups (uneven tiles included) and every output keeps the xla transport's bits."""
    x = _operand(2, shape=(8, 176))       # 11 groups of 128 per rank, 6 per chunk
    mesh = _mesh(2)
    fn = jax.shard_map(lambda a: _ops(a[0], "pallas", opts), mesh=mesh, in_specs=P("x"),
                       out_specs=P(), check_vma=False)
    with pallas.vmem_budget(12_000):
        xs = jax.device_put(x, NamedSharding(mesh, P("x")))
        calls = str(jax.make_jaxpr(fn)(xs)).count("pallas_call")
        got = _run(2, lambda a: _ops(a, "pallas", opts), x)
    assert calls > 2 * 3, calls           # more than one kernel for psum, scatter and gather
    want = _run(2, lambda a: _ops(a, "xla", opts), x)
    for i, (g, w) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(_bits(g), _bits(w), err_msg=f"output {i}")


def test_vmem_budget_must_be_positive():
    with pytest.raises(ValueError, match="must be > 0"):
        with pallas.vmem_budget(0):
            pass
