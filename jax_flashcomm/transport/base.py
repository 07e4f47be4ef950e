"""The contract every transport implements, and the call the planner asks it about.

A transport (vLLM's device communicators have this shape) is one object that

* says whether it can take a call on its exact or its quantized path, and why not
  (:meth:`Transport.unavailable`, :meth:`Transport.collective_reason`,
  :meth:`Transport.ring_reason`);
* prices a call with the cost model over its own link (:meth:`Transport.link`,
  :meth:`Transport.model_s`; the measured table's rows are looked up by the planner under
  :meth:`Transport.path_name`);
* runs the quantized all-reduce, reduce-scatter and all-gather (:meth:`Transport.all_reduce`,
  :meth:`Transport.reduce_scatter`, :meth:`Transport.all_gather`), the exact all-reduce
  (:meth:`Transport.exact_all_reduce`) and the ring steps of the
  collective matmuls (:meth:`Transport.ring_link`), bit for bit alike across transports.

The planner (:mod:`jax_flashcomm.planner`) is the one dispatcher over them.
"""

from __future__ import annotations

import abc
import dataclasses

from jax_flashcomm.costs import Link, exact_collective, flash_collective

__all__ = ["Call", "Transport"]


@dataclasses.dataclass(frozen=True)
class Call:
    """What the choice weighs: ``op`` of an operand of ``nbytes`` per rank (``itemsize``-byte
    values of ``dtype``) over ``n`` ranks, on ``platform`` with the peers ``layout``
    (:data:`jax_flashcomm.costs.LAYOUTS`); ``p2p_reason``: why the p2p transport cannot run
    its quantized collectives (None: it can); ``exact_p2p_reason``: why it cannot run the exact
    all-reduce (None: it can; the default says it was not asked); ``bits``: the quantized
    paths' ``(rs_bits, ag_bits)`` (None: exact); ``group_size`` and ``spikes`` of their
    format."""
    op: str
    nbytes: int
    itemsize: int
    dtype: str
    n: int
    platform: str
    layout: str
    p2p_reason: str | None
    bits: tuple | None
    group_size: int = 128
    spikes: int = 0
    exact_p2p_reason: str | None = "not asked (the caller did not check the exact p2p path)"


class Transport(abc.ABC):
    """A way for payloads to move between ranks (module docstring)."""

    #: ``"xla"`` or ``"p2p"``: a plan's ``transport``, a config's ``transport`` option.
    name = ""

    def path_name(self, exact: bool) -> str:
        """The name of the exact or quantized path over this transport in plans and tables."""
        return f"{'exact' if exact else 'quantized'}/{self.name}"

    def unavailable(self, call: Call, exact: bool) -> str | None:
        """Why the exact (or quantized) path over this transport cannot take ``call``; None
        when it can."""
        if not exact and call.bits is None:
            return "bits=None (exact setting)"
        return None

    @abc.abstractmethod
    def link(self, call: Call, table) -> Link:
        """The link this transport's payloads cross for ``call`` (``table``: the measured
        table, or None)."""

    def model_s(self, call: Call, exact: bool, link: Link, codec_pass_s) -> float:
        """Seconds of ``call`` on the exact (or quantized) path, by the cost model.

        Args:
          call: the :class:`Call`.
          exact: the exact path (else the quantized one at ``call.bits``).
          link: this transport's link (:meth:`link`).
          codec_pass_s: the codec's seconds per pass (a codec's ``codec_pass_s``).
        """
        if exact:
            return exact_collective(call.op, call.nbytes, call.n, link)
        rs, ag = call.bits
        return flash_collective(call.op, call.nbytes, call.n, link, codec_pass_s, rs or ag,
                                ag or rs, call.group_size, call.spikes, call.itemsize)

    @abc.abstractmethod
    def collective_reason(self, config, axes: tuple) -> str | None:
        """Why this transport cannot carry a quantized collective of ``config`` over the bound
        ``axes`` here; None when it can."""

    @abc.abstractmethod
    def ring_reason(self, axes: tuple) -> str | None:
        """Why this transport cannot run ring steps over the bound ``axes`` here; None when it
        can."""

    @abc.abstractmethod
    def all_reduce(self, x, axes: tuple, plan, decode: bool = True):
        """The quantized two-step all-reduce of ``x`` over ``axes``: ``(sum, phase-1 payload,
        gathered phase-2 payload)`` (``sum`` None when ``decode`` is False)."""

    @abc.abstractmethod
    def reduce_scatter(self, rows, axes: tuple, plan):
        """The quantized reduce-scatter of ``rows`` (``(n * m,)``): ``(this rank's summed
        chunk, its phase-1 payload)``."""

    @abc.abstractmethod
    def all_gather(self, x, axes: tuple, axis: int, tiled: bool, plan):
        """The quantized all-gather of ``x`` along ``axis`` (``tiled`` as ``lax.all_gather``)."""

    @abc.abstractmethod
    def exact_all_reduce(self, x, axes: tuple, plan):
        """The exact sum of ``x`` over ``axes`` on this transport (the plan's path
        ``"exact"``)."""

    @abc.abstractmethod
    def ring_link(self, spec: tuple, axis_name, perms: dict):
        """The link the ring steps of a collective matmul take (``spec``:
        :func:`jax_flashcomm.transport.ring_steps.spec`)."""
