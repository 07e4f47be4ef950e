"""jax_flashcomm.policy: per-site configs, their JSON file, their wire bytes, and the
rewrite's use of them."""

import json

import jax
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jax_flashcomm as fc
from jax_flashcomm.codec import spec
from jax_flashcomm.policy._comm_policy import CommPolicy, config_from_dict, config_to_dict, wire_vs_bf16
from jax_flashcomm.rewrite import RewritePolicy, rewrite

INT8 = fc.CommConfig(bits=8, min_bytes=0)
FP8 = fc.CommConfig(format="fp8", min_bytes=0)
MIXED = fc.CommConfig(bits=4, rs_format="nvfp4", ag_format="fp8", min_bytes=0, spikes=2)


def test_wire_vs_bf16_is_the_formats_record_over_a_bf16_ring():
    g = spec.DEFAULT_GROUP_SIZE
    assert wire_vs_bf16(None) == 1.0 and wire_vs_bf16(fc.CommConfig(bits=None)) == 1.0
    assert wire_vs_bf16(FP8) == pytest.approx((g + 2) / g / 2)              # E4M3 + bf16 scale
    assert wire_vs_bf16(INT8) == pytest.approx((g + 4) / g / 2)             # codes + scale, zero
    nv = spec.wire_bytes_per_element(4, g, 2, "nvfp4")     # spikes=2 in both phases
    f8 = spec.wire_bytes_per_element(8, g, 2, "fp8")
    assert f8 == pytest.approx((g + 2 + 2 * 3) / g)                   # a spike: bf16 + position
    assert wire_vs_bf16(MIXED) == pytest.approx((nv + f8) / 4)


def test_config_dict_keeps_only_what_differs_and_round_trips():
    assert config_to_dict(fc.CommConfig()) == {}
    assert config_to_dict(None) is None and config_from_dict(None) is None
    d = config_to_dict(MIXED)
    assert d == {"bits": 4, "min_bytes": 0, "spikes": 2, "rs_format": "nvfp4", "ag_format": "fp8"}
    assert config_from_dict(json.loads(json.dumps(d))) == MIXED


@pytest.mark.parametrize("bad, match", [({"bitz": 4}, "unknown CommConfig options"),
                                        ({"bits": 99}, "bits"),
                                        ({"format": "fp5"}, "format"),
                                        ([4], "object of CommConfig options")])
def test_bad_site_configs_raise_naming_where(bad, match):
    with pytest.raises(ValueError, match=match) as info:
        config_from_dict(bad, "policy.json: site '3.mlp'")
    assert "policy.json: site '3.mlp'" in str(info.value)


def test_lookup_exact_by_name_and_by_substring_in_order():
    policy = CommPolicy(default=INT8, sites={"1.mlp": FP8, "11.mlp": None, "mlp": MIXED})
    assert policy.config_for("1.mlp") == FP8
    assert policy.config_for("11.mlp") is None           # exact: kept exact
    assert policy.config_for("2.attn") == INT8           # unlisted: the default
    assert policy.config_at(("blocks/11.mlp/down",)) == FP8     # "1.mlp" is listed first
    assert policy.config_at(("x", "model.py:3 (mlp)")) == MIXED
    assert policy.config_at(("attn",)) == INT8
    assert policy.mean_wire_vs_bf16(["1.mlp", "11.mlp"]) == pytest.approx(
        (wire_vs_bf16(FP8) + 1.0) / 2)


def test_save_load_round_trip_and_hashing(tmp_path):
    policy = CommPolicy(default=None, sites=(("0.attn", MIXED), ("0.mlp", None)),
                        info={"budget": 0.5, "model": "smollm2"})
    path = policy.save(tmp_path / "p.json")
    back = CommPolicy.load(path)
    assert back == policy and back.sites == policy.sites and back.info == policy.info
    assert hash(back) == hash(policy)
    assert CommPolicy(default=None, sites=policy.sites, info={"other": 1}) == policy
    assert json.loads(path.read_text())["kind"] == "jax_flashcomm.CommPolicy"


def test_bad_policies_raise(tmp_path):
    with pytest.raises(ValueError, match="named twice"):
        CommPolicy(sites=(("a", INT8), ("a", FP8)))
    with pytest.raises(TypeError, match="CommConfig or None"):
        CommPolicy(sites={"a": 8})
    with pytest.raises(TypeError, match="default"):
        CommPolicy(default="int8")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json: not JSON"):
        CommPolicy.load(bad)
    bad.write_text(json.dumps({"sites": {}}))
    with pytest.raises(ValueError, match="not a jax_flashcomm policy"):
        CommPolicy.load(bad)
    bad.write_text(json.dumps({"kind": "jax_flashcomm.CommPolicy", "version": 7}))
    with pytest.raises(ValueError, match="version 7"):
        CommPolicy.load(bad)
    with pytest.raises(ValueError, match="comm_policy gives every site"):
        RewritePolicy(comm_policy=CommPolicy(), bits=4)
    with pytest.raises(TypeError, match="comm_policy must be"):
        RewritePolicy(comm_policy={"a": INT8})


def test_rewrite_gives_each_site_its_config():
    """Three psums in three named scopes: "site_one" int8, "site_two" kept exact,
    "site_three" the default (fp8);
    each rewritten output equals the direct flashcomm call with that config, bit for bit."""
    n = 4
    mesh = jax.make_mesh((n,), ("i",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=jax.devices()[:n])

    def body(x):
        with jax.named_scope("site_one"):
            a = lax.psum(x, "i")
        with jax.named_scope("site_two"):
            b = lax.psum(2.0 * x, "i")
        with jax.named_scope("site_three"):
            c = lax.psum(3.0 * x, "i")
        return a, b, c

    def direct(x):
        return (fc.psum(x, "i", config=INT8), lax.psum(2.0 * x, "i"),
                fc.psum(3.0 * x, "i", config=FP8))

    specs = dict(mesh=mesh, in_specs=P("i"), out_specs=(P(), P(), P()))
    x = jax.device_put(np.random.RandomState(0).randn(n * 8, 256).astype(np.float32),
                       NamedSharding(mesh, P("i")))
    policy = CommPolicy(default=FP8, sites={"site_one": INT8, "site_two": None})
    f = rewrite(jax.shard_map(body, **specs), policy)
    report = f.report(x)
    rows = {r.scope: r for r in report}
    assert rows["site_one"].action == "quantized" and rows["site_one"].detail == "int8/int8"
    assert rows["site_two"].action == "kept" and "comm policy keeps this site exact" in rows["site_two"].reason
    assert rows["site_three"].action == "quantized" and rows["site_three"].detail == "fp8/fp8"
    got = jax.jit(f)(x)
    want = jax.jit(jax.shard_map(direct, **specs))(x)
    for u, v in zip(got, want):
        np.testing.assert_array_equal(np.asarray(u), np.asarray(v))


def test_tpcomm_for_site():
    from jax_flashcomm.nn import TPComm

    auto8 = fc.CommConfig(bits=8)                       # min_bytes="auto": chosen per call
    policy = CommPolicy(default=INT8, sites={"x": None, "y": FP8, "z": auto8})
    assert TPComm.for_site(policy, "x") == TPComm("exact")
    assert TPComm.for_site(policy, "y", "tp", fuse_norm=True) == TPComm(
        "quantized", config=FP8, fuse_norm=True)
    assert TPComm.for_site(policy, "z").kind == "auto"
    assert TPComm.for_site(policy, "unlisted") == TPComm("quantized", config=INT8)
    assert TPComm.for_site(policy, None) == TPComm("quantized", config=INT8)
    assert TPComm.for_site(CommPolicy(), None) == TPComm("exact")
    with pytest.raises(TypeError, match="CommPolicy"):
        TPComm.for_site({"x": None}, "x")
