"""The ``pallas`` transport: the quantized collectives and the ring steps as Pallas TPU kernels.

:class:`PallasTransport` runs :mod:`jax_flashcomm.transport.pallas_kernels` (the fused two-step
all-reduce, reduce-scatter and all-gather: remote DMAs of the codec's bytes, the jnp twin's
codec on VMEM values) and the ring steps of :mod:`jax_flashcomm.transport.pallas_rings`. On a
TPU the kernels compile with Mosaic; on any other backend they run in Pallas's TPU interpret
mode (``pltpu.InterpretParams``), which needs ``jax.shard_map(..., check_vma=False)``. The
results are the ``xla`` transport's with ``backend="jnp"``, bit for bit (docs/tpu.md).

The planner takes it under ``transport="auto"`` on a TPU, and anywhere when it is asked for
(``transport="pallas"``); it prices it with the TPU profile of the device
(:func:`jax_flashcomm.costs.local_tpu`).
"""

from __future__ import annotations

import dataclasses

import jax
from jax import lax

from jax_flashcomm import _axes, costs
from jax_flashcomm.costs import Link
from jax_flashcomm.transport import pallas_kernels, pallas_rings
from jax_flashcomm.transport.base import Call, Transport
from jax_flashcomm.transport.pallas_base import (interpret_params, races_found, use_interpret,
                                                 vmem_budget)

__all__ = ["PallasTransport", "use_interpret", "interpret_params", "races_found", "vmem_budget",
           "interpret_reason"]


def interpret_reason(x) -> str | None:
    """Why the pallas kernels cannot take ``x`` here, or None: in interpret mode, the
    interpreter cannot check the kernel's values under ``check_vma=True``."""
    if interpret_params() is not False and _axes.varying_axes(x):
        return (f"on the {jax.default_backend()} backend transport='pallas' runs Pallas's TPU "
                "interpret mode, which needs jax.shard_map(..., check_vma=False) (it cannot "
                "type a kernel's values under check_vma=True)")
    return None


def _check(x, where: str):
    reason = interpret_reason(x)
    if reason is not None:
        raise ValueError(f"{where}: {reason}")


@dataclasses.dataclass(frozen=True)
class PallasTransport(Transport):
    """Pallas TPU kernels (module docstring).

    Args:
      fallback_link: ``call -> Link``: the link off a TPU (the xla transport's; the interpreter
        moves the bytes in this process's memory).
      pinned: the config asks for this transport: it may take a call off a TPU (in interpret
        mode).
    """

    fallback_link: object = None
    pinned: bool = False
    name = "pallas"

    def as_pinned(self) -> "PallasTransport":
        """This transport, able to take a call on any platform (``transport="pallas"``)."""
        return dataclasses.replace(self, pinned=True)

    def unavailable(self, call: Call, exact: bool) -> str | None:
        if exact:
            return "the pallas transport has no exact path (the exact sum is lax's)"
        reason = super().unavailable(call, exact)
        if reason is None and call.platform != "tpu" and not self.pinned:
            reason = (f"not a TPU ({call.platform}: transport='pallas' runs in interpret mode "
                      "only when asked for)")
        return reason

    def link(self, call: Call, table) -> Link:
        if call.platform == "tpu":
            return costs.local_tpu().link
        return self.fallback_link(call, table)

    def collective_reason(self, config, axes: tuple) -> str | None:
        return None

    def ring_reason(self, axes: tuple) -> str | None:
        return None

    def all_reduce(self, x, axes, plan, decode=True):
        _check(x, "psum")
        return pallas_kernels.all_reduce(x, axes, plan, decode=decode)

    def reduce_scatter(self, rows, axes, plan):
        _check(rows, "psum_scatter")
        return pallas_kernels.reduce_scatter(rows, axes, plan)

    def all_gather(self, x, axes, axis, tiled, plan):
        _check(x, "all_gather")
        return pallas_kernels.all_gather(x, axes, axis, tiled, plan)

    def exact_all_reduce(self, x, axes, plan):
        return lax.psum(x, axes)

    def ring_link(self, spec, axis_name, perms):
        return pallas_rings.PallasLink(axis_name)

