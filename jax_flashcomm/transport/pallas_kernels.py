# long file: the three codec kernels share their wire, DMA and codec helpers
"""The pallas transport's quantized collectives: one Pallas TPU (Mosaic) kernel per call.

Each kernel moves the codec's payload between ranks by remote DMA
(``pltpu.make_async_remote_copy``), one buffer and one DMA per array (codes, and in the integer
formats the bf16 scale and zero: :func:`_parts`; the returned payloads are the
:mod:`jax_flashcomm.transport.wire` ones), and runs the codec itself on VMEM values: the
functions of the jnp twin (:mod:`jax_flashcomm.codec.reference`), traced once outside the kernel
and evaluated inside it (:func:`eval_for_mosaic`), their constant tables passed in as VMEM
inputs. The bytes and the
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
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core

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
    function on loaded values inside the kernel (a kernel cannot capture array constants). A
    constant of fewer than 2 dimensions travels as ``(1, size)`` (Mosaic lays out 1-D VMEM
    arrays only for a known TPU kind) and is reshaped back when loaded."""

    def __init__(self):
        self.jaxprs, self.consts = [], []

    def add(self, fn, *avals) -> int:
        """Trace ``fn`` at ``avals`` (``ShapeDtypeStruct``); returns its index for :meth:`run`."""
        closed = jax.make_jaxpr(fn)(*avals)
        self.jaxprs.append((closed.jaxpr, len(self.consts), len(closed.consts)))
        self.consts.extend(jnp.asarray(c).reshape(1, -1) if jnp.ndim(c) < 2 else jnp.asarray(c)
                           for c in closed.consts)
        return len(self.jaxprs) - 1

    def run(self, index: int, const_refs, *args):
        """Evaluate function ``index`` on ``args`` inside the kernel (``const_refs``: the
        kernel's refs of :attr:`consts`) with :func:`eval_for_mosaic`; returns its output, a
        tuple if it has several."""
        jaxpr, start, count = self.jaxprs[index]
        consts = [const_refs[start + i][...].reshape(v.aval.shape)
                  for i, v in enumerate(jaxpr.constvars)]
        outs = eval_for_mosaic(jaxpr, consts, *args)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _unsigned_sum(x, params):
    """``reduce_sum`` of unsigned integers as the same-width signed sum (Mosaic reduces no
    unsigned integers): two's complement addition has the same bits, so this is exact."""
    signed = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    total = lax.reduce_sum_p.bind(lax.bitcast_convert_type(x, signed), **params)
    return lax.bitcast_convert_type(total, x.dtype)


def eval_for_mosaic(jaxpr, consts, *args):
    """``jax.core.eval_jaxpr`` with the twin's two ops Mosaic does not lower rewritten:
    ``optimization_barrier`` is the identity (it only fences XLA's rewrites; a kernel's
    ops are not reassociated: the interpret-mode tests hold the bits to the twin's), and a
    ``reduce_sum`` over unsigned integers is the signed one (:func:`_unsigned_sum`, exact).
    Nested ``jit`` calls are evaluated the same way."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jex_core.Literal) else env[v]

    for v, c in zip(jaxpr.constvars, consts):
        env[v] = c
    for v, a in zip(jaxpr.invars, args):
        env[v] = a
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "optimization_barrier":
            outs = ins
        elif name == "reduce_sum" and jnp.issubdtype(ins[0].dtype, jnp.unsignedinteger):
            outs = [_unsigned_sum(ins[0], eqn.params)]
        elif name in ("jit", "pjit"):
            closed = eqn.params["jaxpr"]
            outs = eval_for_mosaic(closed.jaxpr, closed.consts, *ins)
        else:
            outs = eqn.primitive.bind(*ins, **eqn.primitive.get_bind_params(eqn.params))
            outs = outs if eqn.primitive.multiple_results else [outs]
        for v, o in zip(eqn.outvars, outs):
            env[v] = o
    return [read(v) for v in jaxpr.outvars]


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


def _parts(p) -> tuple:
    """A payload's arrays as a kernel moves them, each in its own buffer by its own DMA: the
    codes record (uint8), and in the integer formats the bf16 scale and zero ``(..., 1)``
    (no bitcast to bytes, which Mosaic does not lower: "Changing bitwidths")."""
    if p.format != "int":
        return (p.codes,)
    return p.codes, p.scale[..., None], p.zero[..., None]


def _payload(parts, plan, phase: str, shape, dtype):
    """Inverse of :func:`_parts`: the payload of phase ``phase`` for an operand ``shape``."""
    bits, spikes, fmt = _formats(plan, phase)
    if fmt != "int":
        return wire.unpack(parts[0], bits=bits, group_size=plan.group_size, shape=shape,
                           dtype=dtype, rotation=plan.rotation, spikes=spikes, format=fmt)
    codes, scale, zero = parts
    return codec.Payload(codes, scale[..., 0], zero[..., 0], bits=bits,
                         group_size=plan.group_size, shape=tuple(shape), dtype=np.dtype(dtype),
                         rotation=plan.rotation, spikes=spikes)


def _tuple(out):
    return out if isinstance(out, tuple) else (out,)


def _encoder(plan, phase: str, dtype):
    """``values (groups, g) -> wire parts (groups, ...)`` at the phase's format."""
    bits, spikes, fmt = _formats(plan, phase)

    def encode(v):
        return _parts(codec.quantize(v.astype(dtype), bits=bits, group_size=plan.group_size,
                                     backend="jnp", rotation=plan.rotation, spikes=spikes,
                                     format=fmt))
    return encode


def _decoder(plan, phase: str, dtype):
    """``wire parts (groups, ...) -> values (groups, g)`` of ``dtype``."""
    def decode(*parts):
        shape = (parts[0].shape[0], plan.group_size)
        return codec.dequantize(_payload(parts, plan, phase, shape, dtype), backend="jnp")
    return decode


def _remote(src, dst, send_sem, recv_sem, axes, rank):
    return pltpu.make_async_remote_copy(src, dst, send_sem, recv_sem,
                                        device_id=peer_id(axes, rank),
                                        device_id_type=pl.DeviceIdType.MESH)


def _copies(srcs, dsts, sems, slots, axes, rank):
    """One remote copy per wire part: ``srcs[i] -> dsts[i]`` on ``rank``, signalling
    ``sems = (send, recv)`` at ``[i, slots[0]]`` and ``[i, slots[1]]``."""
    return [_remote(a, b, sems[0].at[i, slots[0]], sems[1].at[i, slots[1]], axes, rank)
            for i, (a, b) in enumerate(zip(srcs, dsts))]


def _phase1(refs, fns, enc, axes, me, n):
    """Encode chunk ``(me + s) % N`` for s = 0 .. N-1 and start its DMAs to its owner before
    encoding the next (its HBM -> VMEM load is double-buffered too); the local chunk is stored
    in place. ``send`` and ``recv`` are lists (one buffer per wire part). Returns the pending
    copies ``(outgoing, incoming)``."""
    xg, consts, xv, load_sem, send, recv, sems = refs
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
        parts = _tuple(fns.run(enc, consts, xv[s % 2]))
        if s == 0:
            for r, part in zip(recv, parts):
                r[me] = part
            continue
        for r, part in zip(send, parts):
            r[s] = part
        src_bufs = [r.at[s] for r in send]
        copies = _copies(src_bufs, [r.at[me] for r in recv], sems, (s, me), axes, j)
        for c in copies:
            c.start()
        outgoing += copies
        src = (me - s) % n
        incoming += _copies(src_bufs, [r.at[src] for r in recv], sems, (s, src), axes, src)
    return outgoing, incoming


def _phase2(own, recv, out, yv, sems, decode, axes, me, n):
    """Send ``own`` (VMEM, one buffer per wire part) to slot ``me`` of every peer's ``recv``;
    decode each slot as it lands, the local one first, into ``out`` (HBM) with
    ``decode(slot index)``."""
    outgoing = []
    for s in range(1, n):
        copies = _copies(own, [r.at[me] for r in recv], sems, (s, me), axes, (me + s) % n)
        for c in copies:
            c.start()
        outgoing += copies
    for r, o in zip(recv, own):
        r[me] = o[...]
    for s in range(n):
        src = (me - s) % n
        if s:
            for c in _copies(own, [r.at[src] for r in recv], sems, (s, src), axes, src):
                c.wait_recv()
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


def _take(refs, counts):
    """Split ``refs`` into consecutive groups of ``counts`` (an int: a single ref)."""
    out, i = [], 0
    for c in counts:
        out.append(refs[i] if c is None else list(refs[i:i + c]))
        i += 1 if c is None else c
    return out


def _stacked(parts, n):
    """VMEM buffers of ``n`` of each wire part (``parts``: ShapeDtypeStructs)."""
    return [pltpu.VMEM((n, *p.shape), p.dtype) for p in parts]


def _exchange_fns(plan, dtype, shape, gc, xdtype, n, sum_only):
    """The kernel's codec: ``(fns, enc, tail, dec, phase-1 parts, phase-2 parts)``: ``tail``
    sums the N received chunks (sum_only) or sums and re-encodes them."""
    g = plan.group_size
    fns = Codec()
    enc_fn = _encoder(plan, "rs", dtype)
    enc = fns.add(enc_fn, _sds((gc, g), xdtype))
    p1 = _tuple(jax.eval_shape(enc_fn, _sds((gc, g), xdtype)))
    stacked = [_sds((n, *p.shape), p.dtype) for p in p1]
    if sum_only:
        def summed(*parts):
            p = _payload(parts, plan, "rs", (gc, g), dtype)
            return codec.dequantize_sum(p, backend="jnp").reshape(gc, g)
        return fns, enc, fns.add(summed, *stacked), None, p1, ()
    b2_bits, b2_spikes, b2_fmt = _formats(plan, "ag")

    def requant(*parts):
        p = _payload(parts, plan, "rs", shape, dtype)
        return _parts(codec.dequantize_sum_quantize(p, bits=b2_bits, spikes=b2_spikes,
                                                    backend="jnp", format=b2_fmt))
    tail = fns.add(requant, *stacked)
    p2 = _tuple(jax.eval_shape(requant, *stacked))
    dec = fns.add(_decoder(plan, "ag", dtype), *p2)
    return fns, enc, tail, dec, p1, p2


def _exchange(x, axes, plan, dtype, shape, sum_only: bool):
    n = _axes.axis_size(axes)
    g = plan.group_size
    groups = codec.as_groups(x, g, n)
    gc = groups.shape[0] // n
    xg = groups.reshape(n, gc, g)
    fns, enc, tail, dec, p1, p2 = _exchange_fns(plan, dtype, shape, gc, x.dtype, n, sum_only)
    nc, k1, k2 = len(fns.consts), len(p1), len(p2)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        me = lax.axis_index(axes)
        if sum_only:
            p1_ref, y_ref, xv, load_sem, send, recv, yv, sems = _take(
                refs[1 + nc:], [k1, None, None, None, k1, k1, None, 2])
        else:
            (p1_ref, p2_ref, y_ref, xv, load_sem, send, recv, own, recv2, yv, sems,
             sems2) = _take(refs[1 + nc:], [k1, k2, None, None, None, k1, k1, k2, k2, None, 2,
                                           2])
        barrier(axes, me, n)
        outgoing, incoming = _phase1((xg_ref, consts, xv, load_sem, send, recv, sems), fns,
                                     enc, axes, me, n)
        for c in incoming:
            c.wait_recv()
        summed = fns.run(tail, consts, *[r[...] for r in recv])
        if sum_only:
            yv[...] = summed
            pltpu.sync_copy(yv, y_ref)
        else:
            for o, part in zip(own, _tuple(summed)):
                o[...] = part
            _phase2(own, recv2, y_ref, yv, sems2,
                    lambda src: fns.run(dec, consts, *[r[src] for r in recv2]), axes, me, n)
            for r, o in zip(recv2, p2_ref):
                pltpu.sync_copy(r, o)
        for c in outgoing:
            c.wait_send()
        # this rank's phase-1 payload: its own chunk from recv, the others from send
        for sb, rb, o in zip(send, recv, p1_ref):
            for s in range(1, n):
                pltpu.sync_copy(sb.at[s], o.at[(me + s) % n])
            pltpu.sync_copy(rb.at[me], o.at[me])

    scratch = [pltpu.VMEM((2, gc, g), x.dtype), pltpu.SemaphoreType.DMA((2,)),
               *_stacked(p1, n), *_stacked(p1, n)]
    outs = [out_type((n, *p.shape), p.dtype, x) for p in p1]
    sems = [pltpu.SemaphoreType.DMA((k1, n))] * 2
    if sum_only:
        outs += [out_type((gc, g), dtype, x)]
        scratch += [pltpu.VMEM((gc, g), dtype), *sems]
    else:
        outs += [out_type((n, *p.shape), p.dtype, x, axes) for p in p2]
        outs += [out_type((n, gc, g), dtype, x, axes)]
        scratch += [pltpu.VMEM(p.shape, p.dtype) for p in p2] + _stacked(p2, n)
        scratch += [pltpu.VMEM((gc, g), dtype), *sems, *[pltpu.SemaphoreType.DMA((k2, n))] * 2]
    results = call_kernel(kernel, outs, [xg], scratch, fns,
                          "flashcomm_pallas_" + ("reduce_scatter" if sum_only else "all_reduce"))
    pay1 = _payload(results[:k1], plan, "rs", shape, dtype)
    if sum_only:
        return results[k1].reshape(shape), pay1
    pay2 = _payload([r.reshape(n * gc, *r.shape[2:]) for r in results[k1:k1 + k2]], plan,
                    "ag", shape, dtype)
    y = codec.restore_shape(results[-1].reshape(n * gc, g), tuple(shape)).astype(dtype)
    return y, pay1.merge_groups(), pay2


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
    parts = _tuple(jax.eval_shape(enc_fn, _sds((ng, g), x.dtype)))
    dec = fns.add(_decoder(plan, "ag", x.dtype), *parts)
    nc, k = len(fns.consts), len(parts)

    def kernel(*refs):
        xg_ref, consts = refs[0], refs[1:1 + nc]
        p_ref, y_ref, xv, own, recv, yv, sems = _take(refs[1 + nc:],
                                                       [k, None, None, k, k, None, 2])
        me = lax.axis_index(axes)
        barrier(axes, me, n)
        pltpu.sync_copy(xg_ref, xv)
        for o, part in zip(own, _tuple(fns.run(enc, consts, xv[...]))):
            o[...] = part
        _phase2(own, recv, y_ref, yv, sems,
                lambda src: fns.run(dec, consts, *[r[src] for r in recv]), axes, me, n)
        for o, r in zip(own, p_ref):
            pltpu.sync_copy(o, r)

    scratch = [pltpu.VMEM((ng, g), x.dtype), *[pltpu.VMEM(p.shape, p.dtype) for p in parts],
               *_stacked(parts, n), pltpu.VMEM((ng, g), x.dtype),
               *[pltpu.SemaphoreType.DMA((k, n))] * 2]
    outs = [out_type(p.shape, p.dtype, x) for p in parts]
    outs += [out_type((n, ng, g), x.dtype, x, axes)]
    results = call_kernel(kernel, outs, [xg], scratch, fns, "flashcomm_pallas_all_gather")
    p = _payload(results[:k], plan, "ag", x.shape, x.dtype)
    size = math.prod(x.shape)
    stacked = results[k].reshape(n, ng * g)[:, :size].reshape(n, *x.shape)
    return xla.arrange_gathered(stacked, axis, tiled), p
