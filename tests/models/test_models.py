"""The TP Llama of models/ on a tiny random checkpoint: TP sizes and communication strategies
against TP=1, f32 against f64, prefill/decode against scoring, compile counts, sampling, errors.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_flashcomm import CommConfig
from jax_flashcomm.nn import TPComm
from models.engine import Engine, Sampling, sample
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint
from tests.support.meshes import AXIS_TYPES
from tests.support.pairwise import all_pairs

TOKENS = np.random.RandomState(1).randint(0, TINY.vocab_size, size=(2, 16)).astype(np.int32)


def _engine(tp, comm=None, dtype=jnp.float32, ckpt=None, axis_type=None, cache_len=64):
    kw = {} if axis_type is None else {"axis_types": (axis_type,)}
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp], **kw)
    model, _ = load_model(None, tp=tp, mesh=mesh, comm=comm, dtype=dtype,
                          ckpt=ckpt or DictCheckpoint())
    return Engine(model, mesh, cache_len=cache_len)


@pytest.fixture(scope="module")
def reference():
    """TP=1 logits in f32, and in f64 (the exact function, up to f64 rounding)."""
    f32 = np.asarray(_engine(1).score(TOKENS), np.float64)
    with jax.enable_x64(True):
        f64 = np.asarray(_engine(1, dtype=jnp.float64).score(TOKENS))
    return f32, f64


# Each TP with each kind and axis type, each kind with each axis type (all pairs).
TP_ROWS = all_pairs([2, 4, 8], ["exact", "overlap"], sorted(AXIS_TYPES))


@pytest.mark.default_xla_opt  # the TP=1 run's error is the yardstick: measured on default code
@pytest.mark.parametrize("tp,kind,axis_type", [(n, k, AXIS_TYPES[t]) for n, k, t in TP_ROWS],
                         ids=[f"{t}-{k}-{n}" for n, k, t in TP_ROWS])
def test_tp_logits_equal_tp1_within_f32_rounding(reference, tp, kind, axis_type):
    """An exact TP=N run is another f32 evaluation of the same function (sums reassociated
    across ranks): it must be as close to the f64 logits as the TP=1 f32 run is (tolerance:
    twice the TP=1 run's own f32 error, measured against f64)."""
    f32, f64 = reference
    e1 = np.abs(f32 - f64).max()
    out = np.asarray(_engine(tp, TPComm.from_kind(kind), axis_type=axis_type).score(TOKENS), np.float64)
    assert 0 < e1 < 1e-4 * np.abs(f64).max()
    assert np.abs(out - f64).max() <= 2 * e1
    assert np.abs(out - f32).max() <= 3 * e1


def test_flash_error_shrinks_with_bits(reference):
    """Quantized all-reduces perturb the logits, less at 8 bits than at 4; with min_bytes above
    every message the flash strategy is the exact one, bit for bit."""
    f32, _ = reference
    exact4 = np.asarray(_engine(4).score(TOKENS))
    err = {}
    for bits in (4, 8):
        out = _engine(4, TPComm("quantized", config=CommConfig(bits=bits, min_bytes=0)))
        err[bits] = np.abs(np.asarray(out.score(TOKENS)) - exact4).max()
    assert 0 < err[8] < err[4]
    off = _engine(4, TPComm("quantized", config=CommConfig(bits=4, min_bytes=1 << 30)))
    np.testing.assert_array_equal(np.asarray(off.score(TOKENS)), exact4)


@pytest.mark.parametrize("tp,kind", [(1, "exact"), (4, "exact"), (4, "overlap"),
                                     (4, "flash+overlap")])
def test_prefill_and_decode_match_scoring(tp, kind):
    """Logits of the cached path (prefill, then one decode step per token) equal those of
    scoring the whole sequence at once (same arithmetic up to f32 summation order)."""
    engine = _engine(tp, TPComm.from_kind(kind))
    full = np.asarray(engine.score(TOKENS[:1]))[0]
    cache = engine.new_cache(1)
    logits, cache = engine.prefill(TOKENS[:1, :9], cache)
    tol = 1e-5 * np.abs(full).max() * (50 if kind == "flash+overlap" else 1)
    if kind != "flash+overlap":
        np.testing.assert_allclose(np.asarray(logits)[0], full[8], atol=tol, rtol=0)
    for pos in range(9, 12):
        _, logits, cache = engine.decode(TOKENS[:1, pos], pos, cache, jax.random.key(0))
        if kind != "flash+overlap":
            np.testing.assert_allclose(np.asarray(logits)[0], full[pos], atol=tol, rtol=0)


def test_one_compile_per_bucket_and_one_decode():
    """A generation traces its prefill once per bucket and its decode step once, however many
    tokens and prompts."""
    engine = _engine(2, cache_len=128)
    for prompt_len in (5, 9, 31, 40):
        list(engine.generate(TOKENS[0, :1].repeat(prompt_len), 6))
    assert engine.traces == {("prefill", 32): 1, ("prefill", 64): 1, "decode": 1}


def test_sampling():
    logits = jnp.asarray(np.random.RandomState(0).randn(4, 50), jnp.float32)
    greedy = np.argmax(np.asarray(logits), axis=-1)
    key = jax.random.key(3)
    np.testing.assert_array_equal(sample(logits, key, Sampling()), greedy)
    np.testing.assert_array_equal(sample(logits, key, Sampling(1.0, top_k=1)), greedy)
    np.testing.assert_array_equal(sample(logits, key, Sampling(1.0, top_p=1e-6)), greedy)
    top3 = np.argsort(-np.asarray(logits), axis=-1)[:, :3]
    for seed in range(20):
        ids = np.asarray(sample(logits, jax.random.key(seed), Sampling(2.0, top_k=3)))
        assert all(i in row for i, row in zip(ids, top3))
    with pytest.raises(ValueError, match="top_p"):
        Sampling(1.0, top_p=0)


def test_clear_errors():
    with pytest.raises(ValueError, match="TP size 3 does not divide the 8 query heads"):
        _engine(3)
    engine = _engine(2, cache_len=32)
    with pytest.raises(ValueError, match="longer than the KV cache"):
        engine.prefill(np.zeros((1, 40), np.int32), engine.new_cache(1))
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        list(engine.generate([1, 2, 3], 40))
    with pytest.raises(ValueError, match="unknown communication kind"):
        TPComm.from_kind("fast")


def test_params_follow_llama_sharding_and_no_device_holds_everything():
    """Every parameter's placement is the one LlamaSharding names, and each device of a TP=4
    mesh holds a quarter of every sharded array (the checkpoint was read shard by shard)."""
    from flax import nnx

    from models.llama import LlamaSharding

    engine = _engine(4)
    s = LlamaSharding("tp")
    expected = {("embed", "embedding"): s.embedding, ("blocks", "attn", "qkv", "kernel"): s.qkv,
                ("blocks", "attn", "o", "kernel"): s.o,
                ("blocks", "mlp", "gate_up", "kernel"): s.gate_up,
                ("blocks", "mlp", "down", "kernel"): s.down,
                ("blocks", "attn_norm", "scale"): s.block_norm,
                ("blocks", "mlp_norm", "scale"): s.block_norm, ("norm", "scale"): s.final_norm}
    flat = dict(nnx.to_flat_state(engine.state))
    assert {tuple(map(str, k)) for k in flat} == set(expected)
    for path, var in flat.items():
        spec = expected[tuple(map(str, path))]
        array = var.get_value()
        assert array.sharding.spec == spec
        if "tp" in spec:
            dim = list(spec).index("tp")
            assert all(sh.data.shape[dim] * 4 == array.shape[dim]
                       for sh in array.addressable_shards)
    k, _ = engine.new_cache(1)
    assert k.sharding.spec == s.kv_cache


def test_untied_lm_head():
    """An untied checkpoint uses its own lm_head.weight (vocabulary-parallel like the
    embedding): TP=2 equals TP=1 (within the derived tolerance of the test above), and the
    logits differ from the tied model's."""
    import dataclasses

    from tests.support.tiny_llama import tiny_tensors

    cfg = dataclasses.replace(TINY, tie_embeddings=False)
    ckpt = DictCheckpoint(cfg, tiny_tensors(cfg))
    one = np.asarray(_engine(1, ckpt=ckpt).score(TOKENS), np.float64)
    two = np.asarray(_engine(2, ckpt=ckpt).score(TOKENS), np.float64)
    with jax.enable_x64(True):
        f64 = np.asarray(_engine(1, ckpt=ckpt, dtype=jnp.float64).score(TOKENS))
    assert np.abs(two - f64).max() <= 2 * np.abs(one - f64).max()
    head = ckpt.tensors["lm_head.weight"]
    assert np.abs(one).max() > 0 and head.shape == (TINY.vocab_size, TINY.d_model)
    tied = np.asarray(_engine(1).score(TOKENS))
    assert np.abs(tied - one).max() > 1


@pytest.mark.parametrize("kind", ["overlap", "flash+overlap"])
def test_overlap_rings_on_the_p2p_transport_match_xla(kind):
    """TPComm(transport="p2p") runs the model's ring matmuls as p2p start/done steps (one
    process, the virtual devices as peers), inside the layer scan: the same bits as the xla
    transport's ppermute rings, prefill and scoring; a bad name is a clear error."""
    runs = {}
    for transport in ("xla", "p2p"):
        engine = _engine(4, TPComm.from_kind(kind, transport=transport))
        logits, _ = engine.prefill(TOKENS[:1, :12], engine.new_cache(1))
        runs[transport] = (np.asarray(engine.score(TOKENS)), np.asarray(logits))
    for got, want in zip(runs["p2p"], runs["xla"]):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="transport"):
        TPComm(layout="sequence_parallel", transport="nccl")
