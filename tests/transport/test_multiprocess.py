"""Multi-controller JAX: 2 processes x 2 CPU devices on 127.0.0.1 over gloo. jax_flashcomm.psum
over the cross-process axis and over both axes matches lax.psum (exact: bit-equal; quantized:
within the stored-scale bound), identical on every rank of both processes."""

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from tests.support.ports import free_port
from tests.support.devices import use_worker_xla_flags

pytestmark = pytest.mark.slow  # several python processes over gloo

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "_multiprocess_worker.py"



@pytest.mark.multiprocess
def test_two_processes_gloo_psum_parity():
    nproc = 2
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, str(WORKER), str(port), str(i), str(nproc)],
                                  cwd=tmp, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for i in range(nproc)]
        outputs = []
        try:
            for p in procs:
                out, _ = p.communicate(timeout=180)
                outputs.append(out)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for i, (p, out) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"process {i} failed:\n{out[-3000:]}"
        assert "PASS" in out, out[-3000:]
