"""The sequence-parallel layout under the automatic choice:
``TPComm("auto", layout="sequence_parallel")`` (its options and errors, the ``overlap+auto``
setting and ``--comm auto+overlap``), its ring matmuls choosing per call from a synthetic table, and ``tune_step.measure_steps``, which times a
step's variants side by side (benchmarks/llm/ttft/links.py picks auto's layout per link with it)."""

import argparse

import pytest

import jax_flashcomm as fc
from jax_flashcomm.planner import _plan as planner
from jax_flashcomm.tune import _steps as tune_step
from jax_flashcomm.costs import _table as tuning
from jax_flashcomm.config import COMM_KINDS
from jax_flashcomm.nn import TPComm
from models import cli

N = 3


def test_auto_overlap_is_a_kind_that_quantizes_in_the_sequence_parallel_layout():
    assert "auto+overlap" in COMM_KINDS
    comm = TPComm("auto", layout="sequence_parallel", bits=4)
    assert comm.quantized and comm.overlap and comm.config.auto
    assert comm.config.phase1_bits == 4
    assert not TPComm("auto").overlap
    with pytest.raises(ValueError, match="quantization='auto' chooses per call.*"
                                         "quantization='quantized'"):
        TPComm("auto", layout="sequence_parallel", min_bytes=0)
    with pytest.raises(ValueError, match="quantizes; its config has bits=None"):
        TPComm("auto", layout="sequence_parallel", config=fc.CommConfig(bits=None))


@pytest.mark.parametrize("name,kind,bits", [("auto", "auto", 8), ("auto4", "auto", 4),
                                            ("overlap+auto", "auto+overlap", 8),
                                            ("overlap+auto6", "auto+overlap", 6)])
def test_settings_name_both_layouts(name, kind, bits):
    label, comm = cli.parse_setting(name)
    assert (label, comm.kind, comm.config.phase1_bits) == (name, kind, bits)
    assert comm.config.auto


@pytest.mark.parametrize("name", ["overlap+autox", "auto+overlap", "overlap+overlap+auto"])
def test_unknown_auto_settings(name):
    with pytest.raises(ValueError, match="unknown setting"):
        cli.parse_setting(name)


def test_comm_flag_takes_auto_overlap(capsys):
    parser = argparse.ArgumentParser()
    cli.add_common(parser)
    args = parser.parse_args(["--comm", "auto+overlap", "--bits", "4"])
    cli.check_comm(parser, args)
    comm = cli.comm_from_args(args)
    assert (comm.kind, comm.config.phase1_bits) == ("auto+overlap", 4)
    assert cli.describe(args).startswith("auto+overlap (per call: exact or int4/int4")
    args = parser.parse_args(["--comm", "auto+overlap", "--min-bytes", "0"])
    with pytest.raises(SystemExit):
        cli.check_comm(parser, args)
    assert "pins the size policy" in capsys.readouterr().err


def _ring_table(ag_quantized_s, rs_quantized_s, nbytes=(1024, 1 << 20)):
    """Call rows of the ring matmuls' collectives (in one process, N ranks): lax at 1 ms, the
    quantized candidate at the given seconds."""
    config = fc.CommConfig()
    rows = []
    for op, quantized_s in (("all_gather", ag_quantized_s), ("psum_scatter", rs_quantized_s)):
        for size in nbytes:
            rows.append(tuning.Measurement(op, "in-process", N, "float32", size, "lax", None,
                                           1e-3))
            rows.append(tuning.Measurement(op, "in-process", N, "float32", size,
                                           "quantized/xla", planner.choice_bits(op, config),
                                           quantized_s))
    return tuning.Table(key={"synthetic": True}, rows=tuple(rows))


@pytest.mark.parametrize("ag_s,rs_s,expected", [
    (1e-4, 5e-3, {"all_gather_matmul": "quantized ring", "matmul_reduce_scatter": "ring"}),
    (5e-3, 1e-4, {"all_gather_matmul": "ring", "matmul_reduce_scatter": "matmul, quantized"}),
])
def test_ring_matmuls_follow_the_table(ag_s, rs_s, expected):
    config = fc.CommConfig(transport="xla")
    got = {}
    with tuning.use_table(_ring_table(ag_s, rs_s)):
        for op, shape in (("all_gather_matmul", (1, 11, 64)),
                          ("matmul_reduce_scatter", (1, 33, 64))):
            got[op] = planner.plan(op, ("tp",), shape, "float32", N, config,
                                   record=False).path
    assert got == expected


def test_measure_steps_interleaves_and_takes_medians():
    calls = []

    def step(name, times):
        it = iter(times)

        def run():
            calls.append(name)
            return [next(it)]
        return run

    got = tune_step.measure_steps({"a": step("a", [3.0, 1.0, 2.0]),
                                   "b": step("b", [5.0, 4.0, 9.0])}, rounds=3)
    assert got == {"a": 2.0, "b": 5.0}
    assert calls == ["a", "b", "b", "a", "a", "b"]   # the order rotated round by round


def test_measure_steps_errors():
    with pytest.raises(ValueError, match="rounds >= 1"):
        tune_step.measure_steps({}, rounds=3)
    with pytest.raises(ValueError, match="rounds >= 1"):
        tune_step.measure_steps({"a": lambda: [1.0]}, rounds=0)
    with pytest.raises(ValueError, match="b returned no step time"):
        tune_step.measure_steps({"a": lambda: [1.0], "b": lambda: []}, rounds=2)
