"""Per-site communication overrides of a Llama (models.llama.set_comm(overrides=...))."""

import jax
import numpy as np
import pytest

from jax_flashcomm import CommConfig
from jax_flashcomm.nn import TPComm
from models.engine import Engine
from models.llama import layer_segments, set_comm
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint

TOKENS = np.random.RandomState(3).randint(0, TINY.vocab_size, size=(1, 12)).astype(np.int32)
INT4 = TPComm("quantized", config=CommConfig(bits=4, min_bytes=0))
INT8 = TPComm("quantized", config=CommConfig(bits=8, min_bytes=0))


def _model(tp=4):
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    model, _ = load_model(None, tp=tp, mesh=mesh, ckpt=DictCheckpoint())
    return model, mesh


def _prefill(model, mesh, comm, overrides=None):
    """Logits of the last prompt token and the (k, v) caches, as numpy."""
    engine = Engine(set_comm(model, comm, overrides=overrides), mesh, cache_len=16)
    logits, (k, v) = engine.prefill(TOKENS, engine.new_cache(1))
    return np.asarray(logits), np.asarray(k), np.asarray(v)


def test_override_acts_at_its_site_only():
    """One quantized all-reduce changes what comes after its site and nothing before it: with
    layer 1's MLP all-reduce at int4 every KV cache entry is exact's bit for bit (layer 1's
    keys and values come before its MLP) and the logits are not; with layer 0's MLP at int4
    layer 0's cache is exact's and layer 1's is not."""
    model, mesh = _model()
    exact = _prefill(model, mesh, TPComm("exact"))
    late = _prefill(model, mesh, TPComm("exact"), {(1, "mlp"): INT4})
    np.testing.assert_array_equal(late[1], exact[1])
    np.testing.assert_array_equal(late[2], exact[2])
    assert not np.array_equal(late[0], exact[0])
    early = _prefill(model, mesh, TPComm("exact"), {(0, "mlp"): INT4})
    np.testing.assert_array_equal(early[1][0], exact[1][0])
    assert not np.array_equal(early[1][1], exact[1][1])
    attn = _prefill(model, mesh, TPComm("exact"), {(0, "attn"): INT4})
    assert not np.array_equal(attn[0], early[0])


def test_overrides_everywhere_equal_the_comm_itself():
    """Overriding every site with one comm gives that comm's results bit for bit (the layers
    then run as separate scans: the same arithmetic), and an override equal to the model's
    comm is dropped."""
    model, mesh = _model()
    whole = _prefill(model, mesh, INT8)
    every = {(layer, site): INT8 for layer in range(TINY.n_layers) for site in ("attn", "mlp")}
    for got, want in zip(_prefill(model, mesh, TPComm("exact"), every), whole):
        np.testing.assert_array_equal(got, want)
    mixed = {(0, "attn"): INT8, (1, "mlp"): INT8}
    for got, want in zip(_prefill(model, mesh, INT4, mixed),
                         _prefill(model, mesh, INT8, {(0, "mlp"): INT4, (1, "attn"): INT4})):
        np.testing.assert_array_equal(got, want)
    set_comm(model, INT8, overrides={(0, "mlp"): INT8})
    assert model.comm_overrides == ()


def test_layer_segments():
    a, b = INT4, INT8
    assert layer_segments(3, ()) == [(0, 3, ())]
    overrides = (((1, "attn"), a), ((1, "mlp"), b), ((2, "attn"), a))
    assert layer_segments(4, overrides) == [(0, 1, ()), (1, 2, (("attn", a), ("mlp", b))),
                                            (2, 3, (("attn", a),)), (3, 4, ())]


def test_bad_overrides_raise():
    model, _ = _model(2)
    exact = TPComm("exact")
    with pytest.raises(ValueError, match="site"):
        set_comm(model, exact, overrides={(0, "qkv"): INT4})
    with pytest.raises(ValueError, match="layer"):
        set_comm(model, exact, overrides={(TINY.n_layers, "mlp"): INT4})
    with pytest.raises(TypeError, match="TPComm"):
        set_comm(model, exact, overrides={(0, "mlp"): CommConfig(bits=4)})
    with pytest.raises(ValueError, match="axis"):
        set_comm(model, exact, overrides={(0, "mlp"): TPComm("quantized", "other")})
    with pytest.raises(ValueError, match="layout"):
        set_comm(model, exact, overrides={(0, "mlp"): TPComm(layout="sequence_parallel")})
    with pytest.raises(TypeError, match="Llama"):
        set_comm(model.blocks, exact, overrides={(0, "mlp"): INT4})
