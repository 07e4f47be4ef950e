"""An exact two-step all-reduce whose transfers move bf16 bytes: the measured bf16 baseline.

XLA:CPU widens bf16 all-reduce, reduce-scatter and all-gather to f32 (the compiled HLO shows
``f32[...] all-reduce(convert ...)``), so ``lax.psum`` of bf16 moves twice the bytes of a bf16
ring on this backend. This baseline keeps the wire in bf16 by moving the bit patterns as
``uint16``, with the structure of the quantized ``xla`` transport
(``jax_flashcomm/transport/xla.py``) minus the codec:

1. the (flattened, zero-padded to a multiple of N) operand as N row-chunks of uint16;
2. ``all_to_all``: chunk i of every rank goes to rank i;
3. the N received chunks summed in f32 in rank order, rounded to bf16 once;
4. ``all_gather`` (tiled, result replicated like ``lax.psum``'s) of the uint16 reduced chunks,
   bitcast back to bf16 and un-padded.

The result equals ``bf16(sum_r f32(x_r))`` with the sum in rank order, bit for bit on every rank
(tests/benchmarks/test_bf16_baseline.py). A benchmark baseline, not part of the library.

:class:`Bf16WireComm` is the exact strategy of a model whose all-reduces move bf16: the
baseline a GPU user's exact all-reduce (NCCL on bf16 activations) is, for
``benchmarks.llm.ttft.links``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jax_flashcomm.jax_compat import all_gather_invariant
from jax_flashcomm.nn import TPComm


def bf16_two_step_psum(x, axis_name):
    """Exact all-reduce sum of a bf16 ``x`` over ``axis_name`` inside ``shard_map``.

    Returns a bf16 array of ``x``'s shape, invariant over the reduced axes (``lax.psum``'s type).
    Both collectives carry ``uint16`` (bf16 bit patterns), so no f32 widening on the wire.
    """
    if x.dtype != jnp.bfloat16:
        raise TypeError(f"bf16_two_step_psum takes bf16, got {x.dtype}")
    axes = tuple(axis_name) if isinstance(axis_name, (tuple, list)) else (axis_name,)
    n = math.prod(int(lax.axis_size(a)) for a in axes)
    varying = jax.typeof(x).mat.varying
    missing = tuple(a for a in axes if a not in varying)
    if missing:  # as lax collectives do implicitly: the operand must vary over the axes
        x = lax.pcast(x, missing, to="varying")
    flat = jnp.ravel(x)
    m = flat.size
    pad = (-m) % n
    if pad:
        flat = jnp.pad(flat, (0, pad))
    chunks = lax.bitcast_convert_type(flat.reshape(n, -1), jnp.uint16)   # (N, M/N)
    received = lax.all_to_all(chunks, axes, 0, 0, tiled=False)            # [j] = from rank j
    vals = lax.bitcast_convert_type(received, jnp.bfloat16).astype(jnp.float32)
    total = vals[0]
    for j in range(1, n):  # f32, in rank order
        total = total + vals[j]
    reduced = lax.bitcast_convert_type(total.astype(jnp.bfloat16), jnp.uint16)   # (M/N,)
    gathered = all_gather_invariant(reduced, axes, axis=0, tiled=True)           # (M_padded,)
    y = lax.bitcast_convert_type(gathered, jnp.bfloat16)
    return y[:m].reshape(x.shape)


class Bf16WireComm(TPComm):
    """``TPComm("exact")`` whose all-reduces move bf16: each partial sum is rounded to bf16 and
    all-reduced by :func:`bf16_two_step_psum` (half the bytes of XLA:CPU's f32 ``lax.psum``),
    the sum cast back to the activations' dtype. ``wire_itemsize`` says so to the byte count."""

    wire_itemsize = 2

    def __init__(self, axis_name: str = "tp"):
        super().__init__("exact", axis_name)

    def all_reduce(self, x):
        return bf16_two_step_psum(x.astype(jnp.bfloat16), self.axis_name).astype(x.dtype)
