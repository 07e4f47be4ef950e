"""The CUDA ring steps of the peer-to-peer transport (ffi/cuda/p2p_ring_handlers.cc) without a
GPU.

- The CUDA handlers bind exactly the CPU ring handlers' operands, results and attributes, in
  the same order (read from both sources, as tests/transport/test_cuda_p2p_build.py does for the fused
  collectives), with the stream added to the contexts, and do not declare themselves
  CUDA-graph safe.
- p2p_ring_handlers.cc compiles with g++ -Wall -Wextra -Werror, as the build's
  FLASHCOMM_WERROR=ON does.
- The CUDA module registers ``flashcomm_p2p_ring_start`` / ``_done`` and has its own, empty,
  ring table and timeline.
- With the default backend made "gpu", lowering all_gather_matmul and matmul_reduce_scatter
  with ``transport="p2p"`` for the "cuda" platform emits the start / done custom calls as
  typed-FFI calls with their attributes, paired by site. Without the CUDA ring kernels the same
  call is refused at trace time.

Nothing here runs on a GPU: the handlers have never executed (docs/cuda.md, "Peer-to-peer
transport (not run on hardware)").
"""

from __future__ import annotations

import pathlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.codec import kernels
from jax_flashcomm.transport import p2p, ring_steps
from tests.support.cuda_build import _custom_calls
from tests.support.cuda_p2p import _attr, _cuda_module, _mesh, compile_host_source, same_builders

ROOT = pathlib.Path(__file__).resolve().parents[2]
CPU_SOURCE = ROOT / "ffi" / "cpu" / "p2p_ring_handlers.cc"
CUDA_SOURCE = ROOT / "ffi" / "cuda" / "p2p_ring_handlers.cc"
HANDLERS = ("FlashcommP2pRingStart", "FlashcommP2pRingDone")
START, DONE = ring_steps.TARGETS
M, K, N = 6, 32, 8  # rows per rank (odd halves for the bidirectional rings), contraction, cols


def test_cuda_module_registers_the_ring_targets():
    module = _cuda_module()
    assert set(ring_steps.TARGETS) <= set(module.registrations()), sorted(module.registrations())
    assert set(ring_steps.TARGETS) <= kernels.registered("cuda")
    assert module.p2p_ring_steps_in_progress() == 0
    assert module.p2p_timeline(False) == []


def test_cuda_ring_handlers_bind_what_the_cpu_ring_handlers_bind():
    bound = same_builders(CPU_SOURCE, CUDA_SOURCE, HANDLERS)
    for h, (builder, cpu_ctx, cuda_ctx) in bound.items():
        assert builder == ("Bind", h.removeprefix("FlashcommP2p"), "kInProcess"), (h, builder)
        # The run id first in both, as in p2p_handlers.cc; CUDA adds the stream.
        assert cpu_ctx == ["ffi::RunId"], cpu_ctx
        assert cuda_ctx == ["ffi::RunId", "ffi::PlatformStream<cudaStream_t>"], cuda_ctx


def test_ring_handlers_compile_with_warnings_as_errors(tmp_path):
    compile_host_source(CUDA_SOURCE, tmp_path / "ring_steps.o")


def _lower(op, n=4, timeout_ms=4321):
    """``op(x, w)`` on local shards in a shard_map over a ring of ``n``, lowered for cuda."""
    mesh = _mesh((n,), ("i",))
    f = jax.shard_map(op, mesh=mesh, in_specs=(P("i"), P(None, "i")), out_specs=P(None, "i"))
    x = jax.device_put(jnp.ones((n * M, K), jnp.bfloat16), NamedSharding(mesh, P("i")))
    w = jax.device_put(jnp.ones((K, n * N), jnp.bfloat16), NamedSharding(mesh, P(None, "i")))
    return jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",))


def _check_steps(lowered, n, steps, timeout_ms, shifts):
    """``steps`` start / done pairs, one site each, with the CPU binding's operands and
    attributes; no XLA collective moves the chunks. Returns the starts' shifts."""
    text = lowered.as_text()
    calls = _custom_calls(text)
    assert len(calls.get(START, [])) == len(calls.get(DONE, [])) == steps, sorted(calls)
    assert not re.search(r"stablehlo\.(collective_permute|all_gather|all_to_all)", text)
    start_sites, seen_shifts = {}, []
    for line in calls[START]:
        # send, rank, group -> send_out (aliased to send), recv, order
        m = re.search(r": \((tensor<[^>]+>), tensor<i32>, tensor<i32>\) -> "
                      r"\((tensor<[^>]+>), (tensor<[^>]+>), tensor<i32>\)", line)
        assert m and m[1] == m[2] == m[3], line
        assert "operand_index = 0" in line and "output_tuple_indices = [0]" in line, line
        assert _attr(line, "size") == str(n)
        assert _attr(line, "timeout_ms") == str(timeout_ms)
        assert _attr(line, "link_bytes_per_s") == "0"
        start_sites[_attr(line, "site")] = _attr(line, "shift")
        seen_shifts.append(int(_attr(line, "shift")))
    assert len(start_sites) == steps  # one site per step
    for line in calls[DONE]:
        # recv, send, after, rank, group -> recv_out, after_out (aliased to recv and after)
        m = re.search(r": \((tensor<[^>]+>), (tensor<[^>]+>), (tensor<[^>]+>), tensor<i32>, "
                      r"tensor<i32>\) -> \((tensor<[^>]+>), (tensor<[^>]+>)\)", line)
        assert m and m[1] == m[2] == m[4] and m[3] == m[5], line
        assert _attr(line, "size") == str(n)
        assert start_sites.pop(_attr(line, "site")) == _attr(line, "shift"), line
        assert not re.search(r"\btimeout_ms\b", line)
    assert not start_sites  # every start has its done
    assert set(seen_shifts) <= set(shifts), seen_shifts
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines() if "custom-call(" in ln]
    for target in ring_steps.TARGETS:
        lines = [ln for ln in hlo if f'custom_call_target="{target}"' in ln]
        assert len(lines) == steps
        assert all("api_version=API_VERSION_TYPED_FFI" in ln for ln in lines), lines
    return seen_shifts


@pytest.mark.parametrize("bidirectional", [False, True])
def test_cuda_lowering_all_gather_matmul(as_gpu, bidirectional):
    n = 4
    lowered = _lower(lambda x, w: fc.all_gather_matmul(
        x, w, "i", bidirectional=bidirectional, transport="p2p", p2p_timeout_ms=4321), n)
    shifts = _check_steps(lowered, n, (n - 1) * (2 if bidirectional else 1), 4321, (1, -1))
    assert len(set(shifts)) == (2 if bidirectional else 1), shifts


def test_cuda_lowering_quantized_all_gather_matmul(as_gpu):
    """The quantized ring moves one uint8 payload per step."""
    n = 4
    lowered = _lower(lambda x, w: fc.all_gather_matmul(
        x, w, "i", bits=8, group_size=32, transport="p2p", p2p_timeout_ms=777, min_bytes=0), n)
    _check_steps(lowered, n, n - 1, 777, (1, -1))
    (line, *_) = _custom_calls(lowered.as_text())[START]
    assert re.search(r"\(tensor<\d+xui8>, tensor<i32>, tensor<i32>\)", line), line


@pytest.mark.parametrize("bidirectional", [False, True])
def test_cuda_lowering_matmul_reduce_scatter(as_gpu, bidirectional):
    n = 4
    lowered = _lower(lambda x, w: fc.matmul_reduce_scatter(
        jnp.tile(x, (n, 1)), w, "i", bidirectional=bidirectional, transport="p2p",
        p2p_timeout_ms=4321), n)
    _check_steps(lowered, n, (n - 1) * (2 if bidirectional else 1), 4321, (1, -1))


def test_cuda_lowering_two_ranks(as_gpu):
    """The smallest ring: one step, every rank's neighbour both ways is the same peer."""
    lowered = _lower(lambda x, w: fc.all_gather_matmul(x, w, "i", transport="p2p",
                                                       p2p_timeout_ms=60_000), n=2)
    _check_steps(lowered, 2, 1, 60_000, (1, -1))


def test_cuda_lowering_gradient_rings(as_gpu):
    """The VJP's rings use the transport too: every start still pairs with a done."""
    n = 4

    def loss(x, w):
        return jnp.sum(fc.all_gather_matmul(x, w, "i", transport="p2p", p2p_timeout_ms=999)
                       .astype(jnp.float32))

    def op(x, w):
        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        return gx.astype(jnp.bfloat16)[:, :N] + gw.astype(jnp.bfloat16)[:M]

    lowered = _lower(op, n)
    steps = len(_custom_calls(lowered.as_text()).get(START, []))
    assert steps > n - 1, steps  # the forward ring and at least one backward ring
    _check_steps(lowered, n, steps, 999, (1, -1))


def test_ring_on_gpu_without_cuda_ring_kernels_is_refused(as_gpu, monkeypatch):
    """The trace-time check needs the ring targets, not just the fused collectives'."""
    monkeypatch.setattr(kernels, "registered", lambda platform: frozenset(p2p.TARGETS))
    with pytest.raises(ValueError, match="has no ring-step kernels"):
        _lower(lambda x, w: fc.all_gather_matmul(x, w, "i", transport="p2p"))
