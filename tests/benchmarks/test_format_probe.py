"""benchmarks/llm/fp_formats.py and format_probe.py: the simulated FP8 / FP4 formats round as their
specs say, the Hadamard rotation is undone, the two-phase simulation is what its docstring says, and
the wire bytes are the specs'."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from benchmarks.llm import format_probe as fp  # noqa: E402
from benchmarks.llm import fp_formats as sim  # noqa: E402

E2M1_GRID = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], np.float32)


def test_wire_bytes_are_the_specs():
    assert sim.FORMATS["mxfp4"].bytes_per_value == pytest.approx(0.5 + 1 / 32)   # 4.25 bits
    assert sim.FORMATS["nvfp4"].bytes_per_value == pytest.approx(0.5 + 1 / 16)   # 4.5 bits
    assert sim.FORMATS["mxfp8"].bytes_per_value == pytest.approx(1 + 1 / 32)
    assert sim.FORMATS["fp8"].bytes_per_value == pytest.approx(1 + 2 / 128)


def test_mxfp4_keeps_grid_values_and_bounds_the_error():
    rng = np.random.default_rng(0)
    # values on the E2M1 grid times the block's power-of-two scale come back exactly
    exact = (rng.choice(E2M1_GRID, (64, 32)) * rng.choice([-1, 1], (64, 32))).astype(np.float32)
    exact[:, 0] = 6.0  # amax 6: scale 2^(2 - 2) = 1
    out = np.asarray(sim.fake_quantize(jnp.asarray(exact * 0.25), sim.FORMATS["mxfp4"]))
    np.testing.assert_array_equal(out, exact * 0.25)
    # any block: |error| < 2 X, X = 2^(floor(log2 amax) - 2) (at most 1 X below 6 X, and the
    # clip of (6 X, 8 X) to 6 X)
    x = (rng.standard_normal((256, 32)) * np.exp(rng.uniform(-8, 8, (256, 1)))).astype(np.float32)
    out = np.asarray(sim.fake_quantize(jnp.asarray(x), sim.FORMATS["mxfp4"]))
    scale = np.exp2(np.floor(np.log2(np.abs(x).max(axis=1, keepdims=True))) - 2)
    assert (np.abs(out - x) < 2 * scale).all()
    assert (np.abs(out / scale) <= 6).all()


# XLA:CPU's older loop emitters (the suite's, tests/conftest.py) round f32 -> float4_e2m1fn
# twice (3.4994 -> 4, not 3): the probe's E2M1 rounding holds on the default code only.
@pytest.mark.default_xla_opt
def test_nvfp4_block_scale_is_e4m3_under_the_message_scale():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((128, 16)).astype(np.float32)
    out = np.asarray(sim.fake_quantize(jnp.asarray(x), sim.FORMATS["nvfp4"]))
    tensor = np.abs(x).max() / (448 * 6)
    for row_in, row_out in zip(x, out):
        block = float(jnp.asarray(np.abs(row_in).max() / 6 / tensor).astype(
            jnp.float8_e4m3fn).astype(jnp.float32)) * tensor
        codes = row_out / block
        assert np.isin(np.abs(codes).round(5), E2M1_GRID).all()
        # round to nearest: no grid value is closer to x / block than the chosen code
        dist = np.abs(row_in[:, None] / block - np.sign(row_in)[:, None] * E2M1_GRID[None])
        assert (np.abs(row_in / block - codes) <= dist.min(axis=1) + 1e-6).all()


def test_hadamard_is_orthonormal_and_undone():
    h = sim.hadamard_matrix(32)
    np.testing.assert_allclose(h @ h.T, np.eye(32), atol=1e-6)
    with pytest.raises(ValueError):
        sim.hadamard_matrix(24)
    # fp8 with a rotation: the rotation undone, the error that of the rotated values' rounding
    x = np.random.default_rng(2).standard_normal((8, 128)).astype(np.float32)
    fmt = sim.Format("fp8+h128", "e4m3", "bf16", 128, 128)
    out = np.asarray(sim.fake_quantize(jnp.asarray(x), fmt))
    assert np.abs(out - x).max() < 0.07 * np.abs(x).max()  # E4M3: 3 mantissa bits
    assert not np.array_equal(out, np.asarray(sim.fake_quantize(jnp.asarray(x),
                                                                sim.FORMATS["fp8"])))


def test_simulated_psum_is_two_phases():
    n = 3
    mesh = jax.make_mesh((n,), ("tp",), devices=jax.devices()[:n])
    x = np.random.default_rng(3).standard_normal((n, 4, 96)).astype(np.float32)
    rs, ag = sim.FORMATS["nvfp4"], sim.FORMATS["fp8"]
    f = jax.jit(jax.shard_map(lambda v: sim.simulated_psum(v[0], "tp", rs, ag)[None], mesh=mesh,
                              in_specs=jax.P("tp"), out_specs=jax.P("tp")))
    got = np.asarray(f(jax.device_put(x, jax.NamedSharding(mesh, jax.P("tp")))))
    total = sum(np.asarray(sim.fake_quantize(jnp.asarray(x[r]), rs)) for r in range(n))
    want = np.asarray(sim.fake_quantize(jnp.asarray(total), ag))
    for r in range(n):
        np.testing.assert_allclose(got[r], want, rtol=1e-6, atol=1e-6)


def test_smoothing_scales():
    amax = np.array([0.0, 1.0, 4.0, 100.0], np.float32)
    s = fp.smoothing_scales(amax, 1.0)
    assert np.exp(np.mean(np.log(s))) == pytest.approx(1.0, rel=1e-5)
    assert s[3] / s[2] == pytest.approx(25.0) and s[2] / s[1] == pytest.approx(4.0)
    half = fp.smoothing_scales(amax, 0.5)
    assert half[3] / half[2] == pytest.approx(5.0)
    assert np.isfinite(s).all() and (s > 0).all()


def test_spikes_travel_in_bf16_and_cost_three_bytes():
    fmt = sim.FORMATS["nvfp4+spike"]
    assert fmt.bytes_per_value == pytest.approx(0.5 + 1 / 16 + 3 / 128)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 128)).astype(np.float32)
    x[:, 7] = 1000.0 + np.arange(4)  # one outlier per group
    out = np.asarray(sim.fake_quantize(jnp.asarray(x), fmt))
    np.testing.assert_array_equal(out[:, 7], np.asarray(
        jnp.asarray(x[:, 7]).astype(jnp.bfloat16).astype(jnp.float32)))
    # the rest is quantized on its own scale: far better than with the outlier in its block
    plain = np.asarray(sim.fake_quantize(jnp.asarray(x), sim.FORMATS["nvfp4"]))
    rest = np.ones(128, bool)
    rest[7] = False
    assert np.abs(out - x)[:, rest].max() < 0.5 * np.abs(x[:, rest]).max()
    assert np.abs(out - x)[:, rest].max() <= np.abs(plain - x)[:, rest].max()


def test_a_run_page_holds_its_command_machine_and_table(tmp_path):
    from benchmarks.shared.results import write_page

    data = {"tp": 3, "windows": 6, "window": 512, "machine": "m", "command": "c --x", "rows": [
        {"setting": "exact", "perplexity": 15.0, "delta_ppl": 0.0, "kl": 0.0, "top1": 1.0,
         "vs_bf16_ring": 1.0}]}
    page = write_page(tmp_path / "format_probe_a.json", data, tables=fp.table(data))
    text = page.read_text()
    assert text.startswith("# FP8 and FP4 group formats")
    assert "Command: `c --x`" in text and "Machine: m" in text and "15.000" in text
    assert "(../format_probe.md)" in text


def test_spreading_order_deals_the_largest_channels_to_different_units():
    """A permutation; the row's C // unit largest channels sit in different units on rows that
    start at a unit boundary and on rows that start half a group in; the smallest fill the
    partial unit at the end."""
    rng = np.random.default_rng(0)
    amax = rng.random(576)
    top = rng.choice(576, 4, replace=False)
    amax[top] = 50 + np.arange(4)
    for unit in (128, 16):
        order = fp.spreading_order(amax, unit)
        assert sorted(order) == list(range(576))
        pos = np.argsort(order)  # where each channel went
        k = 576 // unit
        largest = np.argsort(-amax)[:k]
        for shift in (0, 64):
            assert len({(p + shift) // unit for p in pos[largest]}) == k
        assert set(order[k * unit:]) == set(np.argsort(amax)[:576 - k * unit])
