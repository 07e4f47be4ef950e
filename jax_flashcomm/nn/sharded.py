"""Running NNX modules on local shards: the specs of their parameters, placing them on a mesh,
and calling one inside ``jax.shard_map``."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import NamedSharding

__all__ = ["param_specs", "place", "shard_call"]


def param_specs(state):
    """The ``PartitionSpec`` of every variable of an ``nnx.State`` (its ``out_sharding``
    metadata; unannotated variables are replicated), as a pytree matching the state's."""
    return nnx.get_partition_spec(state)


def place(module: nnx.Module, mesh) -> nnx.Module:
    """Put every parameter of ``module`` on ``mesh`` as its sharding metadata says (in place)."""
    graphdef, state = nnx.split(module)
    specs = param_specs(state)
    state = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), state, specs)
    nnx.update(module, state)
    return module


def shard_call(module: nnx.Module, mesh, in_specs, out_specs, **kwargs):
    """``f(*args)`` = ``module(*args, **kwargs)`` run on local shards inside ``jax.shard_map``.

    ``in_specs`` / ``out_specs`` are those of the call's arguments and result; the module's
    parameters travel with their own specs. For using one TP layer on its own; a model step
    puts the shard_map around the whole step instead.
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
