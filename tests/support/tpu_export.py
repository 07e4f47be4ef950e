"""The TPU module of a function under shard_map, exported on a CPU-only machine
(``jax.export(..., platforms=("tpu",))``, the pallas kernels compiled for Mosaic, not
interpreted): what tests/pallas checks for ``tpu_custom_call``s."""

import jax
from jax import export
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jax_flashcomm.transport import pallas


def export_for_tpu(fn, *shapes, n: int = 4) -> str:
    """The MLIR text of ``fn`` under shard_map over ``n`` devices (axis "x"), every operand
    ``(shape, dtype)`` of ``shapes`` and the output row-sharded."""
    mesh = jax.make_mesh((n,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])
    f = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=tuple(P("x") for _ in shapes),
                              out_specs=P("x"), check_vma=False))
    args = [jax.ShapeDtypeStruct(s, d, sharding=NamedSharding(mesh, P("x"))) for s, d in shapes]
    with pallas.use_interpret(False):
        return export.export(f, platforms=("tpu",))(*args).mlir_module()
