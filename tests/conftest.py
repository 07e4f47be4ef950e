"""Test setup: 8 virtual CPU devices, and meshes of both axis types.

The device count must be set before jax is imported, so this runs first.
"""

import os

from tests.support.devices import set_cpu_devices

set_cpu_devices(8)  # the one place the suite's device count is set
# No tuning table from the user's cache: the automatic choice runs on the cost model's defaults
# (tests of tables pass theirs with jax_flashcomm.costs.use_table or this variable).
os.environ["FLASHCOMM_TUNING_TABLE"] = "off"

# XLA's LLVM backend at -O0 unless FLASHCOMM_TEST_XLA_OPT=default: the suite compiles thousands
# of programs and spends most of its time compiling them (timings: docs/build.md). The codec's
# elementwise arithmetic is the same at any level (its parity tests pass at both), but XLA's
# generated loops may sum in another order, so tests whose tolerance is calibrated on the
# default code (marker `default_xla_opt`) are skipped here and run, with the codec parity
# tests, in a subprocess at the default level (tests/package/test_default_xla_opt.py).
# Also XLA:CPU's older loop emitters instead of its fusion emitters: they compile the suite's
# programs in about half the time (a 2x2x2 ring program of tests/collectives/test_axis_order.py:
# 2.0 s -> 0.9 s) and compute the same elementwise values, but for their f32 -> float4_e2m1fn
# conversion, which rounds twice (docs/build.md; the one test that casts to it is marked
# default_xla_opt).
XLA_OPT_DEFAULT = os.environ.get("FLASHCOMM_TEST_XLA_OPT", "0") == "default"
if not XLA_OPT_DEFAULT:
    os.environ["XLA_FLAGS"] += (" --xla_backend_optimization_level=0"
                                " --xla_cpu_use_fusion_emitters=false")

import jax  # noqa: E402
import pytest  # noqa: E402
from hypothesis import settings  # noqa: E402

from tests.support.meshes import AXIS_TYPES, make_mesh  # noqa: E402

# ci: 30 examples per property to fit the CI budget of docs/build.md; "thorough" for
# the long runs of docs/reliability.md.
settings.register_profile("ci", max_examples=30, deadline=None, derandomize=True)
settings.register_profile("dev", max_examples=25, deadline=None)
settings.register_profile("thorough", max_examples=500, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

@pytest.fixture(params=sorted(AXIS_TYPES))
def axis_type(request):
    """Every mesh-using test runs on Explicit and on Auto axes."""
    return AXIS_TYPES[request.param]


@pytest.fixture
def mesh_factory(axis_type):
    """``mesh_factory(shape, names)`` builds a mesh of the parametrized axis type."""
    return lambda shape, names: make_mesh(shape, names, axis_type)


def _cpu_isas():
    from jax_flashcomm.codec import kernels

    return kernels.cpu_isas() if kernels.available("cpu") else ["none"]


@pytest.fixture(params=_cpu_isas())
def each_cpu_isa(request):
    """Run the test once per instruction-set build of the CPU kernels this CPU supports
    (avx512 / avx2 / baseline on x86-64, neon / baseline on aarch64): the codes must be the
    same bits on every one. Compiled executables call the kernel library at run time, so the
    switch needs no recompilation."""
    if request.param == "none":
        pytest.skip("the CPU FFI kernels are not built")
    from jax_flashcomm.codec import kernels

    with kernels.use_cpu_isa(request.param):
        yield request.param


@pytest.fixture(scope="session")
def ptxas_report():
    """nvcc's -Xptxas=-v output of every ffi/cuda/*.cu (tests/support/cuda_build.py), one
    report per session for tests/codec/test_cuda_build.py and
    tests/transport/test_cuda_gather_build.py; skips where there is neither a matching build
    log nor nvcc."""
    from tests.support.cuda_build import ptxas_outputs

    report = ptxas_outputs()
    if isinstance(report, str):
        pytest.skip(report)
    return report


# The fast developer loop, `pytest -m "not slow"` (README): the long-running modules and tests
# of a full run carry `pytestmark = pytest.mark.slow` / `@pytest.mark.slow` themselves
# (tests/package/test_markers.py checks the selection); every test that runs the real SmolLM2
# checkpoint (marker `model`) is slow too, marked here. CI runs everything.
def _mark_slow(items):
    for item in items:
        if item.get_closest_marker("model"):
            item.add_marker(pytest.mark.slow)


# Long tests (subprocesses, fuzzing) go first, whole modules at a time (their
# module fixtures stay together): with two xdist workers stealing work, a long test left for
# last keeps one worker busy while the other idles. Matched on the file name (any folder).
LONG_FIRST = ("test_default_xla_opt.py", "test_fuzz_collectives.py", "test_models_real.py",
              "test_multiprocess_failure.py", "test_multiprocess.py",
              "test_ttft.py::test_quick_run_end_to_end")


def pytest_collection_modifyitems(config, items):
    """One hook (a second definition would replace the first): slow markers, long tests
    first, and the default-level tests skipped where the subprocess runs them."""
    _mark_slow(items)
    items.sort(key=lambda item: not any(
        item.nodeid.split("/")[-1].startswith(name) for name in LONG_FIRST))  # stable
    if XLA_OPT_DEFAULT:
        return
    skip = pytest.mark.skip(reason="runs at XLA's default backend level in a subprocess "
                                   "(tests/package/test_default_xla_opt.py)")
    for item in items:
        if item.get_closest_marker("default_xla_opt"):
            item.add_marker(skip)
