"""A cost model of the collectives: time from bytes moved, link bandwidth and latency, and codec
passes at a measured (or assumed) throughput.

Two users: :mod:`jax_flashcomm.planner` prices a call's candidate paths with it where no
measured table covers the call, and ``benchmarks/gpu/cost_model.py`` predicts GPU all-reduce and
TTFT
speedups with the same equations (every GPU constant's source is in docs/gpu_model.md).

The equations (docs/autotune.md, "The cost model"):

* exact all-reduce of ``S`` bytes per rank: ``2 (N-1)/N S`` over the link, plus the latency of a
  ring (``base + 2 (N-1) step``: one collective call) or of two collectives (``two_step``);
* two-step quantized all-reduce: quantize, ``(N-1)/N`` of the phase-1 payload, the fused
  dequantize-sum-quantize, ``(N-1)/N`` of the phase-2 payload, dequantize; two collectives of
  latency;
* a reduce-scatter or all-gather: one phase of either.

A :class:`Link` is ``shared`` (every rank's bytes cross one bus: a PCIe host bridge, a loopback,
one machine's memory) or ``switched`` (each rank has the bandwidth to itself: NVLink through
NVSwitch).
"""

from __future__ import annotations

import dataclasses

from jax_flashcomm.codec import spec
from jax_flashcomm.codec.group_format import GroupFormat

__all__ = ["MIB", "BF16", "PASSES", "PCIE4_X16_BYTES_PER_S", "NVLINK3_BYTES_PER_S",
           "NVLINK4_BYTES_PER_S", "LINK_EFFICIENCY", "NCCL_BASE_LATENCY_S",
           "NCCL_STEP_LATENCY_S", "NCCL_LL_BASE_LATENCY_S", "NCCL_LL_STEP_LATENCY_S",
           "NCCL_LL_BANDWIDTH_SHARE", "KERNEL_LAUNCH_S", "CODEC_EFFICIENCY", "PREFILL_MFU",
           "L40_HBM", "L40_FLOPS", "A100_HBM", "A100_FLOPS", "H100_HBM", "H100_FLOPS", "Link",
           "Gpu", "CpuCodec", "nccl_ll_link", "GPUS",
           "exact_allreduce", "flash_allreduce", "exact_collective", "flash_collective",
           "gpu_allreduce_speedup", "CPU_CODEC_VALUES_PER_S",
           "CPU_SPIKED_CODEC_VALUES_PER_S", "CPU_CODEC_CALL_S", "cpu_codec", "local_gpu"]

MIB = 2**20
BF16 = 2                 # bytes per activation value of the exact all-reduce on a GPU
PASSES = ("quantize", "dequantize_sum_quantize", "dequantize")

# --- GPU inputs; each one's source is in docs/gpu_model.md, "Parameters" -----------------------
PCIE4_X16_BYTES_PER_S = 16e9 * 16 * 128 / 130 / 8   # 31.5 GB/s per direction
NVLINK3_BYTES_PER_S = 12 * 25e9                     # A100 SXM: 300 GB/s per direction
NVLINK4_BYTES_PER_S = 18 * 25e9                     # H100 SXM: 450 GB/s per direction
LINK_EFFICIENCY = 0.8          # assumed: achieved share of the signalling rate, large transfers
NCCL_BASE_LATENCY_S = 8.4e-6   # NCCL tuning.cc baseLat, Ring/Simple: once per collective
NCCL_STEP_LATENCY_S = 5.7e-6   # NCCL tuning.cc hwLat, Ring/Simple, NVLink and PCI: per step
NCCL_LL_BASE_LATENCY_S = 3.6e-6   # NCCL tuning.h baseLat, Ring/LL: small messages
NCCL_LL_STEP_LATENCY_S = 0.47e-6  # NCCL tuning.h hwLat, Ring/LL, NVLink: per step
NCCL_LL_BANDWIDTH_SHARE = 0.5     # LL lines carry 4 bytes of data per 8 (flag + data)
KERNEL_LAUNCH_S = 4e-6         # assumed: one codec kernel launch
CODEC_EFFICIENCY = 0.5         # assumed: codec kernels' share of HBM bandwidth (bytes in + out)
PREFILL_MFU = 0.5              # assumed: achieved share of dense bf16 peak in prefill
L40_HBM, L40_FLOPS = 864e9, 181.05e12       # NVIDIA L40 datasheet (GDDR6; dense bf16)
A100_HBM, A100_FLOPS = 2039e9, 312e12       # NVIDIA A100 80GB SXM datasheet
H100_HBM, H100_FLOPS = 3.35e12, 989.4e12    # NVIDIA H100 SXM5 datasheet


@dataclasses.dataclass(frozen=True)
class Link:
    """The link between N ranks. ``shared``: all ranks' traffic crosses one bus of ``bytes_per_s``
    (a PCIe host bridge; the tc-limited loopback). ``switched``: every rank has ``bytes_per_s``
    per direction of its own (NVLink through NVSwitch). Latencies: per collective, per step."""
    bytes_per_s: float
    topology: str = "switched"
    base_latency_s: float = 0.0
    step_latency_s: float = 0.0

    def __post_init__(self):
        if not self.bytes_per_s > 0:
            raise ValueError(f"Link.bytes_per_s must be > 0, got {self.bytes_per_s!r}")
        if self.topology not in ("shared", "switched"):
            raise ValueError(f"Link.topology must be 'shared' or 'switched', got {self.topology!r}")
        if self.base_latency_s < 0 or self.step_latency_s < 0:
            raise ValueError("Link latencies must be >= 0")

    def transfer_s(self, bytes_per_rank: float, n: int) -> float:
        """Seconds for every one of ``n`` ranks to send ``bytes_per_rank`` at once."""
        return bytes_per_rank * (n if self.topology == "shared" else 1) / self.bytes_per_s

    @property
    def collective_latency_s(self) -> float:
        """The latency of one collective of the two-step algorithms (one step)."""
        return self.base_latency_s + self.step_latency_s


@dataclasses.dataclass(frozen=True)
class Gpu:
    """A GPU type: its link, HBM bandwidth, dense bf16 FLOP/s, and the assumed efficiencies of
    the codec kernels (share of HBM bandwidth) and of prefill (share of peak FLOP/s)."""
    name: str
    link: Link
    hbm_bytes_per_s: float
    bf16_flops: float
    codec_efficiency: float = CODEC_EFFICIENCY
    mfu: float = PREFILL_MFU
    kernel_launch_s: float = KERNEL_LAUNCH_S

    def codec_pass_s(self, name: str, elems: int, w1: float, w2: float, n: int) -> float:
        """One codec kernel: the HBM bytes it reads and writes, at the codec's share of HBM."""
        touched = {"quantize": elems * (BF16 + w1),                          # bf16 in, payload out
                   "dequantize_sum_quantize": elems * w1 + elems / n * w2,   # N chunks in, 1 out
                   "dequantize": elems * (w2 + BF16)}[name]                  # payload in, bf16 out
        return touched / (self.hbm_bytes_per_s * self.codec_efficiency) + self.kernel_launch_s


@dataclasses.dataclass(frozen=True)
class CpuCodec:
    """The CPU codec's measured speed: values per second of each pass (:data:`PASSES`, the
    operand's values: the fused pass counts the N chunks it reads) and a fixed cost per call."""
    values_per_s: dict
    call_s: float = 0.0

    def codec_pass_s(self, name: str, elems: int, w1: float, w2: float, n: int) -> float:
        """One pass over ``elems`` values (the signature of :meth:`Gpu.codec_pass_s`)."""
        return elems / self.values_per_s[name] + self.call_s


_link = lambda peak, topology: Link(peak * LINK_EFFICIENCY, topology, NCCL_BASE_LATENCY_S,  # noqa: E731
                                   NCCL_STEP_LATENCY_S)


def nccl_ll_link(link: Link) -> Link:
    """The same link under NCCL's LL protocol (what it picks for small messages): lower
    latency, half the bandwidth."""
    return Link(link.bytes_per_s * NCCL_LL_BANDWIDTH_SHARE, link.topology,
                NCCL_LL_BASE_LATENCY_S, NCCL_LL_STEP_LATENCY_S)
GPUS = {"L40": Gpu("L40", _link(PCIE4_X16_BYTES_PER_S, "shared"), L40_HBM, L40_FLOPS),
        "A100": Gpu("A100", _link(NVLINK3_BYTES_PER_S, "switched"), A100_HBM, A100_FLOPS),
        "H100": Gpu("H100", _link(NVLINK4_BYTES_PER_S, "switched"), H100_HBM, H100_FLOPS)}


def _wire(bits: int, group_size: int, spikes: int) -> float:
    """Payload bytes per value of the integer format (:meth:`GroupFormat.wire_bytes_per_element`,
    its fields checked)."""
    g = spec.check_group_size(group_size)
    return GroupFormat("int", bits, g, 0, spec.check_spikes(spikes, g)).wire_bytes_per_element()


def _check(size, n):
    if isinstance(n, bool) or not isinstance(n, int) or n < 2:
        raise ValueError(f"the number of ranks must be an int >= 2, got {n!r}")
    if not size > 0:
        raise ValueError(f"the message size must be > 0 bytes, got {size!r}")


def exact_allreduce(size: float, n: int, link: Link, algorithm: str = "ring") -> dict:
    """bf16 all-reduce of ``size`` bytes per rank; each rank sends 2(N-1)/N * size. ``ring``
    (NCCL) pays 2(N-1) steps of latency, ``two_step`` (all_to_all + all_gather) 2 collectives."""
    _check(size, n)
    if algorithm not in ("ring", "two_step"):
        raise ValueError(f"algorithm must be 'ring' or 'two_step', got {algorithm!r}")
    lat = (link.base_latency_s + 2 * (n - 1) * link.step_latency_s if algorithm == "ring"
           else 2 * link.collective_latency_s)
    t = {"link_s": link.transfer_s(2 * (n - 1) / n * size, n), "latency_s": lat, "codec_s": 0.0}
    return {**t, "total_s": sum(t.values())}


def flash_allreduce(size: float, n: int, link: Link, codec_pass_s, rs_bits: int,
                    ag_bits: int | None = None, group_size: int = 128, spikes: int = 0,
                    itemsize: int = BF16) -> dict:
    """Two-step quantized all-reduce, run serially: quantize -> all_to_all -> dequantize + sum +
    requantize -> all_gather -> dequantize. Each phase sends (N-1)/N of its payload (the operand
    padded to N chunks of whole groups); ``codec_pass_s(name, elems, w1, w2, n)`` prices a pass.
    ``size`` is in bytes of ``itemsize``-byte values."""
    _check(size, n)
    w1 = _wire(rs_bits, group_size, spikes)
    w2 = _wire(rs_bits if ag_bits is None else ag_bits, group_size, spikes)
    elems = spec.padded_size(int(size) // itemsize, group_size, n)
    t = {"link_s": sum(link.transfer_s((n - 1) / n * elems * w, n) for w in (w1, w2)),
         "latency_s": 2 * link.collective_latency_s,
         "codec_s": sum(codec_pass_s(p, elems, w1, w2, n) for p in PASSES)}
    return {**t, "total_s": sum(t.values()), "byte_ideal": 2 * BF16 / (w1 + w2)}


#: The all-to-alls: one step, one quantization.
ALL_TO_ALLS = ("all_to_all", "ragged_all_to_all")

#: The share of an all-reduce's bytes and codec passes each collective has.
_ONE_PHASE = {"psum_scatter": ("quantize", "dequantize_sum_quantize"),
              "all_gather": ("quantize", "dequantize")}


def exact_collective(op: str, size: float, n: int, link: Link) -> float:
    """Seconds of an exact ``op`` (``psum``, ``psum_scatter``, ``all_gather``, an all-to-all) of
    ``size`` bytes per rank (the operand: for ``all_gather`` this rank's shard): one collective,
    a ring (``base + 2 (N-1) step`` latency for ``psum``, ``base + (N-1) step`` for the
    gather and scatter, one collective's latency for the all-to-alls)."""
    _check(size, n)
    if op == "psum":
        return exact_allreduce(size, n, link, "ring")["total_s"]
    if op in ALL_TO_ALLS:  # one step: (N-1)/N of the operand leaves each rank
        return link.transfer_s((n - 1) / n * size, n) + link.collective_latency_s
    sent = (n - 1) / n * size if op == "psum_scatter" else (n - 1) * size
    return link.transfer_s(sent, n) + link.base_latency_s + (n - 1) * link.step_latency_s


def flash_collective(op: str, size: float, n: int, link: Link, codec_pass_s, rs_bits, ag_bits,
                     group_size: int = 128, spikes: int = 0, itemsize: int = BF16) -> float:
    """Seconds of a quantized ``op`` of ``size`` bytes per rank of ``itemsize``-byte values:
    :func:`flash_allreduce` for ``psum``; one phase's payload and passes otherwise."""
    if op == "psum":
        return flash_allreduce(size, n, link, codec_pass_s, rs_bits, ag_bits, group_size,
                               spikes, itemsize)["total_s"]
    _check(size, n)
    if op in ALL_TO_ALLS:  # every row quantized once, sent, decoded once
        w = _wire(ag_bits or rs_bits, group_size, spikes)
        elems = spec.padded_size(int(size) // itemsize, group_size, 1)
        codec = sum(codec_pass_s(p, elems, w, w, n) for p in ("quantize", "dequantize"))
        return link.transfer_s((n - 1) / n * elems * w, n) + link.collective_latency_s + codec
    bits = rs_bits if op == "psum_scatter" else ag_bits
    w = _wire(bits, group_size, spikes)
    elems = int(size) // itemsize
    if op == "psum_scatter":
        elems = spec.padded_size(elems, group_size, n)
        sent = (n - 1) / n * elems * w
    else:
        sent = (n - 1) * spec.padded_size(elems, group_size, 1) * w
    passes = {"quantize": elems, "dequantize_sum_quantize": elems,
              "dequantize": elems * n}                   # all_gather decodes every rank's shard
    codec = sum(codec_pass_s(p, passes[p], w, w, n) for p in _ONE_PHASE[op])
    return link.transfer_s(sent, n) + link.collective_latency_s + codec


def gpu_allreduce_speedup(gpu: Gpu, size: float, n: int, bits: int, **kw) -> float:
    """NCCL bf16 ring time / Flash AllReduce time on ``gpu``."""
    q = flash_allreduce(size, n, gpu.link, gpu.codec_pass_s, bits, **kw)
    return exact_allreduce(size, n, gpu.link, "ring")["total_s"] / q["total_s"]


# --- CPU inputs where no table exists --------------------------------------------------------
#: `python -m jax_flashcomm.tune --quick` on an AMD EPYC Zen 4 (2 cores, AVX2 build;
#: docs/autotune.md, "The cost model"): the codec's passes with 3 ranks running them at once
#: (values/s per rank).
CPU_CODEC_VALUES_PER_S = {"quantize": 6.8e8, "dequantize_sum_quantize": 5.8e9,
                          "dequantize": 3.8e8}
#: The same in the spiked format (4 bits, one spike per group; the default at <= 6 bits): the
#: defaults above times the spiked / rotated ratio of each pass with 3 ranks in one full
#: ``python -m jax_flashcomm.tune`` run (same CPU; 0.94, 0.48, 1.57).
CPU_SPIKED_CODEC_VALUES_PER_S = {"quantize": 6.4e8, "dequantize_sum_quantize": 2.8e9,
                                 "dequantize": 6.0e8}
CPU_CODEC_CALL_S = 130e-6


def cpu_codec(n: int, table) -> tuple[CpuCodec, CpuCodec | None, str]:
    """The CPU codec's speed with ``n`` ranks running it at once.

    Args:
      n: the ranks (they share this machine's cores).
      table: the measured table (:class:`jax_flashcomm.costs.Table`) or None.

    Returns:
      ``(codec, spiked codec or None, source)``: the table's figures measured with ``n`` ranks
      (source ``"table"``), else the defaults above scaled from 3 ranks on 2 cores to ``n``
      ranks on this machine's cores (source ``"defaults"``).
    """
    import os

    share = max(1.0, n / (os.cpu_count() or 1)) / 1.5
    codec, spiked = (CpuCodec({k: v / share for k, v in rates.items()}, CPU_CODEC_CALL_S * share)
                     for rates in (CPU_CODEC_VALUES_PER_S, CPU_SPIKED_CODEC_VALUES_PER_S))
    measured = None if table is None else table.codec.get("by_n", {}).get(str(n))
    if not measured:
        return codec, spiked, "defaults"
    m = measured.get("spiked")  # absent from tables older than this format's figures
    return (CpuCodec(dict(measured["values_per_s"]), float(measured["call_s"])),
            CpuCodec(dict(m["values_per_s"]), float(m["call_s"])) if m else None, "table")


def local_gpu() -> Gpu:
    """The :class:`Gpu` of this process's first device (an H100 when its kind is not known)."""
    import jax

    kind = str(getattr(jax.devices()[0], "device_kind", ""))
    return GPUS[next((g for g in GPUS if g in kind), "H100")]
