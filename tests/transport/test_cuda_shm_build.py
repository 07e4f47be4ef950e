"""The transport between processes on CUDA (ffi/cuda/shm_handlers.cc: the CPU module's
shared-memory meeting point, CUDA IPC memory and event handles) without a GPU.

- The CUDA module registers the four ``flashcomm_shm_*`` collectives and the two ring steps,
  binds only the CPU module's meeting point capsule, and its handlers bind exactly the CPU
  handlers' operands, results and attributes.
- shm_handlers.cc and shm_ring_handlers.cc compile with g++ -Wall -Wextra -Werror.
- Lowered for "cuda" with the peers taken as processes, psum / psum_scatter / all_gather and the
  exact psum emit the ``flashcomm_shm_*`` typed-FFI calls with their ``axes_key``, and the
  collective matmuls emit ``flashcomm_shm_ring_start`` / ``_done`` pairs.

tests/gpu/test_gpu_shm.py runs the collectives on a GPU (two and three processes sharing one).
"""

from __future__ import annotations

import re

import jax
import pytest


import jax_flashcomm as fc
from jax_flashcomm.codec import kernels
from jax_flashcomm.transport import p2p, ring_steps, shm
from tests.support.cuda_build import ROOT, _custom_calls
from tests.support.cuda_p2p import _attr, _cuda_module, _mesh, compile_host_source, same_builders
from tests.transport.test_cuda_p2p_build import _lower_collectives

CPU_SOURCE = ROOT / "ffi" / "cpu" / "shm_handlers.cc"
CUDA_SOURCE = ROOT / "ffi" / "cuda" / "shm_handlers.cc"
HANDLERS = ("FlashcommShmAllReduce", "FlashcommShmReduceScatter", "FlashcommShmAllGather",
            "FlashcommShmPsum", "FlashcommShmExchange")
CPU_RING_SOURCE = ROOT / "ffi" / "cpu" / "shm_ring_handlers.cc"
CUDA_RING_SOURCE = ROOT / "ffi" / "cuda" / "shm_ring_handlers.cc"
RING_HANDLERS = ("FlashcommShmRingStart", "FlashcommShmRingDone")
RING_TARGETS = ("flashcomm_shm_ring_start", "flashcomm_shm_ring_done")


def test_cuda_module_registers_the_shm_collectives():
    module = _cuda_module()
    names = set(module.registrations())
    assert set(shm.TARGETS) | set(RING_TARGETS) <= names, sorted(names)
    assert set(shm.TARGETS) | set(RING_TARGETS) <= kernels.registered("cuda")
    assert module.shm_ring_steps_in_progress() == 0


def test_shm_bind_takes_only_the_cpu_meeting_point():
    module = _cuda_module()
    with pytest.raises((ValueError, TypeError)):
        module.shm_bind(kernels.cpu_module().registrations()["flashcomm_quantize"])
    module.shm_bind(kernels.cpu_module().shm_api())
    assert module.shm_bound()
    assert module.shm_peer_buffers_mapped() == 0
    assert module.shm_signal_channels() == 0  # none given out without a GPU


@pytest.mark.parametrize("cpu_source,cuda_source,handlers", [
    (CPU_SOURCE, CUDA_SOURCE, HANDLERS), (CPU_RING_SOURCE, CUDA_RING_SOURCE, RING_HANDLERS)])
def test_cuda_handlers_bind_what_the_cpu_handlers_bind(cpu_source, cuda_source, handlers):
    for h, (builder, _, cuda_ctx) in same_builders(cpu_source, cuda_source, handlers).items():
        # Between processes: the builders' shared variant (with axes_key), or the exact psum.
        assert builder[2] == "kShared" or builder[1] == "Psum", (h, builder)
        assert cuda_ctx[-1:] == ["ffi::PlatformStream<cudaStream_t>"], cuda_ctx


@pytest.mark.parametrize("source", [CUDA_SOURCE, CUDA_RING_SOURCE])
def test_shm_handlers_compile_with_warnings_as_errors(source, tmp_path):
    compile_host_source(source, tmp_path / "shm.o")


@pytest.fixture
def as_processes(as_gpu, monkeypatch):
    """Lowering as the process of a job whose peers are other processes (one GPU each)."""
    monkeypatch.setattr(p2p, "across_processes", lambda: True)


def test_cuda_lowering_emits_the_shm_targets(as_processes):
    config = fc.CommConfig(bits=4, ag_bits=8, min_bytes=0, rotation=2, spikes=1,
                                      transport="p2p", p2p_timeout_ms=4321)
    lowered, n = _lower_collectives(_mesh((4,), ("x",)), "x", config)
    calls = _custom_calls(lowered.as_text())
    quantized = [t for t in shm.TARGETS if t != "flashcomm_shm_psum"]
    assert set(quantized) <= set(calls), sorted(calls)
    assert not set(p2p.TARGETS) & set(calls)
    for target in quantized:
        (line,) = calls[target]
        assert _attr(line, "size") == str(n)
        assert _attr(line, "timeout_ms") == "4321"
        assert _attr(line, "axes_key") == str(p2p.axes_key(("x",)))
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines() if "custom-call(" in ln]
    for target in quantized:
        (line,) = [ln for ln in hlo if f'custom_call_target="{target}"' in ln]
        assert "api_version=API_VERSION_TYPED_FFI" in line, line


def test_cuda_lowering_exact_psum_over_shm(as_processes):
    config = fc.CommConfig(bits=None, transport="p2p")
    mesh = _mesh((4,), ("x",))

    def f(x):
        return fc.psum(x, "x", config=config)

    g = jax.shard_map(f, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    x = jax.ShapeDtypeStruct((4 * 4096,), jax.numpy.bfloat16,
                             sharding=jax.NamedSharding(mesh, jax.P("x")))
    text = jax.jit(g).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    (line,) = _custom_calls(text)["flashcomm_shm_psum"]
    assert _attr(line, "two_shot_bytes") == str(p2p.TWO_SHOT_BYTES)
    assert not re.search(r"stablehlo\.all_reduce", text)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_cuda_lowering_ring_matmuls_over_shm(as_processes, bidirectional):
    n, m, k, cols = 4, 6, 32, 8
    mesh = _mesh((n,), ("i",))

    def op(x, w):
        return fc.all_gather_matmul(x, w, "i", bidirectional=bidirectional, transport="p2p",
                                    p2p_timeout_ms=4321)

    f = jax.shard_map(op, mesh=mesh, in_specs=(jax.P("i"), jax.P(None, "i")),
                      out_specs=jax.P(None, "i"))
    x = jax.ShapeDtypeStruct((n * m, k), jax.numpy.bfloat16,
                             sharding=jax.NamedSharding(mesh, jax.P("i")))
    w = jax.ShapeDtypeStruct((k, n * cols), jax.numpy.bfloat16,
                             sharding=jax.NamedSharding(mesh, jax.P(None, "i")))
    text = jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",)).as_text()
    calls = _custom_calls(text)
    steps = (n - 1) * (2 if bidirectional else 1)
    assert len(calls.get(RING_TARGETS[0], [])) == len(calls.get(RING_TARGETS[1], [])) == steps
    assert not set(ring_steps.TARGETS) & set(calls)
    for line in calls[RING_TARGETS[0]] + calls[RING_TARGETS[1]]:
        assert _attr(line, "axes_key") == str(p2p.axes_key(("i",))), line
    assert not re.search(r"stablehlo\.(collective_permute|all_gather|all_to_all)", text)
