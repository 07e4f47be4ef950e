"""The benchmark's exact bf16 two-step all-reduce (benchmarks/collectives/bf16_baseline.py): exact, and its
collectives move bf16 bit patterns (u16), not XLA:CPU's f32-widened bf16.

Bound against ``lax.psum`` of the f32 upcast rounded to bf16. With ``S`` the exact sum of the
N bf16 operands (each exactly representable in f32), ``s1`` the two-step's f32 sum (rank order)
and ``s2`` lax.psum's f32 sum (XLA's order, not specified), each f32 sum of N terms has
``|s_i - S| <= gamma_{N-1} * sum_r |x_r|`` with ``gamma_k = k*u / (1 - k*u)``, ``u = 2^-24``.
Rounding to nearest bf16 errs by at most half a bf16 ulp of the value rounded:
``|bf16(s_i) - s_i| <= ulp_bf16(s_i) / 2``. Hence, per element,
``|y - ref| <= max(ulp_bf16(s1), ulp_bf16(s2)) + 2 * gamma_{N-1} * sum_r |x_r|``: one bf16 ulp
of the f32 sum, plus the f32 reordering term (tiny against it). The rank-order sum itself is
checked bit for bit.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from benchmarks.collectives.bf16_baseline import bf16_two_step_psum
from tests.support.meshes import make_mesh

N = 4


def _ulp_bf16(v):
    """Spacing of bf16 numbers at |v| (8 significant bits; subnormal floor 2^-133)."""
    a = np.abs(v.astype(np.float64))
    e = np.floor(np.log2(np.maximum(a, np.finfo(np.float32).tiny)))
    return np.exp2(np.maximum(e, -126) - 7)


def _run(shape, axis_type):
    mesh = make_mesh((N,), ("i",), axis_type)
    x = jax.random.normal(jax.random.key(1), (N, *shape), jnp.bfloat16) * 3
    x = jax.device_put(x, NamedSharding(mesh, P("i")))
    two = jax.jit(jax.shard_map(lambda v: bf16_two_step_psum(v[0], "i"), mesh=mesh,
                                in_specs=P("i"), out_specs=P()))
    ref = jax.jit(jax.shard_map(
        lambda v: lax.psum(v[0].astype(jnp.float32), "i"), mesh=mesh, in_specs=P("i"),
        out_specs=P()))
    return x, two, ref


def test_bf16_two_step_is_exact(axis_type):
    # 3*37 = 111 elements per rank: not a multiple of N, so the padding path runs.
    x, two, ref = _run((3, 37), axis_type)
    y = np.asarray(two(x)).astype(np.float32)
    s2 = np.asarray(ref(x))
    xs = np.asarray(x).astype(np.float32)
    s1 = xs[0]
    for r in range(1, N):
        s1 = s1 + xs[r]
    # bit for bit the rank-order f32 sum rounded once to bf16
    np.testing.assert_array_equal(y, s1.astype(jnp.bfloat16).astype(np.float32))
    u = 2.0 ** -24
    gamma = (N - 1) * u / (1 - (N - 1) * u)
    bound = (np.maximum(_ulp_bf16(s1), _ulp_bf16(s2))
             + 2 * gamma * np.abs(xs.astype(np.float64)).sum(0))
    want = s2.astype(jnp.bfloat16).astype(np.float64)
    assert np.all(np.abs(y.astype(np.float64) - want) <= bound)


def test_bf16_two_step_collectives_are_u16():
    x, two, _ = _run((64,), jax.sharding.AxisType.Explicit)
    hlo = two.lower(x).compile().as_text()
    ops = {}
    for line in hlo.splitlines():
        m = re.search(r"=\s*(.*?)\s(all-to-all|all-gather|all-reduce|reduce-scatter)"
                      r"(-start)?\(", line)
        if m:
            ops.setdefault(m.group(2), []).append(m.group(1))
    assert set(ops) == {"all-to-all", "all-gather"}, ops
    for op, types in ops.items():
        for t in types:
            elems = re.findall(r"\b([a-z]+\d*)\[", t)
            assert elems and set(elems) == {"u16"}, (op, t)
