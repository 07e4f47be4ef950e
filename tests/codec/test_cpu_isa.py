"""The CPU kernels' instruction-set builds (ffi/cpu/cpu_dispatch.h): which one runs,
FLASHCOMM_CPU_ISA, the errors for a build the CPU cannot run, and the vendored FFI headers.

That every build gives the same codes is tested by the parity tests, which run once per build
(the ``each_cpu_isa`` fixture of conftest.py)."""

from __future__ import annotations

import filecmp
import os
import pathlib
import platform
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import codec
from jax_flashcomm.codec import kernels

ROOT = pathlib.Path(__file__).resolve().parents[2]
X86 = platform.machine().lower() in ("x86_64", "amd64")

pytestmark = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")


def test_reports_a_supported_build():
    isas = codec.cpu_isas()
    assert isas[-1] == "baseline", isas  # best first; baseline runs everywhere
    assert codec.cpu_isa() in isas
    expected = ("avx512", "avx2", "baseline") if X86 else ("neon", "baseline")
    assert set(isas) <= set(expected), isas
    if os.environ.get(kernels.ISA_ENV, "auto") in ("", "auto"):
        # the rule's (AVX2 on AMD Zen 4: docs/autotune.md), or the one measured for this kind
        assert codec.cpu_isa() == kernels.default_isa() == kernels.isa_choice_made()["isa"]
        rule = kernels.preferred_isa(isas, kernels.cpuinfo("vendor_id"),
                                     kernels.cpuinfo("cpu family"))
        if rule is not None:
            assert kernels.isa_choice_made() == {"isa": rule, "how": "rule"}


def test_use_cpu_isa_switches_and_restores():
    before = codec.cpu_isa()
    x = jnp.linspace(-3.0, 5.0, 4096, dtype=jnp.float32).astype(jnp.bfloat16)
    quantize = jax.jit(lambda a: codec.quantize(a, bits=6, backend="ffi"))
    outputs = {}
    for isa in codec.cpu_isas():
        with codec.use_cpu_isa(isa):
            assert codec.cpu_isa() == isa
            outputs[isa] = jax.tree.map(np.asarray, quantize(x))  # the same executable
    assert codec.cpu_isa() == before
    first = next(iter(outputs.values()))
    for isa, out in outputs.items():
        assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(out),
                                                        jax.tree.leaves(first))), isa


def test_unknown_and_unsupported_builds_are_clear_errors():
    with pytest.raises(ValueError, match="not one of this library's builds"):
        with codec.use_cpu_isa("sse9"):
            pass
    missing = [n for n in (("avx512", "avx2") if X86 else ()) if n not in codec.cpu_isas()]
    for name in missing:
        with pytest.raises(ValueError, match=f"cannot run the {name} build; it is x86-64 with"):
            with codec.use_cpu_isa(name):
                pass
    if X86:
        with pytest.raises(ValueError, match="not one of"):
            with codec.use_cpu_isa("neon"):
                pass


def _run_with_env(value: str) -> subprocess.CompletedProcess:
    code = ("import jax.numpy as jnp; from jax_flashcomm import codec; "
            "codec.quantize(jnp.ones(256), backend='ffi'); print(codec.cpu_isa())")
    env = dict(os.environ, **{kernels.ISA_ENV: value})
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.parametrize("value", ["baseline", "auto"])
def test_environment_variable_picks_the_build(value):
    proc = _run_with_env(value)
    assert proc.returncode == 0, proc.stderr
    want = codec.cpu_isas()[0] if value == "auto" else value
    assert proc.stdout.strip().splitlines()[-1] == want


def test_environment_variable_bad_value_fails_at_load():
    proc = _run_with_env("avx1024")
    assert proc.returncode != 0
    assert "FLASHCOMM_CPU_ISA=avx1024 is not one of this library's builds" in proc.stderr


def test_vendored_ffi_headers_match_the_installed_jaxlib():
    """third_party/xla_ffi holds jaxlib's XLA FFI headers so the build needs no jax: a jaxlib
    whose headers differ must be noticed (re-vendor, or build with FLASHCOMM_XLA_INCLUDE)."""
    vendored = ROOT / "third_party" / "xla_ffi" / "include" / "xla" / "ffi" / "api"
    installed = pathlib.Path(jax.ffi.include_dir()) / "xla" / "ffi" / "api"
    names = sorted(p.name for p in vendored.glob("*.h"))
    assert names == ["api.h", "c_api.h", "ffi.h"]
    for name in names:
        assert filecmp.cmp(vendored / name, installed / name, shallow=False), name
