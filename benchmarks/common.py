"""What the benchmarks share: the glibc malloc settings they run with, their timing loops, and
the generated block of a hand-written page.

Nothing here imports jax at module level: a benchmark imports this before it sets ``XLA_FLAGS``
or re-executes itself under :data:`MALLOC_KEEP`, both of which must happen before jax is first
imported. (The machine line every benchmark prints first is :mod:`models.machine`.)

glibc reads its ``MALLOC_*`` variables once, at process start. By default it maps any block
above 32 MiB afresh on each allocation and unmaps it on free, and the arenas of XLA's threads
hand freed memory back to the kernel, so each call on a buffer of tens of MiB faults its pages
in again (16384 minor faults for 64 MiB: docs/allreduce.md measures the difference).
:data:`MALLOC_KEEP`: one arena, no mmap'd blocks, never trim, grow the heap 256 MiB at a time:
freed buffers are reused, as under an allocator that keeps memory (what a server would run).
It also asks glibc (2.35 and later; older ones ignore it) to back the heap with transparent
huge pages (``glibc.malloc.hugetlb=1``: ``madvise(MADV_HUGEPAGE)``), as numpy backs its own large
arrays: the single-core memcpy every codec figure is a fraction of runs on huge pages, so the
kernels' buffers do too. Without it, on an Intel Xeon VM (THP in ``madvise`` mode), the
same build's fp8 quantize ran at 2.8-3.0 GB/s instead of 3.3-3.9 GB/s
(``benchmarks.fp_codec``'s rates, two runs each, docs/fp_formats.md).
"""

from __future__ import annotations

import mmap
import os
import statistics
import sys
import time
from pathlib import Path

__all__ = ["MALLOC_KEEP", "reexec_with", "median_seconds", "time_calls", "replace_block",
           "HugeCopy", "paired_seconds"]

MALLOC_KEEP = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0",
               "MALLOC_TRIM_THRESHOLD_": str(2**40), "MALLOC_TOP_PAD_": str(256 * 2**20),
               "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}


def reexec_with(env: dict) -> None:
    """Re-execute this Python program with ``env`` added, unless it is already set.

    The command line is the interpreter's own (``sys.orig_argv``: its options and
    ``-m benchmarks.NAME`` included), so a benchmark run as a module is re-run as one.
    """
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.environ.update(env)
        os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


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


def replace_block(path: Path, begin: str, end: str, block: str) -> None:
    """Put ``block`` between the ``begin`` and ``end`` markers of ``path``, keeping the rest of
    the page; a missing file becomes a page of just the block. A page without the markers is a
    ValueError (it is not overwritten)."""
    path = Path(path)
    body = f"{begin}\n{block.rstrip(chr(10))}\n{end}"
    if not path.exists():
        path.write_text(body + "\n")
        return
    text = path.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{path} has no '{begin}' ... '{end}' markers")
    head, rest = text.split(begin, 1)
    path.write_text(head + body + rest.split(end, 1)[1])


def join_shm_job(rank: int, processes: int, port: int, pin: bool = True) -> None:
    """Join a ``jax.distributed`` job of ``processes`` CPU processes (one device each, gloo)
    on 127.0.0.1:``port`` as ``rank``, pinned to a core of its own when there are enough, and
    set the shared-memory transport up (exits with its reason when it cannot run).

    Call before anything else imports JAX's backends (XLA_FLAGS must already say one device).
    """
    cores = sorted(os.sched_getaffinity(0))
    if pin and len(cores) >= processes:
        os.sched_setaffinity(0, {cores[rank % len(cores)]})
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"127.0.0.1:{port}", num_processes=processes, process_id=rank,
                               initialization_timeout=120)
    from jax_flashcomm.transport import shm

    reason = shm.setup()
    if reason is not None:
        raise SystemExit(f"the shared-memory transport cannot run: {reason}")
