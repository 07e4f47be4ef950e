"""benchmarks/moe: the tiny MoE LM's training lowers its loss, its parameters survive a save and
a load, and block_error's top-1 comparison gives 100% for the exact EP model against itself."""

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from benchmarks.moe import block_error, tiny_lm  # noqa: E402

TINY = dict(vocab=256, d_model=32, n_layers=1, n_heads=2, n_experts=4, ffn_dim=32, top_k=2,
            context=16)


def test_training_lowers_the_loss(tmp_path):
    data = tiny_lm.split(tiny_lm.corpus_bytes("idle-help"))[0]
    cfg = dict(tiny_lm.TRAIN, steps=20, batch=8, lr=3e-3, warmup=5)
    params, history = tiny_lm.train(TINY, cfg, data, log=None)
    assert np.mean(history[-5:]) < np.mean(history[:5]) - 0.5
    path = tiny_lm.save(tmp_path / "lm.npz", params, TINY, cfg, {"x": 1})
    back, info = tiny_lm.load(path)
    assert info == {"model": TINY, "train": cfg, "meta": {"x": 1}}
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_exact_ep_model_agrees_with_itself():
    params, heads = tiny_lm.init(TINY)
    params = jax.tree.map(lambda a: a.astype(jnp.bfloat16), params)
    mesh = jax.make_mesh((block_error.N,), ("ep",), devices=jax.devices()[:block_error.N])
    ids = jax.random.randint(jax.random.key(1), (block_error.N, 8), 0, TINY["vocab"])
    ref = block_error.ep_logits(mesh, params, ids, heads, top_k=2, mode="ragged")
    same = block_error.ep_logits(mesh, params, ids, heads, "exact", "exact", top_k=2,
                                 mode="ragged")
    got = block_error.agreement(same, ref, np.asarray(ids))
    assert got["top-1 = exact"] == 1.0
    assert got["KL bits"] == pytest.approx(0.0, abs=1e-9)
    assert got["logits rel RMS"] == 0.0
    assert 0 < got["bits/byte"] < 16
