"""The benchmarks' timing loops: medians of blocked calls, and a single-core memcpy reference
timed beside a kernel.

Nothing here imports jax at module level (:mod:`benchmarks.shared.runtime` says why)."""

from __future__ import annotations

import mmap
import statistics
import time

__all__ = ["median_seconds", "time_calls", "HugeCopy", "paired_seconds"]


def median_seconds(fn, reps: int) -> float:
    """Median wall time of ``reps`` calls of ``fn()`` (each blocked on), after one warm-up call."""
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class HugeCopy:
    """Single-core ``np.copyto`` of ``nbytes`` between two buffers on transparent huge pages
    (anonymous maps with ``madvise(MADV_HUGEPAGE)``, which the ``MALLOC_KEEP`` heap cannot give
    numpy's arrays): the memcpy reference, in this process, so that it can be timed beside each
    kernel call (the VM's speed drifts by tens of percent within minutes)."""

    def __init__(self, nbytes: int):
        import numpy as np

        self._maps = [mmap.mmap(-1, nbytes) for _ in range(2)]
        for m in self._maps:
            if hasattr(mmap, "MADV_HUGEPAGE"):
                m.madvise(mmap.MADV_HUGEPAGE)
        self.src, self.dst = (np.frombuffer(m, np.uint8) for m in self._maps)
        self.src[:] = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
        self.dst[:] = 0

    def median_seconds(self, reps: int) -> float:
        """Median wall time of ``reps`` copies back to back (the buffers warm in the cache)."""
        return statistics.median(self.seconds() for _ in range(reps))

    def seconds(self) -> float:
        """Wall time of one copy."""
        import numpy as np

        t0 = time.perf_counter()
        np.copyto(self.dst, self.src)
        return time.perf_counter() - t0


def paired_seconds(fn, copy: HugeCopy, reps: int) -> tuple[float, float, float]:
    """``fn()`` (blocked on) and ``copy.seconds()`` alternated ``reps`` times after one warm-up
    of each: ``(median seconds of fn, median seconds of the copy, median of the per-pair ratio
    copy / fn)``, the last the kernel's rate as a fraction of memcpy's at the same moment."""
    import jax

    jax.block_until_ready(fn())
    copy.seconds()
    pairs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        t = time.perf_counter() - t0
        pairs.append((t, copy.seconds()))
    return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
            statistics.median(c / t for t, c in pairs))


def time_calls(fn, x, reps: int, budget_s: float, warm: bool = True) -> tuple[float, int]:
    """``(median seconds, calls timed)`` of up to ``reps`` calls of ``fn(x)`` (each blocked on),
    stopping once ``budget_s`` seconds have passed; ``warm``: one untimed call first (compile and
    warm up)."""
    import jax

    if warm:
        jax.block_until_ready(fn(x))
    times = []
    start = time.perf_counter()
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - t)
        if time.perf_counter() - start > budget_s:
            break
    return statistics.median(times), len(times)


def interleaved_rows(compiled: dict, sizes, names, reps: int, per_call: int = 1,
                     baseline: str = "lax") -> list:
    """Rows of median seconds per call, the strategies interleaved.

    Args:
      compiled: ``{(size, name): (f, x)}``, each ``f(x)`` compiled and warmed up.
      sizes, names: the row keys and the strategies, in order.
      reps: rounds; round ``r`` starts at strategy ``r % len(names)`` (no strategy always runs
        first).
      per_call: calls chained in one ``f`` (a time is divided by it).
      baseline: the strategy the ``vs_<baseline>`` ratios divide.

    Returns:
      ``[{"bytes_per_rank", "seconds": {name: s}, "vs_<baseline>": {name: ratio}}]``.
    """
    import jax

    names = list(names)
    times = {(s, k): [] for s in sizes for k in names}
    for rep in range(reps):
        for size in sizes:
            for name in names[rep % len(names):] + names[:rep % len(names)]:
                f, x = compiled[size, name]
                t0 = time.perf_counter()
                jax.block_until_ready(f(x))
                times[size, name].append((time.perf_counter() - t0) / per_call)
    rows = []
    for size in sizes:
        med = {k: statistics.median(times[size, k]) for k in names}
        rows.append({"bytes_per_rank": size, "seconds": med,
                     f"vs_{baseline}": {k: med[baseline] / med[k] for k in names}})
    return rows
