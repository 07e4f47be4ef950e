"""Command buffers (CUDA graphs): which CUDA handlers may be captured, and that what they do is
safe to capture.

XLA reads a handler's traits at registration, from the handler itself (the metadata call of
``xla/ffi/api/api.h``), and captures a custom call into a command buffer only when it declares
``kCmdBufferCompatible``. The codec and gather handlers declare it: each call is one kernel
launch (or a device-to-device copy and a launch) on XLA's stream, chosen from attributes,
shapes and buffer addresses only. The p2p and ring handlers must not: they read the rank on the
host, meet their peers and wait on the host, so a captured graph would replay one run's peers
and pointers (stale data, as users of other libraries' graph-captured flags have reported).

Without a GPU: the declared traits (read from the built module as XLA reads them) and the
source of every capturable handler. With a GPU: the codec inside real command buffers, called
again and again with new values and offsets, against the CPU kernels.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import jax
import pytest

from jax_flashcomm.codec import fp_kernels, kernels

pytestmark = pytest.mark.gpu

ROOT = pathlib.Path(__file__).resolve().parents[2]
CUDA_DIR = ROOT / "ffi" / "cuda"

#: Handlers that must be capturable: stream work only.
CAPTURABLE = frozenset(kernels.TARGETS) | frozenset(fp_kernels.TARGETS)
#: Handlers that must never be captured: host rendezvous, host reads of device values.
HOST_SYNCHRONOUS = frozenset({
    "flashcomm_p2p_all_reduce", "flashcomm_p2p_reduce_scatter", "flashcomm_p2p_all_gather",
    "flashcomm_p2p_ring_start", "flashcomm_p2p_ring_done", "flashcomm_p2p_psum",
    "flashcomm_shm_all_reduce", "flashcomm_shm_reduce_scatter", "flashcomm_shm_all_gather",
    "flashcomm_shm_psum", "flashcomm_shm_ring_start", "flashcomm_shm_ring_done",
    "flashcomm_p2p_exchange", "flashcomm_shm_exchange",
})


def _api_version(include_dir):
    text = (pathlib.Path(include_dir) / "xla/ffi/api/c_api.h").read_text()
    major = int(re.search(r"#define XLA_FFI_API_MAJOR (\d+)", text).group(1))
    minor = int(re.search(r"#define XLA_FFI_API_MINOR (\d+)", text).group(1))
    return major, minor


def test_every_handler_declares_its_traits(cuda_module):
    """Each registered CUDA handler answers XLA's metadata call; the codec and gather handlers
    are command-buffer compatible, the p2p and ring handlers are not, and no handler is
    unclassified (a new one must be put in one of the two sets)."""
    if not hasattr(cuda_module, "handler_metadata"):
        assert "handler_metadata" in (CUDA_DIR / "module.cc").read_text(), "module.cc lost it"
        pytest.skip("the installed CUDA module predates handler_metadata (a stale build): "
                    "FLASHCOMM_CUDA=ON pip install -e . rebuilds it")
    meta = cuda_module.handler_metadata()
    compatible = int(cuda_module.TRAIT_COMMAND_BUFFER_COMPATIBLE)
    assert compatible == 1  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    assert set(meta) == set(cuda_module.registrations())
    assert set(meta) == CAPTURABLE | HOST_SYNCHRONOUS, (
        f"unclassified handlers: {sorted(set(meta) - CAPTURABLE - HOST_SYNCHRONOUS)}")
    # built against the vendored headers, or (gpu_check.sh's fallback) the installed jaxlib's
    headers = {_api_version(ROOT / "third_party/xla_ffi/include"),
               _api_version(jax.ffi.include_dir())}
    for name, (answered, major, minor, traits) in sorted(meta.items()):
        assert answered, name
        assert (major, minor) in headers, f"{name}: FFI API {major}.{minor}, headers {headers}"
        want = compatible if name in CAPTURABLE else 0
        assert traits == want, f"{name}: traits {traits:#x}, want {want:#x}"


# What a capturable handler (and the launchers it calls) may call of the CUDA runtime: kernel
# launches (`<<<...>>>`), the launch status and a device-to-device copy on the given stream.
ALLOWED_CALLS = {"cudaGetLastError", "cudaGetErrorName", "cudaGetErrorString",
                 "cudaMemcpyAsync"}
CAPTURABLE_SOURCES = ("codec_handlers.cc", "gather_handlers.cc", "launch.h",
                      "codec_quantize.cu", "codec_dequantize.cu", "codec_dequantize_sum.cu",
                      "gather_kernels.cu", "codec_device.cuh", "codec_quantize.cuh",
                      "fp_handlers.cc", "fp_kernels.cu")


def _code(path: pathlib.Path) -> str:
    """The file without comments and string literals."""
    text = path.read_text()
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text)


def test_capturable_handlers_read_nothing_from_the_host():
    """The capturable handlers' sources (and every kernel file they launch from) call no CUDA
    runtime function but the allowed ones: no stream query or synchronization, no allocation,
    no copy to or from the host, no event; no environment or mutable static state that a
    captured graph would freeze. Their only copy is device to device."""
    for name in CAPTURABLE_SOURCES:
        code = _code(CUDA_DIR / name)
        calls = set(re.findall(r"\b(cuda[A-Z]\w*)\s*\(", code))
        assert calls <= ALLOWED_CALLS, f"{name} calls {sorted(calls - ALLOWED_CALLS)}"
        for copy in re.findall(r"cudaMemcpyAsync\s*\(([^;]*);", code, flags=re.S):
            assert "cudaMemcpyDeviceToDevice" in copy, f"{name}: {copy}"
        for word in ("getenv", "std::mutex", "thread_local", "p2p_", "Rendezvous"):
            assert word not in code, f"{name} uses {word}"
        statics = [s for s in re.findall(r"\bstatic\s+(?!constexpr|inline|const\b|_cast)\w[^;({]*",
                                         code) if "__global__" not in s]
        assert not [s for s in statics if "=" in s or ";" in s], f"{name}: {statics}"


def test_host_synchronous_handlers_do_host_work():
    """The other side of the line: the p2p and ring handlers do what capture must not see
    (a stream query, host waits), which is why they declare no trait."""
    assert "cudaStreamQuery" in _code(CUDA_DIR / "p2p_host.h")  # ReadRankAndGroup polls
    assert "ReadRankAndGroup(" in _code(CUDA_DIR / "p2p_protocol.h")  # in protocol::Start
    for name in ("p2p_handlers.cc", "p2p_ring_handlers.cc", "shm_handlers.cc",
                 "shm_ring_handlers.cc"):
        code = _code(CUDA_DIR / name)
        # the rank, read on the host every call (directly or through protocol::Start)
        assert "ReadRankAndGroup(" in code or "Start(" in code, name
        assert "kCmdBufferCompatible" not in code, name


# Runs in a subprocess: XLA reads XLA_FLAGS once, when its GPU client starts.
_GRAPH_SCRIPT = textwrap.dedent("""
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    from jax_flashcomm import codec
    from jax_flashcomm.codec import kernels
    assert kernels.available("cpu") and kernels.available("cuda")
    gpu, cpu = jax.devices("gpu")[0], jax.devices("cpu")[0]

    def f(x, out, offset):
        p = codec.quantize(x, bits=4, group_size=128, num_chunks=2, spikes=1, backend="ffi")
        s = codec.dequantize_sum_quantize(p.split_groups(2), bits=8, backend="ffi")
        y = codec.dequantize(p, backend="ffi")
        one = codec.quantize(x[:1000], bits=6, group_size=128, backend="ffi")
        z = codec.dequantize_into(out, one, offset, backend="ffi")
        return p.codes, p.scale, s.codes, s.scale, y, z

    step = jax.jit(f)
    x0 = jnp.zeros((4096,), jnp.bfloat16)
    out0 = jnp.zeros((5000,), jnp.float32)
    hlo = step.lower(jax.device_put(x0, gpu), jax.device_put(out0, gpu),
                     jax.device_put(np.int32(0), gpu)).compile().as_text()
    rng = np.random.default_rng(0)
    mismatches = []
    for i in range(12):
        x = jnp.asarray(rng.standard_normal(4096) * (1 + i), jnp.bfloat16)
        out = jnp.asarray(rng.standard_normal(5000), jnp.float32)
        offset = np.int32((i * 331) % 4000)
        got = step(*jax.device_put((x, out, offset), gpu))
        want = step(*jax.device_put((x, out, offset), cpu))
        for k, (g, w) in enumerate(zip(got, want)):
            g, w = np.asarray(g), np.asarray(w)
            width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[g.dtype.itemsize]
            if not np.array_equal(g.view(width), w.view(width)):
                mismatches.append((i, k))
    print(json.dumps({"hlo": hlo, "mismatches": mismatches}))
""")


def _computations(hlo: str) -> dict[str, str]:
    """HLO text -> {computation name: body}."""
    out, name, lines = {}, None, []
    for line in hlo.splitlines():
        m = re.match(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name, lines = m.group(1), []
        elif line.startswith("}") and name is not None:
            out[name] = "\n".join(lines)
            name = None
        elif name is not None:
            lines.append(line)
    return out


def _flashcomm_calls(hlo: str) -> dict[str, str]:
    """HLO text -> {custom-call instruction name: flashcomm target}."""
    return dict(re.findall(r'^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=[^\n]*custom_call_target='
                           r'"(flashcomm_\w+)"', hlo, flags=re.M))


def _in_command_buffers(thunks: str) -> list[str]:
    """The lines of every thunk nested in a ``kCommandBuffer`` thunk of a thunk sequence dump
    (``*.thunk_sequence_after_thunk_passes.txt``: one thunk per line, nested thunks indented
    deeper than their parent)."""
    nested, depth = [], None
    for line in thunks.splitlines():
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip(" "))
        if depth is not None and indent > depth:
            nested.append(line)
            continue
        depth = indent if "kCommandBuffer" in line else None
    return nested


def captured_targets(hlo: str, thunks: str) -> set[str]:
    """The flashcomm targets XLA put in a command buffer. XLA before the thunk-level pass
    (jax 0.10) outlines them into ``command_buffer`` computations of the optimized HLO. Later
    XLA (jax 0.11) wraps thunks in ``kCommandBuffer`` thunks after compilation, which only the
    thunk sequence dump (``--xla_dump_to``) shows, and there a custom call's thunk is named
    ``kCustomCall`` alone: when every custom call of the program is a flashcomm one, as many
    nested ``kCustomCall`` thunks as the program has custom calls means all were captured."""
    comps = _computations(hlo)
    found = {t for name, body in comps.items() if "command_buffer" in name
             for t in re.findall(r'custom_call_target="(flashcomm_\w+)"', body)}
    nested = _in_command_buffers(thunks)
    calls = _flashcomm_calls(hlo)
    words = {w for line in nested for w in re.findall(r"[\w.\-]+", line)}
    found |= {t for name, t in calls.items() if name in words}
    every_call = re.findall(r'custom_call_target="([^"]+)"', hlo)
    in_buffers = sum(bool(re.match(r"\s*\d*:?\s*kCustomCall\b", line)) for line in nested)
    if calls and len(every_call) == len(calls) and in_buffers == len(calls):
        found |= set(calls.values())
    return found


def test_capture_detection_reads_both_xla_generations():
    """The detector itself, on the two forms (no GPU needed): an HLO ``command_buffer``
    computation; and a thunk dump (the form XLA of jax 0.11.2 wrote on an H200), where the
    flashcomm calls count as captured only when every one of them is nested under
    kCommandBuffer."""
    hlo = textwrap.dedent("""\
        command_buffer.1 {
          %cc = (u8[4]) custom-call(%p), custom_call_target="flashcomm_quantize"
        }
        ENTRY %main.2 {
          %custom-call.3 = f32[8] custom-call(%a), custom_call_target="flashcomm_dequantize"
          ROOT %custom-call.4 = f32[8] custom-call(%b), custom_call_target="flashcomm_dequantize"
        }
        """)
    assert captured_targets(hlo, "") == {"flashcomm_quantize"}
    flat = hlo.replace("command_buffer.1", "computation.1")
    inside = ("000: kCommandBuffer [source | sink] \n"
              "    001: kCustomKernel [source       | next=002 (1)] loop_pad_fusion\n"
              "    002: kCustomCall   [prev=001 (1) | next=003 (1)] kCustomCall\n"
              "    003: kCustomCall   [prev=002 (1) | sink        ] kCustomCall\n"
              "    004: kCustomCall   [source       | sink        ] kCustomCall\n")
    assert captured_targets(flat, inside) == {"flashcomm_quantize", "flashcomm_dequantize"}
    one_outside = inside.replace("    004:", "004:")
    assert captured_targets(flat, one_outside) == set()
    other = flat.replace('"flashcomm_quantize"', '"cu_threefry2x32"')
    assert captured_targets(other, inside) == set()


def test_codec_in_command_buffers_is_never_stale(gpu, tmp_path):
    """With custom calls allowed in command buffers (XLA_FLAGS), the codec's custom calls are
    captured into a command buffer, and twelve calls of the same executable with new values and
    a new (traced) dequantize_into offset each give the CPU kernels' bits: nothing of a call is
    baked into the captured graph."""
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer="
                        "FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1"
                        f" --xla_dump_to={tmp_path}").strip()
    proc = subprocess.run([sys.executable, "-c", _GRAPH_SCRIPT], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["mismatches"] == [], f"(call, output) pairs that differ: {result['mismatches']}"
    dumps = sorted(tmp_path.glob("*jit_f*thunk_sequence_after_thunk_passes.txt"))
    thunks = "\n".join(d.read_text() for d in dumps)
    captured = captured_targets(result["hlo"], thunks)
    assert captured, ("no flashcomm custom call inside a command buffer; computations: "
                      f"{sorted(_computations(result['hlo']))[:40]}; thunks after the thunk "
                      f"passes ({[d.name for d in dumps]}):\n{thunks[:3000]}")
    assert captured <= CAPTURABLE
