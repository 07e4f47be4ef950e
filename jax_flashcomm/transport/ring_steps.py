"""Ring steps: how the collective matmuls move a chunk to their ring neighbour.

A step is :meth:`begin` (start moving ``payload`` to rank ``r + shift``; returns what the
step's dot may read and a pending move), :meth:`order` (a zero that depends on the start, for
a dot that does not read the chunk to add to its slice offset) and :meth:`finish` (the chunk
of rank ``r - shift``, once it has arrived; the step's dot result goes through it, so the wait
comes after the dot). So start -> dot -> done is a chain of data dependences.

* ``xla``: the move is one ``lax.ppermute``; :meth:`finish` passes things through. Whether the
  permute runs during the dot is up to XLA (asynchronous on GPU/TPU; on CPU a gloo permute runs
  synchronously on the module's thread: docs/overlap.md).
* ``p2p``: the move is a pair of FFI calls (ffi/cpu/p2p_ring_handlers.cc, p2p_ring.h). The start
  returns at once while the transport's copy threads move the chunk from the peer's buffer; the
  done takes the receive buffer, the send buffer and the dot's result, so XLA runs it after the
  dot and keeps both buffers alive until the chunk has arrived and the peer has read ours. The
  ranks are the devices of one process. For benchmarks, :func:`link_emulation` paces the CPU
  copies at a set rate (a "link" slower than memcpy, so overlap can be measured); off by default.
"""

from __future__ import annotations

import contextlib
import contextvars
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.transport import p2p

__all__ = ["XlaLink", "P2pLink", "spec", "link_emulation",
           "recording", "steps_in_progress"]

#: The FFI targets of the ring steps (registered by the CPU module, and the CUDA one if built).
TARGETS = ("flashcomm_p2p_ring_start", "flashcomm_p2p_ring_done")

#: The emulated link rate of p2p ring steps traced in this context (0: unpaced).
_link_bytes_per_s: contextvars.ContextVar[int] = contextvars.ContextVar(
    "jax_flashcomm_link_bytes_per_s", default=0)


class XlaLink:
    """Ring steps as ``lax.ppermute`` over ``axis_name``.

    Args:
      axis_name: the ring's mesh axis (or tuple of axes).
      perms: ``{shift: ppermute pairs}`` for shift +1 and -1.
    """

    name = "xla"

    def __init__(self, axis_name, perms: dict):
        self.axis_name, self.perms = axis_name, perms

    def begin(self, payload, shift: int):
        return payload, lax.ppermute(payload, self.axis_name, self.perms[shift])

    def order(self, pending):
        return 0

    def finish(self, pending, after):
        return pending, after


class P2pLink:
    """Ring steps as start / done FFI calls over the devices of one process.

    Differentiable (for rings autodiff walks through, like tp_attention's): the transpose of
    moving a chunk by ``shift`` is moving its cotangent by ``-shift``, a p2p step too.

    Args:
      axes: the ring's mesh axes (normalized).
      timeout_ms: the limit on every wait for a peer.
      link_bytes_per_s: the emulated link rate (0: unpaced; :func:`link_emulation`).
    """

    name = "p2p"

    def __init__(self, axes: tuple, timeout_ms: int, link_bytes_per_s: int):
        self.axes, self.timeout_ms, self.rate = axes, int(timeout_ms), int(link_bytes_per_s)

    def _static(self, shift: int, payload) -> tuple:
        site = p2p.call_site(f"ring_step{shift:+d}", self.axes, payload)
        return (self.axes, self.timeout_ms, self.rate, shift, site)

    def begin(self, payload, shift: int):
        static = self._static(shift, payload)
        sent, recv, order = _begin(payload, static)
        return sent, (recv, sent, static, order)

    def order(self, pending):
        """A zero that depends on the start: added to a slice offset, it makes a dot that does
        not read the chunk (the reduce-scatter ring's) wait for the start by data."""
        return pending[3]

    def finish(self, pending, after):
        recv, sent, static, _ = pending
        return _finish(recv, sent, after, static)


def _start_call(payload, static):
    axes, timeout_ms, rate, shift, site = static
    rank, group = p2p.rank_and_group(axes)
    like = _same(payload)
    order = p2p.result_aval(payload, (), jnp.int32, _axes.varying_axes(payload))
    start = jax.ffi.ffi_call(_target("start"), (like, like, order),
                             input_output_aliases={0: 0}, vmap_method="sequential")
    return start(payload, rank, group, size=np.int64(_axes.axis_size(axes)),
                 shift=np.int64(shift), site=np.int64(site), timeout_ms=np.int64(timeout_ms),
                 link_bytes_per_s=np.int64(rate), **_shm_attrs(axes))


def _done_call(recv, sent, after, static):
    axes, _, _, shift, site = static
    rank, group = p2p.rank_and_group(axes)
    done = jax.ffi.ffi_call(_target("done"), (_same(recv), _same(after)),
                            input_output_aliases={0: 0, 2: 1}, vmap_method="sequential")
    return done(recv, sent, after, rank, group, size=np.int64(_axes.axis_size(axes)),
                shift=np.int64(shift), site=np.int64(site), **_shm_attrs(axes))


def _target(step: str) -> str:
    """The ring step's FFI target: in one process, or between processes (shared memory)."""
    return f"flashcomm_{'shm' if p2p.across_processes() else 'p2p'}_ring_{step}"


def _shm_attrs(axes) -> dict:
    return {"axes_key": np.int64(p2p.axes_key(axes))} if p2p.across_processes() else {}


@partial(jax.custom_vjp, nondiff_argnums=(1,))
def _begin(payload, static):
    return _start_call(payload, static)


def _begin_fwd(payload, static):
    return _start_call(payload, static), None


def _begin_bwd(static, _, cts):
    ct_sent, ct_recv, _ = cts
    axes, timeout_ms, rate, shift, _ = static
    back = P2pLink(axes, timeout_ms, rate)
    sent, pending = back.begin(ct_recv, -shift)
    moved, sent = back.finish(pending, sent)
    return (ct_sent + moved,)


_begin.defvjp(_begin_fwd, _begin_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _finish(recv, sent, after, static):
    return _done_call(recv, sent, after, static)


def _finish_fwd(recv, sent, after, static):
    return _done_call(recv, sent, after, static), None


def _finish_bwd(static, _, cts):
    ct_recv, ct_after = cts  # sent has recv's shape, dtype and varying axes
    return ct_recv, jnp.zeros_like(ct_recv), ct_after


_finish.defvjp(_finish_fwd, _finish_bwd)


def _same(x):
    return p2p.result_aval(x, x.shape, x.dtype, _axes.varying_axes(x))


def unsupported_reason(axes: tuple[str, ...]) -> str | None:
    """Why the p2p ring steps cannot run over ``axes`` here, or None.

    Args:
      axes: the ring's mesh axes (bound).

    Returns:
      A sentence for the plan's errors, or None when they can run.
    """
    reason = p2p.unsupported_reason(axes)
    if reason is None:
        platform = p2p.kernel_platform(jax.default_backend())
        targets = (_target("start"), _target("done"))
        if not set(targets) <= p2p.kernels.registered(platform):
            reason = f"the {platform} kernel module has no ring-step kernels"
    return reason


def spec(name: str, timeout_ms: int) -> tuple:
    """The ring transport of a planned collective matmul as a hashable spec.

    The custom VJPs carry it to the backward rings. The link emulation rate is read here, at
    trace time.

    Args:
      name: the plan's transport (:func:`jax_flashcomm.planner.plan`): ``"xla"`` or ``"p2p"``.
      timeout_ms: the p2p limit on every wait for a peer.

    Returns:
      ``(name, timeout_ms, link_bytes_per_s)``; ``("xla", 0, 0)`` for the xla transport.
    """
    if name == "pallas":
        return ("pallas", 0, 0)
    if name != "p2p":
        return ("xla", 0, 0)
    return ("p2p", int(timeout_ms), _link_bytes_per_s.get())


@contextlib.contextmanager
def link_emulation(bytes_per_s: float):
    """Pace the CPU p2p ring steps' copies at ``bytes_per_s`` per link (benchmarks only).

    Read when a collective matmul is traced: functions jitted inside the ``with`` keep the
    rate. Each move is copied in ~1 ms slices, none started before the time the bytes before it
    would take on such a link, so a CPU, whose "link" is memcpy, can stand in for a slower one
    and the overlap of copies with dots can be measured
    (benchmarks/collectives/matmul_overlap_p2p.py).

    Args:
      bytes_per_s: the emulated rate per link (positive).

    Raises:
      ValueError: a rate that is not positive.
    """
    if not bytes_per_s > 0:
        raise ValueError(f"link_emulation: bytes_per_s must be positive, got {bytes_per_s!r}")
    token = _link_bytes_per_s.set(int(bytes_per_s))
    try:
        yield
    finally:
        _link_bytes_per_s.reset(token)


_KINDS = {0: "move", 1: "start", 2: "wait"}


@contextlib.contextmanager
def recording():
    """Record the p2p ring steps' own timeline; yields a list filled on exit with dicts
    ``kind`` ("move": a chunk moving from ``peer`` to ``rank``; "start": a start call; "wait":
    from a done call to its completion), ``site``, ``rank``, ``peer``, ``bytes``,
    ``begin_us``/``end_us`` (system clock, the clock of jax.profiler traces)."""
    module = p2p.kernel_module()
    module.p2p_timeline(True)  # in one process: the shared-memory steps do not record
    events: list = []
    try:
        yield events
    finally:
        for kind, site, rank, peer, nbytes, begin, end in module.p2p_timeline(False):
            events.append(dict(kind=_KINDS[kind], site=site, rank=rank, peer=peer, bytes=nbytes,
                               begin_us=begin, end_us=end))


def steps_in_progress() -> int:
    """Ring steps some rank has not finished (0 between collective matmuls); between
    processes, the steps this process started and has not finished."""
    if p2p.across_processes():
        return int(p2p.kernel_module().shm_ring_steps_in_progress())
    return int(p2p.kernel_module().p2p_ring_steps_in_progress())
