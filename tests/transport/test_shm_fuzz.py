"""Calls between processes pair by what they are, not by the order they were traced in
(jax_flashcomm/transport/identity.py, ffi/cpu/shm_rendezvous.cc): processes that trace the same
programs in different orders, or after a trace that failed, get the right numbers; processes
that run different programs all raise, naming the call each side is at.

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
        assert counts["agreeing cases"] + counts["disagreements raised"] == cases, line
        totals.append(counts)
    # every process saw the same cases agree and the same ones raise
    assert len({(c["agreeing cases"], c["disagreements raised"]) for c in totals}) == 1, totals
    print(f"{nproc} processes: {totals[0]}")
