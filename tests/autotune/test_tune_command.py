"""`python -m jax_flashcomm.tune`: it measures, caches the table under this machine's key, the
table loads in another process with the same key, and a changed key invalidates it."""

import json
import os
import subprocess
import sys

import pytest

from jax_flashcomm.costs import _table as tuning
from jax_flashcomm.codec import kernels

pytestmark = pytest.mark.skipif(not kernels.available("cpu"), reason="CPU kernels not built")


def _tune(tmp_path, *args):
    env = {**os.environ, tuning.CACHE_ENV: str(tmp_path)}
    env.pop(tuning.TABLE_ENV, None)
    env.pop("XLA_FLAGS", None)
    return subprocess.run([sys.executable, "-m", "jax_flashcomm.tune", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_tune_writes_a_table_this_process_loads(tmp_path):
    out = _tune(tmp_path, "--devices", "2", "--sizes", "4096,262144", "--bits", "8",
                "--reps", "2")
    assert out.returncode == 0, out.stderr[-2000:]
    files = list(tmp_path.glob("tune-*.json"))
    assert len(files) == 1
    assert files[0].name == tuning.table_path().name      # this machine's key
    assert "cost model vs measured" in out.stdout and "wrote" in out.stdout
    assert "/2" in out.stderr                                   # the progress bar
    table = tuning.load(files[0])                               # same key here: not stale
    assert table is not None
    got = {(r.op, r.dtype, r.nbytes // 1024, r.candidate, r.bits) for r in table.rows}
    for op, dtype in (("psum", "float32"), ("psum", "bfloat16"), ("psum_scatter", "float32"),
                      ("all_gather", "float32")):
        for cand, bits in (("lax", None), ("quantized/p2p", None), ("quantized/xla", None)):
            assert any(g[:2] == (op, dtype) and g[3] == cand for g in got), (op, dtype, cand)
    assert all(r.seconds > 0 and r.n == 2 for r in table.rows)
    assert table.codec["isa"] in kernels.cpu_isas()
    assert set(table.codec["by_n"]["2"]["values_per_s"]) == {
        "quantize", "dequantize_sum_quantize", "dequantize"}
    assert table.link["bytes_per_s"] > 0 and table.link["p2p_latency_s"] > 0
    # invalidation: a table measured under another JAX is stale, and ignored
    data = json.loads(files[0].read_text())
    data["key"]["jax"] = "0.0.1"
    files[0].write_text(json.dumps(data))
    assert tuning.load(files[0]) is None


@pytest.mark.parametrize("args,message", [
    (["--devices", "1"], "--devices"), (["--sizes", "a,b"], "--sizes"),
    (["--bits", "9"], "--bits"), (["--reps", "0"], "--reps")])
def test_bad_arguments_are_usage_errors(tmp_path, args, message):
    out = _tune(tmp_path, *args)
    assert out.returncode == 2 and message in out.stderr
    assert not list(tmp_path.iterdir())
