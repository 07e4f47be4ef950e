"""The pallas transport's rings: the collective matmuls as one fused kernel each
(:func:`all_gather_matmul`, :func:`matmul_reduce_scatter`, from
:mod:`jax_flashcomm.transport.pallas_ring_kernels`), and a ring step as a Pallas kernel
(:class:`PallasLink`) for the calls the fused kernels do not take (:func:`fused_reason`).
``all_gather_matmul`` / ``matmul_reduce_scatter`` with ``transport="pallas"`` run the first
where it fits, the second elsewhere; both are the ``xla`` rings bit for bit.
"""

from __future__ import annotations

import jax
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_flashcomm import _axes
from jax_flashcomm.transport import pallas_base
from jax_flashcomm.transport.pallas_base import Codec, barrier, call_kernel, out_type, peer_id
from jax_flashcomm.transport.pallas_ring_kernels import (all_gather_matmul,
                                                         matmul_reduce_scatter, vmem_bytes)

__all__ = ["PallasLink", "shift", "all_gather_matmul", "matmul_reduce_scatter", "fused_reason"]


def shift(buf: jax.Array, axes: tuple, step: int) -> jax.Array:
    """The ``buf`` of rank ``r - step`` (ranks numbered as ``lax.axis_index(axes)``): one remote
    DMA from HBM to the neighbour's HBM, in a Pallas kernel."""
    n = _axes.axis_size(axes)

    def kernel(src, dst, send_sem, recv_sem):
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        c = pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem,
                                         device_id=peer_id(axes, (me + step) % n),
                                         device_id_type=pl.DeviceIdType.MESH)
        c.start()
        c.wait_send()
        c.wait_recv()

    dma = pltpu.SemaphoreType.DMA(())
    return call_kernel(kernel, [out_type(buf.shape, buf.dtype, buf)], [buf], [dma, dma], Codec(),
                       "flashcomm_pallas_ring_step")[0]


def fused_reason(op: str, x, w, axis_name, *, bidirectional: bool = False,
                 quant=None) -> str | None:
    """Why the fused kernel of ``op`` cannot take a call, or None when it can: 2-D operands, a
    ring of 2+ ranks, and buffers within the VMEM budget
    (:func:`jax_flashcomm.transport.pallas_base.vmem_budget`).

    Args:
      op: ``"all_gather_matmul"`` or ``"matmul_reduce_scatter"``.
      x, w: the operands (arrays or ShapeDtypeStructs).
      axis_name: the ring's mesh axis (or tuple of axes), bound.
      bidirectional: the ring runs both ways.
      quant: ``(bits, group_size, backend, rotation, spikes)`` of a quantized
        all-gather-matmul, or None (exact).

    Returns:
      The reason, or None.
    """
    for name, a in (("x", x), ("w", w)):
        if a.ndim != 2:
            return f"{name} is {a.ndim}-D (the fused kernel takes x (rows, K) and w (K, cols))"
    n = _axes.axis_size(_axes.normalize_axes(axis_name))
    if n == 1:
        return "one rank: the ring has no steps"
    if op == "matmul_reduce_scatter" and x.shape[0] % n:
        return f"{x.shape[0]} rows do not split over {n} ranks"
    vmem = vmem_bytes(op, x, w, n, bidirectional=bidirectional, quant=quant)
    budget = pallas_base.vmem_budget_bytes()
    if vmem > budget:
        return (f"its VMEM buffers ({vmem} B, tile-padded) exceed the VMEM budget ({budget} B, "
                "pallas.vmem_budget)")
    return None


class PallasLink:
    """Ring steps (:mod:`jax_flashcomm.transport.ring_steps`) as :func:`shift` kernels.

    Args:
      axis_name: the ring's mesh axis (or tuple of axes).
    """

    name = "pallas"

    def __init__(self, axis_name):
        self.axes = _axes.normalize_axes(axis_name)

    def begin(self, payload, step: int):
        return payload, shift(payload, self.axes, step)

    def order(self, pending):
        return 0

    def finish(self, pending, after):
        return pending, after
