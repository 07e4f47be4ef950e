"""benchmarks/llm/ttft/p2p.py: the bytes its p2p rows move (the transport's own timeline against
the ring traffic benchmarks/llm/ttft/links.py computes), its FLOP share and exposure arithmetic, its table."""

import contextlib

import jax
import numpy as np
import pytest

from benchmarks.llm.ttft import settings

from benchmarks.llm.ttft import p2p as ttft_p2p
from jax_flashcomm.nn import TPComm
from jax_flashcomm.transport import ring_steps
from models.checkpoints.llama_config import LlamaConfig
from models.engine import Engine
from models.llama.params import load_model
from tests.support.tiny_llama import DictCheckpoint, tiny_tensors

TINY3 = LlamaConfig(vocab_size=101, d_model=64, n_layers=2, n_heads=6, n_kv_heads=3,
                    head_dim=16, ffn_dim=100, max_seq_len=256, eos_token_ids=(2,))


def test_p2p_prefill_moves_the_ring_bytes_of_the_traffic_model():
    """One TP=3 overlap prefill on the p2p rings: every rank receives exactly the per-layer ring
    bytes of settings.step_traffic, in 2 L x 2 (N - 1) moves, paced or not."""
    mesh = jax.make_mesh((3,), ("tp",), devices=jax.devices()[:3])
    comm = TPComm(layout="sequence_parallel", transport="p2p")
    model, _ = load_model(None, tp=3, mesh=mesh, comm=comm,
                          ckpt=DictCheckpoint(TINY3, tiny_tensors(TINY3)))
    ids = list(range(3, 33))
    for rate in (None, 200e6):
        with ring_steps.link_emulation(rate) if rate else contextlib.nullcontext():
            engine = Engine(model, mesh, cache_len=64)
            list(engine.generate(ids, 1))   # traced here: the rate is read at trace time
        with ring_steps.recording() as events:
            list(engine.generate(ids, 1))
        want = settings.step_traffic(TINY3, 3, comm, engine.bucket(len(ids)), decode=False)
        for rank in range(3):
            moves = [e for e in events if e["kind"] == "move" and e["rank"] == rank]
            assert len(moves) == 2 * TINY3.n_layers * 2 * (3 - 1)
            assert sum(e["bytes"] for e in moves) == want["blocks"]


def test_ring_dot_share_and_exposure():
    smol = LlamaConfig(vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3,
                       head_dim=64, ffn_dim=1536)
    share = ttft_p2p.ring_dot_share(smol, 129)
    rest = settings.prefill_flops(smol, 129) * (1 - share)
    attention_and_head = 30 * 2 * 2 * 129 * 129 * 576 + 2 * 576 * 49152
    assert rest == pytest.approx(attention_and_head, rel=1e-9)
    assert ttft_p2p.exposed_fraction(1.5, 1.0, 1.0) == pytest.approx(0.5)
    assert ttft_p2p.exposed_fraction(2.0, 1.0, 1.0) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ttft_p2p.exposed_fraction(1.0, 1.0, 0.0)
    system = settings.SYSTEMS["pcie"]
    assert ttft_p2p.per_link_rate(3e10, system, 3) * 3 == pytest.approx(
        settings.link_rate(3e10, system))


def test_markdown_rows():
    data = {"machine": "m", "tp": 3, "prompt_tokens": 128, "reps": 5, "prefill_flops": 2.9e10,
            "achieved_flops_per_s": 3e10, "ring_dot_share": 0.9,
            "rows": [{"strategy": "exact", "transport": "-", "link": "unpaced",
                      "rate_bytes_per_s": None, "ttft_s": 0.9},
                     {"strategy": "overlap", "transport": "p2p", "link": "matched",
                      "rate_bytes_per_s": 2e7, "ttft_s": 1.2, "bytes_into_rank0": 2**23,
                      "moves_into_rank0": 240, "comm_s": 0.4, "hidden_s": 0.1,
                      "exposed": 0.75}]}
    table = ttft_p2p.markdown(data)
    assert "| exact | - | memcpy | 900 ms | - | - | - | - |" in table
    assert ("| overlap | p2p | matched: 20.00 MB/s | 1200 ms | 8.00 MiB (240 moves) | 400 ms "
            "| 100 ms | **0.75** |") in table
    assert np.isclose(data["ring_dot_share"], 0.9)
