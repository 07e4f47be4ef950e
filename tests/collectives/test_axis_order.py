"""The collectives and ring ops of the library over orderings of subsets of the axes of a 2x4
and a 2x2x2 mesh (the quantized collectives over all 19, the ring ops over 12 that stand for
them, RING_CASES), against the lax composition each replaces (issue: the ring matmuls
numbered ranks in mesh order, lax in the order of the axis tuple, and gave wrong values).

Ring ops (exact): values and gradients, unidirectional and bidirectional, within the f32 bound
of two evaluations of the same dot products and sums, ``2 (K + N) eps32`` times the same
composition on absolute values. Quantized all_gather_matmul: against ``lax.all_gather`` of the
codec's own round trip. ``tp_attention`` (ring in, ring out, softmax between): as accurate as the
unfused lax block against the block in float64 (tests/collectives/test_attention_block.py's criterion). Quantized psum / psum_scatter / all_gather: within the error bounds
derived from their stored scales (tests/support/collective_oracles.py).
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from tests.support.collective_oracles import all_gather_check, psum_check, psum_scatter_check
from tests.support.meshes import AXIS_TYPES
from tests.support.pairwise import full_grids
from jax_flashcomm import codec
from jax_flashcomm import tp_attention

EPS32 = float(np.finfo(np.float32).eps)
MESHES = {"2x4": ((2, 4), ("a", "b")), "2x2x2": ((2, 2, 2), ("a", "b", "c"))}
# Every subset of the axes (single axes too: a ring over one axis of a 2x2x2 mesh) in every
# order: 19 axis tuples.
CASES = [(m, axes) for m, (_, names) in MESHES.items()
         for k in range(1, len(names) + 1)
         for subset in itertools.combinations(names, k)
         for axes in itertools.permutations(subset)]
K, COLS, ROWS = 16, 8, 4   # contraction, columns, local rows (even: bidirectional halves)
# The ring ops' rows: every axis tuple of the 2x4 mesh; of the 2x2x2 mesh (its three axes alike
# in size), one single axis, an adjacent pair and a non-adjacent one in both orders, and the
# triples in mesh order, reversed, rotated and with a swap; alternately Explicit and Auto, and
# the reversed tuples (the orders lax numbers differently from the mesh) on both.
RING_CASES = [("2x4", ("a",)), ("2x4", ("b",)), ("2x4", ("a", "b")), ("2x4", ("b", "a")),
              ("2x2x2", ("b",)), ("2x2x2", ("a", "c")), ("2x2x2", ("c", "a")),
              ("2x2x2", ("b", "c")), ("2x2x2", ("a", "b", "c")), ("2x2x2", ("c", "b", "a")),
              ("2x2x2", ("b", "c", "a")), ("2x2x2", ("a", "c", "b"))]
assert all(case in CASES for case in RING_CASES)
RING_ROWS = ([(m, a, ("explicit", "auto")[i % 2]) for i, (m, a) in enumerate(RING_CASES)]
             + [("2x4", ("b", "a"), "explicit"), ("2x2x2", ("c", "b", "a"), "explicit"),
                ("2x2x2", ("c", "a"), "auto")])
if full_grids():  # FLASHCOMM_TEST_FULL_GRIDS=1: all 19 tuples on both axis types
    RING_ROWS = [(m, a, t) for m, a in CASES for t in sorted(AXIS_TYPES)]


def _mesh(name, axis_type):
    shape, names = MESHES[name]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(names),
                         devices=jax.devices()[:int(np.prod(shape))])


def _ax(axes):
    return axes if len(axes) > 1 else axes[0]


@functools.lru_cache(maxsize=None)
def _ring_program(mesh, axes):
    """Per rank: (value, reference, bound) of each ring op, its gradients included."""
    ax = _ax(axes)
    names = mesh.axis_names

    def ops(x, w, xs, ct_ag, ct_rs):
        out = []
        for bid in (False, True):
            def agmm(x, w, ct, bid=bid):
                return jnp.vdot(fc.all_gather_matmul(x, w, ax, bidirectional=bid), ct)

            def agmm_ref(x, w, ct):
                return jnp.vdot(lax.all_gather(x, ax, tiled=True) @ w, ct)

            def mrs(xs, w, ct, bid=bid):
                return jnp.vdot(fc.matmul_reduce_scatter(xs, w, ax, bidirectional=bid), ct)

            def mrs_ref(xs, w, ct):
                return jnp.vdot(lax.psum_scatter(xs @ w, ax, tiled=True), ct)

            for f, ref, args in ((agmm, agmm_ref, (x, w, ct_ag)), (mrs, mrs_ref, (xs, w, ct_rs))):
                val = jax.value_and_grad(f, argnums=(0, 1))(*args)
                want = jax.value_and_grad(ref, argnums=(0, 1))(*args)
                # the same composition on absolute values bounds the rounding of both
                absval = jax.value_and_grad(ref, argnums=(0, 1))(*map(jnp.abs, args))
                out.append((val, want, absval))
        q = fc.all_gather_matmul(x, w, ax, bits=4, group_size=8, spikes=0, min_bytes=0)
        rt = codec.dequantize(codec.quantize(x, bits=4, group_size=8, backend="jnp"),
                              backend="jnp")
        q_ref = lax.all_gather(rt, ax, tiled=True) @ w
        return out, (q, q_ref)

    def body(x, w, xs, ct_ag, ct_rs):
        out, (q, q_ref) = ops(x, w, xs, ct_ag, ct_rs)
        flat = [jnp.ravel(a) for triple in out for part in triple
                for a in jax.tree.leaves(part)]
        row = jnp.concatenate([*flat, jnp.ravel(q), jnp.ravel(q_ref)])
        return row[None]

    spec = P(names)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec,) * 5, out_specs=spec))


@pytest.mark.parametrize("mesh_name,axes,axis_type",
                         [(m, a, AXIS_TYPES[t]) for m, a, t in RING_ROWS],
                         ids=[f"{t}-{m}-{''.join(a)}" for m, a, t in RING_ROWS])
def test_ring_ops_follow_lax_rank_order(mesh_name, axes, axis_type):
    mesh = _mesh(mesh_name, axis_type)
    nd = int(np.prod(mesh.devices.shape))
    n = int(np.prod([mesh.shape[a] for a in axes]))
    rng = np.random.RandomState(0)
    arrays = [rng.randn(nd, ROWS, K), rng.randn(nd, K, COLS), rng.randn(nd, n * ROWS, K),
              rng.randn(nd, n * ROWS, COLS), rng.randn(nd, ROWS, COLS)]
    # w and xs must be the same on every rank of a group only for the lax reference to be the
    # same function; here every rank has its own (varying) w, as lax allows.
    put = lambda a: jax.device_put(jnp.asarray(a, jnp.float32).reshape(-1, *a.shape[2:]),
                                   NamedSharding(mesh, P(mesh.axis_names)))  # noqa: E731
    row = np.asarray(_ring_program(mesh, axes)(*map(put, arrays)), np.float64)
    # unpack per rank: for each of 4 ops, (value, grad x, grad w) x (ours, lax, lax on |.|)
    sizes = []
    for op in range(4):
        shapes = [(), (ROWS, K) if op % 2 == 0 else (n * ROWS, K), (K, COLS)]
        sizes.append([int(np.prod(s)) for s in shapes])
    for r in range(nd):
        rest = row[r]
        for op in range(4):
            parts = []
            for _ in range(3):
                vals = []
                for size in sizes[op]:
                    vals.append(rest[:size])
                    rest = rest[size:]
                parts.append(vals)
            ours, want, absval = parts
            depth = K + n + n * ROWS   # dot length, ring steps, and the vdot of the cotangent
            for o, wv, a in zip(ours, want, absval):
                assert np.all(np.abs(o - wv) <= 2 * depth * EPS32 * np.abs(a) + 1e-30), (
                    f"{['agmm', 'mrs'][op % 2]} bidirectional={op >= 2} over {axes}: "
                    f"max |diff| {np.abs(o - wv).max():.3g}")
        q, q_ref = rest[:len(rest) // 2], rest[len(rest) // 2:]
        bound = 2 * (K + n) * EPS32 * np.abs(q_ref).max() * 4
        assert np.abs(q - q_ref).max() <= bound, f"quantized agmm over {axes}"


@pytest.mark.parametrize("mesh_name,axes", CASES, ids=[f"{m}-{''.join(a)}" for m, a in CASES])
def test_quantized_collectives_follow_lax_rank_order(mesh_name, axes):
    mesh = _mesh(mesh_name, jax.sharding.AxisType.Explicit)
    nd = int(np.prod(mesh.devices.shape))
    n = int(np.prod([mesh.shape[a] for a in axes]))
    x = np.random.RandomState(1).randn(nd, 2 * n, 64).astype(np.float32)
    config = fc.CommConfig(bits=4, group_size=16, min_bytes=0)
    for y, true, bound in (psum_check(mesh, axes, x, config),
                           psum_scatter_check(mesh, axes, x, config, 0, True),
                           all_gather_check(mesh, axes, x, config, 0, True)):
        assert np.all(np.abs(np.asarray(y, np.float64) - true) <= bound)


HEADS, DH, S_LOCAL = 2, 4, 3   # odd local positions: the bidirectional split is uneven too
U32 = EPS32 / 2


@functools.lru_cache(maxsize=None)
def _attention_program(mesh, axes, dtype, variants):
    """Per variant (a tp_attention keyword set): the block's value and its vjp, over ``axes``."""
    ax = _ax(axes)
    xspec, specs = P(None, axes, None), (P(None, axes, None), P(None, axes), P(axes, None))

    def program(x, w_qkv, w_o, ct):
        outs = []
        for kw in variants:
            fn = functools.partial(tp_attention, axis_name=ax, num_heads=HEADS, **dict(kw))
            sm = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=xspec)
            y, vjp = jax.vjp(sm, x, w_qkv, w_o)
            outs.append((y, *vjp(ct)))
        return outs

    put = lambda a, spec: jax.device_put(jnp.asarray(a, dtype), NamedSharding(mesh, spec))  # noqa
    return jax.jit(program), lambda *a: [put(x, s) for x, s in zip(a, specs + (xspec,))]


def _attention_operands(n):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((2, n * S_LOCAL, K)),
            rng.standard_normal((K, n * 3 * HEADS * DH)) / np.sqrt(K),
            rng.standard_normal((n * HEADS * DH, K)) / np.sqrt(HEADS * DH),
            rng.standard_normal((2, n * S_LOCAL, K)))


@functools.lru_cache(maxsize=None)
def _exact_attention(mesh_name, axes, variants):
    """The unfused block in float64 over ``axes`` in mesh order: the global result is the same
    function of the global operands whatever the order, so one evaluation serves them all."""
    mesh = _mesh(mesh_name, jax.sharding.AxisType.Explicit)
    ops = _attention_operands(int(np.prod([mesh.shape[a] for a in axes])))
    with jax.enable_x64(True):
        fn64, put64 = _attention_program(mesh, axes, np.float64, variants)
        (exact,) = [[np.asarray(a) for a in v] for v in fn64(*put64(*ops))]
    return exact


# Tuples of two or more axes (a single axis has one order: tests/collectives/test_attention_block.py runs
# the block over one axis of 1-D and 2-D meshes). The ring ops above run the orders; the block,
# built from them, runs the reversed order of the 2-D mesh, a reversed non-adjacent pair of the
# 3-D mesh, and its triples reversed and rotated (orders where a rank numbering that differs
# from lax's scrambles the sequence).
TUPLE_CASES = [("2x4", ("b", "a")), ("2x2x2", ("c", "a")), ("2x2x2", ("c", "b", "a")),
               ("2x2x2", ("b", "c", "a"))]
assert all(case in CASES for case in TUPLE_CASES)


@pytest.mark.parametrize("mesh_name,axes", TUPLE_CASES,
                         ids=[f"{m}-{''.join(a)}" for m, a in TUPLE_CASES])
def test_tp_attention_follows_lax_rank_order(mesh_name, axes):
    """The ring attention block over a tuple of axes (uni- and bidirectional) is as accurate as
    the unfused lax block, values and gradients: a rank order that differs from lax's scrambles
    the sequence and fails by O(1)."""
    mesh = _mesh(mesh_name, jax.sharding.AxisType.Explicit)
    n = int(np.prod([mesh.shape[a] for a in axes]))
    ops = _attention_operands(n)
    variants = ((("bidirectional", False),), (("bidirectional", True),),
                (("decomposed", False),))
    fn, put = _attention_program(mesh, axes, np.float32, variants)
    uni, bidi, unfused = [[np.asarray(a, np.float64) for a in v] for v in fn(*put(*ops))]
    exact = _exact_attention(mesh_name, tuple(sorted(axes)), variants[2:])
    for ring, label in ((uni, "uni"), (bidi, "bidi")):
        for name, r, u, e in zip(("out", "dx", "dw_qkv", "dw_o"), ring, unfused, exact):
            ring_err, ref_err = np.max(np.abs(r - e)), np.max(np.abs(u - e))
            bound = 2 * ref_err + 4 * U32 * np.max(np.abs(e))
            assert ring_err <= bound, (f"tp_attention {label} over {axes}, {name}: error "
                                       f"{ring_err:.3g} > {bound:.3g} (unfused {ref_err:.3g})")
