"""examples/explicit_llama.py and examples/rewrite_llama.py on a small random checkpoint, TP=3.

The Explicit-sharding Llama computes the project's Llama (models.llama through models.engine)
within f32 rounding, replicated and sequence-parallel; rewritten at int8 it computes
``comm="flash"``'s int8 within the same rounding (the quantization itself moves the logits by
orders of magnitude more); the report lists the two all-reduces of every block; the script's
``evaluate`` runs every setting.
"""

import dataclasses
import functools

import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import jax_flashcomm as fc
from examples import explicit_llama, rewrite_llama
from jax_flashcomm.nn import TPComm
from models.checkpoints import open_checkpoint
from models.engine import Engine
from models.llama.params import load_model

from tests.support.checkpoint_files import SMALL, write_hf

TP, T = 3, 24
CFG = fc.CommConfig(bits=8, min_bytes=0)
MODEL = dataclasses.replace(SMALL, n_heads=6, n_kv_heads=3, d_model=128, head_dim=16,
                            ffn_dim=192, vocab_size=64, n_layers=3)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("explicit_llama")
    write_hf(path, MODEL)
    return path


@pytest.fixture(scope="module")
def explicit(checkpoint):
    mesh = jax.make_mesh((TP,), ("tp",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:TP])
    with jax.set_mesh(mesh):
        yield mesh, *explicit_llama.load(open_checkpoint(checkpoint), mesh)


TOKENS = (np.arange(T, dtype=np.int32)[None] * 7) % MODEL.vocab_size


def _project_logits(checkpoint, comm):
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    model, _ = load_model(str(checkpoint), tp=TP, mesh=mesh, comm=comm)
    return np.asarray(Engine(model, mesh, cache_len=T).score(TOKENS))


def test_exact_and_int8_match_the_project_llama(checkpoint, explicit):
    mesh, dims, weights = explicit
    fn = functools.partial(explicit_llama.logits, dims)
    tokens = jax.device_put(TOKENS)
    exact = np.asarray(jax.jit(fn)(weights, tokens))
    sp = np.asarray(jax.jit(functools.partial(fn, sequence_parallel=True))(weights, tokens))
    rounding = 1e-5 * np.abs(exact).max()
    np.testing.assert_allclose(sp, exact, atol=rounding, rtol=0)
    np.testing.assert_allclose(exact, _project_logits(checkpoint, TPComm("exact", "tp")),
                               atol=rounding, rtol=0)
    report = fc.rewrite(fn, CFG).report(weights, tokens)
    assert [r.op for r in report] == ["psum"] * 2 * MODEL.n_layers
    assert report.counts() == {"quantized": 2 * MODEL.n_layers}
    assert [r.site.split(" ")[1] for r in report] == ["(_attention)", "(_mlp)"] * MODEL.n_layers
    int8 = np.asarray(jax.jit(fc.rewrite(fn, CFG))(weights, tokens))
    flash = _project_logits(checkpoint, TPComm("quantized", "tp", config=CFG))
    np.testing.assert_allclose(int8, flash, atol=rounding, rtol=0)
    assert np.abs(int8 - exact).max() > 100 * rounding


def test_the_script_evaluates_every_setting(explicit):
    _, dims, weights = explicit
    windows = [list(TOKENS[0, :12]), list(TOKENS[0, 12:])]
    results, reports = rewrite_llama.evaluate(dims, weights, windows, rewrite_llama.SETTINGS)
    assert set(results) == set(rewrite_llama.SETTINGS) and set(reports) == set(
        rewrite_llama.SETTINGS) - {"exact"}
    assert results["rewritten-exact"]["perplexity"] == pytest.approx(
        results["exact"]["perplexity"], rel=1e-6)
    assert reports["int8"].counts() == {"exact": 2 * MODEL.n_layers}    # below min_bytes
    fused = reports["int8-fused"]
    assert fused.counts("op") == {"all_gather": 2 * MODEL.n_layers + 1,
                                  "psum_scatter": 2 * MODEL.n_layers}
    # below min_bytes the reduce-scatters are exact, so every block's four pairs are rings; the
    # final gather feeds the tied head, contracted with the embedding's last dimension
    assert fused.counts() == {"fused": 4 * MODEL.n_layers, "exact": 1}
    for r in results.values():
        assert r["tokens"] == 22 and r["ttft_s"] > 0 and np.isfinite(r["perplexity"])


def test_fused_norm_islands_match_the_project_llama(checkpoint, explicit):
    """fuse_norm=True: every block's two all-reduces end in the residual add and the next
    RMSNorm (the last one in the final norm), so all become psum_add_rms_norm islands: exact,
    the model's bits; int8, TPComm("quantized", fuse_norm=True)'s logits within f32 rounding."""
    _, dims, weights = explicit
    fn = functools.partial(explicit_llama.logits, dims)
    tokens = jax.device_put(TOKENS)
    exact = np.asarray(jax.jit(fn)(weights, tokens))
    policy = fc.RewritePolicy(config=fc.CommConfig(bits=None), fuse_norm=True)
    report = fc.rewrite(fn, policy).report(weights, tokens)
    assert report.counts() == {"fused": 2 * MODEL.n_layers}
    assert all(r.detail.startswith("psum_add_rms_norm") for r in report)
    np.testing.assert_array_equal(np.asarray(jax.jit(fc.rewrite(fn, policy))(weights, tokens)),
                                  exact)
    int8 = np.asarray(jax.jit(fc.rewrite(fn, fc.RewritePolicy(config=CFG, fuse_norm=True)))(
        weights, tokens))
    flash = _project_logits(checkpoint, TPComm("quantized", "tp", config=CFG, fuse_norm=True))
    rounding = 1e-5 * np.abs(exact).max()
    np.testing.assert_allclose(int8, flash, atol=rounding, rtol=0)
    assert np.abs(int8 - exact).max() > 100 * rounding


def test_gspmd_variant_rewritten_like_the_explicit_one(checkpoint, explicit):
    """examples/gspmd_llama.py (the same weights on an Auto mesh, with_sharding_constraint):
    the same logits as the Explicit model; rewritten at int8, the same bits as the rewritten
    Explicit model; every collective XLA's partitioner inserts is replaced by an island."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    _, dims, weights = explicit
    tokens = jax.device_put(TOKENS)
    fn = functools.partial(explicit_llama.logits, dims)
    exact = np.asarray(jax.jit(fn)(weights, tokens))
    int8 = np.asarray(jax.jit(fc.rewrite(fn, CFG))(weights, tokens))
    mesh = jax.make_mesh((TP,), ("tp",), axis_types=(AxisType.Auto,), devices=jax.devices()[:TP])
    auto_dims, auto_weights = explicit_llama.load(open_checkpoint(checkpoint), mesh)
    auto_tokens = jax.device_put(TOKENS, NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):                  # leave the fixture's Explicit mesh context
        _gspmd_checks(mesh, auto_dims, auto_weights, auto_tokens, exact, int8)


def _gspmd_checks(mesh, auto_dims, auto_weights, auto_tokens, exact, int8):
    from examples import gspmd_llama

    for sp in (False, True):
        gspmd = functools.partial(gspmd_llama.logits, auto_dims, mesh, sequence_parallel=sp)
        np.testing.assert_allclose(np.asarray(jax.jit(gspmd)(auto_weights, auto_tokens)), exact,
                                   atol=1e-5 * np.abs(exact).max(), rtol=0)
        rewritten = fc.rewrite(gspmd, CFG)
        report = rewritten.report(auto_weights, auto_tokens)
        islands = [r for r in report if r.path != "partitioner"]
        inserted = report.where(path="partitioner")
        assert len(islands) == (4 * MODEL.n_layers + 1 if sp else 2 * MODEL.n_layers)
        assert len(inserted) == len(islands) and report.compile_seconds > 0
        assert all(r.action == "quantized" and "replaced by the rewrite's" in r.reason
                   for r in inserted)
        if not sp:
            np.testing.assert_array_equal(np.asarray(rewritten(auto_weights, auto_tokens)), int8)
    windows = [list(TOKENS[0, :12]), list(TOKENS[0, 12:])]
    results, reports = rewrite_llama.evaluate(auto_dims, auto_weights, windows,
                                              ("exact", "int8", "int8-fused"), style="gspmd",
                                              mesh=mesh)
    assert results["int8"]["report_compile_s"] > 0 and results["exact"]["report_compile_s"] is None
    assert all(np.isfinite(r["perplexity"]) for r in results.values())
    assert not any(r.action == "kept" for r in reports["int8-fused"])
