"""A one-line progress bar for the long commands (tuning, calibration, the model CLIs)."""

from __future__ import annotations

import sys
import time

__all__ = ["progress"]


def progress(done: int, total: int, start: float, out=sys.stderr, *, unit: str = "",
             what: str = "") -> None:
    """A one-line progress bar: ``done`` of ``total`` ``unit``, time since ``start``, the time
    left at the rate so far, and what runs now (the model CLIs use it too).

    Args:
      done, total: steps done and in all; start: ``time.perf_counter()`` at the start.
      out: the stream; unit: what a step is; what: the step running now.
    """
    width, elapsed = 30, time.perf_counter() - start
    filled = width * done // max(total, 1)
    eta = f", {elapsed / done * (total - done):.0f} s left" if 0 < done < total else ""
    out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total}"
              f"{' ' + unit if unit else ''}, {elapsed:.1f} s{eta}  {what[:48]:<48}")
    if done == total:
        out.write("\n")
    out.flush()
