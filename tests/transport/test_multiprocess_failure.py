"""A process that dies (or freezes) in the middle of a multi-process quantized psum makes the
others fail within a bounded time, never hang (docs/reliability.md).

2 processes x 2 CPU devices on 127.0.0.1 over gloo, jax.distributed with
heartbeat_timeout_seconds=HEARTBEAT. Process 1 fails 2 s after both finished a first psum,
while process 0 waits inside the second one's all-to-all:

* "exit" (os._exit): its sockets close; gloo reports "Connection closed by peer" and the psum
  raises at once in process 0. Process 0 then exits nonzero: its jax.distributed shutdown
  barrier cannot complete, and the coordination service (in process 0) declares process 1 dead
  after the heartbeat timeout and terminates the process.
* "stop" (SIGSTOP: alive, sockets open, silent): gloo keeps waiting; the coordination service
  misses process 1's heartbeats for HEARTBEAT seconds and terminates process 0 (SIGABRT)
  ("The following tasks are unhealthy (stopped sending heartbeats)").

Either way process 0 is gone within HEARTBEAT + SLACK seconds of process 1's failure. Every
subprocess wait has a hard timeout, and the test kills what it started, so it cannot hang.
"""

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from tests.support.ports import free_port
from tests.support.devices import use_worker_xla_flags

pytestmark = pytest.mark.slow  # processes over gloo, waiting out timeouts

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "_multiprocess_failure_worker.py"
HEARTBEAT = 10  # jax.distributed.initialize(heartbeat_timeout_seconds=...)
SLACK = 15  # seconds: the coordination service's polling and process teardown
HARD_TIMEOUT = 180  # no subprocess of this test outlives this



def _wait_for(path: Path, token: str, deadline: float) -> str:
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        for line in text.splitlines():
            if line.startswith(token):
                return line
        time.sleep(0.05)
    raise AssertionError(f"no {token!r} in {path.name} before the deadline:\n"
                         f"{path.read_text()[-3000:] if path.exists() else ''}")


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["exit", "stop"])
def test_peer_failure_is_detected_within_bound(mode):
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"p{i}.log" for i in range(2)]
        procs = []
        try:
            for i in range(2):
                with open(logs[i], "w") as out:
                    procs.append(subprocess.Popen(
                        [sys.executable, "-u", str(WORKER), str(port), str(i), mode,
                         str(HEARTBEAT)], cwd=tmp, env=env, stdout=out,
                        stderr=subprocess.STDOUT))
            deadline = time.monotonic() + HARD_TIMEOUT
            failing = _wait_for(logs[1], "FAILING", deadline)
            failed_at = float(failing.split()[1])
            rc0 = procs[0].wait(timeout=max(1.0, deadline - time.monotonic()))
            gone_after = time.time() - failed_at
            log0 = logs[0].read_text()
        finally:
            for p in procs:
                if p.poll() is None:
                    if mode == "stop":
                        os.kill(p.pid, signal.SIGCONT)
                    p.kill()
                    p.wait(timeout=30)
    assert "FIRST_OK" in log0, log0[-3000:]
    assert "SECOND_RETURNED" not in log0, "the psum returned without its peer"
    assert rc0 != 0, log0[-3000:]
    assert gone_after <= HEARTBEAT + SLACK, (gone_after, log0[-3000:])
    if mode == "exit":
        raised = [ln for ln in log0.splitlines() if ln.startswith("RAISED")]
        assert raised, log0[-3000:]
        seconds = float(raised[0].split()[1])
        assert seconds <= 2.0 + 5.0, raised[0]  # raised as soon as the peer's sockets closed
        assert "Gloo" in raised[0] and "Connection closed by peer" in raised[0], raised[0]
    else:
        assert "stopped sending heartbeats" in log0, log0[-3000:]
        assert rc0 == -signal.SIGABRT, rc0
    raised = [ln[:160] for ln in log0.splitlines() if ln.startswith("RAISED")]
    print(f"{mode}: process 0 gone {gone_after:.1f} s after process 1 failed (rc {rc0}) {raised}")
