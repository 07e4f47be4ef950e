"""How a benchmark process runs: the glibc malloc settings it re-executes itself under, and how
a process joins a multi-process job on the shared-memory transport.

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
(``benchmarks.codec.cpu_speed.fp_speed``'s rates, two runs each, docs/fp_formats.md).
"""

from __future__ import annotations

import argparse
import os
import sys

__all__ = ["MALLOC_KEEP", "reexec_with", "join_shm_job", "command_parser"]

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


def command_parser(module: str, doc: str) -> argparse.ArgumentParser:
    """The argument parser of the benchmark ``module`` (run with ``-m``): its module docstring
    (``doc``) as the help text, kept as written."""
    return argparse.ArgumentParser(prog=f"python -m {module}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
