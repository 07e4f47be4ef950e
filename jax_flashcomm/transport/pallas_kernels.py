"""The pallas transport's quantized collectives: one Pallas TPU (Mosaic) kernel per call.

Each kernel moves the codec's wire bytes (:mod:`jax_flashcomm.transport.wire`) between ranks by
remote DMA (``pltpu.make_async_remote_copy``) and runs the codec itself on VMEM values: the
functions of the jnp twin (:mod:`jax_flashcomm.codec.reference`), traced once outside the kernel
and evaluated inside it, their constant tables passed in as VMEM inputs. The bytes and the
arithmetic are the twin's, so the results equal the ``xla`` transport with ``backend="jnp"``
bit for bit.

* :func:`all_reduce`: every rank encodes its N chunks one after the other and starts each
  chunk's DMA to its owner before encoding the next (the codec of chunk s+1 runs while chunk s
  moves); the owner decodes the N chunks, sums them in f32 (the twin's order) and re-encodes;
  the sum's codes go to every rank, which decodes each one as it lands while the others still
  move.
* :func:`reduce_scatter`: the first half (encode, DMA, decode and f32 sum).
* :func:`all_gather`: each rank encodes its operand once, sends it to every peer and decodes the
  payloads as they land.

Where it runs: on a TPU the kernels compile with Mosaic; on any other backend they run in
Pallas's TPU interpret mode (:func:`interpret_params`), which simulates the DMAs, semaphores and
VMEM of the chips on CPU devices.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jax_flashcomm import _axes, codec
from jax_flashcomm.transport import wire, xla

__all__ = ["all_reduce", "reduce_scatter", "all_gather", "use_interpret", "interpret_params",
           "races_found", "Codec", "barrier", "peer_id", "call_kernel", "out_type"]

#: The interpret mode kernels traced in this context run in (None: the platform's default).
_interpret: contextvars.ContextVar = contextvars.ContextVar("jax_flashcomm_pallas_interpret",
                                                            default=None)


@contextlib.contextmanager
def use_interpret(params):
    """Trace the pallas transport's kernels with ``params`` as their ``interpret`` argument.

    Args:
      params: a ``pltpu.InterpretParams`` (e.g. ``detect_races=True``,
        ``dma_execution_mode="eager"``), or False: compile for Mosaic (on a CPU-only machine:
        only ``jax.export(..., platforms=("tpu",))`` can lower it).
    """
    token = _interpret.set(params)
    try:
        yield
    finally:
        _interpret.reset(token)


def interpret_params():
    """The ``interpret`` argument of the kernels traced now: the :func:`use_interpret` one, else
    False on a TPU (Mosaic) and the default ``pltpu.InterpretParams()`` elsewhere."""
    params = _interpret.get()
    if params is not None:
        return params
    return False if jax.default_backend() == "tpu" else pltpu.InterpretParams()


def races_found() -> bool:
    """Whether the interpreter's race detector found a race since the interpret state was last
    reset (``pltpu.reset_tpu_interpret_mode_state``); needs ``detect_races=True``."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as state

    return bool(state.races is not None and state.races.races_found)


class Codec:
    """The codec functions one kernel runs, traced outside it (:meth:`add`); their constant
    tables become the kernel's last inputs (:attr:`consts`, VMEM) and :meth:`run` evaluates a
    function on loaded values inside the kernel (a kernel cannot capture array constants)."""

    def __init__(self):
        self.jaxprs, self.consts = [], []

    def add(self, fn, *avals) -> int:
        """Trace ``fn`` at ``avals`` (``ShapeDtypeStruct``); returns its index for :meth:`run`."""
        closed = jax.make_jaxpr(fn)(*avals)
        self.jaxprs.append((closed.jaxpr, len(self.consts), len(closed.consts)))
        self.consts.extend(jnp.asarray(c) for c in closed.consts)
        return len(self.jaxprs) - 1

    def run(self, index: int, const_refs, *args):
        """Evaluate function ``index`` on ``args`` inside the kernel (``const_refs``: the
        kernel's refs of :attr:`consts`); returns its single output."""
        jaxpr, start, count = self.jaxprs[index]
        consts = [const_refs[start + i][...] for i in range(count)]
        return jax.core.eval_jaxpr(jaxpr, consts, *args)[0]


def peer_id(axes: tuple, rank):
    """The ``device_id`` of rank ``rank`` (numbered as ``lax.axis_index(axes)``): a mesh
    coordinate over ``axes``, the other mesh axes this device's."""
    return {axes[0] if len(axes) == 1 else tuple(axes): rank}


def barrier(axes: tuple, me, n: int):
    """Wait until every rank over ``axes`` has entered the kernel (so its VMEM buffers exist
    before a peer's DMA writes them)."""
    sem = pltpu.get_barrier_semaphore()
    for s in range(1, n):
        pl.semaphore_signal(sem, 1, device_id=peer_id(axes, (me + s) % n),
                            device_id_type=pl.DeviceIdType.MESH)
    pl.semaphore_wait(sem, n - 1)


def out_type(shape, dtype, like, drop: tuple = ()):
    """An output's type: ``like``'s varying axes (under check_vma) minus ``drop``."""
    mat = getattr(jax.typeof(like), "manual_axis_type", None)
    if mat is not None:
        mat = type(mat)(varying=frozenset(mat.varying) - frozenset(drop))
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def call_kernel(kernel, outs, inputs, scratch, fns: Codec, name: str):
    """``pl.pallas_call`` of a kernel whose array inputs and outputs stay in HBM (``pl.ANY``:
    the kernel DMAs what it needs into VMEM) and whose codec constants are VMEM inputs.

    Args:
      kernel: ``(*input refs, *const refs, *output refs, *scratch refs) -> None``.
      outs: the output types (:func:`out_type`).
      inputs: the array inputs.
      scratch: the scratch shapes (VMEM buffers, semaphores).
      fns: the kernel's :class:`Codec`.
      name: the kernel's name in HLO and profiles.
    """
    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    vmem_spec = pl.BlockSpec(memory_space=pltpu.VMEM)
    # the interpreter checks the kernel's ops for matching varying axes: constants vary as x
    vary = tuple(sorted(set().union(*(_axes.varying_axes(a) for a in inputs))))
    consts = [lax.pcast(c, vary, to="varying") if vary else c for c in fns.consts]
    return pl.pallas_call(
        kernel, out_shape=tuple(outs),
        in_specs=[any_spec] * len(inputs) + [vmem_spec] * len(fns.consts),
        out_specs=tuple(any_spec for _ in outs), scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=0, has_side_effects=True),
        interpret=interpret_params(), name=name)(*inputs, *consts)


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _formats(plan, phase: str):
    """``(bits, spikes, format)`` of a plan's phase ``"rs"`` or ``"ag"``."""
    return ((plan.rs_bits, plan.rs_spikes, plan.rs_format) if phase == "rs"
            else (plan.ag_bits, plan.ag_spikes, plan.ag_format))


def _encoder(plan, phase: str, dtype):
    """``values (groups, g) -> wire bytes (groups, record + 4)`` at the phase's format."""
    bits, spikes, fmt = _formats(plan, phase)

    def encode(v):
        return wire.pack(codec.quantize(v.astype(dtype), bits=bits, group_size=plan.group_size,
                                        backend="jnp", rotation=plan.rotation, spikes=spikes,
                                        format=fmt))
    return encode


def _unpack(buf, plan, phase: str, shape, dtype):
    bits, spikes, fmt = _formats(plan, phase)
    return wire.unpack(buf, bits=bits, group_size=plan.group_size, shape=shape, dtype=dtype,
                       rotation=plan.rotation, spikes=spikes, format=fmt)


def _decoder(plan, phase: str, dtype):
    """``wire bytes (groups, B) -> values (groups, g)`` of ``dtype``."""
    def decode(buf):
        shape = (buf.shape[0], plan.group_size)
        return codec.dequantize(_unpack(buf, plan, phase, shape, dtype), backend="jnp")
    return decode


def _remote(src, dst, send_sem, recv_sem, axes, rank):
    return pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem,
                                        device_id=peer_id(axes, rank),
                                        device_id_type=pl.DeviceIdType.MESH)


def _phase1(refs, fns, enc, axes, me, n):
    """Encode chunk ``(me + s) % N`` for s = 0 .. N-1 and start its DMA to its owner before
    encoding the next (its HBM -> VMEM load is double-buffered too); the local chunk is stored
    in place. Returns the pending copies ``(outgoing, incoming)``."""
    xg, consts, xv, load_sem, send, recv, send_sem, recv_sem = refs
    loads = [None, None]

    def load(s):
        c = pltpu.make_async_copy(xg.at[(me + s) % n], xv.at[s % 2], load_sem.at[s % 2])
        c.start()
        loads[s % 2] = c

    load(0)
    outgoing, incoming = [], []
    for s in range(n):
        j = (me + s) % n
        if s + 1 < n:
            load(s + 1)
        loads[s % 2].wait()
        codes = fns.run(enc, consts, xv[s % 2])
        if s == 0:
            recv[me] = codes
            continue
        send[s] = codes
        c = _remote(send.at[s], recv.at[me], send_sem.at[s], recv_sem.at[me], axes, j)
        c.start()
        outgoing.append(c)
        src = (me - s) % n
        incoming.append(_remote(send.at[s], recv.at[src], send_sem.at[s], recv_sem.at[src],
                                axes, src))
    return outgoing, incoming


def _phase2(own, recv, out, yv, send_sem, recv_sem, decode, axes, me, n):
    """Send ``own`` (VMEM) to slot ``me`` of every peer's ``recv``; decode each slot as it
    lands, the local one first, into ``out`` (HBM) with ``decode(slot index)``."""
    outgoing = []
    for s in range(1, n):
        c = _remote(own, recv.at[me], send_sem.at[s], recv_sem.at[me], axes, (me + s) % n)
        c.start()
        outgoing.append(c)
    recv[me] = own[...]
    for s in range(n):
        src = (me - s) % n
        if s:
            _remote(own, recv.at[src], send_sem.at[s], recv_sem.at[src], axes, src).wait_recv()
        yv[...] = decode(src)
        pltpu.sync_copy(yv, out.at[src])
    for c in outgoing:
        c.wait_send()


def _check_shapes(x, plan, n: int, where: str):
    if n * x.size > 2**31 - 1:
        raise ValueError(f"{where}: transport='pallas' takes at most 2^31 - 1 gathered values, "
                         f"got {n} x {x.size}")


def reduce_scatter(rows: jax.Array, axes: tuple, plan):
    """Quantized reduce-scatter of ``rows`` ``(N, Mp)`` (row i: rank i's slice; ``Mp`` whole
    groups) in one kernel. Returns ``(this rank's f32-summed row (Mp,), its payload split in N
    chunks)``, as :func:`jax_flashcomm.transport.xla.reduce_scatter`."""
    return _exchange(rows, axes, plan, rows.dtype, (rows.shape[1],), sum_only=True)


def all_reduce(x: jax.Array, axes: tuple, plan, decode: bool = True):
    """The two-step quantized all-reduce of ``x`` in one kernel; returns ``(sum, phase-1
    payload, gathered phase-2 payload)`` as :func:`jax_flashcomm.transport.xla.all_reduce`
    (the sum is None when ``decode`` is False, but the kernel decodes it all the same)."""
    _check_shapes(x, plan, 1, "psum")
    y, p1, p2 = _exchange(x, axes, plan, x.dtype, x.shape, sum_only=False)
    return (y if decode else None), p1, p2


def _exchange(x, axes, plan, dtype, shape, sum_only: bool):
    n = _axes.axis_size(axes)
    g = plan.group_size
    groups = codec.as_groups(x, g, n)
    gc = groups.shape[0] // n
    xg = groups.reshape(n, gc, g)
    fns = Codec()
    enc = fns.add(_encoder(plan, "rs", dtype), _sds((gc, g), x.dtype))
    b1 = jax.eval_shape(_encoder(plan, "rs", dtype), _sds((gc, g), x.dtype)).shape[-1]
    if sum_only:
        def summed(buf):
            p = _unpack(buf, plan, "rs", (gc, g), dtype)
            return codec.dequantize_sum(p, backend="jnp").reshape(gc, g)
        tail = fns.add(summed, _sds((n, gc, b1), jnp.uint8))
    else:
        b2_bits, b2_spikes, b2_fmt = _formats(plan, "ag")

        def requant(buf):
            p = _unpack(buf, plan, "rs", shape, dtype)
            return wire.pack(codec.dequantize_sum_quantize(p, bits=b2_bits, spikes=b2_spikes,
                                                           backend="jnp", format=b2_fmt))
        tail = fns.add(requant, _sds((n, gc, b1), jnp.uint8))
        b2 = jax.eval_shape(requant, _sds((n, gc, b1), jnp.uint8)).shape[-1]
        dec = fns.add(_decoder(plan, "ag", dtype), _sds((gc, b2), jnp.uint8))
    nc = len(fns.consts)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        outs = refs[1 + nc:]
        me = lax.axis_index(axes)
        if sum_only:
            p1_ref, y_ref, xv, load_sem, send, recv, yv, send_sem, recv_sem = outs
        else:
            (p1_ref, p2_ref, y_ref, xv, load_sem, send, recv, own, recv2, yv, send_sem,
             recv_sem, send2_sem, recv2_sem) = outs
        barrier(axes, me, n)
        outgoing, incoming = _phase1((xg_ref, consts, xv, load_sem, send, recv, send_sem,
                                      recv_sem), fns, enc, axes, me, n)
        for c in incoming:
            c.wait_recv()
        if sum_only:
            yv[...] = fns.run(tail, consts, recv[...])
            pltpu.sync_copy(yv, y_ref)
        else:
            own[...] = fns.run(tail, consts, recv[...])
            _phase2(own, recv2, y_ref, yv, send2_sem, recv2_sem,
                    lambda src: fns.run(dec, consts, recv2[src]), axes, me, n)
            pltpu.sync_copy(recv2, p2_ref)
        for c in outgoing:
            c.wait_send()
        # this rank's phase-1 payload: its own chunk from recv, the others from send
        for s in range(1, n):
            pltpu.sync_copy(send.at[s], p1_ref.at[(me + s) % n])
        pltpu.sync_copy(recv.at[me], p1_ref.at[me])

    u8 = jnp.uint8
    dma = pltpu.SemaphoreType.DMA((n,))
    scratch = [pltpu.VMEM((2, gc, g), x.dtype), pltpu.SemaphoreType.DMA((2,)),
               pltpu.VMEM((n, gc, b1), u8), pltpu.VMEM((n, gc, b1), u8)]
    p1_type = out_type((n, gc, b1), u8, x)
    if sum_only:
        outs = [p1_type, out_type((gc, g), dtype, x)]
        scratch += [pltpu.VMEM((gc, g), dtype), dma, dma]
    else:
        outs = [p1_type, out_type((n, gc, b2), u8, x, axes), out_type((n, gc, g), dtype, x, axes)]
        scratch += [pltpu.VMEM((gc, b2), u8), pltpu.VMEM((n, gc, b2), u8),
                    pltpu.VMEM((gc, g), dtype), dma, dma, dma, dma]
    results = call_kernel(kernel, outs, [xg], scratch, fns,
                          "flashcomm_pallas_" + ("reduce_scatter" if sum_only else "all_reduce"))
    p1 = _unpack(results[0], plan, "rs", shape, dtype)
    if sum_only:
        return results[1].reshape(shape), wire.with_meta(p1, shape=shape)
    p2 = _unpack(results[1].reshape(n * gc, b2), plan, "ag", shape, dtype)
    y = codec.restore_shape(results[2].reshape(n * gc, g), tuple(shape)).astype(dtype)
    return y, p1.merge_groups(), p2


def all_gather(x: jax.Array, axes: tuple, axis: int, tiled: bool, plan):
    """Quantized all-gather of ``x`` along ``axis`` in one kernel; returns ``(y, this rank's
    payload)`` as :func:`jax_flashcomm.transport.xla.all_gather`."""
    n = _axes.axis_size(axes)
    _check_shapes(x, plan, n, "all_gather")
    g = plan.group_size
    xg = codec.as_groups(x, g, 1)
    ng = xg.shape[0]
    fns = Codec()
    enc_fn = _encoder(plan, "ag", x.dtype)
    enc = fns.add(enc_fn, _sds((ng, g), x.dtype))
    b = jax.eval_shape(enc_fn, _sds((ng, g), x.dtype)).shape[-1]
    dec = fns.add(_decoder(plan, "ag", x.dtype), _sds((ng, b), jnp.uint8))
    nc = len(fns.consts)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        p_ref, y_ref, xv, own, recv, yv, send_sem, recv_sem = refs[1 + nc:]
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(xg_ref, xv)
        own[...] = fns.run(enc, consts, xv[...])
        _phase2(own, recv, y_ref, yv, send_sem, recv_sem,
                lambda src: fns.run(dec, consts, recv[src]), axes, me, n)
        pltpu.sync_copy(own, p_ref)

    u8 = jnp.uint8
    dma = pltpu.SemaphoreType.DMA((n,))
    scratch = [pltpu.VMEM((ng, g), x.dtype), pltpu.VMEM((ng, b), u8), pltpu.VMEM((n, ng, b), u8),
               pltpu.VMEM((ng, g), x.dtype), dma, dma]
    outs = [out_type((ng, b), u8, x), out_type((n, ng, g), x.dtype, x, axes)]
    packed, stacked = call_kernel(kernel, outs, [xg], scratch, fns, "flashcomm_pallas_all_gather")
    p = _unpack(packed, plan, "ag", x.shape, x.dtype)
    size = math.prod(x.shape)
    stacked = stacked.reshape(n, ng * g)[:, :size].reshape(n, *x.shape)
    return xla.arrange_gathered(stacked, axis, tiled), p
