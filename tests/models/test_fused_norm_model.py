"""The Llama with TPComm(fuse_norm=True) (every all-reduce fused with the residual add and the
next RMSNorm, docs/fused_norm.md): the exact strategy gives the unfused logits bit for bit
(scoring, prefill and decode, 2-D and 3-D activations inside), the quantized one stays within
the quantized all-reduce's own distance from the exact logits, and the fused op is what runs
(the plan records it)."""

import jax
import numpy as np
import pytest

import jax_flashcomm as fc
from jax_flashcomm import CommConfig
from jax_flashcomm.nn import TPComm
from models.engine import Engine
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint

TOKENS = np.random.RandomState(1).randint(0, TINY.vocab_size, size=(2, 16)).astype(np.int32)


def _engine(tp, comm):
    mesh = jax.make_mesh((tp,), ("tp",), devices=jax.devices()[:tp])
    model, _ = load_model(None, tp=tp, mesh=mesh, comm=comm, ckpt=DictCheckpoint())
    return Engine(model, mesh, cache_len=64)


@pytest.mark.parametrize("tp", [2, 4])
def test_exact_fused_equals_unfused(tp):
    plain, fused = _engine(tp, TPComm("exact")), _engine(tp, TPComm("exact", fuse_norm=True))
    with fc.record() as plans:
        got = np.asarray(fused.score(TOKENS))
    np.testing.assert_array_equal(got, np.asarray(plain.score(TOKENS)))
    fused_plans = [p for p in plans if p.op == "psum_add_rms_norm"]
    assert len(fused_plans) == 2 and all(p.path == "lax" for p in fused_plans)  # 2 per block
    cache_a, cache_b = plain.new_cache(1), fused.new_cache(1)
    la, cache_a = plain.prefill(TOKENS[:1, :9], cache_a)
    lb, cache_b = fused.prefill(TOKENS[:1, :9], cache_b)
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))
    _, la, _ = plain.decode(TOKENS[:1, 9], 9, cache_a, jax.random.key(0))
    _, lb, _ = fused.decode(TOKENS[:1, 9], 9, cache_b, jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(la), np.asarray(lb))


def test_quantized_fused_close_to_unfused():
    config = CommConfig(bits=8, min_bytes=0)
    exact = np.asarray(_engine(4, TPComm("exact")).score(TOKENS))
    plain = np.asarray(_engine(4, TPComm("quantized", config=config)).score(TOKENS))
    with fc.record() as plans:
        fused = np.asarray(_engine(4, TPComm("quantized", config=config, fuse_norm=True))
                           .score(TOKENS))
    assert any(p.op == "psum_add_rms_norm" and p.quantized for p in plans)
    err_plain, err_fused = np.abs(plain - exact).max(), np.abs(fused - exact).max()
    assert 0 < err_fused <= 2 * err_plain, (err_fused, err_plain)


def test_fuse_norm_is_a_tpcomm_option():
    comm = TPComm("quantized", fuse_norm=True, bits=4)
    assert comm.fuse_norm and comm.config.bits == 4
    assert not TPComm("exact").fuse_norm
    assert TPComm("exact", fuse_norm=True) != TPComm("exact")
