"""The transports, one class each (the contract: :mod:`jax_flashcomm.transport.base`).

:class:`XlaTransport` runs the collectives of :mod:`jax_flashcomm.transport.xla` and the ring
steps as ``ppermute``; :class:`P2pTransport` those of :mod:`jax_flashcomm.transport.p2p` and
:mod:`jax_flashcomm.transport.ring_steps`. Each knows its own link for the cost model.
"""

from __future__ import annotations

import dataclasses

from jax import lax

from jax_flashcomm import _axes, costs
from jax_flashcomm.costs import Link
from jax_flashcomm.transport import p2p, ring_steps, shm, xla
from jax_flashcomm.transport.pallas import PallasTransport
from jax_flashcomm.transport.base import Call, Transport

__all__ = ["XlaTransport", "P2pTransport", "PallasTransport", "TRANSPORTS"]


class _Collectives(Transport):
    """A transport whose quantized collectives are the functions of one module."""

    #: The module with ``all_reduce``, ``reduce_scatter`` and ``all_gather``.
    collectives = None

    def all_reduce(self, x, axes, plan, decode=True):
        return self.collectives.all_reduce(x, axes, plan, decode=decode)

    def reduce_scatter(self, rows, axes, plan):
        return self.collectives.reduce_scatter(rows, axes, plan)

    def all_gather(self, x, axes, axis, tiled, plan):
        return self.collectives.all_gather(x, axes, axis, tiled, plan)


class XlaTransport(_Collectives):
    """XLA's own collectives: runs everywhere, across processes and hosts; its exact path is
    the ``lax`` collective itself."""

    name = "xla"
    collectives = xla
    #: The in-process link where no table measured it: a 3-device ppermute on an AMD EPYC Zen 4
    #: (2 cores; ``python -m jax_flashcomm.tune --quick``, docs/autotune.md).
    IN_PROCESS_LINK = Link(21e9, "shared", 145e-6, 0.0)
    #: gloo over a loopback, 3 processes on 2 cores (docs/results/ttft.json, "unlimited": the 1 MiB
    #: psum's rate and the 4-byte psum's time): the link between processes where none is given.
    GLOO_LOOPBACK_LINK = Link(309e6, "shared", 150e-6, 0.0)

    def path_name(self, exact: bool) -> str:
        return "lax" if exact else "quantized/xla"

    def link(self, call: Call, table) -> Link:
        if call.platform == "tpu":
            return costs.local_tpu().link
        if call.platform != "cpu":
            return costs.local_gpu().link
        if call.layout == "processes":
            return costs.link_profile() or self.GLOO_LOOPBACK_LINK
        if table is not None and table.link.get("bytes_per_s"):
            return Link(float(table.link["bytes_per_s"]), "shared", float(table.link["latency_s"]))
        return self.IN_PROCESS_LINK

    def model_s(self, call: Call, exact: bool, link: Link, codec_pass_s) -> float:
        if not exact:
            return super().model_s(call, exact, link, codec_pass_s)
        # XLA:CPU moves bf16 as f32; on GPUs NCCL takes its LL protocol for small messages
        wide = 2 if call.platform == "cpu" and call.dtype == "bfloat16" else 1
        links = [link] if call.platform == "cpu" else [link, costs.nccl_ll_link(link)]
        return min(costs.exact_collective(call.op, call.nbytes * wide, call.n, lk)
                   for lk in links)

    def collective_reason(self, config, axes: tuple) -> str | None:
        return None

    def ring_reason(self, axes: tuple) -> str | None:
        return None

    def exact_all_reduce(self, x, axes, plan):
        return lax.psum(x, axes)

    def ring_link(self, spec, axis_name, perms):
        return ring_steps.XlaLink(axis_name, perms)



class P2pTransport(_Collectives):
    """One FFI call per rank that reads its peers' buffers (module docstring): the devices of
    this process, or processes of this host over shared memory."""

    name = "p2p"
    collectives = p2p
    #: The latency of one p2p call in one process where no table measured it (AMD EPYC Zen 4,
    #: 2 cores; ``python -m jax_flashcomm.tune --quick``, docs/autotune.md).
    LATENCY_S = 174e-6
    #: The exact all-reduce over shared memory between processes
    # (benchmarks/collectives/allreduce_shm.py
    #: on an AMD EPYC Zen 4, 2 processes on 2 cores, fitted to its 2 KiB, 16 and 64 MiB rows;
    #: docs/transport.md, "Across processes").
    SHM_LINK = Link(2.2e9, "shared", 110e-6, 0.0)

    #: The in-process exact all-reduce against ``lax.psum`` where no table measured it, from
    #: benchmarks/collectives/allreduce_exact_p2p.py (Intel Xeon, 2 cores, 3 and 8 devices, two
    #: runs, before the sum ran in place; docs/transport.md, "The exact all-reduce", has the
    #: AMD EPYC Zen 4 figures since, above these at every size): up to :data:`EXACT_SMALL_BYTES`
    #: per rank (:data:`EXACT_SMALL_BYTES_16` for 16-bit floats) lax's time times
    #: :data:`EXACT_SMALL_RATIO` (measured 1.36-2.46x faster there); 16-bit floats from
    #: :data:`EXACT_NARROW_BYTES` at their own bytes, which lax moves as f32 (1.19-2.21x
    #: faster); elsewhere lax's time times :data:`EXACT_RATIO` (1.01-1.45x faster, the least
    #: at 128 KiB-2 MiB).
    EXACT_SMALL_BYTES = 32 * 1024
    EXACT_SMALL_BYTES_16 = 8 * 1024
    EXACT_NARROW_BYTES = 512 * 1024
    EXACT_SMALL_RATIO = 0.75
    EXACT_RATIO = 0.97

    def unavailable(self, call: Call, exact: bool) -> str | None:
        if exact:
            return "only psum has an exact p2p path" if call.op != "psum" else (
                call.exact_p2p_reason)
        return super().unavailable(call, exact) or call.p2p_reason

    def model_s(self, call: Call, exact: bool, link: Link, codec_pass_s) -> float:
        if not exact or call.layout == "processes" or call.platform != "cpu":
            return super().model_s(call, exact, link, codec_pass_s)
        xla = TRANSPORTS["xla"]
        lax_link = xla.link(call, costs.active())
        narrow = call.itemsize == 2  # lax moves 16-bit floats as f32; this sum as they are
        small = self.EXACT_SMALL_BYTES_16 if narrow else self.EXACT_SMALL_BYTES
        if call.nbytes <= small:
            return xla.model_s(call, True, lax_link, codec_pass_s) * self.EXACT_SMALL_RATIO
        if narrow and call.nbytes >= self.EXACT_NARROW_BYTES:
            as_is = dataclasses.replace(call, dtype="float32")
            return xla.model_s(as_is, True, lax_link, codec_pass_s)
        return xla.model_s(call, True, lax_link, codec_pass_s) * self.EXACT_RATIO

    def link(self, call: Call, table) -> Link:
        if call.platform != "cpu":
            return costs.local_gpu().link
        if call.layout == "processes":
            return self.shm_link()
        latency = self.LATENCY_S
        if table is not None and table.link.get("bytes_per_s"):
            latency = float(table.link.get("p2p_latency_s", latency))
        return dataclasses.replace(TRANSPORTS["xla"].link(call, table), base_latency_s=latency)

    def shm_link(self) -> Link:
        """The shared-memory link between processes as it runs now: paced at the emulated bus's
        rate where a benchmark set one (:func:`jax_flashcomm.transport.shm.set_link_rate`), with
        shared memory's own latency; else :data:`SHM_LINK`. (The link profile describes XLA's
        path between the processes: with no emulation, shared memory does not cross it.)"""
        try:
            rate = shm.link_rate()
        except RuntimeError:  # no CPU kernel module: no shared-memory transport either
            rate = 0.0
        if rate <= 0:
            return self.SHM_LINK
        return Link(rate, "shared", self.SHM_LINK.base_latency_s, self.SHM_LINK.step_latency_s)

    def collective_reason(self, config, axes: tuple) -> str | None:
        reason = p2p.unsupported_reason(axes)
        if reason is None and config.floating_point:
            reason = "a floating-point format (the p2p transport moves integer groups)"
        if reason is None and config.backend == "jnp":
            reason = "backend='jnp' (the p2p transport runs the FFI codec kernels)"
        return reason

    def ring_reason(self, axes: tuple) -> str | None:
        return ring_steps.unsupported_reason(axes)

    def exact_all_reduce(self, x, axes, plan):
        return p2p.exact_all_reduce(x, axes, plan.timeout_ms)

    def ring_link(self, spec, axis_name, perms):
        _, timeout_ms, rate = spec
        return ring_steps.P2pLink(_axes.normalize_axes(axis_name), timeout_ms, rate)



#: The transports by name, in the order the planner tries them when none is pinned.
_XLA = XlaTransport()
TRANSPORTS = {t.name: t for t in (_XLA, P2pTransport(), PallasTransport(_XLA.link))}
