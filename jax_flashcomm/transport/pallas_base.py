"""What every pallas-transport kernel shares: where it runs (Mosaic on a TPU, Pallas's TPU
interpret mode elsewhere: :func:`use_interpret`), the VMEM it may take (:func:`vmem_budget`),
the jnp twin's codec evaluated inside a kernel (:class:`Codec`, :func:`eval_for_mosaic`), and
the barrier, peer ids, output types and ``pallas_call`` of every kernel (:func:`call_kernel`)."""

from __future__ import annotations

import contextlib
import contextvars
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.extend import core as jex_core

from jax_flashcomm import _axes

__all__ = ["use_interpret", "interpret_params", "vmem_budget", "vmem_budget_bytes",
           "tile_bounds", "races_found",
           "Codec", "eval_for_mosaic", "barrier", "peer_id", "call_kernel", "out_type",
           "concat", "padded_bytes", "vmem_bytes_of", "vmem_per_group"]


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


#: The VMEM a kernel may take for its buffers, in bytes (:func:`vmem_budget`): 16 MiB, the
#: default scoped VMEM limit of v5e's Mosaic kernels (the smallest of v5e, v5p, v6e).
DEFAULT_VMEM_BUDGET = 16 << 20
_vmem_budget: contextvars.ContextVar = contextvars.ContextVar("jax_flashcomm_pallas_vmem",
                                                              default=DEFAULT_VMEM_BUDGET)


@contextlib.contextmanager
def vmem_budget(nbytes: int):
    """Trace the codec kernels with ``nbytes`` of VMEM for their buffers: an operand whose
    buffers need more is cut into tiles of whole groups, one kernel per tile (the groups are
    independent, so the bits do not change).

    Args:
      nbytes: the budget (> 0).
    """
    if int(nbytes) <= 0:
        raise ValueError(f"vmem_budget: nbytes must be > 0, got {nbytes}")
    token = _vmem_budget.set(int(nbytes))
    try:
        yield
    finally:
        _vmem_budget.reset(token)


def vmem_budget_bytes() -> int:
    """The VMEM budget of the kernels traced now (:func:`vmem_budget`)."""
    return _vmem_budget.get()


def vmem_per_group(scratch, groups: int, temporaries: int) -> int:
    """VMEM per group of a kernel over ``groups`` groups: its scratch (:func:`vmem_bytes_of`)
    and the codec's ``temporaries`` (bytes), spread over the groups."""
    return -(-(vmem_bytes_of(scratch) + temporaries) // groups)


def tile_bounds(count: int, bytes_each: int) -> list:
    """``[(start, stop), ...]`` cutting ``count`` groups into tiles whose buffers, at
    ``bytes_each`` per group, fit the VMEM budget (at least one group a tile)."""
    per = max(1, _vmem_budget.get() // max(1, bytes_each))
    return [(a, min(a + per, count)) for a in range(0, count, per)]


def concat(parts, axis: int):
    """``jnp.concatenate`` of ``parts`` along ``axis`` (one part: itself)."""
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=axis)


def padded_bytes(shape, dtype) -> int:
    """Bytes of a VMEM buffer, its last two dims padded to Mosaic's tiles."""
    itemsize = jnp.dtype(dtype).itemsize
    dims = list(shape) if len(shape) >= 2 else [1, *shape]
    dims[-1] = -(-dims[-1] // 128) * 128
    sub = 8 * max(1, 4 // itemsize)
    dims[-2] = -(-dims[-2] // sub) * sub
    return math.prod(dims) * itemsize


def vmem_bytes_of(scratch, consts=()) -> int:
    """The VMEM a kernel's VMEM scratch buffers (semaphores skipped) and codec tables take,
    each padded to Mosaic's tiles."""
    refs = [s for s in scratch if getattr(s, "memory_space", None) == pltpu.VMEM]
    return sum(padded_bytes(a.shape, a.dtype) for a in [*refs, *consts])


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
        kernel's refs of :attr:`consts`); returns its output, a tuple if it has several.

        For Mosaic it is :func:`eval_for_mosaic` (the twin's barriers dropped); interpreted,
        the twin's jaxpr runs as it is, barriers kept: without them XLA:CPU may reassociate
        the rotation's arithmetic, which changed a code in some tens of thousands of rotated
        values (``tests/pallas``), and interpret mode is the check of the twin's bits."""
        jaxpr, start, count = self.jaxprs[index]
        consts = [const_refs[start + i][...].reshape(v.aval.shape)
                  for i, v in enumerate(jaxpr.constvars)]
        outs = eval_for_mosaic(jaxpr, consts, *args, mosaic=interpret_params() is False)
        return outs[0] if len(outs) == 1 else tuple(outs)


def _unsigned_sum(x, params):
    """``reduce_sum`` of unsigned integers as the same-width signed sum (Mosaic reduces no
    unsigned integers): two's complement addition has the same bits, so this is exact."""
    signed = jnp.dtype(f"int{8 * x.dtype.itemsize}")
    total = lax.reduce_sum_p.bind(lax.bitcast_convert_type(x, signed), **params)
    return lax.bitcast_convert_type(total, x.dtype)


def eval_for_mosaic(jaxpr, consts, *args, mosaic: bool = True):
    """``jax.core.eval_jaxpr`` with, for ``mosaic``, the twin's two ops Mosaic does not lower
    rewritten: ``optimization_barrier`` is the identity (it only fences XLA's rewrites; what
    Mosaic makes of the rotation's arithmetic without it is not checked on a CPU-only
    machine), and a ``reduce_sum`` over unsigned integers is the signed one
    (:func:`_unsigned_sum`, exact). Nested ``jit`` calls are evaluated the same way. With
    ``mosaic=False`` every op is bound as it is."""
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
        if mosaic and name == "optimization_barrier":
            outs = ins
        elif mosaic and name == "reduce_sum" and jnp.issubdtype(ins[0].dtype,
                                                                 jnp.unsignedinteger):
            outs = [_unsigned_sum(ins[0], eqn.params)]
        elif name in ("jit", "pjit"):
            closed = eqn.params["jaxpr"]
            outs = eval_for_mosaic(closed.jaxpr, closed.consts, *ins, mosaic=mosaic)
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
