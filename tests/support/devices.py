"""The one helper that sets the number of virtual CPU devices (XLA_FLAGS'
--xla_force_host_platform_device_count), for tests/conftest.py and the subprocess worker scripts.
It must run before jax is imported, so this module imports nothing of jax."""

import os

_FLAG = "--xla_force_host_platform_device_count"


def set_cpu_devices(n: int) -> None:
    """Make XLA:CPU expose ``n`` devices: replaces any device-count flag already in XLA_FLAGS
    and keeps the other flags."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    os.environ["XLA_FLAGS"] = " ".join([*flags, f"{_FLAG}={n}"])


def worker_xla_flags() -> str | None:
    """XLA_FLAGS for a subprocess of the suite: this process's flags without the device count
    (each worker sets its own), so the suite's compile level (tests/conftest.py: LLVM -O0
    unless FLASHCOMM_TEST_XLA_OPT=default) reaches the workers too. None when nothing is left."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
    return " ".join(flags) or None


def use_worker_xla_flags(env: dict) -> dict:
    """``env`` (a subprocess's environment) with :func:`worker_xla_flags` as its XLA_FLAGS (or
    none); returns it."""
    flags = worker_xla_flags()
    if flags is None:
        env.pop("XLA_FLAGS", None)
    else:
        env["XLA_FLAGS"] = flags
    return env
