"""The ragged exchange over the ``p2p`` transport: the rows of ``lax.ragged_all_to_all`` in one
FFI call per rank (ffi/cpu/cpu_exchange.h; CUDA: ffi/cuda/exchange.h, compiled, not run on a GPU).

Rank ``r`` sends rows ``[input_offsets[j], input_offsets[j] + send_sizes[j])`` of its operand to
rank ``j``, which finds them at ``output_offsets[j]`` of its output (an offset the sender gives);
the output's other rows keep their values. The bytes are copied as they are, any dtype, so the
exact ragged all-to-all is this call on the operand and the quantized one this call on the
packed rows of the codec's payload (:mod:`jax_flashcomm.alltoall`). The ranks are the devices
of this process (target ``flashcomm_p2p_exchange``) or processes of this host over shared memory
(``flashcomm_shm_exchange``); every wait for a peer gives up after ``timeout_ms``. XLA:CPU has no
``ragged-all-to-all``, so on CPU this is the only way it runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_flashcomm import _axes
from jax_flashcomm.codec import kernels
from jax_flashcomm.jax_compat import kernel_platform_name
from jax_flashcomm.transport import p2p

__all__ = ["TARGETS", "unavailable", "exchange", "uniform_offsets"]

#: The FFI targets (both modules register them).
TARGETS = ("flashcomm_p2p_exchange", "flashcomm_shm_exchange")


def unavailable(axes: tuple[str, ...]) -> str | None:
    """Why the exchange cannot run over the bound ``axes`` here; None when it can."""
    platform = kernel_platform_name(jax.default_backend())
    if platform is None or not set(TARGETS) <= kernels.registered(platform):
        return f"no exchange kernels for platform {jax.default_backend()!r} in this build"
    return p2p.unsupported_reason(axes)


def exchange(operand: jax.Array, output: jax.Array, input_offsets, send_sizes, output_offsets,
             recv_sizes, axes: tuple[str, ...], timeout_ms: int) -> jax.Array:
    """The rows of a ragged all-to-all, moved as bytes (module docstring).

    Args:
      operand: ``(rows, ...)`` this rank sends from (any dtype).
      output: ``(rows', ...)`` of ``operand``'s dtype and row shape: the rows not written keep
        these values.
      input_offsets, send_sizes, output_offsets, recv_sizes: ``(N,)`` integers, as for
        ``lax.ragged_all_to_all``.
      axes: the mesh axes (bound).
      timeout_ms: the limit on every wait for a peer.

    Returns:
      ``output`` with the received rows written, varying over ``axes``.

    Raises:
      ValueError: the exchange cannot run here (:func:`unavailable`).
    """
    reason = unavailable(axes)
    if reason is not None:
        raise ValueError(f"ragged exchange: the p2p transport cannot run here: {reason}")
    metas = [_axes.to_varying(jnp.asarray(a).astype(jnp.int32), axes)
             for a in (input_offsets, send_sizes, output_offsets, recv_sizes)]
    output = _axes.to_varying(output, axes)
    operand = _axes.to_varying(operand, axes)
    # varying over what they vary over: nothing where shard_map does not check (check_vma=False)
    vma = _axes.varying_axes(operand) | _axes.varying_axes(output)
    # the operand's type carries the mesh: an output made by lax.empty has none
    call = jax.ffi.ffi_call(p2p.target("exchange"),
                            p2p.result_aval(operand, output.shape, output.dtype, vma),
                            input_output_aliases={1: 0}, vmap_method="sequential")
    rank, group = p2p.rank_and_group(axes)
    return call(operand, output, *metas, rank, group,
                **p2p.meeting_attrs("exchange", axes, operand, timeout_ms))


def uniform_offsets(n: int, rows: int, rank) -> tuple:
    """The offsets of an all-to-all as an exchange: block ``j`` of ``rows`` rows goes to rank
    ``j``, which keeps it in block ``rank``.

    Args:
      n: the number of ranks.
      rows: rows per block.
      rank: this rank's index (a traced int32 scalar).

    Returns:
      ``(input_offsets, send_sizes, output_offsets, recv_sizes)``, int32 ``(n,)``.
    """
    blocks = jnp.arange(n, dtype=jnp.int32) * rows
    sizes = jnp.full((n,), rows, jnp.int32)
    return blocks, sizes, jnp.full((n,), rows, jnp.int32) * rank.astype(jnp.int32), sizes

