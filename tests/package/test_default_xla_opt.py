"""The suite compiles at XLA's backend level 0 (tests/conftest.py). Here, in a subprocess at
XLA's default level (what users compile with): the tests marked ``default_xla_opt`` (skipped in
the main run), and again the codec's parity tests, whose point is the same bits from the jnp
twin and the FFI kernels."""

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# Every width and dtype at the default group size, the fused sums, spikes and rotation.
SELECTION = [
    "tests/codec/test_codec_parity.py::test_fused_sum_ops_bit_identical",
    "tests/codec/test_codec_parity.py::test_quantize_dequantize_bit_identical",
    "tests/codec/test_rotation.py::test_parity_fused_sums",
    "tests/codec/test_spikes.py::test_fused_op_spikes_per_phase_parity",
    "tests/codec/test_norm_parity.py::test_fused_norm_bit_identical",
]


def _run_at_default_level(args):
    env = dict(os.environ, FLASHCOMM_TEST_XLA_OPT="default")
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "optimization_level" not in f
                                and "fusion_emitters" not in f
                                and "device_count" not in f)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
    assert "skipped" not in summary, summary
    return int(summary.split(" passed")[0].split()[-1])


def test_twin_and_kernel_parity_at_the_default_xla_level():
    assert _run_at_default_level(["-k", "128 or fused", *SELECTION]) >= 40


def test_marked_tests_at_the_default_xla_level():
    assert _run_at_default_level(["-m", "default_xla_opt", "tests"]) >= 7
