"""The glibc malloc settings the CPU benchmarks run with, and the re-execution that applies them.

glibc reads its ``MALLOC_*`` variables once, at process start. By default it maps any block
above 32 MiB afresh on each allocation and unmaps it on free, and the arenas of XLA's threads
hand freed memory back to the kernel, so each call on a buffer of tens of MiB faults its pages
in again (16384 minor faults for 64 MiB: docs/allreduce.md measures the difference). ``KEEP``:
one arena, no mmap'd blocks, never trim, grow the heap 256 MiB at a time: freed buffers are
reused, as under an allocator that keeps memory (what a server would run).
"""

from __future__ import annotations

import os
import sys

KEEP = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(2**40),
        "MALLOC_TOP_PAD_": str(256 * 2**20)}


def reexec_with(env: dict) -> None:
    """Re-execute this Python program with ``env`` added, unless it is already set."""
    if any(os.environ.get(k) != v for k, v in env.items()):
        os.environ.update(env)
        os.execv(sys.executable, [sys.executable, *sys.argv])
