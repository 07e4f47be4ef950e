"""Multi-process JAX over gloo on a rate-limited loopback, inside a private network namespace.

A bandwidth-bound link (what PCIe is to a GPU) on one machine: a network namespace of our own
whose loopback goes through a ``tc tbf`` qdisc, and N python worker processes started in it with
``ip netns exec``, one per CPU device, talking gloo on 127.0.0.1. Needs root, ``ip`` and ``tc``.

Launcher side::

    from benchmarks.shared.netns import run_workers
    results = run_workers("benchmarks.my_bench", 2, args=["--size", "64"], rate="2gbit")
    # results[i] is whatever process i passed to write_result (JSON)

Worker side (``benchmarks/my_bench.py``, which ``run_workers`` runs as the module
``benchmarks.my_bench``)::

    from benchmarks.shared.netns import worker_init, write_result
    process_id, num_processes = worker_init()  # gloo + jax.distributed.initialize
    ...
    write_result({"t": 1.0})

The namespace (and every process started here) is always removed on the way out, also on
errors, timeouts and KeyboardInterrupt. All traffic stays on 127.0.0.1 inside the namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from benchmarks.shared.results import REPO

__all__ = ["rate_limited_netns", "run_workers", "worker_init", "write_result", "available"]

_ENV_PREFIX = "FLASHCOMM_NETNS_"


def available() -> str | None:
    """None if this machine can run ``run_workers``, else the reason it cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def _sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=30)


@contextlib.contextmanager
def rate_limited_netns(rate: str = "2gbit", burst: str = "256kb", latency: str = "100ms",
                       mtu: int | None = None):
    """A fresh network namespace whose loopback is limited by ``tc tbf`` to ``rate`` (and has
    MTU ``mtu`` if given: the bucket must hold one packet, so a small burst needs a small MTU).

    Yields its name (use ``ip netns exec NAME cmd``). Every packet, both directions, passes the
    one qdisc of ``lo``: ``rate`` is the aggregate of all the traffic in the namespace. The
    namespace is deleted on exit, whatever happens inside.
    """
    reason = available()
    if reason:
        raise RuntimeError(f"rate_limited_netns: {reason}")
    name = f"flashcomm-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    _sh("ip", "netns", "add", name)
    try:
        if mtu is not None:
            _sh("ip", "-n", name, "link", "set", "lo", "mtu", str(int(mtu)))
        _sh("ip", "-n", name, "link", "set", "lo", "up")
        _sh("ip", "netns", "exec", name, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
            "rate", rate, "burst", burst, "latency", latency)
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], capture_output=True, timeout=30)


def run_workers(module: str, num_processes: int, *, args=(), rate: str = "2gbit",
                burst: str = "256kb", latency: str = "100ms", timeout: float = 900.0,
                pin_cpus: bool = True, port: int = 23456, env: dict | None = None,
                mtu: int | None = None) -> list:
    """Run ``sys.executable -m module *args`` as ``num_processes`` JAX processes in a
    rate-limited netns (``module``: e.g. ``"benchmarks.llm.ttft.links_worker"``; the workers find it
    through ``PYTHONPATH``, which gets the repository root).

    Each worker finds its coordinates in the environment (read them with :func:`worker_init`)
    and returns a JSON value with :func:`write_result`. With ``pin_cpus`` process i is pinned to
    CPU ``i % os.cpu_count()`` (``taskset``), so the processes do not migrate between cores.
    Returns the results in process order. Raises RuntimeError (with the tail of the failing
    worker's stderr) if a worker fails, or TimeoutError after ``timeout`` seconds; the workers
    are killed and the namespace deleted in either case.
    """
    if num_processes < 1:
        raise ValueError(f"num_processes must be >= 1, got {num_processes}")
    if "/" in module or module.endswith(".py"):
        raise ValueError(f"run_workers takes a module name (benchmarks.x), got {module!r}")
    ncpu = os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="flashcomm-netns-") as tmp, \
            rate_limited_netns(rate, burst, latency, mtu) as ns:
        procs, logs = [], []
        try:
            for i in range(num_processes):
                wenv = dict(os.environ, **(env or {}))
                wenv["PYTHONPATH"] = os.pathsep.join(
                    [str(REPO)] + [p for p in [wenv.get("PYTHONPATH")] if p])
                wenv.update({
                    _ENV_PREFIX + "COORDINATOR": f"127.0.0.1:{port}",
                    _ENV_PREFIX + "NUM_PROCESSES": str(num_processes),
                    _ENV_PREFIX + "PROCESS_ID": str(i),
                    _ENV_PREFIX + "RESULT": os.path.join(tmp, f"result_{i}.json"),
                })
                pin = ["taskset", "-c", str(i % ncpu)] if pin_cpus and shutil.which("taskset") \
                    else []
                log = open(os.path.join(tmp, f"stderr_{i}.txt"), "w+")
                logs.append(log)
                procs.append(subprocess.Popen(
                    ["ip", "netns", "exec", ns, *pin, sys.executable, "-m", module,
                     *map(str, args)],
                    env=wenv, stdout=log, stderr=subprocess.STDOUT))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in procs):
                failed = [i for i, p in enumerate(procs) if p.returncode not in (None, 0)]
                if failed:
                    break  # one died: the others would wait for it forever
                if time.monotonic() > deadline:
                    raise TimeoutError(f"run_workers: {module} did not finish in {timeout} s")
                time.sleep(0.2)
            for i, p in enumerate(procs):
                if p.poll() not in (None, 0):
                    logs[i].seek(0)
                    tail = logs[i].read()[-3000:]
                    raise RuntimeError(f"run_workers: process {i} exited with {p.returncode}:\n"
                                       f"{tail}")
            return [json.loads(Path(tmp, f"result_{i}.json").read_text())
                    for i in range(num_processes)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait(timeout=30)
            for log in logs:
                log.close()


def worker_init(local_device_count: int = 1) -> tuple[int, int]:
    """In a worker: select gloo and join the job. Returns (process_id, num_processes).

    Sets the number of CPU devices of this process (before jax is first imported) and calls
    ``jax.distributed.initialize`` on the coordinator ``run_workers`` chose.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    os.environ["XLA_FLAGS"] = (
        flags + f" --xla_force_host_platform_device_count={local_device_count}").strip()
    import jax

    process_id = int(os.environ[_ENV_PREFIX + "PROCESS_ID"])
    num_processes = int(os.environ[_ENV_PREFIX + "NUM_PROCESSES"])
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(os.environ[_ENV_PREFIX + "COORDINATOR"],
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=120)
    return process_id, num_processes


def write_result(value) -> None:
    """In a worker: hand ``value`` (JSON-serializable) back to ``run_workers``."""
    Path(os.environ[_ENV_PREFIX + "RESULT"]).write_text(json.dumps(value))
