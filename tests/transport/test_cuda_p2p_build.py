"""The CUDA peer-to-peer transport (ffi/cuda/p2p_handlers.cc) without a GPU.

- The CUDA module registers the three ``flashcomm_p2p_*`` targets (and has its own, empty,
  rendezvous table).
- The CUDA handlers bind through the CPU handlers' builders (flashcomm/bindings.h: the same
  operands, results and attributes, read from both sources), and do not declare themselves
  CUDA-graph safe.
- p2p_handlers.cc compiles with g++ -Wall -Wextra -Werror, as the build's
  FLASHCOMM_WERROR=ON does.
- With the default backend made "gpu" (so that the transport's trace-time check takes its CUDA
  branch, which needs those registrations), lowering psum / psum_scatter / all_gather with
  ``transport="p2p"`` for the "cuda" platform emits the p2p custom calls as typed-FFI calls with
  their attributes and the int32 rank and group operands. Without the CUDA p2p kernels the same
  call is refused at trace time.

Nothing here runs on a GPU: the handlers have never executed (docs/cuda.md, "Peer-to-peer
transport (not run on hardware)").
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm
from jax_flashcomm.codec import kernels
from jax_flashcomm.transport import p2p
from tests.support.cuda_build import ROOT, _custom_calls
from tests.support.cuda_p2p import (_attr, _bindings, _cuda_module, _mesh, compile_host_source,
                                     same_builders)

CPU_SOURCE = ROOT / "ffi" / "cpu" / "p2p_handlers.cc"
CUDA_SOURCE = ROOT / "ffi" / "cuda" / "p2p_handlers.cc"
#: The quantized collectives' targets (p2p.TARGETS less the exact all-reduce's).
QUANTIZED_TARGETS = tuple(t for t in p2p.TARGETS if t != "flashcomm_p2p_psum")
HANDLERS = ("FlashcommP2pAllReduce", "FlashcommP2pReduceScatter", "FlashcommP2pAllGather",
            "FlashcommP2pPsum", "FlashcommP2pExchange")


def test_cuda_module_registers_the_p2p_targets():
    module = _cuda_module()
    assert set(p2p.TARGETS) <= set(module.registrations()), sorted(module.registrations())
    assert set(p2p.TARGETS) <= kernels.registered("cuda")
    assert module.p2p_meetings_in_progress() == 0


def test_cuda_handlers_bind_what_the_cpu_handlers_bind():
    bound = same_builders(CPU_SOURCE, CUDA_SOURCE, HANDLERS)
    assert set(_bindings(CPU_SOURCE)) == {h + "Cpu" for h in HANDLERS}
    for h, (builder, _, cuda_ctx) in bound.items():
        assert builder[2] == "kInProcess", (h, builder)
        assert cuda_ctx == ["ffi::RunId", "ffi::PlatformStream<cudaStream_t>"], cuda_ctx


def test_p2p_handlers_compile_with_warnings_as_errors(tmp_path):
    compile_host_source(CUDA_SOURCE, tmp_path / "p2p.o")


def test_kernel_platform_choice():
    """CPU runs unchanged on this machine; "gpu" needs the CUDA module's p2p targets."""
    assert p2p.kernel_platform(jax.default_backend()) == "cpu"
    assert p2p.kernel_platform("tpu") is None
    if set(p2p.TARGETS) <= kernels.registered("cuda"):
        assert p2p.kernel_platform("gpu") == "cuda"
    else:
        assert p2p.kernel_platform("gpu") is None


def _lower_collectives(mesh, axis, config, shape=(4 * 1000,)):
    n = mesh.shape[axis]
    spec = P(*mesh.axis_names) if len(shape) == len(mesh.axis_names) else P(axis)

    def f(x):
        a = jax_flashcomm.psum(x, axis, config=config)
        b = jax_flashcomm.psum_scatter(x, axis, tiled=True, config=config)
        c = jax_flashcomm.all_gather(x, axis, tiled=True, config=config)
        return a, b, c

    g = jax.shard_map(f, mesh=mesh, in_specs=spec, out_specs=(spec, spec, spec))
    x = jax.device_put(jnp.linspace(-3.0, 5.0, math.prod(shape), dtype=jnp.float32)
                       .reshape(shape).astype(jnp.bfloat16), NamedSharding(mesh, spec))
    lowered = jax.jit(g).trace(x).lower(lowering_platforms=("cuda",))
    return lowered, n


@pytest.mark.parametrize("rotation,spikes", [(0, 0), (2, 3)])
def test_cuda_lowering_emits_the_p2p_targets(as_gpu, rotation, spikes):
    config = jax_flashcomm.CommConfig(bits=4, ag_bits=8, min_bytes=0, rotation=rotation,
                                      spikes=spikes, transport="p2p", p2p_timeout_ms=1234)
    lowered, n = _lower_collectives(_mesh((4,), ("x",)), "x", config)
    calls = _custom_calls(lowered.as_text())
    assert set(QUANTIZED_TARGETS) <= set(calls), sorted(calls)
    # No XLA collective moves the payloads: the p2p calls do.
    assert not re.search(r"stablehlo\.(all_to_all|all_gather|all_reduce|reduce_scatter)",
                         lowered.as_text())
    results = {"flashcomm_p2p_all_reduce": 7, "flashcomm_p2p_reduce_scatter": 4,
               "flashcomm_p2p_all_gather": 4}
    sites = set()
    for target in QUANTIZED_TARGETS:
        (line,) = calls[target]
        assert re.search(rf"%\w+:{results[target]} = stablehlo.custom_call", line), line
        # operands: x (groups, group_size) and the int32 scalars rank and group
        assert re.search(r"\(tensor<\d+x128xbf16>, tensor<i32>, tensor<i32>\)", line), line
        assert _attr(line, "fmt", "group_size") == "128"
        assert _attr(line, "fmt", "rotation") == str(rotation)
        assert _attr(line, "fmt", "spikes") == str(spikes)
        assert _attr(line, "size") == str(n)
        assert _attr(line, "timeout_ms") == "1234"
        sites.add(_attr(line, "site"))
    assert len(sites) == 3, sites  # one site per call
    ar = calls["flashcomm_p2p_all_reduce"][0]
    assert (_attr(ar, "fmt", "bits"), _attr(ar, "out_fmt", "bits"),
            _attr(ar, "out_fmt", "spikes")) == ("4", "8", str(spikes))
    assert _attr(calls["flashcomm_p2p_reduce_scatter"][0], "fmt", "bits") == "4"
    assert _attr(calls["flashcomm_p2p_all_gather"][0], "fmt", "bits") == "8"
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines() if "custom-call(" in ln]
    for target in QUANTIZED_TARGETS:
        (line,) = [ln for ln in hlo if f'custom_call_target="{target}"' in ln]
        assert "api_version=API_VERSION_TYPED_FFI" in line, line


def test_cuda_lowering_two_axis_mesh(as_gpu):
    """Reducing over one axis of a 2-D mesh: size is that axis's, and the group operand is the
    index over the other axis (not a constant)."""
    config = jax_flashcomm.CommConfig(bits=8, min_bytes=0, spikes=0, transport="p2p")
    lowered, n = _lower_collectives(_mesh((2, 2), ("x", "y")), "x", config, shape=(4, 1024))
    assert n == 2
    calls = _custom_calls(lowered.as_text())
    for target in QUANTIZED_TARGETS:
        (line,) = calls[target]
        assert _attr(line, "size") == "2", line


def test_p2p_on_gpu_without_cuda_p2p_kernels_is_refused(as_gpu, monkeypatch):
    """The trace-time check is what makes lowering for a GPU depend on the registrations."""
    monkeypatch.setattr(kernels, "registered", lambda platform: frozenset())
    config = jax_flashcomm.CommConfig(bits=4, min_bytes=0, transport="p2p")
    with pytest.raises(ValueError, match="no p2p kernels for platform 'gpu'"):
        _lower_collectives(_mesh((4,), ("x",)), "x", config)


def test_cuda_lowering_emits_the_exchange(as_gpu):
    """fc.all_to_all and fc.ragged_all_to_all with transport="p2p" lower for "cuda" to the
    exchange (typed FFI, the output aliased), and no XLA all-to-all moves the rows."""
    mesh = _mesh((4,), ("x",))

    def f(x):
        a = jax_flashcomm.all_to_all(x, "x", 0, 0, tiled=True, bits=8, min_bytes=0,
                                     transport="p2p", p2p_timeout_ms=1234)
        sizes = jnp.ones((4,), jnp.int32)
        offsets = jnp.arange(4, dtype=jnp.int32)
        b = jax_flashcomm.ragged_all_to_all(x, jnp.zeros_like(x), offsets, sizes, offsets,
                                            sizes, "x", bits=None, transport="p2p")
        return a, b

    x = jax.device_put(jnp.ones((16, 256), jnp.bfloat16), NamedSharding(mesh, P("x")))
    g = jax.shard_map(f, mesh=mesh, in_specs=P("x"), out_specs=(P("x"), P("x")))
    lowered = jax.jit(g).trace(x).lower(lowering_platforms=("cuda",))
    calls = _custom_calls(lowered.as_text())
    lines = calls["flashcomm_p2p_exchange"]
    assert len(lines) == 2, lines
    assert {_attr(line, "size") for line in lines} == {"4"}
    assert "1234" in {_attr(line, "timeout_ms") for line in lines}
    assert not re.search(r"stablehlo\.(all_to_all|ragged_all_to_all)\b", lowered.as_text())
    hlo = [ln for ln in lowered.as_text(dialect="hlo").splitlines()
           if 'custom_call_target="flashcomm_p2p_exchange"' in ln]
    assert len(hlo) == 2 and all("API_VERSION_TYPED_FFI" in ln for ln in hlo)
    assert all("output_to_operand_aliasing" in ln for ln in hlo), hlo
