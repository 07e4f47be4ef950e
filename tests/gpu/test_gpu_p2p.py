"""The CUDA p2p handlers (one process, several GPUs) and the CUDA ring steps give the ``xla``
transport's bits, leave no meeting or ring step behind, and survive many calls in a row.

They need two or more GPUs in one process; with fewer every test here skips, saying so. Without
a GPU the same programs are lowered for CUDA on CPU devices: they must trace with the package
as it is and call the CUDA p2p and ring targets. What this does not cover (docs/cuda.md, "What
is untested"): a missing peer's timeout on CUDA, compute-sanitizer runs, a profile of the copies
overlapping the dots.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.transport import p2p, ring_steps

from tests.gpu.gpu_support import assert_same_bits, gpu_devices, host

pytestmark = pytest.mark.gpu

CONFIGS = (
    fc.CommConfig(bits=8, group_size=128, min_bytes=0, rotation=0, spikes=0),
    fc.CommConfig(bits=4, ag_bits=8, group_size=32, min_bytes=0, rotation=1, spikes=1),
)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
ROWS, COLS = 8, 250
M, K, N = 6, 64, 16  # ring matmuls: rows per rank, contraction, columns per rank
CALLS = 20           # calls in a row (a scan), for buffer reuse and call counting


def _with(config, transport):
    return dataclasses.replace(config, backend="ffi", transport=transport,
                               p2p_timeout_ms=30_000)


def _n_gpus(gpus):
    """A ring of 2, 4 or 8 GPUs (the operands' rows divide by it)."""
    gpus(2)
    return 1 << (min(len(gpu_devices()), 8).bit_length() - 1)


def _mesh(devices, shape, names):
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names)


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


@functools.lru_cache(maxsize=None)
def _collectives(mesh, axes, config):
    names = mesh.axis_names
    ax = axes if len(axes) > 1 else axes[0]

    def body(v):
        v = v.reshape(ROWS, COLS)

        def step(carry, _):
            return carry + fc.psum(v, ax, config=config), None

        looped, _ = jax.lax.scan(step, jnp.zeros_like(v), None, length=CALLS)
        return tuple(r[None] for r in (
            fc.psum(v, ax, config=config),
            fc.psum_scatter(v, ax, scatter_dimension=0, tiled=True, config=config),
            fc.all_gather(v, ax, axis=1, tiled=True, config=config),
            looped))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names), out_specs=(P(names),) * 4))


def _operand(n, dtype, seed):
    rng = np.random.default_rng(seed)
    return jnp.asarray(rng.standard_normal((n, ROWS, COLS)) * 4, jnp.float32).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"b{c.bits}-r{c.rotation}-k{c.spikes}")
def test_p2p_collectives_bit_identical_to_xla(gpus, config, dtype):
    n = _n_gpus(gpus)
    meshes = [((n,), ("i",), ("i",))]
    if n >= 4:  # a 2-D mesh reducing over one axis: the replica groups
        meshes += [((2, n // 2), ("a", "b"), ("b",)), ((2, n // 2), ("a", "b"), ("a",))]
    x = _operand(n, dtype, seed=config.bits)
    for shape, names, axes in meshes:
        mesh = _mesh(gpu_devices()[:n], shape, names)
        xs = _put(mesh, x)
        got = host(_collectives(mesh, axes, _with(config, "p2p"))(xs))
        want = host(_collectives(mesh, axes, _with(config, "xla"))(xs))
        for name, g, w in zip(("psum", "psum_scatter", "all_gather", "psum x20"), got, want):
            assert_same_bits(g, w, f"p2p {name} on {shape} over {axes}, {config}")
        assert p2p.meetings_in_progress() == 0


@functools.lru_cache(maxsize=None)
def _rings(mesh, transport):
    ax = mesh.axis_names[0]
    n = mesh.shape[ax]
    exact = fc.CommConfig(bits=None, transport=transport, p2p_timeout_ms=30_000)
    quant = fc.CommConfig(bits=8, group_size=32, min_bytes=0, transport=transport,
                          p2p_timeout_ms=30_000)

    def body(x, w):
        return tuple(r[None] for r in (
            fc.all_gather_matmul(x, w, ax, config=exact),
            fc.all_gather_matmul(x, w, ax, bidirectional=True, config=exact),
            fc.all_gather_matmul(x, w, ax, config=quant),
            fc.matmul_reduce_scatter(jnp.tile(x, (n, 1)), w, ax, config=exact),
            fc.matmul_reduce_scatter(jnp.tile(x, (n, 1)), w, ax, bidirectional=True,
                                     config=exact)))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(ax), P(None, ax)),
                                 out_specs=(P(ax),) * 5))


def _ring_operands(n):
    rng = np.random.default_rng(5)
    return (jnp.asarray(rng.standard_normal((n * M, K)), jnp.float32),
            jnp.asarray(rng.standard_normal((K, n * N)), jnp.float32))


def test_ring_steps_bit_identical_to_xla(gpus):
    """all_gather_matmul (plain, bidirectional, int8) and matmul_reduce_scatter (plain,
    bidirectional) with the CUDA ring steps give the xla transport's bits; no step left."""
    n = _n_gpus(gpus)
    mesh = _mesh(gpu_devices()[:n], (n,), ("i",))
    x, w = _ring_operands(n)
    args = (jax.device_put(x, NamedSharding(mesh, P("i"))),
            jax.device_put(w, NamedSharding(mesh, P(None, "i"))))
    got = host(_rings(mesh, "p2p")(*args))
    want = host(_rings(mesh, "xla")(*args))
    for name, g, wa in zip(("ag", "ag_bidi", "ag_int8", "rs", "rs_bidi"), got, want):
        assert_same_bits(g, wa, f"ring {name} over {n} GPUs")
    assert ring_steps.steps_in_progress() == 0


def test_p2p_many_calls(gpus):
    """100 calls of one executable: every result the xla transport's, nothing left over."""
    n = _n_gpus(gpus)
    mesh = _mesh(gpu_devices()[:n], (n,), ("i",))
    f_p2p = _collectives(mesh, ("i",), _with(CONFIGS[1], "p2p"))
    f_xla = _collectives(mesh, ("i",), _with(CONFIGS[1], "xla"))
    for i in range(100):
        xs = _put(mesh, _operand(n, jnp.bfloat16, seed=100 + i))
        assert_same_bits(host(f_p2p(xs)[0]), host(f_xla(xs)[0]), f"call {i}")
    assert p2p.meetings_in_progress() == 0


@functools.lru_cache(maxsize=None)
def _exact(mesh, two_shot):
    def body(v):
        return p2p.exact_all_reduce(v, ("i",), 30_000, two_shot=two_shot)[None]
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=P("i")))


@pytest.mark.parametrize("two_shot", [False, True, None])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
def test_exact_p2p_psum_is_the_f32_rank_order_sum(gpus, dtype, two_shot):
    """The exact all-reduce over the CUDA p2p handlers: every GPU gets the same bits, the sum
    in f32 in rank order rounded once (the CPU handlers' values)."""
    n = _n_gpus(gpus)
    mesh = _mesh(gpu_devices()[:n], (n,), ("i",))
    x = _operand(n, dtype, seed=7).reshape(n * ROWS, COLS)
    got = host(_exact(mesh, two_shot)(_put(mesh, x)))
    want = np.asarray(x, np.float32).reshape(n, ROWS, COLS).sum(0)  # rank order, f32
    want = np.asarray(jnp.asarray(want).astype(dtype))
    for rank in range(n):
        assert_same_bits(got[rank], want, f"rank {rank}, {dtype}")
    assert p2p.meetings_in_progress() == 0


def test_programs_lower_for_cuda(cuda_module, monkeypatch):
    """Without a GPU: the p2p and ring programs trace (on 2 CPU devices, the default backend
    reported as "gpu" so that the transports pick the CUDA module's kernels) and call the CUDA
    p2p and ring targets when lowered for CUDA."""
    assert set(p2p.TARGETS) | set(ring_steps.TARGETS) <= set(cuda_module.registrations())
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    mesh = _mesh(jax.devices("cpu")[:2], (2,), ("i",))

    def targets(fn, *args):
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return set(re.findall(r"flashcomm_\w+", text))

    got = targets(_collectives(mesh, ("i",), _with(CONFIGS[1], "p2p")),
                  _put(mesh, _operand(2, jnp.bfloat16, 0)))
    got |= targets(_exact(mesh, None), _put(mesh, _operand(2, jnp.bfloat16, 0).reshape(
        2 * ROWS, COLS)))
    assert set(p2p.TARGETS) <= got, got
    x, w = _ring_operands(2)
    got = targets(_rings(mesh, "p2p"), jax.device_put(x, NamedSharding(mesh, P("i"))),
                  jax.device_put(w, NamedSharding(mesh, P(None, "i"))))
    assert set(ring_steps.TARGETS) <= got, got
