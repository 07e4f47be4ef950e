"""The ``p2p`` transport: each quantized collective is one FFI call per rank that reads its
peers' buffers directly (ffi/cpu/p2p_handlers.cc, ffi/include/flashcomm/p2p_rendezvous.h; on
CUDA ffi/cuda/p2p_handlers.cc, which compiles and lowers but has not run on a GPU).

The ranks are the devices of one process, or processes on one host with one device each: then
the same protocols run over shared memory (:mod:`jax_flashcomm.transport.shm`, FFI targets
``flashcomm_shm_*``), and :func:`exact_all_reduce` sums exactly over it too. In one process, every
call of a collective meets its peers through
an in-process rendezvous keyed by the XLA execution (its run id), the call site (an id given
here at trace time, :mod:`jax_flashcomm.transport.identity`), the replica group (the index over the
mesh axes not reduced) and how many
times this rank has called the site in this run (loops). Inside, the call runs the `xla`
transport's steps with the same codec kernels on the same bytes in the same order, so the
results are bit-identical to it (tests/transport/test_transport.py): quantize into its own result
buffer; read its chunk of every peer's payload, sum in f32 in rank order and re-quantize into
its slot of the gathered phase-2 payload; read every peer's slot; decode. Barriers keep every
buffer alive until every peer has read it; every wait gives up after ``timeout_ms`` with an
error (a Python exception from the computation), never a hang.
"""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_flashcomm import _axes
from jax_flashcomm.codec import Payload, kernels, spec
from jax_flashcomm.codec import as_groups, restore_shape
from jax_flashcomm.transport import identity, shm
from jax_flashcomm.jax_compat import kernel_platform_name
from jax_flashcomm.transport.xla import arrange_gathered


def result_aval(x: jax.Array, shape: tuple[int, ...], dtype, vma) -> jax.core.ShapedArray:
    """The aval of one result: ``x``'s mesh, ``shape``/``dtype``, varying over ``vma``.

    Args:
      x: an operand of the call (its mesh and sharding).
      shape: the result's shape.
      dtype: the result's dtype.
      vma: the mesh axes it varies over.

    Returns:
      A ``ShapedArray`` for ``jax.ffi.ffi_call``.
    """
    aval = kernels.result_like(x, shape, dtype)
    mat = aval.manual_axis_type
    return aval.update(manual_axis_type=mat.update(varying=frozenset(vma)))


def rank_and_group(axes: tuple[str, ...]) -> tuple[jax.Array, jax.Array]:
    """``(rank, group)`` of this device, int32 scalars.

    Args:
      axes: the mesh axes of the collective (bound).

    Returns:
      ``rank``: this device's index over ``axes`` in lax's order (the slot all_to_all /
      all_gather give it); ``group``: its replica group's index over the other manual axes of
      the mesh (a 2-D mesh reducing over one axis has a group per index of the other).
    """
    mesh = jax.sharding.get_abstract_mesh()
    others = tuple(a for a in mesh.axis_names if a not in axes and a in mesh.manual_axes)
    rank = lax.axis_index(axes).astype(jnp.int32)
    group = (lax.axis_index(others).astype(jnp.int32) if others
             else jnp.zeros((), jnp.int32))
    return rank, group


#: The FFI targets of the transport (both the CPU and the CUDA module register them).
TARGETS = ("flashcomm_p2p_all_reduce", "flashcomm_p2p_reduce_scatter",
           "flashcomm_p2p_all_gather", "flashcomm_p2p_psum")


def kernel_platform(jax_platform: str) -> str | None:
    """The kernel module whose p2p handlers run on the JAX platform ``jax_platform``.

    CUDA: one process with several GPUs (ffi/cuda/p2p_handlers.cc), compiled and lowered but
    never run on hardware.

    Args:
      jax_platform: a JAX platform name, ``jax.default_backend()`` (``"cpu"``, ``"gpu"``,
        ``"cuda"``, ...); not the codec's ``backend`` option.

    Returns:
      ``"cpu"`` or ``"cuda"``, or None when that module is not built or lacks them.
    """
    platform = kernel_platform_name(jax_platform)
    if platform == "cuda" and "rocm" in _platform_version().lower():
        return None
    if platform is None or not set(TARGETS) <= kernels.registered(platform):
        return None
    return platform


def _platform_version() -> str:
    try:
        return str(jax.devices()[0].client.platform_version)
    except Exception:  # noqa: BLE001  (no devices, or an older client without the field)
        return ""


def unsupported_reason(axes: tuple[str, ...]) -> str | None:
    """Why the p2p transport cannot run this collective here, or None when it can.

    Args:
      axes: the collective's mesh axes (bound: inside ``jax.shard_map``).

    Returns:
      A sentence for the plan's errors, or None.
    """
    if jax.process_count() != 1:
        reason = shm.unsupported_reason()
        if reason is not None:
            return f"peers in other processes, and shared memory cannot serve them: {reason}"
        return _auto_axes_reason()
    platform = jax.default_backend()
    if kernel_platform(platform) is None:
        return (f"no p2p kernels for platform {platform!r} in this build (the CPU module has "
                "them; the CUDA ones need FLASHCOMM_CUDA=ON and have not run on a GPU, "
                "docs/cuda.md)")
    return _auto_axes_reason()


def _auto_axes_reason() -> str | None:
    mesh = jax.sharding.get_abstract_mesh()
    auto = [a for a in mesh.axis_names if a not in mesh.manual_axes and mesh.shape[a] > 1]
    if auto:
        return (f"mesh axes {auto} are not manual in this shard_map: devices along them would "
                "claim the same rank")
    return None


def across_processes() -> bool:
    """Whether the peers are processes (the shared-memory targets) rather than devices of this
    process."""
    return jax.process_count() != 1


def target(op: str) -> str:
    """The FFI target of ``op`` for these peers: ``flashcomm_p2p_<op>`` in one process,
    ``flashcomm_shm_<op>`` between processes."""
    return f"flashcomm_{'shm' if across_processes() else 'p2p'}_{op}"


def axes_key(axes) -> int:
    """The mesh axes as the shared-memory handlers' ``axes_key`` (a hash of their names)."""
    digest = hashlib.sha1("\0".join(axes).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def operand_text(x) -> str:
    """``x``'s type as a call's description shows it (``f32[8,256]``)."""
    return f"{np.dtype(x.dtype).name}[{','.join(str(d) for d in x.shape)}]"


def call_site(kind: str, axes, x) -> int:
    """The site id of a p2p call of ``kind`` over ``axes`` on operand ``x``, traced now
    (:func:`jax_flashcomm.transport.identity.site`); between processes its description is
    published for the peers' errors."""
    ident = identity.site(kind, tuple(axes), operand_text(x))
    if across_processes():
        shm.name_site(ident, identity.describe(ident) or "")
    return ident


def meeting_attrs(kind, axes, x, timeout_ms) -> dict:
    """The meeting attributes of a p2p call of ``kind`` over ``axes`` on operand ``x``: size,
    site and ``timeout_ms`` (between processes also ``axes_key``)."""
    attrs = dict(size=np.int64(_axes.axis_size(axes)), site=np.int64(call_site(kind, axes, x)),
                 timeout_ms=np.int64(timeout_ms))
    if across_processes():
        attrs["axes_key"] = np.int64(axes_key(axes))
    return attrs


def all_reduce(x: jax.Array, axes: tuple[str, ...], plan,
               decode: bool = True) -> tuple[jax.Array | None, Payload, Payload]:
    """The two-step quantized all-reduce of a varying ``x`` in one call per rank.

    Args:
      x: the operand (f32, bf16 or f16), varying over ``axes``.
      axes: the reduced mesh axes.
      plan: the call's quantized :class:`~jax_flashcomm.planner.Plan` (bits, spikes,
        rotation, group size, timeout).
      decode: False: the call stops at the gathered phase-2 payload (its ``y`` result is
        empty, so the kernels skip the decode) and ``y`` is None.

    Returns:
      ``(y, p1, p2)`` as :func:`jax_flashcomm.allreduce.two_step` does: the sum, this rank's
      phase-1 payload and the gathered phase-2 payload, for error bounds.
    """
    n = _axes.axis_size(axes)
    g, b1, b2 = plan.group_size, plan.rs_bits, plan.ag_bits
    rot, k1, k2 = plan.rotation, plan.rs_spikes, plan.ag_spikes
    groups = as_groups(x, g, n)
    total = groups.shape[0]
    vma = _axes.varying_axes(x)
    rep = vma - frozenset(axes)
    call = jax.ffi.ffi_call(
        target("all_reduce"),
        (result_aval(x, groups.shape if decode else (0,), x.dtype, rep),
         result_aval(x, (n, total // n, spec.record_bytes(g, b1, k1)), jnp.uint8, vma),
         result_aval(x, (n, total // n), jnp.bfloat16, vma),
         result_aval(x, (n, total // n), jnp.bfloat16, vma),
         result_aval(x, (total, spec.record_bytes(g, b2, k2)), jnp.uint8, rep),
         result_aval(x, (total,), jnp.bfloat16, rep), result_aval(x, (total,), jnp.bfloat16, rep)),
        vmap_method="sequential")
    rank, group = rank_and_group(axes)
    y, c1, s1, z1, c2, s2, z2 = call(
        groups, rank, group, fmt=plan.group_formats[0].ffi_attribute(),
        out_fmt=plan.group_formats[1].ffi_attribute(),
        **meeting_attrs("all_reduce", axes, x, plan.timeout_ms))
    meta = dict(group_size=g, shape=tuple(x.shape), dtype=np.dtype(x.dtype), rotation=rot)
    p1 = Payload(c1, s1, z1, bits=b1, spikes=k1, **meta).merge_groups()
    p2 = Payload(c2, s2, z2, bits=b2, spikes=k2, **meta)
    return (restore_shape(y, x.shape) if decode else None), p1, p2


def reduce_scatter(rows: jax.Array, axes: tuple[str, ...],
                   plan) -> tuple[jax.Array, Payload]:
    """Quantized reduce-scatter of varying ``rows``, as the `xla` transport's.

    Args:
      rows: ``(N, Mp)`` (``Mp`` whole groups): row i is the slice rank i keeps.
      axes: the reduced mesh axes.
      plan: the call's quantized :class:`~jax_flashcomm.planner.Plan`.

    Returns:
      ``(y, p1)``: ``y`` the f32-summed row of this rank ``(Mp,)`` in ``rows``' dtype, ``p1``
      this rank's payload split in N chunks.
    """
    n, mp = rows.shape
    g, bits = plan.group_size, plan.rs_bits
    rot, k1 = plan.rotation, plan.rs_spikes
    groups = rows.reshape(n * mp // g, g)
    vma = _axes.varying_axes(rows)
    call = jax.ffi.ffi_call(
        target("reduce_scatter"),
        (result_aval(rows, (mp // g, g), rows.dtype, vma),
         result_aval(rows, (n, mp // g, spec.record_bytes(g, bits, k1)), jnp.uint8, vma),
         result_aval(rows, (n, mp // g), jnp.bfloat16, vma),
         result_aval(rows, (n, mp // g), jnp.bfloat16, vma)),
        vmap_method="sequential")
    rank, group = rank_and_group(axes)
    y, c1, s1, z1 = call(groups, rank, group,
                         fmt=plan.group_formats[0].ffi_attribute(),
                         **meeting_attrs("reduce_scatter", axes, rows, plan.timeout_ms))
    p1 = Payload(c1, s1, z1, bits=bits, group_size=g, shape=(mp,), dtype=np.dtype(rows.dtype),
                 rotation=rot, spikes=k1)
    return y.reshape(mp), p1


def all_gather(x: jax.Array, axes: tuple[str, ...], axis: int, tiled: bool,
               plan) -> tuple[jax.Array, Payload]:
    """:func:`jax_flashcomm.transport.xla.all_gather` (same arguments and results, the same
    bits) in one FFI call per rank."""
    n = _axes.axis_size(axes)
    g, bits = plan.group_size, plan.ag_bits
    rot, k2 = plan.rotation, plan.ag_spikes
    groups = as_groups(x, g, 1)
    count = groups.shape[0]
    vma = _axes.varying_axes(x)
    call = jax.ffi.ffi_call(
        target("all_gather"),
        (result_aval(x, (n, count, g), x.dtype, vma),
         result_aval(x, (count, spec.record_bytes(g, bits, k2)), jnp.uint8, vma),
         result_aval(x, (count,), jnp.bfloat16, vma), result_aval(x, (count,), jnp.bfloat16, vma)),
        vmap_method="sequential")
    rank, group = rank_and_group(axes)
    y, c, s, z = call(groups, rank, group, fmt=plan.group_formats[1].ffi_attribute(),
                      **meeting_attrs("all_gather", axes, x, plan.timeout_ms))
    p = Payload(c, s, z, bits=bits, group_size=g, shape=tuple(x.shape), dtype=np.dtype(x.dtype),
                rotation=rot, spikes=k2)
    stacked = restore_shape(y, tuple(x.shape))  # (N, count, g) -> (N, *x.shape)
    return arrange_gathered(stacked, axis, tiled), p


def kernel_module():
    """The kernel module of the default backend (CUDA's or the CPU's): each has its own
    rendezvous and ring tables."""
    if kernel_platform(jax.default_backend()) == "cuda":
        return kernels.cuda_module()
    return kernels.cpu_module()


def meetings_in_progress() -> int:
    """Peer-to-peer calls that some rank has not finished (0 between collectives)."""
    return int(kernel_module().p2p_meetings_in_progress())


#: Bytes per rank from which :func:`exact_all_reduce` between processes takes two shots (each
#: rank sums one chunk, then every rank copies every chunk) rather than one (every rank sums
#: everything); over an emulated link (:func:`jax_flashcomm.transport.shm.set_link_rate`) with
#: more than two ranks it always takes two (a ring's bytes; one shot sends N - 1 copies). The
#: kernel decides at run time from this threshold (its ``two_shot_bytes`` attribute).
TWO_SHOT_BYTES = 256 * 1024
#: The same threshold between the devices of one process: 0, two shots at every size (they were
#: at least as fast as one at every size measured by
#: benchmarks/collectives/allreduce_exact_p2p.py; docs/transport.md, "The exact all-reduce").
IN_PROCESS_TWO_SHOT_BYTES = 0


def exact_all_reduce(x: jax.Array, axes: tuple[str, ...], timeout_ms: int,
                     two_shot: bool | None = None) -> jax.Array:
    """The exact all-reduce of a varying ``x`` over the p2p transport: the devices of this
    process, or processes of this host over shared memory.

    Every rank's ``x`` is summed in rank order (16-bit floats in f32, rounded once to their
    dtype; integers wrap as ``lax.psum``'s do), so every rank gets the same bits, run after run.

    Args:
      x: the operand (a float, complex or integer array), varying over ``axes``.
      axes: the reduced mesh axes.
      timeout_ms: the limit on every wait for a peer.
      two_shot: reduce-scatter then gather (True), every rank sums all (False), or by size
        (and link) at run time (None: :data:`IN_PROCESS_TWO_SHOT_BYTES`, between processes
        :data:`TWO_SHOT_BYTES`).

    Returns:
      The sum, invariant over ``axes``.

    Raises:
      ValueError: the p2p transport cannot run here (:func:`unsupported_reason`).
      TypeError: a dtype the kernels do not sum (:func:`exact_dtypes`).
    """
    reason = unsupported_reason(axes)
    if reason is not None:
        raise ValueError(f"exact_all_reduce: the p2p transport cannot run here: {reason}")
    taken = exact_dtypes(jax.default_backend())
    if np.dtype(x.dtype) not in taken:
        raise TypeError(f"exact_all_reduce: no exact p2p sum of {np.dtype(x.dtype)} here "
                        f"(it takes {', '.join(sorted(d.name for d in taken))})")
    rep = _axes.varying_axes(x) - frozenset(axes)
    mode = 2 if two_shot is None else int(bool(two_shot))
    processes = across_processes()
    threshold = TWO_SHOT_BYTES if processes else IN_PROCESS_TWO_SHOT_BYTES
    two = mode == 1 or (mode == 2 and x.size * np.dtype(x.dtype).itemsize >= threshold)
    # the in-process two-shot CPU sum writes every rank's sums over its x (each piece read
    # before it is written): its stores hit lines it has just read, a third less memory
    # traffic than a fresh y (XLA copies an x that is still live)
    in_place = two and not processes and kernel_platform_name(jax.default_backend()) == "cpu"
    call = jax.ffi.ffi_call(target("psum"), result_aval(x, x.shape, x.dtype, rep),
                            vmap_method="sequential",
                            input_output_aliases={0: 0} if in_place else None)
    rank, group = rank_and_group(axes)
    return call(x, rank, group, two_shot=np.int32(mode),
                two_shot_bytes=np.int64(threshold), **meeting_attrs("psum", axes, x, timeout_ms))


#: The dtypes the CPU kernels of :func:`exact_all_reduce` sum (SumComponents,
#: ffi/cpu/cpu_exact_sum.h); the CUDA kernels sum the 16- and 32-bit floats.
CPU_EXACT_DTYPES = frozenset(np.dtype(d) for d in (
    np.float32, jnp.bfloat16, np.float16, np.float64, np.complex64, np.complex128, np.int8,
    np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64))
CUDA_EXACT_DTYPES = frozenset(np.dtype(d) for d in (np.float32, jnp.bfloat16, np.float16))


def exact_dtypes(jax_platform: str) -> frozenset:
    """The dtypes :func:`exact_all_reduce` sums on ``jax_platform``'s kernels (others take
    ``lax.psum``)."""
    return (CUDA_EXACT_DTYPES if kernel_platform_name(jax_platform) == "cuda"
            else CPU_EXACT_DTYPES)
