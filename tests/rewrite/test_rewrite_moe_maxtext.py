"""MaxText's MoE layer (RoutedMoE, sparse_matmul with expert parallelism) rewritten:
examples/rewrite_moe_maxtext.py run as a script, its report and differences checked.

Needs MaxText 0.2.5 where examples/maxtext_install.sh puts it (or on PYTHONPATH); skipped
when it is not importable (CI has no network to fetch it). The layer as written cannot compile
on CPU (XLA:CPU has no ragged-all-to-all); the rewritten one runs and, exact, equals MaxText's
own dense path of the same weights and a NumPy evaluation within f32 summation order.
"""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SITE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                    "jax_flashcomm", "maxtext-0.2.5")


def _maxtext_importable() -> bool:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [os.environ.get("PYTHONPATH"), SITE])))
    probe = subprocess.run([sys.executable, "-c", "import importlib.util, sys; "
                            "sys.exit(importlib.util.find_spec('maxtext') is None)"],
                           env=env, capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
def test_maxtext_moe_all_to_alls_found_and_replaced(tmp_path):
    if not _maxtext_importable():
        pytest.skip("MaxText is not installed (bash examples/maxtext_install.sh)")
    out = tmp_path / "moe.json"
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "rewrite_moe_maxtext.py"),
                          "--bits", "8", "--json", str(out)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(out.read_text())
    assert "does not compile here" in run.stdout          # the layer as written, on CPU
    exact = result["rows"]["exact"]
    ragged = [r for r in exact if r["op"] == "ragged_all_to_all"]
    assert len(ragged) == 2                               # the dispatch and the combine
    assert all(r["action"] == "exact" and "moe.py" in r["site"] for r in ragged)
    assert {r["op"] for r in exact} == {"ragged_all_to_all", "all_gather"}
    assert result["exact_vs_dense"] <= 1e-6 * max(1.0, result["max_abs"]) * 10
    assert result["exact_vs_numpy"] <= 1e-6
    assert result["grad_exact_vs_dense"] <= 1e-5 * max(1.0, result["grad_max_abs"])
    quant = result["rows"]["quantized"]
    assert [r["action"] for r in quant if r["op"] == "ragged_all_to_all"] == ["quantized"] * 2
    assert all(r["action"] == "kept" and r["dtype"] == "int32"
               for r in quant if r["op"] == "all_gather")   # group sizes: integers, exact
    assert 0 < result["quantized_rel_l2"] < 0.05
