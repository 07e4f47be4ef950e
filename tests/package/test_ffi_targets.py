"""The FFI target names are declared once, in ``ffi/include/flashcomm/targets.def``: both native
modules register exactly that list (their ``registrations()`` is generated from it) and export
what their ``.pyi`` stubs list; the Python constants that name the targets, and every literal
target of an ``ffi_call``, are in it."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest

from jax_flashcomm.codec import fp_kernels, kernels
from jax_flashcomm.transport import exchange, p2p, ring_steps, shm

ROOT = pathlib.Path(__file__).resolve().parents[2]
TARGETS_DEF = ROOT / "ffi" / "include" / "flashcomm" / "targets.def"


def declared() -> dict[str, str]:
    """target name -> handler stem, from targets.def."""
    pairs = re.findall(r"^FLASHCOMM_TARGET\((\w+), (\w+)\)$", TARGETS_DEF.read_text(), re.M)
    assert pairs, TARGETS_DEF
    names = [name for name, _ in pairs]
    assert len(set(names)) == len(names), "a target is declared twice"
    return dict(pairs)


def python_constants() -> set[str]:
    """The target names the package's constants hold (the shared-memory ring steps are the
    p2p ones' names between processes: ring_steps._target)."""
    shm_rings = {t.replace("flashcomm_p2p_", "flashcomm_shm_") for t in ring_steps.TARGETS}
    return {*kernels.TARGETS, *fp_kernels.TARGETS, *p2p.TARGETS, *ring_steps.TARGETS, *shm.TARGETS,
            *shm_rings, *exchange.TARGETS}


def test_python_constants_are_the_declared_targets():
    assert python_constants() == set(declared())


def test_every_literal_ffi_call_target_is_declared():
    names = set(declared())
    literal = set()
    for path in (ROOT / "jax_flashcomm").rglob("*.py"):
        literal |= set(re.findall(r"ffi_call\(\s*\"(flashcomm_\w+)\"", path.read_text()))
    assert literal and literal <= names, sorted(literal - names)


def test_stems_name_the_handler_symbols():
    for name, stem in declared().items():
        words = name.removeprefix("flashcomm_").split("_")
        assert stem == "".join(w.capitalize() for w in words), (name, stem)


@pytest.mark.parametrize("module", ["_flashcomm_cpu", "_flashcomm_cuda"])
def test_native_module_registers_the_declared_targets(module):
    try:
        native = importlib.import_module(f"jax_flashcomm.{module}")
    except ImportError as err:
        pytest.skip(f"{module} not built: {err}")
    assert set(native.registrations()) == set(declared())


@pytest.mark.parametrize("module", ["_flashcomm_cpu", "_flashcomm_cuda"])
def test_stub_lists_what_the_native_module_exports(module):
    stub = (ROOT / "jax_flashcomm" / f"{module}.pyi").read_text()
    listed = set(re.findall(r"^def (\w+)\(", stub, re.M)) | set(re.findall(r"^(\w+): ", stub, re.M))
    try:
        native = importlib.import_module(f"jax_flashcomm.{module}")
    except ImportError as err:
        pytest.skip(f"{module} not built: {err}")
    assert listed == {n for n in dir(native) if not n.startswith("_")}
