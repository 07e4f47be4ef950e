"""Launches tests/support/_shm_worker.py as N processes of one device each (the transport
between processes over shared memory): tests/transport/test_shm.py on CPU devices,
tests/gpu/test_gpu_shm.py with the processes sharing one GPU."""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.support.devices import use_worker_xla_flags
from tests.support.ports import free_port

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "_shm_worker.py"
HARD_TIMEOUT = 240  # seconds: no worker outlives this
KILL_BOUND = 15.0  # seconds: survivors of a killed peer raise within this (the worker's BOUND_S)


def require_shm() -> None:
    """Skip the calling test module where the shared-memory transport cannot run (not Linux,
    or a CPU module built without it)."""
    import pytest

    if not sys.platform.startswith("linux"):
        pytest.skip("the shared-memory transport maps memfds through /proc (Linux)",
                    allow_module_level=True)
    from jax_flashcomm.codec import kernels

    if "flashcomm_shm_psum" not in kernels.registered("cpu"):
        pytest.skip("the CPU kernel module lacks the shared-memory handlers",
                    allow_module_level=True)


def dev_shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


class ShmJob:
    """``nproc`` worker processes of one scenario, their output in log files; every wait has a
    deadline, and :meth:`close` kills what is still running."""

    def __init__(self, scenario: str, nproc: int, tmp: str, platform: str = "cpu",
                 hard_timeout: float = HARD_TIMEOUT, worker: Path = WORKER,
                 extra_env: dict | None = None):
        port = free_port()
        env = dict(os.environ)
        env["FLASHCOMM_TEST_PLATFORM"] = platform
        env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")]
                                                           if p])
        use_worker_xla_flags(env)  # conftest's compile level, not its 8 devices
        env.update(extra_env or {})
        flags = env.get("XLA_FLAGS")
        if platform == "gpu":
            # XLA shares GPU autotuning between the processes of a job, keyed by the program:
            # processes compiling different programs (the mismatch scenario) wait on each
            # other in compilation forever (seen on an H200 with jax 0.11.2).
            env["XLA_FLAGS"] = " ".join(
                [*(flags.split() if flags else []), "--xla_gpu_shard_autotuning=false"])
        self.deadline = time.monotonic() + hard_timeout
        self.logs = [Path(tmp) / f"p{i}.log" for i in range(nproc)]
        self.procs = []
        for i in range(nproc):
            with open(self.logs[i], "w") as out:
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-u", str(worker), str(port), str(i), str(nproc), scenario],
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


def lines(out: str, token: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(token)]


def run_scenario(scenario: str, nproc: int, platform: str = "cpu",
                 hard_timeout: float = HARD_TIMEOUT, worker: Path = WORKER,
                 extra_env: dict | None = None) -> list[str]:
    """Runs the scenario to its end; asserts every process exited 0 with PASS and that
    /dev/shm has no new entry; returns the outputs."""
    before = dev_shm()
    with tempfile.TemporaryDirectory() as tmp:
        job = ShmJob(scenario, nproc, tmp, platform, hard_timeout, worker, extra_env)
        try:
            codes = [job.wait(i) for i in range(nproc)]
            outs = [job.text(i) for i in range(nproc)]
        finally:
            job.close()
    for i, (rc, out) in enumerate(zip(codes, outs)):
        assert rc is not None, f"process {i} ran past {hard_timeout} s:\n{out[-3000:]}"
        assert rc == 0, f"process {i} failed ({rc}):\n{out[-3000:]}"
        assert "PASS" in out.splitlines(), out[-3000:]
    left = dev_shm() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"
    return outs


def check_mismatch(outs: list[str]):
    """Every process of ``mismatch`` raised once, with the reason, within p2p_timeout_ms."""
    for i, out in enumerate(outs):
        raised = lines(out, "RAISED")
        assert len(raised) == 1, out[-3000:]
        assert "different shapes or options" in raised[0] or "timed out" in raised[0], raised
        assert float(raised[0].split()[1]) < 5.0 + 5.0, raised  # within p2p_timeout_ms
        print(f"process {i}: {raised[0][:200]}")


def run_killed(scenario: str, platform: str = "cpu", hard_timeout: float = HARD_TIMEOUT):
    """``killed`` / ``killed_after_first`` with 2 processes: the killed one exits 3, the other
    raises within KILL_BOUND seconds ("exited" / "timed out") and exits 0 with PASS; /dev/shm
    has no new entry."""
    nproc = 2
    before = dev_shm()
    with tempfile.TemporaryDirectory() as tmp:
        job = ShmJob(scenario, nproc, tmp, platform, hard_timeout)
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
        raised = lines(out, "RAISED")
        assert raised, (f"process {i} did not raise within {waited:.1f} s of READY (its peer "
                        f"exits 0.5 s later; p2p_timeout_ms=60000):\n{out[-3000:]}")
        seconds = float(raised[0].split()[1])
        assert seconds <= KILL_BOUND, raised[0]
        assert "exited" in raised[0] or "timed out" in raised[0], raised[0]
        assert "/proc/" not in raised[0], raised[0]  # the exit named, not its vanished fds
        assert codes[i] == 0 and "PASS" in out.splitlines(), out[-3000:]
        print(f"{scenario}: process {i} {raised[0][:200]}")
    left = dev_shm() - before
    assert not left, f"left in /dev/shm: {sorted(left)}"
