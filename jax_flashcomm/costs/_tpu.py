"""TPU profiles for the cost model: ICI and HBM bandwidth of v5e, v5p and v6e from Google
Cloud's public TPU pages (docs/tpu.md, "The cost model on TPUs").

A profile is a :class:`~jax_flashcomm.costs.Gpu` (the same equations: the codec passes are HBM
bound, the collective crosses the link). The link of a tensor-parallel group is a bidirectional
ring over ICI: each chip sends over two links (one per neighbour), each at its one-way share of
the chip's published ICI bandwidth.
"""

from __future__ import annotations

from jax_flashcomm.costs._model import LINK_EFFICIENCY, Gpu, Link

__all__ = ["TPUS", "TPU_SPECS", "TPU_ICI_BASE_LATENCY_S", "TPU_ICI_STEP_LATENCY_S",
           "TPU_KERNEL_S", "local_tpu", "tpu_link"]

#: Per chip, from cloud.google.com/tpu/docs (v5e, v5p, v6e system architecture pages):
#: ``(ICI bits/s per chip, ICI links per chip, HBM bytes/s, dense bf16 FLOP/s)``. The ICI figure
#: is the chip's total over its links, both directions (the reading this model assumes).
TPU_SPECS = {
    "v5e": (1600e9, 4, 819e9, 197e12),
    "v5p": (4800e9, 6, 2765e9, 459e12),
    "v6e": (3584e9, 4, 1640e9, 918e12),
}
#: Assumed: one collective's fixed cost on ICI, and one ring step's.
TPU_ICI_BASE_LATENCY_S = 10e-6
TPU_ICI_STEP_LATENCY_S = 1e-6
#: Assumed: the fixed cost of one codec pass inside the fused kernel (no separate launch).
TPU_KERNEL_S = 1e-6


def tpu_link(generation: str) -> Link:
    """The bidirectional ICI ring of a ``generation`` chip (``"v5e"``, ``"v5p"``, ``"v6e"``):
    two links' one-way bandwidth at :data:`LINK_EFFICIENCY`, switched (each chip its own)."""
    ici_bits, links, _, _ = TPU_SPECS[generation]
    one_way = ici_bits / 8 / links / 2
    return Link(2 * one_way * LINK_EFFICIENCY, "switched", TPU_ICI_BASE_LATENCY_S,
                TPU_ICI_STEP_LATENCY_S)


TPUS = {name: Gpu(name, tpu_link(name), hbm, flops, kernel_launch_s=TPU_KERNEL_S)
        for name, (_, _, hbm, flops) in TPU_SPECS.items()}


def local_tpu() -> Gpu:
    """The profile of this process's first device (v5e when its kind is not known)."""
    import jax

    kind = str(getattr(jax.devices()[0], "device_kind", "")).lower().replace(" ", "")
    for name, marks in (("v6e", ("v6", "trillium")), ("v5p", ("v5p",)),
                        ("v5e", ("v5e", "v5lite"))):
        if any(m in kind for m in marks):
            return TPUS[name]
    return TPUS["v5e"]
