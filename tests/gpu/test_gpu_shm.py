"""The transport between processes on CUDA (ffi/cuda/shm_handlers.cc, shm_ring_handlers.cc:
CUDA IPC memory handles and signal words over the CPU module's shared-memory meeting point),
run on a GPU.

Two and three processes share the one GPU (CUDA IPC works between processes on one device;
NCCL refuses two ranks on one GPU, so XLA's own collectives cannot be the reference here). The
reference is one CPU process with N devices running the same programs with transport="xla":
the codec kernels are bit-identical across CPU and CUDA away from denormals, so every quantized
result must match bit for bit. The exact all-reduce (one shot and two shots) must equal the f32
rank-order sum; the ring matmuls (exact, small integers) must equal numpy's. Each worker checks
that no meeting or ring step is left in progress; every test checks that /dev/shm has no new
entry afterwards. The soak, mismatch and killed-peer scenarios of tests/transport/test_shm.py
run here too, with the processes on the GPU.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.gpu.gpu_support import gpu_devices, no_gpu_reason
from tests.support.ports import free_port
from tests.support.shm_job import check_mismatch, lines, run_killed, run_scenario

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "support" / "_gpu_shm_worker.py"
HARD_TIMEOUT = 240  # seconds, per launch
# The soak took under a minute on an H200; the mismatch scenario, whose good call then still ran
# over XLA's collectives (NCCL, which refuses two ranks on one GPU), hung until 320 s were spent.
GPU_SCENARIO_TIMEOUT = 120



def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    env.pop("XLA_FLAGS", None)
    env.pop("JAX_PLATFORMS", None)
    return env


def _run(args_per_proc: list[list[str]], tmp: Path, env: dict) -> list[str]:
    """Runs the worker once per argument list, at once; returns their outputs (all must pass)."""
    deadline = time.monotonic() + HARD_TIMEOUT
    logs = [tmp / f"log{i}.txt" for i in range(len(args_per_proc))]
    procs = []
    try:
        for args, log in zip(args_per_proc, logs):
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-u", str(WORKER), *args],
                                              cwd=tmp, env=env, stdout=out,
                                              stderr=subprocess.STDOUT))
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    texts = [log.read_text() for log in logs]
    for p, text in zip(procs, texts):
        assert p.returncode == 0 and "PASS" in text, text[-4000:]
    return texts


def _check(nproc: int, mode: str, tmp_path: Path, rings: bool = False):
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    env = _env()
    if rings:
        env["FLASHCOMM_TEST_RINGS"] = "1"
    ref_env = dict(env, JAX_PLATFORMS="cpu")
    _run([["reference", str(nproc), str(tmp_path)]], tmp_path, ref_env)
    port = str(free_port())
    texts = _run([[mode, str(nproc), str(tmp_path), port, str(i)] for i in range(nproc)],
                 tmp_path, env)
    print("\n".join(line for t in texts for line in t.splitlines() if "exact" in line
                    or "mapped" in line or "ring" in line))
    ref = np.load(tmp_path / "reference.npz")
    assert len(ref.files) == 3 * 2 * 4
    for i in range(nproc):
        got = np.load(tmp_path / f"p{i}.npz")
        assert sorted(got.files) == sorted(ref.files)
        for name in ref.files:
            want = ref[name][i:i + 1]
            differ = got[name] != want
            assert not differ.any(), (f"rank {i}, {name}: {int(differ.sum())} of {want.size} "
                                      "values differ from the CPU reference")
    after = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    # cuda.shm.0.<pid>.1: the CUDA driver's file behind a process's IPC events (gone with the
    # events: shm.setup() destroys them at exit)
    assert after <= before, f"left in /dev/shm: {sorted(after - before)}"


@pytest.mark.parametrize("nproc", [2, 3])
def test_shm_transport_on_one_gpu_matches_the_cpu_reference(nproc, tmp_path, cuda_module):
    if not gpu_devices():
        pytest.skip(no_gpu_reason())
    _check(nproc, "gpu", tmp_path)


def test_shm_ring_steps_on_one_gpu(tmp_path, cuda_module):
    """The ring steps between processes (ffi/cuda/shm_ring_handlers.cc) under the ring matmuls,
    exact on small integers; besides the same collectives as above."""
    if not gpu_devices():
        pytest.skip(no_gpu_reason())
    _check(2, "gpu", tmp_path, rings=True)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_launcher_on_cpu_processes(tmp_path):
    """The same launch and comparison with one CPU device per process (the CPU shm transport):
    what this module runs on a GPU stays runnable where there is none."""
    _check(2, "cpu", tmp_path)


def test_shm_soak_1000_calls_on_one_gpu(cuda_module):
    """1000 calls dispatched without reading a result (the signal words' sequence numbers run
    ahead of the GPU), each equal bit for bit to the same call made alone."""
    if not gpu_devices():
        pytest.skip(no_gpu_reason())
    for out in run_scenario("soak", 2, "gpu", GPU_SCENARIO_TIMEOUT):
        (line,) = lines(out, "SOAK")
        print(line)


def test_shm_mismatched_shapes_raise_on_one_gpu(cuda_module):
    if not gpu_devices():
        pytest.skip(no_gpu_reason())
    check_mismatch(run_scenario("mismatch", 2, "gpu", GPU_SCENARIO_TIMEOUT))


@pytest.mark.parametrize("scenario", ["killed", "killed_after_first"])
def test_shm_killed_peer_is_detected_on_one_gpu(scenario, cuda_module):
    """A process that exits before a collective: its peer's call raises within the bound."""
    if not gpu_devices():
        pytest.skip(no_gpu_reason())
    run_killed(scenario, "gpu", GPU_SCENARIO_TIMEOUT)
