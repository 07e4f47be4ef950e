"""The transport between processes on CUDA (ffi/cuda/shm_handlers.cc: the CPU module's
shared-memory meeting point, CUDA IPC memory and event handles) without a GPU.

- The CUDA module registers the four ``flashcomm_shm_*`` collectives (no ring steps), binds
  only the CPU module's meeting point capsule, and its handlers bind exactly the CPU handlers'
  operands, results and attributes.
- shm_handlers.cc compiles with g++ -Wall -Wextra -Werror.
- Lowered for "cuda" with the peers taken as processes, psum / psum_scatter / all_gather and the
  exact psum emit the ``flashcomm_shm_*`` typed-FFI calls with their ``axes_key``; the
  collective matmul's ring is refused with a reason (no CUDA ring steps across processes).

tests/gpu/test_gpu_shm.py runs it on a GPU (two and three processes sharing one).
"""

from __future__ import annotations

import re

import jax
import pytest

import jax_flashcomm
from jax_flashcomm.codec import kernels
from jax_flashcomm.transport import p2p, ring, shm
from tests.support.cuda_build import ROOT, _custom_calls
from tests.support.cuda_p2p import _attr, _bindings, _cuda_module, _mesh, compile_host_source
from tests.transport.test_cuda_p2p_build import _lower_collectives

CPU_SOURCE = ROOT / "ffi" / "cpu" / "shm_kernels.cc"
CUDA_SOURCE = ROOT / "ffi" / "cuda" / "shm_handlers.cc"
HANDLERS = ("FlashcommShmAllReduce", "FlashcommShmReduceScatter", "FlashcommShmAllGather",
            "FlashcommShmPsum")


def test_cuda_module_registers_the_shm_collectives():
    module = _cuda_module()
    names = set(module.registrations())
    assert set(shm.TARGETS) <= names, sorted(names)
    assert not {"flashcomm_shm_ring_start", "flashcomm_shm_ring_done"} & names
    assert set(shm.TARGETS) <= kernels.registered("cuda")


def test_shm_bind_takes_only_the_cpu_meeting_point():
    module = _cuda_module()
    with pytest.raises((ValueError, TypeError)):
        module.shm_bind(kernels.cpu_module().registrations()["flashcomm_quantize"])
    module.shm_bind(kernels.cpu_module().shm_api())
    assert module.shm_bound()
    assert module.shm_peer_buffers_mapped() == 0
    assert module.shm_release_events() == 0  # none created without a GPU


def test_cuda_handlers_bind_what_the_cpu_handlers_bind():
    cpu, cuda = _bindings(CPU_SOURCE), _bindings(CUDA_SOURCE)
    assert {h + "Cpu" for h in HANDLERS} <= set(cpu), sorted(cpu)
    assert set(cuda) == {h + "Cuda" for h in HANDLERS}, sorted(cuda)
    for h in HANDLERS:
        cpu_sig = [e for e in cpu[h + "Cpu"] if e[0] != "Ctx"]
        cuda_sig = [e for e in cuda[h + "Cuda"] if e[0] != "Ctx"]
        assert len(cpu_sig) >= 8 and cuda_sig == cpu_sig, (h, cpu_sig, cuda_sig)
        assert "axes_key" in [e[2] for e in cuda_sig if e[0] == "Attr"]
        ctx = [e[1] for e in cuda[h + "Cuda"] if e[0] == "Ctx"]
        assert ctx == ["ffi::PlatformStream<cudaStream_t>"], ctx
    assert "CmdBuffer" not in CUDA_SOURCE.read_text()


def test_shm_handlers_compile_with_warnings_as_errors(tmp_path):
    compile_host_source(CUDA_SOURCE, tmp_path / "shm.o")


@pytest.fixture
def as_processes(as_gpu, monkeypatch):
    """Lowering as the process of a job whose peers are other processes (one GPU each)."""
    monkeypatch.setattr(p2p, "across_processes", lambda: True)


def test_cuda_lowering_emits_the_shm_targets(as_processes):
    config = jax_flashcomm.CommConfig(bits=4, ag_bits=8, min_bytes=0, rotation=2, spikes=1,
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
    config = jax_flashcomm.CommConfig(bits=None, transport="p2p")
    mesh = _mesh((4,), ("x",))

    def f(x):
        return jax_flashcomm.psum(x, "x", config=config)

    g = jax.shard_map(f, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))
    x = jax.ShapeDtypeStruct((4 * 4096,), jax.numpy.bfloat16,
                             sharding=jax.NamedSharding(mesh, jax.P("x")))
    text = jax.jit(g).trace(x).lower(lowering_platforms=("cuda",)).as_text()
    (line,) = _custom_calls(text)["flashcomm_shm_psum"]
    assert _attr(line, "two_shot_bytes") == str(p2p.TWO_SHOT_BYTES)
    assert not re.search(r"stablehlo\.all_reduce", text)


def test_ring_across_processes_on_cuda_is_refused(as_processes):
    reasons = []

    def f(x):
        reasons.append(ring.unsupported_reason(("x",)))
        return x

    mesh = _mesh((4,), ("x",))
    x = jax.ShapeDtypeStruct((8,), jax.numpy.float32, sharding=jax.NamedSharding(mesh, jax.P("x")))
    jax.jit(jax.shard_map(f, mesh=mesh, in_specs=jax.P("x"), out_specs=jax.P("x"))).trace(x)
    (reason,) = reasons
    assert reason is not None and "ring-step" in reason, reason
