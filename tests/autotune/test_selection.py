"""The automatic choice (min_bytes="auto"): it follows a synthetic measured table, falls back to
the cost model where the table is silent, honours pinned options, and shows in the plan."""

import contextlib
import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.planner import _choose as selection
from jax_flashcomm import costs
from jax_flashcomm.costs import _table as tuning
from jax_flashcomm.costs._model import Link
from jax_flashcomm.transport import shm as shm_transport

KIB, MIB = 1024, 1024 * 1024
N = 4


def _rows(op, dtype, times):
    """Measurements of ``op`` at N ranks: ``{candidate: {nbytes: seconds}}``."""
    bits = {"psum": (8, 8), "psum_scatter": (8, None), "all_gather": (None, 8)}[op]
    return [tuning.Measurement(op, "in-process", N, dtype, size, cand,
                               None if cand == "lax" else bits, t)
            for cand, by_size in times.items() for size, t in by_size.items()]


# lax wins below 64 KiB, the quantized xla path from 64 KiB on, the p2p path never
CROSSING = {"lax": {4 * KIB: 10e-6, 64 * KIB: 100e-6, 1 * MIB: 2e-3},
            "quantized/xla": {4 * KIB: 50e-6, 64 * KIB: 60e-6, 1 * MIB: 0.5e-3},
            "quantized/p2p": {4 * KIB: 60e-6, 64 * KIB: 90e-6, 1 * MIB: 0.9e-3}}
TABLE = tuning.Table(key={"synthetic": True}, rows=tuple(
    _rows("psum", "float32", CROSSING) + _rows("all_gather", "float32", CROSSING)))


def _plan(nbytes, config=None, op="psum", table=TABLE):
    mesh = jax.make_mesh((N,), ("i",), devices=jax.devices()[:N],
                         axis_types=(jax.sharding.AxisType.Explicit,))
    config = config or fc.CommConfig()
    m = nbytes // 4
    fns = {"psum": lambda v: fc.psum(v[0], "i", config=config),
           "all_gather_matmul": lambda v: fc.all_gather_matmul(
               v[0].reshape(-1, 8), jnp.ones((8, 8)), "i", config=config)}
    f = jax.jit(jax.shard_map(fns[op], mesh=mesh, in_specs=P("i"), out_specs=P(),
                              check_vma=False))
    with tuning.use_table(table), fc.record() as plans:
        f.lower(jax.ShapeDtypeStruct((N, m), jnp.float32, sharding=NamedSharding(mesh, P("i"))))
    return plans[0]


def test_default_config_is_auto():
    assert fc.CommConfig().min_bytes == "auto" and fc.CommConfig().auto
    assert not fc.CommConfig(min_bytes=0).auto


@pytest.mark.parametrize("nbytes,path,transport", [
    (4 * KIB, "lax", None), (16 * KIB, "lax", None), (64 * KIB, "quantized", "xla"),
    (1 * MIB, "quantized", "xla"), (4 * MIB, "quantized", "xla")])
def test_the_choice_follows_the_table(nbytes, path, transport):
    p = _plan(nbytes)
    assert (p.path, p.transport) == (path, transport), str(p)
    cand = "lax" if path == "lax" else "quantized/xla"
    bits = None if path == "lax" else (8, 8)
    expect = TABLE.seconds("psum", "in-process", N, "float32", cand, bits, nbytes)
    assert p.predicted_s == pytest.approx(expect)
    assert "(table)" in p.reason and "auto:" in str(p)


def test_an_inverted_table_inverts_the_choice():
    swapped = {"lax": CROSSING["quantized/xla"], "quantized/xla": CROSSING["lax"],
               "quantized/p2p": CROSSING["quantized/p2p"]}
    table = tuning.Table(key={}, rows=tuple(_rows("psum", "float32", swapped)))
    assert _plan(4 * KIB, table=table).path == "quantized"
    assert _plan(1 * MIB, table=table).path == "lax"


def test_a_faster_p2p_row_takes_the_p2p_transport():
    fast = {**CROSSING, "quantized/p2p": {k: v / 10 for k, v in CROSSING["lax"].items()}}
    table = tuning.Table(key={}, rows=tuple(_rows("psum", "float32", fast)))
    p = _plan(64 * KIB, table=table)
    assert (p.path, p.transport) == ("quantized", "p2p")
    # transport pinned to xla: the p2p candidate is not considered
    p = _plan(64 * KIB, fc.CommConfig(transport="xla"), table=table)
    assert (p.path, p.transport) == ("quantized", "xla")
    assert "quantized/p2p" not in p.reason


def test_pinned_min_bytes_ignores_the_table():
    p = _plan(4 * KIB, fc.CommConfig(min_bytes=0))
    assert p.path == "quantized" and p.predicted_s is None
    p = _plan(4 * MIB, fc.CommConfig(min_bytes=8 * MIB))
    assert p.path == "lax"


def test_exact_config_never_asks():
    p = _plan(4 * MIB, fc.CommConfig(bits=None))
    assert p.path == "lax" and p.predicted_s is None


def test_quantized_must_be_a_quarter_faster():
    close = {"lax": {64 * KIB: 100e-6}, "quantized/xla": {64 * KIB: 80e-6},
             "quantized/p2p": {64 * KIB: 200e-6}}
    table = tuning.Table(key={}, rows=tuple(_rows("psum", "float32", close)))
    assert _plan(64 * KIB, table=table).path == "lax"          # 20% faster: not enough
    clear = {**close, "quantized/xla": {64 * KIB: 70e-6}}
    table = tuning.Table(key={}, rows=tuple(_rows("psum", "float32", clear)))
    assert _plan(64 * KIB, table=table).path == "quantized"    # 30% faster


def test_a_table_of_other_sizes_falls_back_to_the_cost_model():
    other = tuning.Table(key={}, rows=tuple(
        dataclasses.replace(r, n=2) for r in _rows("psum", "float32", CROSSING)))
    p = _plan(1 * MIB, table=other)
    assert "cost model" in p.reason and "(table)" not in p.reason
    assert p.predicted_s > 0


def test_ring_matmul_weighs_its_all_gather():
    assert _plan(4 * KIB, op="all_gather_matmul").path == "ring"
    p = _plan(1 * MIB, op="all_gather_matmul")
    assert p.path == "quantized ring" and "(table)" in p.reason


def test_table_interpolates_in_log_log():
    t = TABLE.seconds
    args = ("psum", "in-process", N, "float32", "lax", None)
    assert t(*args, 4 * KIB) == pytest.approx(10e-6)
    assert t(*args, 1 * KIB) == pytest.approx(10e-6)             # below: latency-bound
    assert t(*args, 2 * MIB) == pytest.approx(4e-3)              # above: scales with bytes
    assert t(*args, 16 * KIB) == pytest.approx((10e-6 * 100e-6) ** 0.5)   # geometric middle
    assert t("psum", "in-process", 3, "float32", "lax", None, 4 * KIB) is None


def _call(nbytes, layout="processes", n=3):
    return selection.Call("psum", nbytes, 4, "float32", n, "cpu", layout, "other processes",
                          (8, 8), exact_p2p_reason="other processes")


def _choose(call, link):
    with tuning.use_table(None), costs.use_link(link):
        return selection.choose(call)


def test_processes_are_priced_on_the_link_profile():
    slow = Link(5e6, "shared", 1e-3)                  # a PCIe-class emulated link
    fast = Link(1e12, "shared", 1e-4)                 # a link that costs nothing per byte
    assert _choose(_call(297 * KIB), slow).candidate == "quantized/xla"     # a prefill
    assert _choose(_call(2 * KIB), slow).candidate == "lax"                 # a decode step
    assert _choose(_call(297 * KIB), fast).candidate == "lax"
    assert "given link" in _choose(_call(297 * KIB), slow).source
    assert "gloo loopback" in _choose(_call(297 * KIB), None).source


def test_the_choice_is_the_fastest_candidate_considered():
    for size in (1 * KIB, 32 * KIB, 1 * MIB, 16 * MIB):
        c = _choose(_call(size), Link(50e6, "shared", 2e-4))
        times = {name: s for name, s, _ in c.considered if s is not None}
        quantized = min(times["quantized/xla"], times.get("quantized/p2p", float("inf")))
        expect = ("lax" if times["lax"] * selection.EXACT_PREFERENCE <= quantized
                  else "quantized/xla")
        assert c.candidate == expect and c.predicted_s == times[expect]
        assert [name for name, *_ in c.considered] == ["lax", "exact/p2p", "quantized/p2p",
                                                       "quantized/pallas", "quantized/xla"]
        for unavailable in c.considered[1:3]:
            assert unavailable[1] is None and unavailable[2] == "other processes"


@contextlib.contextmanager
def _emulated_bus(bytes_per_s: float):
    """The shared-memory transport's emulated bus at ``bytes_per_s`` inside the block."""
    shm_transport.set_link_rate(bytes_per_s)
    try:
        yield
    finally:
        shm_transport.set_link_rate(0.0)


def test_processes_of_one_host_take_shared_memory():
    """With the shared-memory transport (p2p_reason None between processes), a decode-sized
    psum takes the exact sum over it (exact: no margin) rather than gloo, a prefill over a
    slow emulated bus the codec over it; psum_scatter has no exact p2p path; in one process
    a decode-sized psum takes the exact sum over the in-process rendezvous."""
    slow = Link(5e6, "shared", 1e-3)
    shm = lambda nbytes, op="psum", layout="processes": dataclasses.replace(  # noqa: E731
        _call(nbytes, layout), op=op, p2p_reason=None, exact_p2p_reason=None)
    assert _choose(shm(2 * KIB), None).candidate == "exact/p2p"
    assert _choose(shm(297 * KIB), None).candidate == "exact/p2p"
    with _emulated_bus(5e6):  # the benchmarks pace shared memory at the link's rate
        assert _choose(shm(297 * KIB), slow).candidate == "quantized/p2p"
    # A slow link between the processes (gloo's path) does not slow shared memory down when
    # nothing paces it: a prefill's exact sum takes it (the ttft "unlimited" row once chose
    # lax at 572 ms against exact-shm's 385).
    assert _choose(shm(297 * KIB), slow).candidate == "exact/p2p"
    assert _choose(shm(297 * KIB), Link(295e6, "shared", 4.5e-4)).candidate == "exact/p2p"
    scatter = _choose(shm(2 * KIB, op="psum_scatter"), slow)
    assert dict((n, r) for n, _, r in scatter.considered)["exact/p2p"] == (
        "only psum has an exact p2p path")
    assert _choose(shm(2 * KIB, layout="in-process"), None).candidate == "exact/p2p"
