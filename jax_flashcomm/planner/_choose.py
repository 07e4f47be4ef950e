"""The automatic choice (``min_bytes="auto"``): per call, the fastest path the config allows.

Each candidate is the exact or the quantized path over one transport
(:class:`~jax_flashcomm.transport.Transport`: it says whether it can take the call and prices it
over its own link); :func:`choose` asks them in order and keeps the
fastest (the first on a tie), a quantized one only when it is predicted at least 25% faster
than the exact ones (:data:`EXACT_PREFERENCE`; 3% where the table timed the model's own steps,
:data:`STEP_EXACT_PREFERENCE`):

=====================  ========================================================================
candidate              can take the call when
=====================  ========================================================================
``lax``                always: the exact ``lax`` collective
``exact/p2p``          ``psum`` whose peers are devices of this process (the in-process
                       rendezvous) or processes of this host (shared memory), of a dtype
                       its kernels sum: the exact sum over the p2p transport
``quantized/p2p``      the peers are devices of this process (or processes of this host) and
                       the p2p kernels run here
``quantized/xla``      always: the codec around XLA's collectives, at the config's bits
=====================  ========================================================================

A candidate's time is the table's step rows where it has them for exactly this call (then
only the candidates measured in the step are weighed), else the measured table's
(:mod:`jax_flashcomm.costs`, interpolated over sizes) where it covers the call (then only the
candidates it measured are weighed: a table's time and a model's do not rank each other), else
the cost model's with the profile of the platform and layout: the table's measured codec speed and
in-process link, or the defaults (:func:`jax_flashcomm.costs.cpu_codec` and each transport's
link, measured on an AMD EPYC Zen 4 by ``python -m jax_flashcomm.tune``, docs/autotune.md);
for peers in other processes the link profile (:func:`jax_flashcomm.costs.link_profile`), else
gloo over a loopback; on GPUs the cost model's GPU (H100 when the device kind is not known).
The accuracy budget is the config's: the quantized candidates run at its bits, rotation and
spikes; ``bits=None`` leaves only ``lax``.
"""

from __future__ import annotations

import dataclasses

from jax_flashcomm import costs, transport
from jax_flashcomm.transport import Call, Transport

__all__ = ["Call", "Choice", "Candidate", "CANDIDATES", "choose", "profile", "Profile",
           "EXACT_PREFERENCE", "STEP_EXACT_PREFERENCE"]

#: A quantized candidate is chosen over exact ``lax`` only when predicted at least 25% faster:
#: exact is exact; one small call's measured time varies by more than 10% from run to run on a
#: loaded machine; and an isolated timing undercounts the quantized path's CPU work (its codec
#: passes) where a model's ranks already keep the cores busy (docs/autotune.md, "The margin").
EXACT_PREFERENCE = 0.75
#: The same preference where the table times whole model steps (``scope="step"`` rows,
#: :func:`jax_flashcomm.tune.measure_in_step`): the model's own step leaves none of an isolated
#: timing's biases, so exact is kept unless quantizing makes the step at least 3% faster;
#: keeping exact costs at most that (docs/autotune.md, "Decode: measured in the step").
STEP_EXACT_PREFERENCE = 0.97


@dataclasses.dataclass(frozen=True)
class Profile:
    """The cost model's inputs for a call: each transport's link (by name), the codec (an
    object with ``codec_pass_s``; a :class:`~jax_flashcomm.costs.Gpu` on GPUs) and its speed in
    the spiked format, and a name for reports."""
    name: str
    links: dict
    codec: object
    spiked_codec: object | None = None  # the codec in the spiked format (None: ``codec``)

    def codec_for(self, spikes: int):
        """The codec's speed in a format with ``spikes`` per group."""
        return self.spiked_codec if spikes and self.spiked_codec is not None else self.codec


def profile(call: Call, table: costs.Table | None) -> Profile:
    """The :class:`Profile` of ``call``'s platform and layout (module docstring)."""
    links = {t.name: t.link(call, table) for t in transport.all_transports()}
    if call.platform == "tpu":
        tpu = costs.local_tpu()
        return Profile(f"cost model TPU {tpu.name}", links, tpu)
    if call.platform != "cpu":
        gpu = costs.local_gpu()
        return Profile(f"cost model {gpu.name}", links, gpu)
    codec, spiked, source = costs.cpu_codec(call.n, table)
    if call.layout == "processes":
        given = "given link" if costs.link_profile() else "gloo loopback"
        return Profile(f"cost model, {given}, codec {source}", links, codec, spiked)
    return Profile(f"cost model, in-process, {source}", links, codec, spiked)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A path a call can take: the exact or quantized path over one transport.
    :meth:`unavailable` says why not (None: it can), :meth:`model_s` prices it with the cost
    model."""
    transport: Transport
    exact: bool

    @property
    def name(self) -> str:
        """``lax``, ``exact/p2p``, ``quantized/p2p`` or ``quantized/xla`` (the tables' names)."""
        return self.transport.path_name(self.exact)

    def unavailable(self, call: Call) -> str | None:
        return self.transport.unavailable(call, self.exact)

    def model_s(self, call: Call, prof: Profile) -> float:
        """Seconds of ``call`` on this path, by the cost model with ``prof``."""
        return self.transport.model_s(call, self.exact, prof.links[self.transport.name],
                                      prof.codec_for(call.spikes).codec_pass_s)


_XLA, _P2P = transport.by_name("xla"), transport.by_name("p2p")
_PALLAS = transport.by_name("pallas")
#: The candidates, in the order ties are broken.
CANDIDATES = (Candidate(_XLA, True), Candidate(_P2P, True), Candidate(_P2P, False),
              Candidate(_PALLAS, False), Candidate(_XLA, False))


@dataclasses.dataclass(frozen=True)
class Choice:
    """The chosen candidate, its predicted seconds and their source (``"table"`` or the cost
    model's profile), and every candidate considered: ``(name, seconds or None, source or the
    reason it could not take the call)``."""
    candidate: str
    predicted_s: float
    source: str
    considered: tuple

    @property
    def transport(self) -> str | None:
        return self.candidate.split("/", 1)[1] if "/" in self.candidate else None

    def __str__(self):
        alts = ", ".join(f"{name} {s * 1e6:.0f} us" for name, s, _ in self.considered
                         if s is not None and name != self.candidate)
        return (f"auto: {self.candidate} {self.predicted_s * 1e6:.0f} us ({self.source})"
                + (f"; {alts}" if alts else ""))


def _bits(cand: Candidate, call: Call) -> tuple | None:
    """The bits ``cand`` runs ``call`` at: the config's for the quantized ones, else None."""
    quantized = not cand.exact and call.bits is not None
    return tuple(call.bits) if quantized else None


def choose(call: Call, table: costs.Table | None = None, *,
           candidates=CANDIDATES) -> Choice:
    """The fastest candidate that can take ``call``.

    Args:
      call: the :class:`Call`.
      table: the measured table (default: :func:`jax_flashcomm.costs.active`).
      candidates: the candidates to consider, in tie-break order.

    Returns:
      The :class:`Choice`.
    """
    table = costs.active() if table is None else table
    step = {} if table is None else table.step_seconds(call.op, call.layout, call.n,
                                                        call.dtype, call.nbytes)
    able = [(cand, cand.unavailable(call), _bits(cand, call)) for cand in candidates]
    if not any(reason is None and (cand.name, bits) in step for cand, reason, bits in able):
        step = {}  # the step rows cover none of the candidates that can take the call
    timed = {} if table is None or step else {
        (cand.name, bits): table.seconds(call.op, call.layout, call.n, call.dtype, cand.name,
                                         bits, call.nbytes)
        for cand, reason, bits in able if reason is None}
    measured = any(s is not None for s in timed.values())
    prof, considered, best = None, [], None
    for cand, reason, bits in able:
        if reason is None and step and (cand.name, bits) not in step:
            reason = "not measured in the step (the step rows rank only each other)"
        if reason is None and measured and timed[cand.name, bits] is None:
            reason = ("not in the table, which measured the others (python -m "
                      "jax_flashcomm.tune measures it)")
        if reason is not None:
            considered.append((cand.name, None, reason))
            continue
        exact = cand.exact
        if step:
            seconds, source = step[cand.name, bits], "table, in the step"
            preference = STEP_EXACT_PREFERENCE
        else:
            seconds = timed.get((cand.name, bits))
            source, preference = "table", EXACT_PREFERENCE
            if seconds is None:
                prof = prof or profile(call, table)
                seconds, source = cand.model_s(call, prof), prof.name
        considered.append((cand.name, seconds, source))
        rank = seconds * (preference if exact else 1.0)
        if best is None or rank < best[0]:
            best = (rank, cand.name, seconds, source)
    return Choice(best[1], best[2], best[3], tuple(considered))
