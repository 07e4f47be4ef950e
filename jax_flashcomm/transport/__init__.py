"""Transports: how the quantized collectives' payloads move between ranks.

``xla``: XLA's own collectives (``all_to_all``, ``all_gather``, ``ppermute``) around separate
codec calls; runs everywhere, across processes and hosts (gloo on CPU, NCCL on GPU, ICI on
TPU). ``p2p``: one fused FFI call per rank that reads its peers' buffers directly
(:mod:`jax_flashcomm.transport.p2p`); its peers are the devices of one process. Both run the
same codec kernels on the same bytes in the same order, so they give the same bits.

``transport="auto"`` (the default) picks ``p2p`` where it is measured faster and every peer is
local (:func:`choose`; docs/transport.md has the measurements), else ``xla``.
"""

from __future__ import annotations

from jax_flashcomm.policy import TRANSPORTS
from jax_flashcomm.transport import p2p, xla

__all__ = ["TRANSPORTS", "check_transport", "choose", "select", "p2p", "xla"]

#: ``auto`` uses p2p from this many operand bytes per rank up (None: never). docs/transport.md:
#: on 8 CPU devices p2p beat both lax.psum and the xla transport at every size measured, from
#: 256 KiB (below the quantization policy's default min_bytes of 1 MiB) to 64 MiB.
AUTO_P2P_MIN_BYTES = 0


def check_transport(name, what: str = "transport") -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"{what} must be one of {TRANSPORTS}, got {name!r}")
    return name


def choose(config, axes: tuple, nbytes: int) -> str:
    """The transport a quantized collective over ``axes`` of ``nbytes`` per rank uses.

    An explicit ``config.transport="p2p"`` that cannot run here (peers in other processes, a
    platform without p2p kernels, the jnp codec backend, mesh axes left automatic) is an error
    naming the reason; ``"auto"`` falls back to ``xla`` for those.
    """
    want = config.transport
    if want == "xla":
        return "xla"
    reason = p2p.unsupported_reason(axes)
    if reason is None and config.backend == "jnp":
        reason = "backend='jnp' (the p2p transport runs the FFI codec kernels)"
    if want == "p2p":
        if reason is not None:
            raise ValueError(f"transport='p2p' cannot run here: {reason}")
        return "p2p"
    if reason is not None or AUTO_P2P_MIN_BYTES is None or nbytes < AUTO_P2P_MIN_BYTES:
        return "xla"
    return "p2p"


def select(config, axes: tuple, x):
    """The transport module (:mod:`~jax_flashcomm.transport.xla` or
    :mod:`~jax_flashcomm.transport.p2p`) for a quantized collective of ``x`` over ``axes``.
    Both have ``all_reduce(x, axes, config)``, ``reduce_scatter(rows, axes, config)`` and
    ``all_gather(x, axes, axis, tiled, config)``, with the same results bit for bit."""
    nbytes = x.size * x.dtype.itemsize
    return p2p if choose(config, axes, nbytes) == "p2p" else xla
