"""Tensor-parallel linear layers and the vocabulary-parallel embedding (Flax NNX).

Parameters live at their global shape with ``out_sharding`` metadata (``nnx.get_partition_spec``
reads it); ``__call__`` runs on local shards, inside ``jax.shard_map`` (the model step's, or
:func:`jax_flashcomm.nn.shard_call`'s). Kernels are ``(in, out)``, like ``nnx.Linear``.

* :class:`ColumnParallelLinear`: kernel sharded by output columns; input replicated, output
  sharded by features. With ``sp=True`` (sequence-parallel) the input is this rank's slice of the
  sequence and the all-gather runs as a ring next to the partial matmuls.
* :class:`RowParallelLinear`: kernel sharded by input rows; input sharded by features, output
  the all-reduced sum, or with ``sp=True`` this rank's slice of the sequence (reduce-scatter).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from jax_flashcomm.jax_compat import all_gather_invariant
from jax_flashcomm.nn.comm import TPComm

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "init_param"]


def init_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype, sharding: tuple,
               scale: float | None = None) -> nnx.Param:
    """An ``nnx.Param`` of ``shape`` with ``out_sharding=sharding``.

    Args:
      rngs: lecun-normal from ``rngs.params()``; None: zeros (weights to be loaded; use under
        ``nnx.eval_shape``).
      shape: the global shape (kernels ``(in, out)``).
      dtype: the parameter's dtype.
      sharding: a mesh axis name or None per dimension.
      scale: with ``rngs``, fill with this constant instead (e.g. 1.0 for a norm's scale).

    Returns:
      The ``nnx.Param``.
    """
    if rngs is None:
        value = jnp.zeros(shape, dtype)
    elif scale is not None:
        value = jnp.full(shape, scale, dtype)
    else:
        value = jax.nn.initializers.lecun_normal(in_axis=-2, out_axis=-1)(
            rngs.params(), shape, dtype)
    return nnx.Param(value, out_sharding=tuple(sharding), eager_sharding=False)


def _sequence_axis(x, name: str) -> int:
    if x.ndim < 2:
        raise ValueError(f"{name}: sp=True needs (..., seq, features) inputs, got {x.shape}")
    return x.ndim - 2


class _ShardedLinear(nnx.Module):
    """``y = x @ kernel``, ``kernel`` ``(in, out)`` at global shape, sharded over
    ``comm.axis_name`` along dimension ``SHARDED`` (0: rows, 1: columns).

    Args:
      in_features: input width (global; a multiple of ``tp`` when rows are sharded).
      out_features: output width (global; a multiple of ``tp`` when columns are sharded).
      tp: the TP size.
      comm: the :class:`~jax_flashcomm.nn.TPComm`.
      dtype: the kernel's dtype.
      use_bias: a bias ``(out,)`` added to the output (column-parallel only: sharded like the
        output's features; zeros when initialized).
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    SHARDED: int

    def __init__(self, in_features: int, out_features: int, *, tp: int, comm: TPComm,
                 dtype=jnp.float32, use_bias: bool = False, rngs: nnx.Rngs | None):
        name, size = (("in_features", in_features) if self.SHARDED == 0
                      else ("out_features", out_features))
        if size % tp:
            raise ValueError(f"{type(self).__name__}: {name}={size} is not divisible by the TP "
                             f"size {tp}")
        self.comm, self.tp = comm, tp
        sharding = [None, None]
        sharding[self.SHARDED] = comm.axis_name
        self.kernel = init_param(rngs, (in_features, out_features), dtype, tuple(sharding))
        if use_bias and self.SHARDED == 0:
            raise ValueError(f"{type(self).__name__}: a bias on a row-parallel layer would be "
                             f"added once per rank before the all-reduce; add it after")
        self.bias = (init_param(rngs, (out_features,), dtype, (comm.axis_name,), scale=0.0)
                     if use_bias else None)


class ColumnParallelLinear(_ShardedLinear):
    """``y = x @ kernel`` with ``kernel`` ``(in, out)`` sharded by columns over ``comm.axis_name``
    (the arguments of :class:`_ShardedLinear`).

    Local: ``x (..., in)`` replicated → ``(..., out / N)``; with ``sp=True``
    ``x (..., S / N, in)`` → ``(..., S, out / N)`` through ``comm.gather_matmul``; plus the bias.
    """

    SHARDED = 1

    def __call__(self, x, *, sp: bool = False):
        w = self.kernel[...]
        if sp and self.tp > 1:
            y = self.comm.gather_matmul(x, w, _sequence_axis(x, "ColumnParallelLinear"))
        else:
            y = x @ w
        return y if self.bias is None else y + self.bias[...]


class RowParallelLinear(_ShardedLinear):
    """``y = x @ kernel`` with ``kernel`` ``(in, out)`` sharded by rows over ``comm.axis_name``
    (the arguments of :class:`_ShardedLinear`).

    Local: ``x (..., in / N)`` → the sum over ranks ``(..., out)`` through ``comm.all_reduce``
    (``reduce=False``: this rank's partial ``x @ kernel``, for a caller that all-reduces it
    fused with what follows, :meth:`TPComm.all_reduce_add_norm`);
    with ``sp=True`` → this rank's ``(..., S / N, out)`` through ``comm.matmul_scatter``.
    """

    SHARDED = 0

    def __call__(self, x, *, sp: bool = False, reduce: bool = True):
        w = self.kernel[...]
        if sp and self.tp > 1:
            return self.comm.matmul_scatter(x, w, _sequence_axis(x, "RowParallelLinear"))
        if not reduce:  # this rank's partial sum, all-reduced by the caller (fuse_norm)
            return x @ w
        return self.comm.all_reduce(x @ w)


class VocabParallelEmbedding(nnx.Module):
    """Token embedding with the table ``(vocab_padded, d)`` sharded by vocabulary rows.

    ``vocab_padded`` is ``vocab_size`` rounded up to a multiple of the TP size (the padding rows
    are zero and their logits masked). ``__call__(ids)``: each rank looks up the ids in its rows,
    zeros elsewhere, and the partial embeddings are summed exactly (``lax.psum``, or
    ``lax.psum_scatter`` over the sequence with ``sp=True``). :meth:`attend` is the tied LM head:
    this rank's logits, all-gathered over the vocabulary (exact).

    Args:
      vocab_size: the real vocabulary size.
      d_model: the embedding width.
      tp: the TP size.
      comm: the :class:`~jax_flashcomm.nn.TPComm` (its ``axis_name`` shards the rows).
      dtype: the table's dtype.
      rngs: ``nnx.Rngs`` to initialize, or None for zeros (weights to be loaded).
    """

    def __init__(self, vocab_size: int, d_model: int, *, tp: int, comm: TPComm,
                 dtype=jnp.float32, rngs: nnx.Rngs | None):
        self.comm, self.tp, self.vocab_size = comm, tp, vocab_size
        self.vocab_padded = -(-vocab_size // tp) * tp
        self.embedding = init_param(rngs, (self.vocab_padded, d_model), dtype,
                                    (comm.axis_name, None))

    def __call__(self, ids, *, sp: bool = False):
        table = self.embedding[...]
        rows = table.shape[0]
        start = lax.axis_index(self.comm.axis_name) * rows
        local = ids - start
        inside = (local >= 0) & (local < rows)
        x = jnp.where(inside[..., None], table[jnp.where(inside, local, 0)], 0)
        if sp and self.tp > 1:
            return lax.psum_scatter(x, self.comm.axis_name, scatter_dimension=x.ndim - 2,
                                    tiled=True)
        return lax.psum(x, self.comm.axis_name)

    def attend(self, x):
        """Logits ``x @ table.T`` over the real vocabulary, replicated: ``(..., vocab_size)``."""
        logits = x @ self.embedding[...].T
        logits = all_gather_invariant(logits, (self.comm.axis_name,), axis=logits.ndim - 1,
                                      tiled=True)
        return logits[..., :self.vocab_size]
