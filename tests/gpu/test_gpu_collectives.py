"""psum / psum_scatter / all_gather with the CUDA codec give the CPU kernels' bits.

On one GPU the axis has one rank, where the public ops take the exact ``lax`` path (nothing to
communicate), so the quantized paths are run through their own functions (``two_step``,
``reduce_scatter_parts``, ``all_gather_parts``, the ``xla`` transport) with a plan that says
"quantized": quantize, all-to-all, fused dequantize-sum-quantize, all-gather, dequantize, all
on the GPU. With two or more GPUs the public ops run on a mesh of them (transport ``xla``:
NCCL moves the bytes) against the same ops on as many CPU devices.

Without a GPU the same programs are lowered for CUDA on CPU devices: they must trace with the
package as it is and emit the CUDA codec targets.
"""

from __future__ import annotations

import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm import allreduce, codec, scatter_gather
from jax_flashcomm.planner import _plan as planner

from tests.gpu.gpu_support import assert_same_bits, gpu_devices, host

pytestmark = pytest.mark.gpu

CONFIGS = (
    fc.CommConfig(bits=8, group_size=128, min_bytes=0, rotation=0, spikes=0),
    fc.CommConfig(bits=4, ag_bits=8, group_size=32, min_bytes=0, rotation=0, spikes=1),
    fc.CommConfig(bits=6, group_size=128, min_bytes=0, rotation=1, spikes=1),
    fc.CommConfig(bits=3, group_size=64, min_bytes=0, rotation=2, spikes=4),
)
DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
LOCAL = (8, 250)  # rows per rank, columns: 2000 values, not a multiple of 64 or 128


def _xla(config):
    return dataclasses.replace(config, backend="ffi", transport="xla")


def _mesh(devices, names=("i",)):
    shape = (len(devices),) if len(names) == 1 else (2, len(devices) // 2)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), names)


def _put(mesh, x):
    return jax.device_put(x, NamedSharding(mesh, P(mesh.axis_names)))


def _operand(n, dtype, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, *LOCAL)) * np.linspace(0.1, 30, LOCAL[1])
    x[:, 1, 7] = 300.0  # an outlier per rank
    return jnp.asarray(x, jnp.float32).astype(dtype)


# --- one rank: the quantized paths, forced ---------------------------------------------------

def _forced(op, axes, v, config):
    """The plan the op would make with two ranks, for the one rank there is: quantized."""
    p = planner.plan(op, axes, v.shape, v.dtype, 2, config, record=False)
    assert p.quantized, p
    return dataclasses.replace(p, axis_size=1, reason="one device: quantized path forced")


@functools.lru_cache(maxsize=None)
def _one_rank_program(mesh, config):
    axes = ("i",)

    def body(v):
        v = v[0]
        y, p1, p2 = allreduce.two_step(v, axes, _forced("psum", axes, v, config))
        ys, _ = scatter_gather.reduce_scatter_parts(v, axes, 0, True,
                                                    _forced("psum_scatter", axes, v, config))
        yg, _ = scatter_gather.all_gather_parts(v, axes, 1, True,
                                                _forced("all_gather", axes, v, config))
        bound = (codec.error_bound(p1, dtype=jnp.float32)
                 + codec.error_bound(p2, dtype=jnp.float32))
        return tuple(r[None] for r in (y, ys, yg, p1.codes, p2.codes, bound))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("i"), out_specs=(P("i"),) * 6))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"b{c.bits}-r{c.rotation}-k{c.spikes}")
def test_one_gpu_quantized_paths_bit_identical_to_cpu(gpu, config, dtype):
    config = _xla(config)
    x = _operand(1, dtype, seed=config.bits)
    got = host(_one_rank_program(_mesh([gpu]), config)(_put(_mesh([gpu]), x)))
    cpu = jax.devices("cpu")[:1]
    want = host(_one_rank_program(_mesh(cpu), config)(_put(_mesh(cpu), x)))
    for name, g, w in zip(("psum", "psum_scatter", "all_gather", "phase-1 codes",
                           "phase-2 codes"), got, want):
        assert_same_bits(g, w, f"{name} on one GPU, {config}, {jnp.dtype(dtype).name}")
    # one rank: the sum is its own operand, within the bounds of the two quantizations (and
    # the final rounding to the operand's dtype)
    x64, y64 = np.asarray(x, np.float64), np.asarray(got[0], np.float64)
    ulp = float(jnp.finfo(dtype).eps) * np.abs(x64)
    assert np.all(np.abs(y64 - x64) <= got[5] + ulp), "psum beyond its error bound"


def test_one_gpu_public_ops_are_exact(gpu):
    """On one rank the public ops take the lax path: no codec, the operand itself."""
    mesh = _mesh([gpu])
    x = _operand(1, jnp.bfloat16, seed=1)
    with planner.record() as plans:
        f = jax.jit(jax.shard_map(lambda v: fc.psum(v, "i", config=_xla(CONFIGS[0])),
                                  mesh=mesh, in_specs=P("i"), out_specs=P("i")))
        y = f(_put(mesh, x))
    assert [p.path for p in plans] == ["lax"], [str(p) for p in plans]
    assert_same_bits(np.asarray(y), np.asarray(x), "psum over one GPU")


# --- two or more GPUs: the public ops on a mesh of them --------------------------------------

@functools.lru_cache(maxsize=None)
def _mesh_program(mesh, config):
    names = mesh.axis_names
    ax = names if len(names) > 1 else names[0]

    def body(v):
        v = v.reshape(LOCAL)
        return tuple(r[None] for r in (
            fc.psum(v, ax, config=config),
            fc.psum_scatter(v, ax, scatter_dimension=0, tiled=True, config=config),
            fc.all_gather(v, ax, axis=0, tiled=True, config=config),
            lax.psum(v, names)))

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(names),
                                 out_specs=(P(names),) * 4))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"b{c.bits}-r{c.rotation}-k{c.spikes}")
def test_multi_gpu_collectives_bit_identical_to_cpu(gpus, config, dtype):
    gpus(2)
    n = 1 << (min(len(gpu_devices()), 8).bit_length() - 1)  # 2, 4 or 8: divides LOCAL[0]
    devices = gpu_devices()[:n]
    config = _xla(config)
    x = _operand(n, dtype, seed=10 + config.bits)
    got = host(_mesh_program(_mesh(devices), config)(_put(_mesh(devices), x)))
    cpu = jax.devices("cpu")[:n]
    want = host(_mesh_program(_mesh(cpu), config)(_put(_mesh(cpu), x)))
    for name, g, w in zip(("psum", "psum_scatter", "all_gather"), got, want):
        assert_same_bits(g, w, f"{name} over {n} GPUs, {config}, {jnp.dtype(dtype).name}")
    # every rank holds the same psum
    for r in range(1, n):
        assert_same_bits(got[0][r], got[0][0], f"psum rank {r} vs rank 0")


# --- no GPU: the same programs lowered for CUDA ----------------------------------------------

def _cuda_targets(fn, *args):
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return set(re.findall(r"flashcomm_\w+", text))


def test_programs_lower_for_cuda(cuda_module):
    """The one-rank and the mesh programs trace with the package as it is and call the CUDA
    codec targets when lowered for CUDA (on CPU devices; no GPU needed)."""
    config = _xla(CONFIGS[1])
    cpu1 = _mesh(jax.devices("cpu")[:1])
    targets = _cuda_targets(_one_rank_program(cpu1, config),
                            _put(cpu1, _operand(1, jnp.bfloat16, 0)))
    assert {"flashcomm_quantize", "flashcomm_dequantize_sum_quantize", "flashcomm_dequantize",
            "flashcomm_dequantize_sum"} <= targets, targets
    cpu2 = _mesh(jax.devices("cpu")[:2])
    targets = _cuda_targets(_mesh_program(cpu2, config), _put(cpu2, _operand(2, jnp.bfloat16, 0)))
    assert {"flashcomm_quantize", "flashcomm_dequantize_sum_quantize"} <= targets, targets
