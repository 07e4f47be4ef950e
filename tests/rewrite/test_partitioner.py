"""The report of a model sharded by annotations alone (GSPMD, Auto axes): the collectives XLA's
partitioner inserts, read from the compiled module (kind, mesh axes from the replica groups,
per-rank operand, the equation and source line each comes from) and what the rewrite did at
their equation; the replica-group forms."""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.rewrite import partitioner

CFG = fc.CommConfig(bits=8, min_bytes=0)


@pytest.mark.parametrize("text,groups", [
    ("{{0,1,2,3},{4,5,6,7}}", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("[4,2]<=[2,4]T(1,0)", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=2,'axis_1'=4,'axis_2'=1] {'axis_0'}", [[0, 4], [1, 5], [2, 6], [3, 7]]),
    ("mesh['axis_0'=1,'axis_1'=1,'axis_2'=4] {'axis_2'}", [[0, 1, 2, 3]]),
])
def test_replica_group_forms(text, groups):
    assert partitioner.replica_groups(text, 8) == groups


def test_groups_name_mesh_axes():
    mesh = jax.make_mesh((2, 4), ("data", "tp"), axis_types=(AxisType.Auto,) * 2,
                         devices=jax.devices()[:8])
    assert partitioner._mesh_axes([[0, 1, 2, 3], [4, 5, 6, 7]], mesh) == ("tp",)
    assert partitioner._mesh_axes([[0, 4], [1, 5], [2, 6], [3, 7]], mesh) == ("data",)
    assert partitioner._mesh_axes([list(range(8))], mesh) == ("data", "tp")
    assert partitioner._mesh_axes([[0, 1], [2, 3], [4, 5], [6, 7]], mesh) == ()


def _line(fn, text):
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def make_block(mesh, data):
    def block(x, w1, w2):
        h = jax.nn.silu(jnp.einsum("bsd,df->bsf", x, w1))
        y = jnp.einsum("bsf,fd->bsd", h, w2)                   # row-parallel: all-reduce
        y = lax.with_sharding_constraint(y, NamedSharding(mesh, P(data)))
        s = lax.with_sharding_constraint(y, NamedSharding(mesh, P(data, "tp")))
        return lax.with_sharding_constraint(s * 2.0, NamedSharding(mesh, P(data)))
    return block


@pytest.mark.parametrize("shape,names", [((4,), ("tp",)), ((2, 4), ("data", "tp"))],
                         ids=["tp4", "data2xtp4"])
def test_report_lists_the_partitioners_collectives(shape, names):
    n = int(np.prod(shape))
    mesh = jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names),
                         devices=jax.devices()[:n])
    data = "data" if "data" in names else None
    rng = np.random.RandomState(0)
    x = jax.device_put(rng.randn(2, 8, 64).astype(np.float32), NamedSharding(mesh, P(data)))
    w1 = jax.device_put(rng.randn(64, 256).astype(np.float32), NamedSharding(mesh, P(None, "tp")))
    w2 = jax.device_put(rng.randn(256, 64).astype(np.float32), NamedSharding(mesh, P("tp", None)))
    block = make_block(mesh, data)
    report = fc.rewrite(block, CFG).report(x, w1, w2)
    assert report.compile_seconds > 0
    rows = report.where(path="partitioner")
    islands = [r for r in report if r.path != "partitioner"]
    assert [(r.op, r.action) for r in islands] == [("psum", "quantized"),
                                                   ("all_gather", "quantized")]
    assert all(r.action == "quantized" and "replaced by the rewrite's" in r.reason
               for r in rows)
    reduce = [r for r in rows if r.op == "psum"]
    gather = [r for r in rows if r.op == "all_gather"]
    assert len(reduce) == 1 and reduce[0].axes == ("tp",) and reduce[0].axis_size == 4
    assert reduce[0].primitive == "dot_general"
    line = _line(make_block, "row-parallel")
    assert reduce[0].site.endswith(f"test_partitioner.py:{line} (make_block.<locals>.block)")
    assert reduce[0].bytes_per_rank == 2 * 8 * 64 * 4 // (2 if data else 1)
    # XLA moves the gather past the elementwise multiply: its metadata names the mul's line
    assert len(gather) == 1 and gather[0].axes == ("tp",) and gather[0].primitive in (
        "sharding_constraint", "mul")
    assert gather[0].site.endswith("(make_block.<locals>.block)")
    assert gather[0].shape[1] == 2                                      # 8 positions over 4


def test_no_compile_without_auto_axes():
    mesh = jax.make_mesh((4,), ("tp",), axis_types=(AxisType.Explicit,), devices=jax.devices()[:4])
    with jax.set_mesh(mesh):
        h = jax.device_put(np.ones((8, 256), np.float32), NamedSharding(mesh, P(None, "tp")))
        w = jax.device_put(np.ones((256, 64), np.float32), NamedSharding(mesh, P("tp", None)))
        report = fc.rewrite(lambda h, w: jnp.einsum("sf,fd->sd", h, w, out_sharding=P()),
                            CFG).report(h, w)
    assert report.compile_seconds is None and [r.path for r in report] == ["-"]
