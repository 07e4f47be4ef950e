"""Transports: how the quantized collectives' payloads and the ring matmuls' chunks move.

``xla``: XLA's own collectives (``all_to_all``, ``all_gather``, ``ppermute``) around separate
codec calls; runs everywhere, across processes and hosts (gloo on CPU, NCCL on GPU, ICI on
TPU). ``p2p``: one fused FFI call per rank that reads its peers' buffers directly
(:mod:`jax_flashcomm.transport.p2p`), and ring steps as start / done FFI calls
(:mod:`jax_flashcomm.transport.ring`); its peers are the devices of one process, or processes
of one host with one device each, over shared memory (:mod:`jax_flashcomm.transport.shm`).
Both run the same codec kernels on the same bytes in the same order, so they give the same
bits.
:mod:`jax_flashcomm.transport.wire` is what travels. Which transport a call takes is the plan's
decision (:func:`jax_flashcomm.planner.plan`).
"""

from __future__ import annotations

import types

from jax_flashcomm.config import TRANSPORTS
from jax_flashcomm.transport import p2p, ring, wire, xla

__all__ = ["TRANSPORTS", "by_name", "p2p", "ring", "wire", "xla"]


def by_name(name: str) -> types.ModuleType:
    """The transport module called ``name``.

    Args:
      name: ``"xla"`` or ``"p2p"`` (a plan's ``transport``).

    Returns:
      The module: each has ``all_reduce(x, axes, plan, decode=True)``, ``reduce_scatter(rows, axes, plan)``
      and ``all_gather(x, axes, axis, tiled, plan)``, with the same results bit for bit.

    Raises:
      ValueError: another name.
    """
    modules = {"xla": xla, "p2p": p2p}
    if name not in modules:
        raise ValueError(f"transport must be one of {tuple(modules)}, got {name!r}")
    return modules[name]
