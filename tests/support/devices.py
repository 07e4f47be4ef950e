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
