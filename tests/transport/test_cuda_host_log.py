"""The evidence the host-compile tests accept instead of compiling a CUDA handler again
(tests/support/cuda_p2p.py): the build's log of that very source (every input's sha256 as
it is here) compiled with -Wall -Wextra -Werror; anything else compiles again."""

import hashlib
import types

import pytest

from tests.support import cuda_p2p
from tests.support.cuda_build import ROOT

SOURCE = ROOT / "ffi" / "cuda" / "shm_handlers.cc"
HEADER = ROOT / "ffi" / "cuda" / "ipc_participant.h"


def _log(tmp_path, monkeypatch, flags="-Wall -Wextra -Werror", digest=None):
    module = tmp_path / "_flashcomm_cuda.so"
    module.write_bytes(b"")
    monkeypatch.setattr(cuda_p2p.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(module)))
    sha = lambda p: hashlib.sha256(p.read_bytes()).hexdigest()  # noqa: E731
    lines = ["# jax_flashcomm cuda_ptxas.log v1", "# source: ffi/cuda/shm_handlers.cc",
             f"# command: g++ -O3 {flags} -c {SOURCE}",
             f"# input: {digest or sha(SOURCE)} ffi/cuda/shm_handlers.cc",
             f"# input: {sha(HEADER)} ffi/cuda/ipc_participant.h", "# end: shm_handlers.cc"]
    (tmp_path / cuda_p2p.HOST_LOG).write_text("\n".join(lines) + "\n")


def test_a_matching_log_with_werror_is_accepted(tmp_path, monkeypatch):
    _log(tmp_path, monkeypatch)
    assert cuda_p2p.built_with_warnings_as_errors(SOURCE) == str(tmp_path / cuda_p2p.HOST_LOG)
    assert cuda_p2p.built_with_warnings_as_errors(ROOT / "ffi/cuda/p2p_handlers.cc") is None


@pytest.mark.parametrize("flags, digest", [("-Wall -Wextra", None),      # no -Werror
                                           ("-Wall -Wextra -Werror", "0" * 64)])  # changed
def test_anything_else_is_not(tmp_path, monkeypatch, flags, digest):
    _log(tmp_path, monkeypatch, flags, digest)
    assert cuda_p2p.built_with_warnings_as_errors(SOURCE) is None
