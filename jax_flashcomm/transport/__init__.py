"""Transports: how the quantized collectives' payloads and the ring matmuls' chunks move.

Each transport is one :class:`~jax_flashcomm.transport.base.Transport` object: it says whether
it can take a call, prices it over its own link, and runs the collectives and ring steps.

``xla`` (:class:`XlaTransport`): XLA's own collectives
(``all_to_all``, ``all_gather``, ``ppermute``) around separate codec calls; runs everywhere,
across processes and hosts (gloo on CPU, NCCL on GPU, ICI on TPU); its exact path is ``lax``.
``p2p`` (:class:`P2pTransport`): one fused FFI call per rank that
reads its peers' buffers directly, and ring steps as start / done FFI calls
(:mod:`jax_flashcomm.transport.ring_steps`); its peers are the devices of one process, or processes
of one host with one device each, over shared memory (:mod:`jax_flashcomm.transport.shm`).
Both run the same codec kernels on the same bytes in the same order, so they give the same
bits. :mod:`jax_flashcomm.transport.wire` is what travels. Which transport a call takes is the
plan's decision (:func:`jax_flashcomm.planner.plan`).
"""

from __future__ import annotations

from jax_flashcomm.config import TRANSPORTS
from jax_flashcomm.transport import p2p, ring_steps, wire, xla
from jax_flashcomm.transport.base import Call, Transport
from jax_flashcomm.transport.registry import TRANSPORTS as _BY_NAME
from jax_flashcomm.transport.registry import P2pTransport, XlaTransport

__all__ = ["TRANSPORTS", "Call", "Transport", "XlaTransport", "P2pTransport", "by_name",
           "all_transports", "p2p", "ring_steps", "wire",
           "xla"]


def by_name(name: str) -> Transport:
    """The transport called ``name``.

    Args:
      name: ``"xla"`` or ``"p2p"`` (a plan's ``transport``).

    Returns:
      The :class:`Transport`.

    Raises:
      ValueError: another name.
    """
    if name not in _BY_NAME:
        raise ValueError(f"transport must be one of {tuple(_BY_NAME)}, got {name!r}")
    return _BY_NAME[name]


def all_transports() -> tuple[Transport, ...]:
    """Every transport, ``xla`` first."""
    return tuple(_BY_NAME.values())
