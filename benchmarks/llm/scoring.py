"""What the accuracy benchmarks share (:mod:`benchmarks.llm.accuracy`,
:mod:`benchmarks.llm.layer_sensitivity`): scoring token windows against exact communication's
log-probs, and the wire bytes per element of a setting."""

from __future__ import annotations

__all__ = ["wire", "metrics_fns", "score_windows"]

from models.window_scores import metrics_fns, score_windows  # noqa: E402  (shared with models)


def wire(config) -> dict:
    """Wire bytes per element, averaged over the two phases (a bf16 ring moves 2.0), and the
    ratio to a bf16 ring (padding to whole groups left out: it is the same for every row of a
    message size and below 0.5% here except per-tensor)."""
    if config is None:
        return {"bytes_per_element": 2.0, "vs_bf16_ring": 1.0}
    per = sum(f.wire_bytes_per_element() for f in config.group_formats) / 2
    return {"bytes_per_element": per, "vs_bf16_ring": per / 2.0}
