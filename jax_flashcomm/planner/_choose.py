"""The automatic choice (``min_bytes="auto"``): per call, the fastest path the config allows.

Each candidate is a class that says whether it can take a call and what the call would cost
(vLLM's device communicators have this shape); :func:`choose` asks them in order and keeps the
fastest (the first on a tie), a quantized one only when it is predicted at least 25% faster
than the exact ones (:data:`EXACT_PREFERENCE`; 3% where the table timed the model's own steps,
:data:`STEP_EXACT_PREFERENCE`):

=====================  ========================================================================
candidate              can take the call when
=====================  ========================================================================
``lax``                always: the exact ``lax`` collective
``exact/p2p``          ``psum`` whose peers are processes of this host: the exact sum over
                       shared memory
``quantized/p2p``      the peers are devices of this process (or processes of this host) and
                       the p2p kernels run here
``quantized/xla``      always: the codec around XLA's collectives, at the config's bits
=====================  ========================================================================

A candidate's time is the table's step rows where it has them for exactly this call (then
only the candidates measured in the step are weighed), else the measured table's
(:mod:`jax_flashcomm.tune`, interpolated over sizes) where it covers the call, else the cost model's (:mod:`jax_flashcomm.tune`) with the
profile of the platform and layout: the table's measured codec speed and in-process link, or the
defaults below (measured on an AMD EPYC Zen 4 by ``python -m jax_flashcomm.tune``, docs/autotune.md);
for peers in other processes the link profile (:func:`jax_flashcomm.tune.link_profile`), else
gloo over a loopback; on GPUs the cost model's GPU (H100 when the device kind is not known).
The accuracy budget is the config's: the quantized candidates run at its bits, rotation and
spikes; ``bits=None`` leaves only ``lax``.
"""

from __future__ import annotations

import abc
import dataclasses
import os

from jax_flashcomm import costs
from jax_flashcomm.costs import CpuCodec, Link
from jax_flashcomm.transport import shm

__all__ = ["Call", "Choice", "Candidate", "Lax", "ExactP2p", "Quantized", "CANDIDATES", "choose",
           "profile", "Profile", "EXACT_PREFERENCE", "STEP_EXACT_PREFERENCE"]

# Defaults where no table exists: `python -m jax_flashcomm.tune --quick` on an AMD EPYC Zen 4
# (2 cores, AVX2 build; docs/autotune.md, "The cost model"): the codec's passes with 3 ranks running
# them at once (values/s per rank) and the in-process link of a 3-device ppermute.
CPU_CODEC_VALUES_PER_S = {"quantize": 6.8e8, "dequantize_sum_quantize": 5.8e9,
                          "dequantize": 3.8e8}
#: The same in the spiked format (4 bits, one spike per group; the default at <= 6 bits): the
#: defaults above times the spiked / rotated ratio of each pass with 3 ranks in one full
#: ``python -m jax_flashcomm.tune`` run (same CPU; 0.94, 0.48, 1.57).
CPU_SPIKED_CODEC_VALUES_PER_S = {"quantize": 6.4e8, "dequantize_sum_quantize": 2.8e9,
                                 "dequantize": 6.0e8}
CPU_CODEC_CALL_S = 130e-6
IN_PROCESS_LINK = Link(21e9, "shared", 145e-6, 0.0)
P2P_LATENCY_S = 174e-6
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
#: The exact all-reduce over shared memory between processes (benchmarks/shm_allreduce.py on an
#: AMD EPYC Zen 4, 2 processes on 2 cores, fitted to its 2 KiB, 16 and 64 MiB rows;
#: docs/transport.md, "Across processes").
SHM_LINK = Link(2.2e9, "shared", 110e-6, 0.0)
#: gloo over a loopback, 3 processes on 2 cores (docs/ttft.json, "unlimited": the 1 MiB psum's
#: rate and the 4-byte psum's time).
GLOO_LOOPBACK_LINK = Link(309e6, "shared", 150e-6, 0.0)


@dataclasses.dataclass(frozen=True)
class Call:
    """What the choice weighs: ``op`` of an operand of ``nbytes`` per rank (``itemsize``-byte
    values of ``dtype``) over ``n`` ranks, on ``platform`` with the peers ``layout``
    (:data:`jax_flashcomm.tune.LAYOUTS`); ``p2p_reason``: why the p2p transport cannot run
    (None: it can); ``bits``: the quantized candidates' ``(rs_bits, ag_bits)`` (None: exact);
    ``group_size`` and ``spikes`` of their format."""
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


@dataclasses.dataclass(frozen=True)
class Profile:
    """The cost model's inputs for a call: the link of the exact and ``xla`` paths, the p2p
    transport's link, the codec (an object with ``codec_pass_s``), whether ``lax`` widens bf16
    to f32 (XLA:CPU does), a name for reports, and the link the exact collective may take for
    small messages instead (NCCL's LL protocol on GPUs)."""
    name: str
    link: Link
    p2p_link: Link | None
    codec: object
    widens_bf16: bool
    small_link: Link | None = None
    spiked_codec: object | None = None  # the codec in the spiked format (None: ``codec``)

    def codec_for(self, spikes: int):
        """The codec's speed in a format with ``spikes`` per group."""
        return self.spiked_codec if spikes and self.spiked_codec is not None else self.codec


def profile(call: Call, table: costs.Table | None) -> Profile:
    """The :class:`Profile` of ``call``'s platform and layout (module docstring)."""
    if call.platform != "cpu":
        gpu = costs.GPUS[_gpu_name()]
        return Profile(f"cost model {gpu.name}", gpu.link, gpu.link, gpu, False,
                       costs.nccl_ll_link(gpu.link))
    link, p2p, source = IN_PROCESS_LINK, P2P_LATENCY_S, "defaults"
    # the defaults were measured with 3 ranks on 2 cores: scale to n ranks on this machine's
    share = max(1.0, call.n / (os.cpu_count() or 1)) / 1.5
    codec, spiked = (CpuCodec({k: v / share for k, v in rates.items()}, CPU_CODEC_CALL_S * share)
                     for rates in (CPU_CODEC_VALUES_PER_S, CPU_SPIKED_CODEC_VALUES_PER_S))
    measured = None if table is None else table.codec.get("by_n", {}).get(str(call.n))
    if measured:  # measured with n ranks at once: the sharing is in the figures
        codec = CpuCodec(dict(measured["values_per_s"]), float(measured["call_s"]))
        m = measured.get("spiked")  # absent from tables older than this format's figures
        spiked = CpuCodec(dict(m["values_per_s"]), float(m["call_s"])) if m else None
        source = "table"
    if table is not None and table.link.get("bytes_per_s"):
        link = Link(float(table.link["bytes_per_s"]), "shared", float(table.link["latency_s"]))
        p2p = float(table.link.get("p2p_latency_s", p2p))
    if call.layout == "processes":
        ext = costs.link_profile()
        return Profile(f"cost model, {'given link' if ext else 'gloo loopback'}, codec {source}",
                       ext or GLOO_LOOPBACK_LINK, _shm_link(), codec, True, spiked_codec=spiked)
    return Profile(f"cost model, in-process, {source}", link,
                   dataclasses.replace(link, base_latency_s=p2p), codec, True,
                   spiked_codec=spiked)


def _shm_link() -> Link:
    """The shared-memory link between processes as it runs now: paced at the emulated bus's
    rate where a benchmark set one (:func:`jax_flashcomm.transport.shm.set_link_rate`), with
    shared memory's own latency; else :data:`SHM_LINK`. (The link profile describes XLA's path
    between the processes: with no emulation, shared memory does not cross it.)"""
    try:
        rate = shm.link_rate()
    except RuntimeError:  # no CPU kernel module: no shared-memory transport either
        rate = 0.0
    if rate <= 0:
        return SHM_LINK
    return Link(rate, "shared", SHM_LINK.base_latency_s, SHM_LINK.step_latency_s)


def _gpu_name() -> str:
    import jax

    kind = str(getattr(jax.devices()[0], "device_kind", ""))
    return next((g for g in costs.GPUS if g in kind), "H100")


class Candidate(abc.ABC):
    """A path a call can take: :meth:`unavailable` says why not (None: it can),
    :meth:`model_s` prices it with the cost model."""
    name = ""

    def unavailable(self, call: Call) -> str | None:
        return None

    @abc.abstractmethod
    def model_s(self, call: Call, prof: Profile) -> float:
        """Seconds of ``call`` on this path, by the cost model with ``prof``."""


class Lax(Candidate):
    """The exact ``lax`` collective (XLA:CPU moves bf16 as f32)."""
    name = "lax"

    def model_s(self, call, prof):
        wide = 2 if prof.widens_bf16 and call.dtype == "bfloat16" else 1
        links = [prof.link] + ([prof.small_link] if prof.small_link else [])
        return min(costs.exact_collective(call.op, call.nbytes * wide, call.n, link)
                   for link in links)


class ExactP2p(Candidate):
    """The exact ``psum`` over the p2p transport between processes (shared memory)."""
    name = "exact/p2p"

    def unavailable(self, call):
        if call.op != "psum":
            return "only psum has an exact p2p path"
        if call.layout != "processes":
            return "peers in this process (lax.psum is its exact path)"
        return call.p2p_reason

    def model_s(self, call, prof):
        return costs.exact_collective(call.op, call.nbytes, call.n, prof.p2p_link or SHM_LINK)


class Quantized(Candidate):
    """The codec at the config's bits over ``transport``."""

    def __init__(self, transport: str):
        self.transport = transport
        self.name = f"quantized/{transport}"

    def unavailable(self, call):
        if call.bits is None:
            return "bits=None (exact setting)"
        if self.transport == "p2p":
            return call.p2p_reason
        return None

    def model_s(self, call, prof):
        link = prof.p2p_link if self.transport == "p2p" else prof.link
        rs, ag = call.bits
        return costs.flash_collective(call.op, call.nbytes, call.n, link,
                                          prof.codec_for(call.spikes).codec_pass_s,
                                          rs or ag, ag or rs,
                                          call.group_size, call.spikes, call.itemsize)


#: The candidates, in the order ties are broken.
CANDIDATES = (Lax(), ExactP2p(), Quantized("p2p"), Quantized("xla"))


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
    quantized = cand.name.startswith("quantized") and call.bits is not None
    return tuple(call.bits) if quantized else None


def choose(call: Call, table: costs.Table | None = None, *,
           candidates=CANDIDATES) -> Choice:
    """The fastest candidate that can take ``call``.

    Args:
      call: the :class:`Call`.
      table: the measured table (default: :func:`jax_flashcomm.tune.active`).
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
    prof, considered, best = None, [], None
    for cand, reason, bits in able:
        if reason is None and step and (cand.name, bits) not in step:
            reason = "not measured in the step (the step rows rank only each other)"
        if reason is not None:
            considered.append((cand.name, None, reason))
            continue
        exact = not cand.name.startswith("quantized")
        if step:
            seconds, source = step[cand.name, bits], "table, in the step"
            preference = STEP_EXACT_PREFERENCE
        else:
            seconds = None if table is None else table.seconds(
                call.op, call.layout, call.n, call.dtype, cand.name, bits, call.nbytes)
            source, preference = "table", EXACT_PREFERENCE
            if seconds is None:
                prof = prof or profile(call, table)
                seconds, source = cand.model_s(call, prof), prof.name
        considered.append((cand.name, seconds, source))
        rank = seconds * (preference if exact else 1.0)
        if best is None or rank < best[0]:
            best = (rank, cand.name, seconds, source)
    return Choice(best[1], best[2], best[3], tuple(considered))
