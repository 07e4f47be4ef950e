"""The GPU cost model (benchmarks/gpu_model.py): its limits, its monotonicity, its self-checks
(the emulated-link all-reduce data and a synthetic docs/ttft.json) and its argument errors."""

import dataclasses
import json

import pytest

from benchmarks import gpu_model as gm

MIB = 2**20
FREE = gm.Link(1e9, "switched")                      # no latency
FREE_SHARED = gm.Link(1e9, "shared")
NO_CODEC = lambda name, elems, w1, w2, n: 0.0         # noqa: E731 - an infinitely fast codec


@pytest.mark.parametrize("link", [FREE, FREE_SHARED], ids=["switched", "shared"])
@pytest.mark.parametrize("n", [2, 4, 8])
@pytest.mark.parametrize("rs_bits,ag_bits", [(8, 8), (6, 6), (4, 4), (2, 2), (4, 8)])
def test_no_latency_and_free_codec_give_the_byte_ratio(link, n, rs_bits, ag_bits):
    size = 2 * n * 128 * 1000                        # whole groups in every chunk: no padding
    exact = gm.exact_allreduce(size, n, link, "ring")["total_s"]
    q = gm.flash_allreduce(size, n, link, NO_CODEC, rs_bits, ag_bits)
    ratio = 2 * gm.BF16 / (gm.wire_bytes_per_element(rs_bits) + gm.wire_bytes_per_element(ag_bits))
    assert exact / q["total_s"] == pytest.approx(ratio, rel=1e-12)
    assert q["byte_ideal"] == pytest.approx(ratio, rel=1e-12)


def test_wire_bytes_follow_the_format():
    assert gm.wire_bytes_per_element(8) == pytest.approx(1.03125)
    assert gm.wire_bytes_per_element(4) == pytest.approx(0.53125)
    assert gm.wire_bytes_per_element(4, 128, 1) == pytest.approx((64 + 3 + 4) / 128)


@pytest.mark.parametrize("gpu", [gm.GPUS["L40"], *(dataclasses.replace(
    g, link=dataclasses.replace(g.link, base_latency_s=0.0, step_latency_s=0.0))
    for g in gm.GPUS.values())], ids=["L40", "L40-nolat", "A100-nolat", "H100-nolat"])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_speedup_grows_with_size_toward_the_byte_ideal(gpu, bits):
    sizes = [2**k for k in range(16, 31)]
    s = [gm.gpu_allreduce_speedup(gpu, size, 4, bits) for size in sizes]
    ideal = gm.BF16 / gm.wire_bytes_per_element(bits)
    assert all(b >= a * (1 - 1e-9) for a, b in zip(s, s[1:])), s
    assert s[-1] < ideal
    free = dataclasses.replace(gpu, codec_efficiency=1e12, kernel_launch_s=0.0,
                               link=dataclasses.replace(gpu.link, base_latency_s=0.0, step_latency_s=0.0))
    assert gm.gpu_allreduce_speedup(free, 2**30, 4, bits) == pytest.approx(ideal, rel=1e-6)


def test_ttft_is_compute_plus_two_allreduces_per_layer():
    m, g = gm.MODELS["LLaMA-3-70B"], gm.GPUS["A100"]
    t = gm.ttft(m, g, 4, 8, 1024)
    ar = gm.exact_allreduce(8 * 1024 * m.d_model * 2, 4, g.link, "ring")["total_s"]
    assert t["comm_s"] == pytest.approx(2 * m.n_layers * ar)
    assert t["ttft_s"] == pytest.approx(t["compute_s"] + t["comm_s"])
    # matmul FLOPs of a short prompt ~ 2 x the non-embedding parameters per token
    params = m.n_layers * (m.d_model * (2 * m.d_model + 2 * 8 * 128) + 3 * m.d_model * m.ffn_dim)
    assert m.prefill_flops(1, 16) / 16 == pytest.approx(2 * params, rel=0.1)


def test_emulated_allreduce_predictions_within_tolerance():
    res = gm.emulated_allreduce_check()
    assert res["rate_bytes_per_s"] == pytest.approx(50e6)
    assert len(res["rows"]) == 16 and res["within_tolerance"], res["max_abs_err"]


def _synthetic_ttft(tmp_path=None, lat=1e-3, rate=1e6):
    tp, coll = 3, 60
    rows = []
    for strat, bits, pre, dec in (("exact", None, 3e5, 300.0), ("flash", 4, 8e4, 80.0)):
        common = {"strategy": strat, "kind": "psum", "rs_bits": bits, "ag_bits": bits, "group_size": 128,
                  "ttft_samples_s": [], "prefill_bytes_per_rank": pre, "decode_bytes_per_rank": dec,
                  "collectives_prefill": coll}
        rows.append({**common, "link": "unlimited", "ttft_s": 1.0, "decode_s_per_token": 0.01})
        rows.append({**common, "link": "pcie", "ttft_s": 1.0 + tp * pre / rate + coll * lat,
                     "decode_s_per_token": 0.01 + tp * dec / rate + coll * lat})
    rows.append({**rows[-1], "strategy": "orphan"})     # no unlimited twin: not predicted
    data = {"machine": {}, "tp": tp, "prompt_tokens": 1000, "decode_tokens": 8, "rows": rows,
            "links": {"pcie": {"rate_bytes_per_s": rate, "calibration": {}},
                      "unlimited": {"rate_bytes_per_s": None, "calibration": {}}}}
    if tmp_path is not None:
        (tmp_path / "ttft.json").write_text(json.dumps(data))
    return data


def test_ttft_check_reads_a_synthetic_file():
    res = gm.ttft_check(_synthetic_ttft())
    assert res["latency_per_collective_s"]["pcie"] == pytest.approx(1e-3)
    assert len(res["rows"]) == 2 and res["within_tolerance"] and not res["notes"]
    for r in res["rows"]:
        assert r["predicted_s"] == pytest.approx(r["measured_s"]) and abs(r["err"]) < 1e-9


def test_main_writes_json_and_png(tmp_path):
    _synthetic_ttft(tmp_path)
    res = gm.main(["--out", str(tmp_path / "m"), "--ttft", str(tmp_path / "ttft.json")])
    data = json.loads((tmp_path / "m.json").read_text())
    assert (tmp_path / "m.png").stat().st_size > 10_000
    assert data["checks"]["ttft"]["within_tolerance"] and data["checks"]["emulated_allreduce"]["within_tolerance"]
    assert [p["paper"] for p in res["predictions"]["paper"]] == [3.18, 2.06, 1.19]


def test_parse_rate():
    assert gm.parse_rate("400mbit") == pytest.approx(50e6)
    assert gm.parse_rate("2gbit") == pytest.approx(250e6)
    assert gm.parse_rate("50mbps") == pytest.approx(50e6)


@pytest.mark.parametrize("call", [
    lambda: gm.Link(0.0), lambda: gm.Link(1e9, "ring"), lambda: gm.Link(1e9, "shared", -1.0),
    lambda: gm.exact_allreduce(MIB, 1, FREE), lambda: gm.exact_allreduce(0, 4, FREE),
    lambda: gm.exact_allreduce(MIB, 4, FREE, "tree"), lambda: gm.exact_allreduce(MIB, 4.0, FREE),
    lambda: gm.flash_allreduce(MIB, 4, FREE, NO_CODEC, 9),
    lambda: gm.flash_allreduce(MIB, 4, FREE, NO_CODEC, 4, group_size=12),
    lambda: gm.parse_rate("fast"), lambda: gm.parse_rate("400"),
    lambda: gm.ttft_check({"tp": 3, "rows": []}),
    lambda: gm.ttft_check({**_synthetic_ttft(), "links": {"pcie": {"rate_bytes_per_s": 0}}}),
])
def test_bad_inputs_raise(call):
    with pytest.raises((ValueError, TypeError)):
        call()
