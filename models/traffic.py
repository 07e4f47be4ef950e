"""Bytes each rank sends for the all-reduces of one decode step (one token per sequence).

A decode step of an L-layer TP model all-reduces 2 L activation vectors of ``d_model`` values
per sequence (after attention and after the MLP). Per rank, a ring all-reduce of ``n`` bytes
over N ranks sends ``2 (N - 1) / N * n``; the two-step quantized all-reduce sends ``(N - 1) / N``
of the phase-1 payload and ``(N - 1) / N`` of the phase-2 payload, each the codes, spikes,
scale and zero of the operand padded to ``N`` chunks of whole groups (docs/format.md). The
embedding's exact psum and the logits' all-gather are the same for every strategy and are not
counted.
"""

from __future__ import annotations

from jax_flashcomm import policy as comm_policy
from jax_flashcomm.codec import spec
from jax_flashcomm.policy import wire_per_element
from jax_flashcomm.planner import quantizes

__all__ = ["allreduce_bytes_per_token", "wire_per_element", "wire_vs_bf16", "plans_wire_vs_bf16"]


def wire_vs_bf16(comm) -> float:
    """A quantized all-reduce's wire bytes per element (the mean of its two phases) over a bf16
    ring's 2 bytes per element and phase; 1.0 for a strategy that does not quantize."""
    return comm_policy.wire_vs_bf16(comm.config if comm.quantized else None)


def plans_wire_vs_bf16(plans) -> tuple[float, dict]:
    """Wire bytes of the all-reduces that ran over a bf16 ring's (2 bytes per element and
    phase), from their traced plans, and how many took each path.

    Args:
      plans: :class:`jax_flashcomm.planner.Plan` objects (``jax_flashcomm.record()``).

    Returns:
      ``(ratio, {path: count})`` over the psum plans (1.0 and {} when there are none).
    """
    import numpy as np

    wire = bf16 = 0.0
    paths: dict[str, int] = {}
    for p in plans:
        if p.op != "psum":
            continue
        paths[p.path] = paths.get(p.path, 0) + 1
        elements = p.nbytes / np.dtype(p.dtype).itemsize
        bf16 += 2.0 * elements
        if p.quantized:
            wire += elements * sum(f.wire_bytes_per_element() for f in p.group_formats) / 2
        else:
            wire += 2.0 * elements
    return (wire / bf16 if bf16 else 1.0), paths


def allreduce_bytes_per_token(cfg, tp: int, comm, *, batch: int = 1, itemsize: int = 4) -> dict:
    """``{"sent": bytes per rank, "exact": the same with lax.psum, "messages": count}``."""
    n_msgs = 2 * cfg.n_layers
    elems = batch * cfg.d_model
    if tp == 1:
        return {"sent": 0.0, "exact": 0.0, "messages": n_msgs}
    exact = 2 * (tp - 1) / tp * elems * itemsize
    sent = exact
    if comm.quantized:
        c = comm.config
        quantized = quantizes("psum", elems * itemsize, tp,
                              "bfloat16" if itemsize == 2 else "float32", c)
        if quantized:
            padded = spec.padded_size(elems, c.group_size, tp)
            sent = (tp - 1) / tp * padded * sum(wire_per_element(c))
    return {"sent": n_msgs * sent, "exact": n_msgs * exact, "messages": n_msgs}

