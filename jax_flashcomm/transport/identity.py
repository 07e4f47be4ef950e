"""Call-site identities of the p2p transport: what pairs one rank's call with its peers'.

Every p2p call carries a ``site`` attribute: the ranks' calls of one collective meet by it (in
one process with the run id, between processes over shared memory with a per-site sequence
number for loops). A site is a hash of where the call is in its program and what it is, equal
on every process that traces the same code whatever else it traced before, in between, or
failed to trace:

* the Python frames from the function ``jax.jit`` is tracing (the unit JAX caches and reuses
  in every program that calls it; the whole stack when no jit is tracing) down to the call,
  JAX's own frames left out;
* how many calls with those frames and that kind came before it in that jit's trace (a Python
  loop over layers, the backward rules of a ring's steps), counted per trace object, so a trace
  that fails uses up nothing;
* the collective and its mesh axes.

Shapes, dtypes and options travel beside it as the kernels' descriptor, compared at every
meeting: ranks that agree on the site but not on those fail with an error naming the call.
A scan, cond or while body function shared by two jitted programs is traced once (JAX caches
it) inside whichever program came first, so its sites depend on that order: processes that
trace the two programs in different orders then time out at those calls, with an error naming
both sides, instead of pairing them; wrapping the shared body in ``jax.jit`` makes it its own
unit.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import weakref
from collections import Counter

from jax_flashcomm import jax_compat

__all__ = ["site", "describe"]

_lock = threading.Lock()
_counts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_names: dict[int, str] = {}
_MAX_NAMES = 100_000
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _path():
    """The frames from the jit being traced down to the caller of :func:`site` (outermost
    first), the trace that counts occurrences (the jit's, else the outermost one found, else
    the current one), and the innermost frame outside jax_flashcomm (the user's line)."""
    frames, user, scope = [], None, None
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if jax_compat.is_jit_entry(code):
            break
        if jax_compat.is_trace_entry(code):
            scope = jax_compat.trace_started_in(frame) or scope
        elif not jax_compat.is_jax_frame(code):
            frames.append((code.co_filename, code.co_qualname, frame.f_lineno))
            if user is None and not code.co_filename.startswith(_PACKAGE_DIR):
                user = (os.path.basename(code.co_filename), frame.f_lineno, code.co_qualname)
        frame = frame.f_back
    return tuple(reversed(frames)), scope or jax_compat.current_trace(), user


def site(kind: str, axes: tuple[str, ...], what: str = "") -> int:
    """The site id of the p2p call being traced now (a positive int64).

    Args:
      kind: the call's FFI target or step (``"all_reduce"``, ``"ring_start"``, ...).
      axes: its mesh axes.
      what: its operand, for the description (``"f32[8,256]"``); not part of the id.

    Returns:
      The id; :func:`describe` gives its description (the kind, axes, operand and user line).
    """
    frames, trace, user = _path()
    key = hashlib.sha1(repr((kind, tuple(axes), frames)).encode()).digest()
    with _lock:
        counts = _counts.setdefault(trace, Counter())  # every jax Trace takes weak references
        occurrence = counts[key]
        counts[key] += 1
    digest = hashlib.sha1(key + occurrence.to_bytes(8, "little")).digest()
    ident = int.from_bytes(digest[:8], "little") & ((1 << 63) - 1) or 1
    where = f" at {user[0]}:{user[1]} in {user[2]}" if user else ""
    nth = f" #{occurrence + 1}" if occurrence else ""
    name = f"{kind} over {','.join(axes)} {what}{where}{nth}".replace("  ", " ")
    with _lock:
        if len(_names) < _MAX_NAMES:
            _names[ident] = name
    return ident


def describe(ident: int) -> str | None:
    """What site ``ident`` is (as traced in this process), or None when it traced no such site."""
    return _names.get(int(ident))

