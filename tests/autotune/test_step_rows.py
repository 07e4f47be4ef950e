"""Step-scoped tuning rows (jax_flashcomm.tune): the choice ranks the candidates measured
inside a model's step by those times, for calls of exactly that kind, with a 3% preference for
exact; measure_in_step counts the step's calls, interleaves the candidates and pins each one."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.planner import _choose as selection
from jax_flashcomm.tune import _steps as tune_step
from jax_flashcomm.costs import _table as tuning
from jax_flashcomm.codec import kernels

N, NBYTES = 3, 2304  # a decode step's block all-reduce of SmolLM2 at TP=3 (576 f32 values)


def _call(nbytes=NBYTES, bits=(8, 8), p2p_reason="not measured here"):
    return selection.Call(op="psum", nbytes=nbytes, itemsize=4, dtype="float32", n=N,
                          platform="cpu", layout="in-process", p2p_reason=p2p_reason,
                          bits=bits)


def _table(step_times, call_times=None):
    """Call rows (default: quantized 2x faster than lax at every size) and step rows."""
    call_times = call_times or {"lax": 2e-3, "quantized/xla": 1e-3}
    rows = [tuning.Measurement("psum", "in-process", N, "float32", size, cand,
                               None if cand == "lax" else (8, 8), t)
            for cand, t in call_times.items() for size in (1024, 65536)]
    rows += [tuning.Measurement("psum", "in-process", N, "float32", NBYTES, cand,
                                None if cand == "lax" else (8, 8), t, scope="step")
             for cand, t in step_times.items()]
    return tuning.Table(key={"synthetic": True}, rows=tuple(rows))


@pytest.mark.parametrize("quantized_s,expected", [
    (5.0e-3, "lax"),              # the step is slower quantized: the call rows' 2x is ignored
    (0.985 * 5e-3, "lax"),        # 1.5% faster: under the 3% preference for exact
    (0.95 * 5e-3, "quantized/xla")])  # 5% faster: taken
def test_step_rows_decide_calls_of_their_kind(quantized_s, expected):
    table = _table({"lax": 5e-3, "quantized/xla": quantized_s})
    choice = selection.choose(_call(), table)
    assert choice.candidate == expected
    assert choice.source == "table, in the step"
    assert choice.predicted_s == pytest.approx(5e-3 if expected == "lax" else quantized_s)


def test_step_rows_leave_other_sizes_to_the_call_rows():
    table = _table({"lax": 1e-3, "quantized/xla": 5e-3})
    choice = selection.choose(_call(nbytes=4096), table)
    assert (choice.candidate, choice.source) == ("quantized/xla", "table")


def test_step_rows_never_interpolate_and_are_not_call_times():
    table = _table({"lax": 1e-3, "quantized/xla": 5e-3})
    # the call rows at 1 KiB and 64 KiB: interpolated at NBYTES, whatever the step rows say
    assert table.seconds("psum", "in-process", N, "float32", "lax", None, NBYTES) == \
        pytest.approx(2e-3)
    assert table.step_seconds("psum", "in-process", N, "float32", NBYTES + 4) == {}


def test_candidates_missing_from_the_step_are_not_weighed():
    # quantized/p2p can take the call but was not measured in the step: only lax and xla rank
    table = _table({"lax": 5e-3, "quantized/xla": 4e-3},
                   {"lax": 2e-3, "quantized/xla": 1e-3, "quantized/p2p": 1e-6})
    choice = selection.choose(_call(p2p_reason=None), table)
    assert choice.candidate == "quantized/xla"
    p2p = dict((name, (s, why)) for name, s, why in choice.considered)["quantized/p2p"]
    assert p2p[0] is None and "not measured in the step" in p2p[1]


def test_step_rows_of_unavailable_candidates_fall_back_to_the_call_rows():
    # the exact config (bits=None) can take only lax; the step rows name only the quantized path
    table = _table({"quantized/xla": 1e-3})
    choice = selection.choose(_call(bits=None), table)
    assert (choice.candidate, choice.source) == ("lax", "table")


def test_step_scope_survives_the_json_round_trip(tmp_path):
    table = _table({"lax": 5e-3, "quantized/xla": 4e-3})
    data = table.to_json()
    again = tuning.Table.from_json(data)
    assert again.rows == table.rows
    # rows written before the scope existed are call rows
    old = {**data, "rows": [{k: v for k, v in r.items() if k != "scope"} for r in data["rows"]]}
    assert {r.scope for r in tuning.Table.from_json(old).rows} == {"call"}
    bad = {**data, "rows": [{**data["rows"][0], "scope": "program"}]}
    with pytest.raises(ValueError, match="scope must be one of"):
        tuning.Table.from_json(bad)


def test_candidate_configs_pin_each_path():
    cfg = fc.CommConfig(bits=8)
    assert tune_step.candidate_config("lax", cfg).exact
    assert tune_step.candidate_config("lax", cfg).transport == "xla"
    assert tune_step.candidate_config("exact/p2p", cfg).transport == "p2p"
    q = tune_step.candidate_config("quantized/xla", cfg)
    assert (q.bits, q.min_bytes, q.transport) == (8, 0, "xla")
    with pytest.raises(ValueError, match="unknown candidate"):
        tune_step.candidate_config("nccl", cfg)
    with pytest.raises(ValueError, match="needs a quantized config"):
        tune_step.candidate_config("quantized/xla", fc.CommConfig(bits=None))


def _mesh():
    return jax.make_mesh((N,), ("i",), devices=jax.devices()[:N],
                         axis_types=(jax.sharding.AxisType.Explicit,))


def _make_step(times, built, sizes=(576, 576, 1152)):
    """A step of three psums (two of NBYTES) built for real; its runner returns the step time
    ``times[config.exact]``, so that the rows are known."""
    mesh = _mesh()

    def make_step(config):
        def body(v):
            for m in sizes:
                v = v + fc.psum(jnp.resize(v, (m,)), "i", config=config)[: v.shape[0]] * 0.0
            return v
        f = jax.jit(jax.shard_map(lambda v: body(v[0])[None], mesh=mesh, in_specs=P("i"),
                                  out_specs=P("i")))
        x = jax.device_put(jnp.ones((N, 576), jnp.float32), NamedSharding(mesh, P("i")))
        with fc.record() as plans:  # what the built step runs (traced by its first call)
            jax.block_until_ready(f(x))
        built.append((config, [(p.path, p.transport) for p in plans]))
        return lambda: [times[config.exact]]
    return make_step


def test_measure_in_step_counts_the_calls_and_pins_each_candidate():
    built = []
    # step seconds by candidate (keyed by exactness): lax 6 ms, quantized 3 ms
    rows = tune_step.measure_in_step(_make_step({True: 6e-3, False: 3e-3}, built), "psum",
                                     fc.CommConfig(bits=8), nbytes=NBYTES, n=N,
                                     dtype="float32", rounds=2)
    assert [(r.candidate, r.bits, r.scope) for r in rows] == [
        ("lax", None, "step"), ("quantized/xla", (8, 8), "step")]
    assert [r.seconds for r in rows] == pytest.approx([6e-3, 3e-3])  # the steps' medians
    assert [paths for _, paths in built] == [
        [("lax", None)] * 3, [("quantized", "xla")] * 3]
    table = tuning.Table(key={"synthetic": True}, rows=tuple(rows))
    assert selection.choose(_call(), table).candidate == "quantized/xla"


def test_measure_in_step_refuses_a_step_without_the_call():
    with pytest.raises(ValueError, match="makes no psum of 4096 B"):
        tune_step.measure_in_step(_make_step({True: 1.0, False: 1.0}, []), "psum",
                                  fc.CommConfig(bits=8), nbytes=4096, n=N, dtype="float32")
    with pytest.raises(ValueError, match="op must be one of"):
        tune_step.measure_in_step(lambda c: None, "ppermute", fc.CommConfig(), nbytes=4, n=N,
                                  dtype="float32")


@pytest.mark.skipif(not kernels.available("cpu"), reason="the CPU kernels are not built")
def test_measure_in_step_times_a_real_step():
    mesh = _mesh()

    def make_step(config):
        f = jax.jit(jax.shard_map(lambda v: fc.psum(v, "i", config=config), mesh=mesh,
                                  in_specs=P("i"), out_specs=P()))
        x = jax.device_put(jnp.ones((N * 576,), jnp.float32), NamedSharding(mesh, P("i")))
        jax.block_until_ready(f(x))

        def run():
            import time
            t = time.perf_counter()
            jax.block_until_ready(f(x))
            return [time.perf_counter() - t]
        return run

    rows = tune_step.measure_in_step(make_step, "psum", fc.CommConfig(bits=8), nbytes=NBYTES,
                                     n=N, dtype="float32",
                                     candidates=("lax", "quantized/xla", "quantized/p2p"))
    assert [r.candidate for r in rows] == ["lax", "quantized/xla", "quantized/p2p"]
    assert all(0 < r.seconds < 10 for r in rows)
    chosen = selection.choose(dataclasses.replace(_call(), p2p_reason=None),
                              tuning.Table(key={}, rows=tuple(rows)))
    fastest = min(rows, key=lambda r: r.seconds * (selection.STEP_EXACT_PREFERENCE
                                                   if r.bits is None else 1.0))
    assert chosen.candidate == fastest.candidate
