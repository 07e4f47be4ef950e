"""Fixtures of the transport tests."""

import jax
import pytest

from tests.support.cuda_p2p import _cuda_module


@pytest.fixture
def as_gpu(monkeypatch):
    """The default backend reported as "gpu": the transport's trace-time checks then need the
    CUDA module's p2p (and ring) kernels (nothing is compiled or run, only lowered for
    "cuda")."""
    _cuda_module()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
