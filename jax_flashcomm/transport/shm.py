"""The p2p transport between processes on one host: its setup and whether it can run.

When every device of a job is its own process (``jax.distributed``, one device per process:
the launch style of SLURM and Kubernetes jobs with one process per GPU, and of CPU
tensor-parallel inference across sockets) and the processes share a host, the ``p2p`` transport
reads its peers' buffers through shared memory (ffi/cpu/shm_handlers.cc,
ffi/cpu/shm_rendezvous.h): each process owns a block (a memfd: no name in
``/dev/shm``, only the job's user can open it through ``/proc/<pid>/fd``, gone with the last
process that maps it), and publishes the regions a call shares in segments of its own that its
peers map. On CUDA GPUs (one per process) the same meeting point carries CUDA IPC handles of
device buffers and events instead (ffi/cuda/shm_handlers.cc; docs/cuda.md).
:func:`setup` exchanges the blocks' addresses once through ``jax.distributed``'s
key-value store; every process publishes its own readiness there too, so that all of them
decide alike (a transport that one process takes and another does not would pair different
programs). Across hosts, or with several devices per process, the transport is unavailable and
``transport="auto"`` keeps XLA's collectives.
"""

from __future__ import annotations

import json
import os
import socket
import threading

import jax

from jax_flashcomm import jax_compat
from jax_flashcomm.codec import kernels
from jax_flashcomm.jax_compat import kernel_platform_name

__all__ = ["TARGETS", "setup", "unsupported_reason", "meetings_in_progress", "segments",
           "set_link_rate", "link_rate", "name_site"]

#: The FFI targets of the transport between processes (the CPU module registers them, and the
#: CUDA module its CUDA IPC version: ffi/cuda/shm_handlers.cc).
TARGETS = ("flashcomm_shm_all_reduce", "flashcomm_shm_reduce_scatter", "flashcomm_shm_all_gather",
           "flashcomm_shm_psum")

_KEY = "jax_flashcomm/shm/v1/process/{}"
_SETUP_TIMEOUT_MS = 120_000
_lock = threading.Lock()
_decided: dict[str, str | None] = {}
_named: dict[int, str] = {}  # site -> description, published in this process's block


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _local_reason() -> str | None:
    """Why this process alone cannot take part (None: it can)."""
    if not os.path.isdir("/proc/self/fd"):
        return "no /proc (the shared-memory transport maps its peers' memfds through it)"
    platform = kernel_platform_name()
    if platform is None:
        return (f"platform {jax.default_backend()!r} (the shared-memory transport runs on CPU "
                "and on CUDA GPUs)")
    if not set(TARGETS) <= kernels.registered("cpu"):
        return "the CPU kernel module lacks the shared-memory meeting point"
    if platform == "cuda" and not set(TARGETS) <= kernels.registered("cuda"):
        return "the CUDA kernel module lacks the shared-memory handlers (FLASHCOMM_CUDA=ON)"
    if jax.local_device_count() != 1:
        return (f"{jax.local_device_count()} devices in one process (the shared-memory "
                "transport takes one device per process)")
    return None


def setup() -> str | None:
    """Sets the transport up in this process (once; every process of the job must call it).

    Returns:
      None when the transport runs here, else a sentence saying why not (every process of the
      job gets the same answer).
    """
    if jax.process_count() == 1:
        return "one process (the in-process p2p transport serves it)"
    with _lock:
        if "answer" not in _decided:
            _decided["answer"] = _exchange()
        return _decided["answer"]


def _exchange() -> str | None:
    client = jax_compat.distributed_client()
    if client is None:
        return "jax.distributed is not initialized"
    me = jax.process_index()
    reason = _local_reason()
    entry = {"host": socket.gethostname(), "boot": _boot_id(), "uid": os.getuid(),
             "reason": reason, "pid": 0, "fd": -1}
    if reason is None:
        try:
            entry["pid"], entry["fd"] = kernels.cpu_module().shm_create_block(me)
        except RuntimeError as e:
            entry["reason"] = reason = str(e)
        else:
            for site, text in list(_named.items()):  # sites traced before the setup
                kernels.cpu_module().shm_name_site(site, text)
    client.key_value_set(_KEY.format(me), json.dumps(entry))
    if reason is not None:  # the others read it and decide alike; no need to wait for them
        return f"process {me}: {reason}"
    peers = []
    for j in range(jax.process_count()):
        text = _get(client, _KEY.format(j))
        if text is None:
            return f"process {j} did not say whether it can take part within {_SETUP_TIMEOUT_MS} ms"
        peers.append(json.loads(text))
    for j, peer in enumerate(peers):
        if peer["reason"] is not None:
            return f"process {j}: {peer['reason']}"
        if (peer["host"], peer["boot"]) != (entry["host"], entry["boot"]):
            return f"process {j} is on another host ({peer['host']})"
        if peer["uid"] != entry["uid"]:
            return f"process {j} runs as another user"
    failure = ""
    try:
        kernels.cpu_module().shm_attach([(j, p["pid"], p["fd"]) for j, p in enumerate(peers)])
        if jax.default_backend() != "cpu":  # the CUDA handlers meet through the CPU module
            cuda = kernels.cuda_module()
            cuda.shm_bind(kernels.cpu_module().shm_api())
    except (RuntimeError, ValueError) as e:
        failure = str(e)
    client.key_value_set(_KEY.format(me) + "/attach", failure)  # every process agrees on it
    for j in range(jax.process_count()):
        theirs = _get(client, _KEY.format(j) + "/attach")
        if theirs is None:
            return f"process {j} did not attach within {_SETUP_TIMEOUT_MS} ms"
        if theirs:
            return f"process {j}: {theirs}"
    return None


def _get(client, key: str) -> str | None:
    """The value of ``key`` once a peer has set it; None if it does not within the timeout."""
    try:
        return client.blocking_key_value_get(key, _SETUP_TIMEOUT_MS)
    except Exception:  # noqa: BLE001  (jax raises its own error type on a timeout)
        return None


def unsupported_reason() -> str | None:
    """Why the transport between processes cannot run here, or None when it can."""
    return setup()


def name_site(site: int, text: str) -> None:
    """Publishes what call site ``site`` is (its description) in this process's block, so that
    a peer's error names the call this process is at (sites traced before :func:`setup` are
    published by it)."""
    if site in _named:
        return
    _named[site] = text
    if _decided.get("answer", "no block") is None:
        kernels.cpu_module().shm_name_site(int(site), text)


def meetings_in_progress() -> int:
    """Shared-memory calls that this process has not finished (0 between collectives)."""
    return int(kernels.cpu_module().shm_meetings_in_progress())


def segments() -> int:
    """Shared segments this process owns or maps (blocks excluded)."""
    return int(kernels.cpu_module().shm_segments())


def set_link_rate(bytes_per_s: float) -> None:
    """Emulate a link of ``bytes_per_s`` shared by every rank of this host (benchmarks only).

    Every shared-memory publication, and every ring step's copy without a rate of its own,
    then holds one bus for the bytes its peers read, in turn with the other processes (a
    reservation in the lowest process's block), from the moment the sender has them (a ring
    chunk: its sender's start): a PCIe host bridge, or the tc-limited loopback
    gloo crosses in the same benchmark. Takes effect at once, for compiled programs too; every
    process of the job should set the same rate.

    Args:
      bytes_per_s: the bus's rate; 0 turns the emulation off (the default).

    Raises:
      ValueError: a negative rate.
    """
    if not bytes_per_s >= 0:
        raise ValueError(f"set_link_rate: bytes_per_s must be >= 0, got {bytes_per_s!r}")
    kernels.cpu_module().shm_set_link_rate(float(bytes_per_s))


def link_rate() -> float:
    """The emulated bus's bytes/s (0: none)."""
    return float(kernels.cpu_module().shm_link_rate())
