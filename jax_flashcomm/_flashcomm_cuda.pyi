"""The CUDA kernel module (ffi/cuda/module.cc, built with FLASHCOMM_CUDA=ON): the FFI handlers,
their declared traits and the native state's inspection. Imports without a GPU."""

from typing import Any

TRAIT_COMMAND_BUFFER_COMPATIBLE: int

def registrations() -> dict[str, Any]:
    """Target name -> capsule of its XLA FFI handler, every target of
    ffi/include/flashcomm/targets.def (for jax.ffi.register_ffi_target, platform "CUDA")."""

def handler_metadata() -> dict[str, tuple[bool, int, int, int]]:
    """Target name -> (answered, FFI API major, minor, traits) of every registered handler."""

def p2p_meetings_in_progress() -> int: ...
def p2p_ring_steps_in_progress() -> int: ...
def p2p_timeline(record: bool, /) -> list[tuple[int, int, int, int, int, int, int]]:
    """The ring steps' recorded events (host times), cleared; records from now on if
    ``record``."""

def shm_bind(api: Any, /) -> None:
    """Binds the CPU module's shared-memory meeting point (its shm_api() capsule)."""

def shm_bound() -> bool: ...
def shm_signal_channels() -> int: ...
def shm_ring_steps_in_progress() -> int: ...
def shm_peer_buffers_mapped() -> int: ...
