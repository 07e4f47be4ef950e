"""Helpers of the GPU check's tests (tests/gpu): devices, and bit-for-bit comparison of CUDA
results with the CPU kernels' results."""

from __future__ import annotations

import jax
import numpy as np


def gpu_devices() -> list:
    """The GPUs JAX sees, [] where it has no GPU backend (CPU-only jaxlib, no plugin, no
    driver or no device)."""
    try:
        return list(jax.devices("gpu"))
    except RuntimeError:
        return []


def no_gpu_reason() -> str:
    return (f"no GPU: jax.devices('gpu') is empty here (jax {jax.__version__}, default backend "
            f"{jax.default_backend()!r}); benchmarks/gpu_check.sh on a GPU machine runs it")


def cpu_device():
    return jax.devices("cpu")[0]


def on(device, tree):
    """``tree``'s arrays committed to ``device``: a jitted function called on them compiles
    for and runs on that device's platform (the codec then runs that platform's kernels)."""
    return jax.device_put(tree, device)


def host(tree):
    """Every array of ``tree`` as numpy."""
    return jax.tree.map(np.asarray, tree)


def bits_of(a) -> np.ndarray:
    """An array's bit patterns (uint8/16/32 by item size): equal bits, NaNs included."""
    a = np.asarray(a)
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[a.dtype.itemsize])


def assert_same_bits(got, want, what: str):
    """Leaf by leaf bit equality of two pytrees of arrays, the first differences named. Two
    NaNs count as equal whatever their sign and payload bits (an invalid operation's NaN is
    0xFFC00000 on x86 and 0x7FFFFFFF on NVIDIA GPUs); every other value must match bit for
    bit, so -0.0 != +0.0."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (
            f"{what}, leaf {i}: {g.dtype}{g.shape} vs {w.dtype}{w.shape}")
        differ = bits_of(g).ravel() != bits_of(w).ravel()
        if np.issubdtype(g.dtype, np.floating) or g.dtype.name == "bfloat16":
            g32, w32 = g.astype(np.float32).ravel(), w.astype(np.float32).ravel()
            differ &= ~(np.isnan(g32) & np.isnan(w32))
        diff = np.flatnonzero(differ)
        if diff.size:
            k = diff[:5]
            raise AssertionError(
                f"{what}, leaf {i} ({g.dtype}{g.shape}): {diff.size} of {g.size} elements "
                f"differ; first at flat {k.tolist()}: CUDA {g.ravel()[k].tolist()} vs CPU "
                f"{w.ravel()[k].tolist()}")
