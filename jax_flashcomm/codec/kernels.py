# long file: the ffi_call of every codec kernel, one function each, and the module loading
"""The FFI codec kernels: registration of the compiled targets and their ``ffi_call``\\ s.

The CPU module (``_flashcomm_cpu``) is built by ``pip install``; the CUDA module
(``_flashcomm_cuda``) only with ``FLASHCOMM_CUDA=ON``. Both register the same target names.
Importing this module never needs a GPU or the CUDA runtime.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import types

import jax
import numpy as np
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from jax_flashcomm.codec import isa_choice, spec
from jax_flashcomm.codec.isa_choice import cpuinfo
from jax_flashcomm.codec.group_format import GroupFormat

TARGETS = (
    "flashcomm_quantize",
    "flashcomm_dequantize",
    "flashcomm_dequantize_sum",
    "flashcomm_dequantize_sum_quantize",
    "flashcomm_dequantize_into",
    "flashcomm_add_rms_norm",
    "flashcomm_add_rms_norm_quantize",
)
_PLATFORMS = {"cpu": "_flashcomm_cpu", "cuda": "_flashcomm_cuda"}
_XLA_PLATFORM = {"cpu": "cpu", "cuda": "CUDA"}
_available: dict[str, bool] = {}
_import_errors: dict[str, str] = {}
_registered: dict[str, frozenset] = {}


def _register(platform: str) -> bool:
    try:
        module = importlib.import_module(f"jax_flashcomm.{_PLATFORMS[platform]}")
    except ImportError as err:
        _import_errors[platform] = str(err)
        return False
    if platform == "cpu":
        _apply_isa_choice(module)
        _apply_isa_env(module)
        _apply_threads_env(module)
    registrations = module.registrations()
    for name, capsule in registrations.items():
        jax.ffi.register_ffi_target(name, capsule, platform=_XLA_PLATFORM[platform])
    _registered[platform] = frozenset(registrations)
    return True


def registered(platform: str) -> frozenset[str]:
    """The FFI target names the ``platform`` module registered (empty when it is not built).

    Args:
      platform: ``"cpu"`` or ``"cuda"``.
    """
    return _registered.get(platform, frozenset()) if available(platform) else frozenset()


ISA_ENV = "FLASHCOMM_CPU_ISA"


def _apply_isa_env(module) -> None:
    """Honour ``FLASHCOMM_CPU_ISA`` (avx512 | avx2 | baseline, on aarch64 neon | baseline, or
    auto): a build the CPU cannot run, or an unknown name, is an error here, at load."""
    name = os.environ.get(ISA_ENV, "").strip()
    if name:
        try:
            module.set_cpu_isa(name)
        except ValueError as err:
            raise RuntimeError(f"jax_flashcomm: {err}") from None


def preferred_isa(supported: list[str], vendor: str, family: str) -> str | None:
    """The build the loader's rule runs instead of the widest on a CPU of ``vendor`` and
    ``family``, or None where it has no rule (``isa_choice.MEASURED_KINDS``: AMD family 25,
    Zen 3 / Zen 4, runs AVX-512 on 256-bit units, where the AVX2 build does the all-reduce's
    passes faster; docs/autotune.md, "The CPU build").

    Args:
      supported: the builds this CPU runs, best first.
      vendor, family: ``/proc/cpuinfo``'s ``vendor_id`` and ``cpu family``.
    """
    rule = isa_choice.MEASURED_KINDS.get((vendor, family))
    return rule if rule in supported[1:] else None  # None too where it is the widest


_isa_choice: dict = {}


def _apply_isa_choice(module) -> None:
    name, how = isa_choice.choose(module)
    _isa_choice.update(isa=name, how=how)
    if name != module.cpu_isa():
        module.set_cpu_isa(name)


def isa_choice_made() -> dict:
    """The loader's choice of CPU build: ``{"isa", "how"}`` (``how``: ``"rule"``, ``"only
    build"``, ``"measured before (cache)"`` or ``"measured now (...)"``;
    :mod:`jax_flashcomm.codec.isa_choice`); empty before the CPU module is loaded."""
    return dict(_isa_choice)


def default_isa() -> str:
    """The build the loader picks on this CPU without ``FLASHCOMM_CPU_ISA`` or a tuning table:
    the rule's, or the one measured for this CPU kind (:mod:`jax_flashcomm.codec.isa_choice`)."""
    if available("cpu") and _isa_choice:
        return _isa_choice["isa"]
    isas = cpu_isas()
    return preferred_isa(isas, cpuinfo("vendor_id"), cpuinfo("cpu family")) or isas[0]


def set_cpu_isa(name: str) -> None:
    """Run the CPU codec kernels with build ``name`` from now on (unless ``FLASHCOMM_CPU_ISA``
    names one: the environment wins).

    Raises:
      ValueError: a build this CPU cannot run.
    """
    if not os.environ.get(ISA_ENV, "").strip():
        cpu_module().set_cpu_isa(name)


THREADS_ENV = "FLASHCOMM_CPU_THREADS"


def _apply_threads_env(module) -> None:
    """Honour ``FLASHCOMM_CPU_THREADS`` (a count >= 1, or 0 for every thread of XLA's pool)."""
    value = os.environ.get(THREADS_ENV, "").strip()
    if value:
        try:
            threads = int(value)
            if threads < 0:
                raise ValueError
        except ValueError:
            raise RuntimeError(f"jax_flashcomm: {THREADS_ENV}={value!r} is not a count >= 0 "
                               "(0: every thread of XLA's intra-op pool)") from None
        module.set_cpu_threads(threads)


def cpu_module() -> types.ModuleType:
    """The CPU kernel module (``_flashcomm_cpu``), registered.

    Raises:
      RuntimeError: it is not built.
    """
    if not available("cpu"):
        require("cpu")
    return importlib.import_module("jax_flashcomm._flashcomm_cpu")


def cuda_module() -> types.ModuleType:
    """The CUDA kernel module (``_flashcomm_cuda``), registered.

    Raises:
      RuntimeError: it is not built (``FLASHCOMM_CUDA=ON``).
    """
    if not available("cuda"):
        require("cuda")
    return importlib.import_module("jax_flashcomm._flashcomm_cuda")


def cpu_isa() -> str:
    """The instruction-set build the CPU codec kernels run: ``"avx512"`` (16 f32 lanes),
    ``"avx2"`` (8), ``"baseline"`` (SSE2 on x86-64, 4) or ``"neon"`` (aarch64, 4). The best the
    CPU supports, unless :func:`preferred_isa`'s rule, a tuning table or ``FLASHCOMM_CPU_ISA``
    names another."""
    return cpu_module().cpu_isa()


def cpu_isas() -> list[str]:
    """The builds this CPU can run, best first."""
    return list(cpu_module().supported_isas())


def cpu_features() -> str:
    """The CPU's vector features as the kernel library sees them (for reports)."""
    return cpu_module().cpu_features()


@contextlib.contextmanager
def use_cpu_isa(name: str):
    """Run the CPU codec kernels with build ``name`` inside the block.

    For tests and benchmarks: compiled executables call the kernel library at run time, so no
    recompilation is needed.

    Args:
      name: a build of :func:`cpu_isas` (``"avx512"``, ``"avx2"``, ``"baseline"``,
        ``"neon"``).

    Raises:
      ValueError: a build this CPU cannot run.
    """
    module = cpu_module()
    with _swapped(module.cpu_isa, module.set_cpu_isa, name):
        yield


def cpu_threads() -> int:
    """At most how many threads one CPU codec call uses: ``0`` means every thread of XLA's
    intra-op pool (the default, as XLA's own ops), ``1`` the calling thread alone. Calls on
    operands under 512 KiB stay on one thread; the bytes never depend on the split."""
    return int(cpu_module().cpu_threads())


@contextlib.contextmanager
def use_cpu_threads(threads: int):
    """Split CPU codec calls over at most ``threads`` threads inside the block.

    Benchmarks use 1 for single-core figures; set ``FLASHCOMM_CPU_THREADS`` for a process.

    Args:
      threads: the most threads per call; 0: the whole pool.

    Raises:
      ValueError: a negative count.
    """
    if not isinstance(threads, int) or threads < 0:
        raise ValueError(f"threads must be an int >= 0, got {threads!r}")
    module = cpu_module()
    with _swapped(module.cpu_threads, module.set_cpu_threads, threads):
        yield


@contextlib.contextmanager
def _swapped(get, set_, value):
    """A kernel-library setting set to ``value`` inside the block, its old value after."""
    previous = get()
    set_(value)
    try:
        yield
    finally:
        set_(previous)


def available(platform: str) -> bool:
    """Whether the FFI kernels for ``platform`` are built and registered (registers them).

    Args:
      platform: ``"cpu"`` or ``"cuda"``; any other name is not available.
    """
    if platform not in _PLATFORMS:
        return False
    if platform not in _available:
        _available[platform] = _register(platform)
    return _available[platform]


def require(platform: str) -> None:
    """Raise a clear error when FFI kernels for ``platform`` are asked for but not built.

    Args:
      platform: ``"cpu"`` or ``"cuda"``.

    Raises:
      RuntimeError: they are not built (the message says how to build them).
    """
    if not available(platform):
        how = ("pip install . (builds the CPU kernels)" if platform == "cpu"
               else "FLASHCOMM_CUDA=ON pip install . (needs nvcc)")
        raise RuntimeError(
            f"jax_flashcomm: the {platform} FFI kernels are not built "
            f"({_import_errors.get(platform, 'no such platform')}); install with {how}, "
            "or pass backend='jnp' to use the pure-JAX codec")


def result_like(x, shape: tuple[int, ...], dtype):
    """Result type of ``x``'s kind with a new shape and dtype.

    Args:
      x: an operand (its mesh and varying manual axes are kept).
      shape: the result's shape (unsharded along its dimensions).
      dtype: the result's dtype.

    Returns:
      An aval for ``jax.ffi.ffi_call``.
    """
    aval = jax.typeof(x)
    sharding = NamedSharding(aval.sharding.mesh, PartitionSpec(*([None] * len(shape))))
    return aval.update(shape=tuple(shape), dtype=np.dtype(dtype), sharding=sharding)


def quantize(v, *, bits: int, group_size: int, rotation: int = 0, spikes: int = 0):
    """``v`` ``(..., group_size)`` of f32/bf16/f16 -> (codes, scale, zero).

    Args:
      v: the groups (:func:`jax_flashcomm.codec.as_groups`).
      bits, group_size, rotation, spikes: the codec parameters (validated by the caller).

    Returns:
      ``(codes, scale, zero)``: uint8 ``(..., record bytes)``, bf16 ``(...)`` twice.
    """
    lead = v.shape[:-1]
    call = jax.ffi.ffi_call(
        "flashcomm_quantize",
        (result_like(v, (*lead, spec.record_bytes(group_size, bits, spikes)), jnp.uint8),
         result_like(v, lead, jnp.bfloat16), result_like(v, lead, jnp.bfloat16)),
        vmap_method="broadcast_all",
    )
    return tuple(call(
        v, fmt=GroupFormat("int", bits, group_size, rotation, spikes).ffi_attribute()))


def dequantize(codes, scale, zero, *, bits: int, group_size: int, dtype, rotation: int = 0,
               spikes: int = 0):
    """A payload's arrays -> the decoded groups ``(..., groups, group_size)`` of ``dtype``.

    Args:
      codes, scale, zero: the payload's arrays.
      bits, group_size, dtype, rotation, spikes: the codec parameters.
    """
    call = jax.ffi.ffi_call(
        "flashcomm_dequantize", result_like(codes, (*scale.shape, group_size), dtype),
        vmap_method="broadcast_all",
    )
    return call(codes, scale, zero,
                fmt=GroupFormat("int", bits, group_size, rotation, spikes).ffi_attribute())


def dequantize_sum(codes, scale, zero, *, bits: int, group_size: int, dtype,
                   rotation: int = 0, spikes: int = 0):
    """Chunked ``(..., N, groups, bytes)`` -> f32-summed ``(..., groups, group_size)``.

    Args:
      codes, scale, zero: the chunked payload's arrays.
      bits, group_size, dtype, rotation, spikes: the codec parameters (``dtype``: the sum's).
    """
    out_shape = (*scale.shape[:-2], scale.shape[-1], group_size)
    call = jax.ffi.ffi_call(
        "flashcomm_dequantize_sum", result_like(codes, out_shape, dtype),
        vmap_method="broadcast_all"
    )
    return call(codes, scale, zero,
                fmt=GroupFormat("int", bits, group_size, rotation, spikes).ffi_attribute())


def dequantize_sum_quantize(codes, scale, zero, *, bits: int, out_bits: int, group_size: int,
                            spikes: int = 0, out_spikes: int | None = None):
    """Chunked payload -> f32 sum over N -> payload ``(..., groups, ...)``.

    Args:
      codes, scale, zero: the chunked payload's arrays.
      bits, group_size, spikes: the input's codec parameters.
      out_bits: the sum's bits.
      out_spikes: the sum's spikes per group (None: the input's ``spikes``).

    Returns:
      ``(codes, scale, zero)`` of the sum.
    """
    out_spikes = spikes if out_spikes is None else out_spikes
    groups = (*scale.shape[:-2], scale.shape[-1])
    call = jax.ffi.ffi_call(
        "flashcomm_dequantize_sum_quantize",
        (result_like(codes, (*groups, spec.record_bytes(group_size, out_bits, out_spikes)),
                     jnp.uint8),
         result_like(codes, groups, jnp.bfloat16), result_like(codes, groups, jnp.bfloat16)),
        vmap_method="broadcast_all",
    )
    return tuple(call(codes, scale, zero,
                      fmt=GroupFormat("int", bits, group_size, 0, spikes).ffi_attribute(),
                      out_fmt=GroupFormat("int", out_bits, group_size, 0,
                                          out_spikes).ffi_attribute()))


def dequantize_into(out, codes, scale, zero, offset, *, bits: int, group_size: int, count: int,
                    rotation: int = 0, spikes: int = 0):
    """Decode one payload ``(groups, ...)`` into ``out`` (any shape, flat row-major view) at
    element ``offset`` (an int32 scalar operand): its first ``count`` values, cast to out's
    dtype and saturated. The result is ``out`` itself (aliased to operand 0): XLA updates the
    buffer in place. An out-of-range offset is an error of the CPU kernel (the CUDA kernel
    writes nothing).

    Args:
      out: the buffer (f32/bf16/f16).
      codes, scale, zero: one payload's arrays.
      offset: the first element written (int32 scalar).
      bits, group_size, rotation, spikes: the codec parameters.
      count: values written.
    """
    call = jax.ffi.ffi_call(
        "flashcomm_dequantize_into", result_like(out, out.shape, out.dtype),
        input_output_aliases={0: 0}, vmap_method="sequential",
    )
    return call(out, codes, scale, zero, offset,
                fmt=GroupFormat("int", bits, group_size, rotation, spikes).ffi_attribute(),
                count=np.int64(count))


def _union_like(x, others, shape: tuple[int, ...], dtype):
    """:func:`result_like` of ``x``, varying over every axis any of ``x`` and ``others`` varies
    over."""
    aval = result_like(x, shape, dtype)
    mat = getattr(aval, "manual_axis_type", None)
    if mat is None:
        return aval
    vma = frozenset().union(*(getattr(getattr(jax.typeof(a), "manual_axis_type", None),
                                      "varying", frozenset()) for a in (x, *others)))
    return aval.update(manual_axis_type=mat.update(varying=vma))


def add_rms_norm(codes, scale, zero, residual, weight, *, bits: int, group_size: int,
                 rotation: int, spikes: int, eps: float, out_bits: int | None,
                 out_group_size: int):
    """The fused decode + residual add + RMSNorm (docs/fused_norm.md) as one FFI call.

    Args:
      codes, scale, zero: one operand's payload arrays (``(groups, record)``, ``(groups,)``).
      residual: ``(..., hidden)`` f32/bf16/f16; weight: ``(hidden,)`` f32 or bf16.
      bits, group_size, rotation, spikes: the payload's codec parameters.
      eps: added to the mean square.
      out_bits, out_group_size: None: the normalised output is written; else quantized.

    Returns:
      ``(out, new_residual)``, ``out`` the array or ``(codes, scale, zero)``.
    """
    others = (codes, scale, zero, weight)
    res = _union_like(residual, others, residual.shape, residual.dtype)
    attrs = dict(fmt=GroupFormat("int", bits, group_size, rotation, spikes).ffi_attribute(),
                 eps=np.float32(eps))
    if out_bits is None:
        call = jax.ffi.ffi_call("flashcomm_add_rms_norm", (res, res),
                                vmap_method="broadcast_all")
        new_residual, out = call(codes, scale, zero, residual, weight, **attrs)
        return out, new_residual
    groups = residual.size // out_group_size
    call = jax.ffi.ffi_call(
        "flashcomm_add_rms_norm_quantize",
        (res, _union_like(residual, others, (groups, spec.record_bytes(out_group_size,
                                                                       out_bits, 0)), jnp.uint8),
         _union_like(residual, others, (groups,), jnp.bfloat16),
         _union_like(residual, others, (groups,), jnp.bfloat16)),
        vmap_method="broadcast_all")
    new_residual, c, s, z = call(
        codes, scale, zero, residual, weight,
        out_fmt=GroupFormat("int", out_bits, out_group_size).ffi_attribute(), **attrs)
    return (c, s, z), new_residual
