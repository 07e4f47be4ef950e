"""A free TCP port on 127.0.0.1 for the coordinator of the multi-process tests
(``jax.distributed.initialize``)."""

import socket


def free_port() -> int:
    """A port nothing listens on now (the OS picks it; a race with other programs is possible
    but the tests' processes take it at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
