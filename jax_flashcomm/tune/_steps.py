"""Measure the automatic choice's candidates inside a model's own step.

The tuning table (:mod:`jax_flashcomm.tune`) times each collective in a chain of its own calls.
For small calls that timing can rank the candidates wrongly: across processes on an oversubscribed
host, or on a rate-limited link whose budget refills during the compute between a decode step's
calls, a 2 KB all-reduce that is 45% faster quantized on its own made the decode step 12% slower
(docs/autotune.md, "Decode: measured in the step"). :func:`measure_in_step` runs the step itself
with each candidate at every call of one kind and records the step times as ``scope="step"``
rows; :func:`jax_flashcomm.planner.choose` ranks those candidates by them for calls of exactly
that kind::

    rows = tune_step.measure_in_step(make_step, "psum", config, nbytes=1 * 576 * 4, n=3,
                                     dtype="float32")
    table = dataclasses.replace(table, rows=table.rows + tuple(rows))

``make_step(config)`` builds the step with every collective under ``config`` (compiling it) and
returns a function that runs it and returns the seconds of the steps it ran.

:func:`measure_steps` times whole variants of a step side by side: what decides a choice made for
the whole model rather than per call, such as the sequence-parallel layout (``TPComm("auto")``
against ``TPComm("auto", layout="sequence_parallel")``).
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Mapping, Sequence

from jax_flashcomm import costs
from jax_flashcomm.config import CommConfig

__all__ = ["measure_in_step", "measure_steps", "candidate_config", "count_calls", "STEP_OPS"]

#: The collectives a step can be measured for.
STEP_OPS = ("psum", "psum_scatter", "all_gather")


def candidate_config(candidate: str, config: CommConfig) -> CommConfig:
    """The config that runs every call by ``candidate`` (pinned: no choice left to make).

    Args:
      candidate: ``"lax"``, ``"exact/p2p"``, ``"quantized/xla"`` or ``"quantized/p2p"``.
      config: the automatic config whose accuracy budget (bits, format, rotation, spikes) the
        quantized candidates keep.

    Returns:
      A :class:`~jax_flashcomm.CommConfig`.
    """
    if candidate in ("lax", "exact/p2p"):
        return CommConfig(bits=None, min_bytes=0, transport="xla" if candidate == "lax" else "p2p",
                          p2p_timeout_ms=config.p2p_timeout_ms)
    if candidate in ("quantized/xla", "quantized/p2p"):
        if config.exact:
            raise ValueError(f"candidate_config: {candidate} needs a quantized config "
                             f"(bits=None given)")
        return dataclasses.replace(config, min_bytes=0, transport=candidate.split("/")[1])
    raise ValueError(f"candidate_config: unknown candidate {candidate!r}; expected lax, "
                     f"exact/p2p, quantized/xla or quantized/p2p")


def count_calls(plans, op: str, nbytes: int, n: int, dtype: str) -> int:
    """How many of ``plans`` (:func:`jax_flashcomm.record`'s) are calls of ``op`` (or of an op
    weighed as ``op``: a fused all-reduce and norm is a ``psum``) of ``nbytes`` per rank over
    ``n`` ranks of a ``dtype`` operand."""
    import numpy as np

    from jax_flashcomm import planner

    dtype = np.dtype(dtype).name
    return sum(planner.WEIGHED.get(p.op, p.op) == op and p.nbytes == nbytes and p.axis_size == n
               and p.dtype == dtype for p in plans)


def measure_steps(steps: Mapping[str, Callable[[], Sequence[float]]], *,
                  rounds: int = 3) -> dict[str, float]:
    """The median step time of each variant of a step, the variants run in turn.

    Every process must call it alike; process 0's medians become every process's (so that all
    make the same choice from them).

    Args:
      steps: ``{name: run}``; ``run()`` runs the variant's step (compiled beforehand) and
        returns the seconds of each step it ran.
      rounds: each variant runs this many times, interleaved (the order rotated round by
        round, so that the machine's slow spells hit every variant alike).

    Returns:
      ``{name: median seconds}``.

    Raises:
      ValueError: no variant, ``rounds < 1``, or a run that returned no time.
    """
    import jax
    import numpy as np

    names = list(steps)
    if rounds < 1 or not names:
        raise ValueError("measure_steps: needs rounds >= 1 and at least one step")
    samples = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            samples[name].extend(float(s) for s in steps[name]())
    empty = [name for name in names if not samples[name]]
    if empty:
        raise ValueError(f"measure_steps: {', '.join(empty)} returned no step time")
    seconds = np.array([statistics.median(samples[name]) for name in names])
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        seconds = multihost_utils.broadcast_one_to_all(seconds)
    return {name: float(s) for name, s in zip(names, seconds)}


def measure_in_step(make_step: Callable[[CommConfig], Callable[[], Sequence[float]]],
                    op: str, config: CommConfig, *, nbytes: int, n: int, dtype: str,
                    candidates: Sequence[str] = ("lax", "quantized/xla"), rounds: int = 3,
                    layout: str | None = None) -> list:
    """Time a model step with each candidate at every ``op`` call of ``nbytes`` per rank.

    Every process must call it alike (across processes the step's collectives need all of
    them); process 0's times become every process's, so that all make the same choice.

    Args:
      make_step: ``make_step(config)`` builds the step under ``config`` and returns a function
        running it that returns the seconds of each step it ran (a decode loop: one per
        token). Where it traces the step (a first build), the step must make such a call.
      op: the collective (:data:`STEP_OPS`); ``config``: the automatic config (its bits are the
        quantized candidates').
      nbytes, n, dtype: the calls measured: bytes per rank, ranks, the operand's dtype (the
        step's other calls follow the same pinned config).
      candidates: the candidates, in the order of each round (rotated round by round).
      rounds: each candidate's step runs this many times, interleaved.
      layout: the rows' layout (default: ``"processes"`` with several JAX processes, else
        ``"in-process"``).

    Returns:
      ``scope="step"`` :class:`~jax_flashcomm.costs.Measurement` rows, one per candidate:
      the median step's seconds (the whole step's: it ranks the candidates, it is not a
      call's time).

    Raises:
      ValueError: an unknown op or candidate, ``rounds < 1``, or a traced step without the call.
    """
    import jax
    import numpy as np

    from jax_flashcomm import planner

    if op not in STEP_OPS:
        raise ValueError(f"measure_in_step: op must be one of {STEP_OPS}, got {op!r}")
    if rounds < 1 or not candidates:
        raise ValueError("measure_in_step: needs rounds >= 1 and at least one candidate")
    dtype = np.dtype(dtype).name
    layout = layout or ("processes" if jax.process_count() > 1 else "in-process")
    runs = {}
    for cand in candidates:
        cfg = candidate_config(cand, config)
        with planner.record() as plans:
            runs[cand] = make_step(cfg)
        if plans and not count_calls(plans, op, nbytes, n, dtype):
            raise ValueError(f"measure_in_step: the step built under {cand} makes no {op} of "
                             f"{nbytes} B per rank over {n} ranks ({dtype}): nothing to measure")
    seconds = measure_steps(runs, rounds=rounds)
    bits = planner.choice_bits(op, config)
    return [costs.Measurement(op, layout, n, dtype, nbytes, cand,
                               bits if cand.startswith("quantized") else None, seconds[cand],
                               scope="step")
            for cand in candidates]
