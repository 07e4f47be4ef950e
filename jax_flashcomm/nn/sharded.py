"""Running NNX modules on local shards: the specs of their parameters, placing them on a mesh,
and calling one inside ``jax.shard_map``."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

__all__ = ["param_specs", "place", "shard_call"]


def param_specs(state: nnx.State):
    """The ``PartitionSpec`` of every variable of an ``nnx.State``.

    Args:
      state: an ``nnx.State`` (e.g. ``nnx.split(module)[1]``).

    Returns:
      A pytree matching the state's: each variable's ``out_sharding`` metadata as a
      ``PartitionSpec`` (unannotated variables are replicated).
    """
    return nnx.get_partition_spec(state)


def place(module: nnx.Module, mesh: jax.sharding.Mesh) -> nnx.Module:
    """Put every parameter of ``module`` on ``mesh`` as its sharding metadata says (in place).

    Args:
      module: an NNX module whose parameters carry ``out_sharding`` metadata.
      mesh: the mesh whose axes the metadata names.

    Returns:
      ``module`` itself, updated.
    """
    graphdef, state = nnx.split(module)
    specs = param_specs(state)
    state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state, specs)
    nnx.update(module, state)
    return module


def shard_call(module: nnx.Module, mesh: jax.sharding.Mesh, in_specs, out_specs, **kwargs):
    """``f(*args)`` = ``module(*args, **kwargs)`` run on local shards inside ``jax.shard_map``.

    ``in_specs`` / ``out_specs`` are those of the call's arguments and result; the module's
    parameters travel with their own specs. For using one TP layer on its own; a model step
    puts the shard_map around the whole step instead.

    Args:
      module: the NNX module (its parameters at global shape with sharding metadata).
      mesh: the mesh of the ``shard_map``.
      in_specs: a ``PartitionSpec`` per positional argument of the call.
      out_specs: the ``PartitionSpec`` (pytree) of the result.
      **kwargs: static keyword arguments of every call (e.g. ``sp=True``).

    Returns:
      ``f(*args)``: jitted; it places the (global) arguments on ``mesh`` by ``in_specs``.
    """
    graphdef, state = nnx.split(module)
    specs = param_specs(state)

    def body(state, *args):
        return nnx.merge(graphdef, state)(*args, **kwargs)

    def call(*args):
        args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, in_specs)]
        return fn(state, *args)

    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, *in_specs),
                               out_specs=out_specs))

    return call
