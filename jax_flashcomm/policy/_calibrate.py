"""Choosing a per-site :class:`~jax_flashcomm.policy.CommPolicy` from measurements.

:func:`calibrate` knows nothing of models: it calls ``evaluate(assignment)``, which runs the
caller's model on calibration data with the given sites quantized (every other site exact)
and returns the loss it adds (a perplexity change in percent, a KL, ...). It

1. measures each site's sensitivity to each candidate config alone (``len(sites) *
   len(candidates)`` evaluations, with a progress bar);
2. predicts a policy's loss as the sum of its sites' sensitivities and picks, per site, the
   config of the fewest wire bytes that keeps the prediction within a target (a greedy
   multiple-choice knapsack: each step takes the upgrade with the largest predicted loss saved
   per wire byte added; "exact" is always the last upgrade);
3. evaluates that policy whole, and while the measurement is over ``budget``, shrinks the
   target by the ratio measured / budget and picks again (``rounds`` times at most).

It returns the cheapest measured policy within the budget, or, if none was, the one of least
measured loss, with ``info["met"]`` saying which (docs/calibration.md).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence

from jax_flashcomm._progress import progress
from jax_flashcomm.policy._comm_policy import CommPolicy, config_to_dict, wire_vs_bf16
from jax_flashcomm.config import CommConfig

__all__ = ["calibrate", "select"]

Evaluate = Callable[[Mapping[str, CommConfig]], float]


def _label(config: CommConfig | None) -> str:
    if config is None:
        return "exact"
    parts = [f"{k}={v}" for k, v in (config_to_dict(config) or {}).items()]
    return "CommConfig(" + ", ".join(parts) + ")"


def _frontier(options: list[tuple[float, float, int]]) -> list[tuple[float, float, int]]:
    """``(wire, loss, index)`` options of one site, by wire, keeping those that lose less than
    every cheaper one (the others are never worth their bytes)."""
    kept = []
    for wire, loss, k in sorted(options):
        if not kept or loss < kept[-1][1]:
            kept.append((wire, loss, k))
    return kept


def select(sensitivity: Sequence[Sequence[float]], wires: Sequence[float], target: float,
           max_wire: float | None = None) -> list[int]:
    """Per site, the index of its option under the additive model (``-1``: exact).

    Args:
      sensitivity: ``sensitivity[i][k]``, site ``i``'s loss with option ``k`` alone.
      wires: option ``k``'s wire bytes over a bf16 ring's (exact is 1.0, loss 0).
      target: the predicted total loss to reach (the sum over sites, negatives as 0).
      max_wire: the cap on the mean wire over sites (``None``: none).

    Returns:
      The option of each site: the cheapest start, upgraded greedily while the prediction is
      over ``target`` and an upgrade fits under ``max_wire``.
    """
    n = len(sensitivity)
    fronts = [_frontier([(w, max(0.0, s[k]), k) for k, w in enumerate(wires)] + [(1.0, 0.0, -1)])
              for s in sensitivity]
    at = [0] * n
    total_wire = math.fsum(f[0][0] for f in fronts)
    predicted = math.fsum(f[0][1] for f in fronts)
    cap = None if max_wire is None else max_wire * n
    while predicted > target:
        best, best_rate = None, -1.0
        for i, f in enumerate(fronts):
            if at[i] + 1 >= len(f):
                continue
            (w0, l0, _), (w1, l1, _) = f[at[i]], f[at[i] + 1]
            if cap is not None and total_wire + (w1 - w0) > cap + 1e-12:
                continue
            rate = (l0 - l1) / max(w1 - w0, 1e-12)
            if rate > best_rate:
                best, best_rate = i, rate
        if best is None:
            break
        (w0, l0, _), (w1, l1, _) = fronts[best][at[best]], fronts[best][at[best] + 1]
        at[best] += 1
        total_wire += w1 - w0
        predicted += l1 - l0
    return [fronts[i][at[i]][2] for i in range(n)]


class _Progress:
    """The progress bar of one calibration: ``total`` evaluations, counted as they start."""

    def __init__(self, total: int, out):
        self.total, self.out, self.done, self.start = total, out, 0, time.perf_counter()

    def step(self, what: str):
        if self.out is not None:
            progress(self.done, self.total, self.start, self.out, unit="evaluations", what=what)
        self.done += 1

    def finish(self):
        self.done = self.total
        if self.out is not None:
            progress(self.done, self.total, self.start, self.out, unit="evaluations",
                     what="done")


def _checked(sites, candidates, budget, max_wire, rounds, sensitivity):
    """``(sites, candidates, labels)`` of :func:`calibrate`'s arguments, each checked."""
    sites = list(sites)
    candidates = list(candidates)
    if not sites or len(set(sites)) != len(sites):
        raise ValueError(f"calibrate: sites must be distinct names, at least one, got {sites}")
    if not candidates:
        raise ValueError("calibrate: no candidate configs")
    for c in candidates:
        if not isinstance(c, CommConfig) or c.exact:
            raise ValueError(f"calibrate: candidates must be quantized CommConfigs (exact is "
                             f"always a choice), got {c!r}")
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget >= 0):
        raise ValueError(f"calibrate: budget must be a finite number >= 0, got {budget!r}")
    if max_wire is not None and not 0 < max_wire:
        raise ValueError(f"calibrate: max_wire must be > 0 (a ratio to a bf16 ring), got "
                         f"{max_wire!r}")
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"calibrate: rounds must be an int >= 1, got {rounds!r}")
    labels = [_label(c) for c in candidates]
    if len(set(labels)) != len(labels):
        raise ValueError(f"calibrate: candidates repeat: {labels}")
    if sensitivity is not None:
        missing = [(s, label) for s in sites for label in labels
                   if label not in (sensitivity.get(s) or {})]
        if missing:
            raise ValueError(f"calibrate: the given sensitivity lacks {missing[:3]}"
                             f"{' ...' if len(missing) > 3 else ''} (another model or other "
                             f"candidates?)")
    return sites, candidates, labels


def _sensitivity(evaluate, sites, candidates, labels, given, bar) -> list[list[float]]:
    """Step 1: the loss each candidate adds at each site alone (``given``: an earlier run's,
    by site and label, instead of measuring)."""
    rows = []
    for site in sites:
        row = []
        for c, label in zip(candidates, labels):
            if given is None:
                bar.step(f"{site} {label}")
                row.append(float(evaluate({site: c})))
            else:
                row.append(float(given[site][label]))
        rows.append(row)
    return rows


def _tables(sites, candidates, labels, sensitivity, tried) -> dict:
    """The candidates, the measured sensitivities and the rounds, for a policy's ``info``."""
    return {"candidates": {label: config_to_dict(c) for label, c in zip(labels, candidates)},
            "sensitivity": {s: dict(zip(labels, row)) for s, row in zip(sites, sensitivity)},
            "rounds": [{k: t[k] for k in ("target", "measured", "predicted", "mean_wire")}
                       for t in tried]}


def calibrate(evaluate: Evaluate, sites: Sequence[str], candidates: Sequence[CommConfig], *,
              budget: float, max_wire: float | None = None, rounds: int = 4,
              verify: Evaluate | None = None, sensitivity: Mapping | None = None,
              progress_out=sys.stderr, info: dict | None = None) -> CommPolicy:
    """A per-site policy within ``budget`` at the fewest mean wire bytes.

    Args:
      evaluate: ``evaluate({site: config, ...})``: the loss added when those sites use those
        configs and every other site is exact, measured on calibration data (for example the
        perplexity change in percent). Called ``len(sites) * len(candidates) + rounds`` times
        at most.
      sites: the call-site names (as the model names them; equal message sizes assumed, so
        the mean wire is the plain mean over sites).
      candidates: quantized :class:`~jax_flashcomm.CommConfig` choices (exact is always one).
      budget: the loss the whole policy may add.
      max_wire: the cap on the policy's mean wire bytes over a bf16 ring's (``None``: none).
      rounds: whole-policy evaluations at most.
      verify: the measure of a whole policy held to ``budget`` (default: ``evaluate``). A
        model's caller may rank sites by a smooth, additive estimate (a KL in perplexity
        percent) and hold the policy to the measured perplexity.
      sensitivity: step 1's results from an earlier run (its ``info["sensitivity"]``: per
        site, per candidate label): step 1 is skipped, and only whole policies are measured
        (another budget or cap without measuring every site again).
      progress_out: the stream of the progress bar (``None``: quiet).
      info: more data for the policy's ``info`` (the model, the calibration text, ...).

    Returns:
      A :class:`~jax_flashcomm.policy.CommPolicy` naming every site (``None`` for exact),
      with ``info``: ``budget``, ``max_wire``, ``measured``, ``predicted``, ``mean_wire``,
      ``met``, ``sensitivity`` (per site, per candidate label) and ``rounds``.

    Raises:
      ValueError: no sites or candidates, an exact candidate, a bad budget, cap or count.
    """
    sites, candidates, labels = _checked(sites, candidates, budget, max_wire, rounds,
                                         sensitivity)
    wires = [wire_vs_bf16(c) for c in candidates]
    measure = sensitivity is None
    bar = _Progress((len(sites) * len(candidates) if measure else 0) + rounds, progress_out)
    sensitivity = _sensitivity(evaluate, sites, candidates, labels, sensitivity, bar)

    def assignment_of(choice):
        return {s: candidates[k] for s, k in zip(sites, choice) if k >= 0}

    def mean_wire(choice):
        return math.fsum(wires[k] if k >= 0 else 1.0 for k in choice) / len(sites)

    def predicted_of(choice):
        return math.fsum(max(0.0, sensitivity[i][k]) if k >= 0 else 0.0
                         for i, k in enumerate(choice))

    tried, target, seen = [], budget, set()
    for _ in range(rounds):
        choice = select(sensitivity, wires, target, max_wire)
        if tuple(choice) in seen:
            break
        seen.add(tuple(choice))
        bar.step(f"whole policy, target {target:.4g}")
        measured = float((verify or evaluate)(assignment_of(choice)))
        tried.append({"choice": choice, "target": target, "measured": measured,
                      "predicted": predicted_of(choice), "mean_wire": mean_wire(choice)})
        if measured <= budget or measured <= 0 or predicted_of(choice) <= 0:
            break
        target = min(target, predicted_of(choice)) * budget / measured
    bar.finish()

    within = [t for t in tried if t["measured"] <= budget]
    best = (min(within, key=lambda t: (t["mean_wire"], t["measured"])) if within
            else min(tried, key=lambda t: (t["measured"], t["mean_wire"])))
    data = {**(info or {}), "budget": budget, "max_wire": max_wire,
            "measured": best["measured"], "sensitivity_reused": not measure,
            "predicted": best["predicted"], "mean_wire": best["mean_wire"], "met": bool(within),
            **_tables(sites, candidates, labels, sensitivity, tried)}
    return CommPolicy(default=None,
                      sites=tuple((s, candidates[k] if k >= 0 else None)
                                  for s, k in zip(sites, best["choice"])),
                      info=data)
