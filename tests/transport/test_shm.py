"""The p2p transport between processes on one host, over shared memory
(jax_flashcomm/transport/shm.py, ffi/cpu/shm_rendezvous.cc, ffi/cpu/shm_kernels.cc).

Each test launches tests/support/_shm_worker.py as N processes of one device each
(jax.distributed on 127.0.0.1, gloo for XLA's own collectives):

* parity (N = 2, 3, 4): psum / psum_scatter / all_gather and their gradients, f32 and bf16,
  bits=8 and rs_bits=4/ag_bits=8, with transport="p2p" bit-identical to transport="xla";
  the exact all-reduce (one shot == two shots == the f32 rank-order sum; == lax.psum for N=2);
* soak: 1000 calls dispatched without reading a result in between, each checked bitwise;
* mismatch: ranks passing different shapes at one call site all raise; the next call works;
* killed: a process that exits right before its first collective (and, separately, right before
  its second) makes the survivors raise within a bound instead of waiting out
  p2p_timeout_ms=60000.

Every subprocess wait has a hard timeout and the test kills whatever it started. The transport's
segments are memfds (no name in /dev/shm): every test checks that /dev/shm has no new entry
after its processes are gone.
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if not sys.platform.startswith("linux"):
    pytest.skip("the shared-memory transport maps memfds through /proc (Linux)",
                allow_module_level=True)

from jax_flashcomm.codec import kernels  # noqa: E402
from tests.support.ports import free_port  # noqa: E402

if "flashcomm_shm_psum" not in kernels.registered("cpu"):
    pytest.skip("the CPU kernel module lacks the shared-memory handlers",
                allow_module_level=True)

pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]  # several python processes

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "_shm_worker.py"
HARD_TIMEOUT = 240  # seconds: no subprocess of this module outlives this
KILL_BOUND = 15.0  # seconds: survivors of a killed peer raise within this (the worker's BOUND_S)



def _dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class _Job:
    """``nproc`` worker processes of one scenario, their output in log files; every wait has a
    deadline, and :meth:`close` kills what is still running."""

    def __init__(self, scenario: str, nproc: int, tmp: str):
        port = free_port()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")]
                                                           if p])
        env.pop("XLA_FLAGS", None)  # conftest's 8 devices must not leak into the workers
        self.deadline = time.monotonic() + HARD_TIMEOUT
        self.logs = [Path(tmp) / f"p{i}.log" for i in range(nproc)]
        self.procs = []
        for i in range(nproc):
            with open(self.logs[i], "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-u", str(WORKER), str(port), str(i), str(nproc), scenario],
                    cwd=tmp, env=env, stdout=out, stderr=subprocess.STDOUT))

    def text(self, i: int) -> str:
        return self.logs[i].read_text() if self.logs[i].exists() else ""

    def wait(self, i: int, until: float | None = None) -> int | None:
        """Process i's exit status, or None if it is still running at ``until``."""
        until = self.deadline if until is None else min(until, self.deadline)
        try:
            return self.procs[i].wait(timeout=max(0.1, until - time.monotonic()))
        except subprocess.TimeoutExpired:
            return None

    def wait_for_line(self, i: int, token: str) -> str:
        while time.monotonic() < self.deadline:
            for line in self.text(i).splitlines():
                if line.startswith(token):
                    return line
            if self.procs[i].poll() is not None and token not in self.text(i):
                raise AssertionError(f"process {i} exited ({self.procs[i].returncode}) "
                                     f"without {token!r}:\n{self.text(i)[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no {token!r} from process {i} before the deadline:\n"
                             f"{self.text(i)[-3000:]}")

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)


def _run(scenario: str, nproc: int) -> list[str]:
    """Runs the scenario to its end; asserts every process exited 0 with PASS and that
    /dev/shm has no new entry; returns the outputs."""
    before = _dev_shm()
    with tempfile.TemporaryDirectory() as tmp:
        job = _Job(scenario, nproc, tmp)
        try:
            codes = [job.wait(i) for i in range(nproc)]
            outs = [job.text(i) for i in range(nproc)]
        finally:
            job.close()
    for i, (rc, out) in enumerate(zip(codes, outs)):
        assert rc is not None, f"process {i} ran past {HARD_TIMEOUT} s:\n{out[-3000:]}"
        assert rc == 0, f"process {i} failed ({rc}):\n{out[-3000:]}"
        assert "PASS" in out.splitlines(), out[-3000:]
    left = _dev_shm() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"
    return outs


def _lines(out: str, token: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(token)]


@pytest.mark.parametrize("nproc", [2, 3, 4])
def test_parity_with_xla_transport_and_exact_sum(nproc):
    outs = _run("parity", nproc)
    for out in outs:
        # 4 (dtype, bits) combos x 11 results (ops and gradients) + 4 exact operands x 3 checks
        assert "] checked 56 segments " in out, out[-3000:]
        if nproc == 2:
            assert out.count("lax.psum equal: True") == 4, out[-3000:]


def test_soak_1000_calls_without_reading():
    outs = _run("soak", 2)
    for out in outs:
        (line,) = _lines(out, "SOAK")
        print(line)


def test_mismatched_shapes_raise_everywhere_then_recover():
    outs = _run("mismatch", 2)
    for i, out in enumerate(outs):
        raised = _lines(out, "RAISED")
        assert len(raised) == 1, out[-3000:]
        assert "different shapes or options" in raised[0] or "timed out" in raised[0], raised
        assert float(raised[0].split()[1]) < 5.0 + 5.0, raised  # within p2p_timeout_ms
        print(f"process {i}: {raised[0][:200]}")


@pytest.mark.parametrize("scenario", ["killed", "killed_after_first"])
def test_killed_peer_is_detected_within_bound(scenario):
    """The last process os._exit(3)s right before its first (killed) or second
    (killed_after_first) collective; the other's psum, with p2p_timeout_ms=60000, must raise
    within KILL_BOUND seconds ("exited" / "timed out") rather than wait out the timeout."""
    nproc = 2
    before = _dev_shm()
    with tempfile.TemporaryDirectory() as tmp:
        job = _Job(scenario, nproc, tmp)
        try:
            for i in range(nproc):
                job.wait_for_line(i, "READY")
            ready_at = time.monotonic()
            codes = [job.wait(i, until=ready_at + KILL_BOUND + 10.0) for i in range(nproc)]
            waited = time.monotonic() - ready_at
            outs = [job.text(i) for i in range(nproc)]
        finally:
            job.close()
    assert codes[-1] == 3, f"the killed process: {codes[-1]}\n{outs[-1][-3000:]}"
    for i in range(nproc - 1):
        out = outs[i]
        raised = _lines(out, "RAISED")
        assert raised, (f"process {i} did not raise within {waited:.1f} s of READY (its peer "
                        f"exits 0.5 s later; p2p_timeout_ms=60000):\n{out[-3000:]}")
        seconds = float(raised[0].split()[1])
        assert seconds <= KILL_BOUND, raised[0]
        assert "exited" in raised[0] or "timed out" in raised[0], raised[0]
        assert codes[i] == 0 and "PASS" in out.splitlines(), out[-3000:]
        print(f"{scenario}: process {i} {raised[0][:200]}")
    left = _dev_shm() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"
