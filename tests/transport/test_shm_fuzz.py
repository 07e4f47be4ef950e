"""Calls between processes pair by what they are, not by the order they were traced in
(jax_flashcomm/transport/identity.py, ffi/cpu/shm_rendezvous.cc): processes that trace the same
programs in different orders, or after a trace that failed, get the right numbers; when
processes run different programs some raise, naming the call each side is at, and any that
returns (all its calls met matching ones) has the right numbers.

The workers are tests/support/_shm_fuzz_worker.py (one CPU device each, jax.distributed).
FLASHCOMM_FUZZ_CASES_PER_JOB (default 2:80,3:70,4:50, 200 cases in all) sets the cases per
process count; the long run is FLASHCOMM_FUZZ_CASES_PER_JOB=2:2000,3:1800,4:1200.
"""

import os
from pathlib import Path

import pytest

from tests.support.shm_job import require_shm, run_scenario

require_shm()

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).resolve().parents[1] / "support" / "_shm_fuzz_worker.py"
JOBS = dict(tuple(int(v) for v in item.split(":")) for item in
            os.environ.get("FLASHCOMM_FUZZ_CASES_PER_JOB", "2:80,3:70,4:50").split(","))


@pytest.mark.parametrize("nproc", [2, 3])
def test_trace_orders_and_a_failed_trace_pair_the_right_calls(nproc):
    outs = run_scenario("-1", nproc, worker=WORKER)
    for out in outs:
        (line,) = [ln for ln in out.splitlines() if "] ORDERS " in ln]
        assert "every result right" in line, out[-3000:]
    for out in outs[:-1]:
        assert "] NEVER_JOINED " in out, out[-3000:]


@pytest.mark.parametrize("nproc", sorted(JOBS))
def test_protocol_fuzzer_never_gives_a_wrong_number(nproc):
    cases = JOBS[nproc]
    outs = run_scenario(str(nproc), nproc, worker=WORKER,
                        extra_env={"FLASHCOMM_FUZZ_CASES": str(cases)},
                        hard_timeout=max(240, 3 * cases))
    totals = []
    for out in outs:
        (line,) = [ln for ln in out.splitlines() if "] FUZZ " in ln]
        counts = dict((k.strip(), int(v)) for k, v in
                      (item.rsplit(" ", 1) for item in line.split("] FUZZ ")[1].split(", ")))
        assert counts["agreeing cases"] + counts["disagreements raised"] + counts[
            "disagreements returned right"] == cases, line
        totals.append(counts)
    # every process saw the same cases agree; in every disagreeing case some process raised
    assert len({c["agreeing cases"] for c in totals}) == 1, totals
    disagreeing = [{ln.split("CASE ")[1].split()[0] for ln in out.splitlines()
                    if "] CASE " in ln and " disagreement " in ln} for out in outs]
    raised = set().union(*({ln.split("CASE ")[1].split()[0] for ln in out.splitlines()
                            if "] CASE " in ln and " disagreement raised " in ln}
                           for out in outs))
    assert len({frozenset(d) for d in disagreeing}) == 1 and disagreeing[0] <= raised, (
        sorted(disagreeing[0] - raised))
    print(f"{nproc} processes: {totals[0]}")
