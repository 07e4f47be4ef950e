"""The GPU cost model (benchmarks/gpu/cost_model.py): its limits, its monotonicity, its self-checks
(the emulated-link all-reduce data and a synthetic docs/results/ttft.json) and its argument errors."""

import dataclasses
import json

import pytest

from benchmarks.gpu import cost_model as gm

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
    ratio = 2 * gm.BF16 / (gm.int_wire_bytes(rs_bits) + gm.int_wire_bytes(ag_bits))
    assert exact / q["total_s"] == pytest.approx(ratio, rel=1e-12)
    assert q["byte_ideal"] == pytest.approx(ratio, rel=1e-12)


def test_wire_bytes_follow_the_format():
    assert gm.int_wire_bytes(8) == pytest.approx(1.03125)
    assert gm.int_wire_bytes(4) == pytest.approx(0.53125)
    assert gm.int_wire_bytes(4, 128, 1) == pytest.approx((64 + 3 + 4) / 128)


@pytest.mark.parametrize("gpu", [gm.GPUS["L40"], *(dataclasses.replace(
    g, link=dataclasses.replace(g.link, base_latency_s=0.0, step_latency_s=0.0))
    for g in gm.GPUS.values())], ids=["L40", "L40-nolat", "A100-nolat", "H100-nolat"])
@pytest.mark.parametrize("bits", [8, 6, 4])
def test_speedup_grows_with_size_toward_the_byte_ideal(gpu, bits):
    sizes = [2**k for k in range(16, 31)]
    s = [gm.gpu_allreduce_speedup(gpu, size, 4, bits) for size in sizes]
    ideal = gm.BF16 / gm.int_wire_bytes(bits)
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


def _synthetic_ttft(tmp_path=None, lat=1e-3, rate=1e6, r_u=1e8, cores=2, machine=None):
    """TTFTs built by the documented formula: T_c = U - tp B / R_u, T_l = tp B / R + K lam,
    TTFT = max(T_c, T_l + T_c min(1, C / N)); lam = the link's small psum less the unlimited one."""
    tp, coll, share = 3, 60, min(1.0, cores / 3)
    rows = []
    for strat, bits, pre, dec in (("exact", None, 3e5, 300.0), ("flash", 4, 8e4, 80.0), ("tiny", 8, 10.0, 1.0)):
        common = {"strategy": strat, "kind": "psum", "rs_bits": bits, "ag_bits": bits, "group_size": 128,
                  "ttft_samples_s": [], "prefill_bytes_per_rank": pre, "decode_bytes_per_rank": dec,
                  "collectives_prefill": coll}
        t_c = 1.0 - tp * pre / r_u
        rows.append({**common, "link": "unlimited", "ttft_s": 1.0, "decode_s_per_token": 0.01})
        rows.append({**common, "link": "pcie", "ttft_s": max(t_c, tp * pre / rate + coll * lat + share * t_c),
                     "decode_s_per_token": 0.01})
    rows.append({**rows[-1], "strategy": "orphan"})     # no unlimited twin: not predicted
    data = {"machine": machine if machine is not None else f"CPU test ({cores} cores, x86_64)", "tp": tp,
            "prompt_tokens": 1000, "decode_tokens": 8, "rows": rows,
            "links": {"pcie": {"rate_bytes_per_s": rate, "small_psum_s": 2e-3 + lat, "calibration": {}},
                      "unlimited": {"rate_bytes_per_s": None, "small_psum_s": 2e-3, "measured_bytes_per_s": r_u,
                                    "calibration": {}}}}
    if tmp_path is not None:
        (tmp_path / "ttft.json").write_text(json.dumps(data))
    return data


def test_ttft_check_reads_a_synthetic_file():
    res = gm.ttft_check(_synthetic_ttft())
    assert res["latency_per_collective_s"]["pcie"] == pytest.approx(1e-3)
    assert res["cores"] == 2 and res["exposed_share"] == pytest.approx(2 / 3)
    assert len(res["rows"]) == 3 and res["within_tolerance"] and not res["notes"]
    for r in res["rows"]:
        assert r["predicted_s"] == pytest.approx(r["measured_s"]) and abs(r["err"]) < 1e-9
        lo, hi = r["bounds_s"]
        assert lo - 1e-12 <= r["predicted_s"] <= hi + 1e-12
    tiny = res["rows"][-1]   # link time << non-link work: the prediction is T_c, the lower bound
    assert tiny["predicted_s"] == pytest.approx(tiny["compute_s"])


def test_ttft_check_formula_by_hand():
    """One link-bound row, worked by hand: U = 1 s, B = 3 x 3e5 bytes, R_u = 1e8 B/s, R = 1e6 B/s,
    60 collectives x 1 ms, 2 cores / 3 ranks: T_c = 1 - 0.009 = 0.991 s, T_l = 0.9 + 0.06 = 0.96 s,
    TTFT = 0.96 + 0.991 x 2/3; the unlimited transfer is not counted twice."""
    r = gm.ttft_check(_synthetic_ttft())["rows"][0]
    assert r["compute_s"] == pytest.approx(0.991) and r["link_s"] == pytest.approx(0.96)
    assert r["predicted_s"] == pytest.approx(0.96 + 0.991 * 2 / 3)
    assert r["bounds_s"] == pytest.approx([0.991, 0.991 + 0.96])


@pytest.mark.parametrize("cores,share", [(1, 1 / 3), (2, 2 / 3), (3, 1.0), (8, 1.0)])
def test_ttft_check_exposed_share_is_cores_over_ranks(cores, share):
    res = gm.ttft_check(_synthetic_ttft(cores=cores))
    assert res["exposed_share"] == pytest.approx(share) and res["within_tolerance"]


def test_ttft_check_missing_inputs_fall_back_with_notes():
    data = _synthetic_ttft(machine={})                      # no core count: C = N, the sum bound
    del data["links"]["unlimited"]["measured_bytes_per_s"]  # no unlimited rate: T_c = U
    res = gm.ttft_check(data)
    assert res["exposed_share"] == 1.0 and len(res["notes"]) == 2
    for r in res["rows"]:
        assert r["compute_s"] == pytest.approx(r["unlimited_s"])
        assert r["predicted_s"] == pytest.approx(max(r["compute_s"], r["link_s"] + r["compute_s"]))
    assert gm.ttft_check(_synthetic_ttft(machine={"cores": 4}))["cores"] == 4


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


def test_ttft_check_on_the_measured_file_is_within_tolerance():
    path = gm.REPO / gm.TTFT_FILE
    if not path.exists():
        pytest.skip(f"{gm.TTFT_FILE} not written yet")
    res = gm.ttft_check(json.loads(path.read_text()))
    assert res["rows"] and res["within_tolerance"], [(r["link"], r["strategy"], r["err"]) for r in res["rows"]]
