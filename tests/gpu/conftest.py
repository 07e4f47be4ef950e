"""Fixtures of the GPU check (marker ``gpu``; ``bash benchmarks/gpu_check.sh`` runs them).

Every module here imports and is collected on any machine, CI's included, so a change that
breaks these tests shows without a GPU. A test that needs a GPU asks for the ``gpu`` fixture
(or ``gpus(n)``) and skips, saying why, where there is none; a test that needs the CUDA module
asks for ``cuda_module`` and skips where it is not built and there is no GPU either (with a GPU
an unbuilt module is an error: the check exists to run it).
"""

from __future__ import annotations

import importlib

import pytest

from tests.gpu.gpu_support import gpu_devices, no_gpu_reason


@pytest.fixture(scope="session")
def cuda_module():
    """``jax_flashcomm._flashcomm_cuda``, with its targets registered for platform CUDA."""
    from jax_flashcomm.codec import kernels

    if not kernels.available("cuda"):
        reason = (f"the CUDA module is not built ({kernels._import_errors.get('cuda')}); "
                  "FLASHCOMM_CUDA=ON pip install -e . builds it")
        if gpu_devices():
            pytest.fail(f"a GPU is present but {reason}")
        pytest.skip(reason)
    return importlib.import_module("jax_flashcomm._flashcomm_cuda")


@pytest.fixture(scope="session")
def cpu_kernels():
    """The CPU FFI kernels, registered: the reference every CUDA result is compared with."""
    from jax_flashcomm.codec import kernels

    assert kernels.available("cpu"), (
        f"the CPU FFI kernels are not built ({kernels._import_errors.get('cpu')})")


@pytest.fixture(scope="session")
def gpu(cuda_module, cpu_kernels):
    """The first GPU; skips without one."""
    devices = gpu_devices()
    if not devices:
        pytest.skip(no_gpu_reason())
    return devices[0]


@pytest.fixture(scope="session")
def gpus(cuda_module, cpu_kernels):
    """``gpus(n)``: the first n GPUs; skips when there are fewer (the p2p and ring handlers
    need two or more, in one process)."""

    def need(n: int):
        devices = gpu_devices()
        if not devices:
            pytest.skip(no_gpu_reason())
        if len(devices) < n:
            pytest.skip(f"needs {n} GPUs in one process, this machine has {len(devices)} "
                        f"({devices[0].device_kind})")
        return devices[:n]

    return need
