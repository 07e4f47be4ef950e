"""The all-to-alls between processes on one host over shared memory (the exchange,
ffi/cpu/cpu_exchange.h over ffi/cpu/shm_rendezvous.cc): tests/support/_shm_a2a_worker.py as 2
and 3 processes of one device each checks fc.all_to_all p2p == xla bit for bit, the exact
setting == lax.all_to_all, the ragged op (which XLA:CPU cannot run) == NumPy exact and == the
decoded codes at int8; /dev/shm keeps no entry."""

from pathlib import Path

import pytest

from tests.support.shm_job import require_shm, run_scenario

require_shm()

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

WORKER = Path(__file__).resolve().parents[1] / "support" / "_shm_a2a_worker.py"


@pytest.mark.parametrize("nproc", [2, 3])
def test_all_to_alls_over_shared_memory(nproc):
    for out in run_scenario("a2a", nproc, worker=WORKER):
        assert "checked all_to_all and ragged_all_to_all over shared memory" in out, out[-3000:]
