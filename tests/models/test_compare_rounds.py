"""``models.compare.run``'s timing rounds (``--rounds``, models.demo's default 3): every setting
timed in every round, the settings' generations advanced a token at a time in turn, then a few
prefills each in turn; its TTFT the median of those samples and its tokens/s those of all the
rounds' decode steps; the greedy answers are the first (untimed-round) generation's."""

import dataclasses
import statistics

import jax
import pytest

from jax_flashcomm.nn import TPComm
from models import demo
from models.compare import TTFT_REPEATS, interleaved, run, table
from models.llama.params import load_model
from tests.support.tiny_llama import TINY, DictCheckpoint

TP = 2


class ChatTokenizer:
    """Each UTF-8 byte a token id below TINY's vocabulary; a chat template that is the text."""

    eos_ids = ()

    def encode(self, text):
        return [3 + b % (TINY.vocab_size - 3) for b in text.encode()]

    def apply_chat_template(self, messages):
        return " ".join(m["content"] for m in messages)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def _rows(rounds, settings, max_new_tokens=5):
    mesh = jax.make_mesh((TP,), ("tp",), devices=jax.devices()[:TP])
    # no EOS (no early stop); a context for compare's 512-position cache
    ckpt = DictCheckpoint(dataclasses.replace(TINY, eos_token_ids=(), max_seq_len=512))
    ckpt.tokenizer = ChatTokenizer()
    model, ckpt = load_model(None, tp=TP, mesh=mesh, ckpt=ckpt)
    return run(model, ckpt, mesh, settings, prompts=["hello there"], max_new_tokens=max_new_tokens,
               rounds=rounds, log=open("/dev/null", "w"))


def test_rounds_time_every_setting_and_take_medians():
    settings = [("exact", TPComm("exact")), ("int8", TPComm("quantized", bits=8, min_bytes=0))]
    rows = _rows(3, settings)
    for row in rows:
        assert len(row["ttft_samples_s"]) == 3 * (1 + TTFT_REPEATS)
        assert len(row["decode_samples_s"]) == 3 * 4      # 5 tokens: the first is the TTFT
        assert row["ttft_s"] == statistics.median(row["ttft_samples_s"])
        assert row["tokens_per_s_median"] == 1 / statistics.median(row["decode_samples_s"])
        assert row["tokens_per_s"] == pytest.approx(12 / sum(row["decode_samples_s"]))
    assert rows[0]["match_prefix"] == [5]                  # exact against itself


def test_one_round_is_one_generation_and_rounds_must_be_positive():
    rows = _rows(1, [("exact", TPComm("exact"))])
    assert len(rows[0]["ttft_samples_s"]) == 1 and len(rows[0]["decode_samples_s"]) == 4
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        _rows(0, [("exact", TPComm("exact"))])


def test_demo_rejects_zero_rounds(capsys):
    with pytest.raises(SystemExit) as e:
        demo.main(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds must be >= 1" in capsys.readouterr().err


def test_the_table_shows_no_nan_and_wire_comes_from_the_plans():
    """Without --text there is no perplexity and with --max-new-tokens 1 no decode step: the
    table says "-" rather than "nan"; each row's wire ratio is that of the calls that ran."""
    settings = [("exact", TPComm("exact")), ("int8", TPComm("quantized", bits=8, min_bytes=0))]
    rows = _rows(1, settings, max_new_tokens=1)
    assert "tokens_per_s" not in rows[0]
    text = table(rows, TP)
    assert "nan" not in text.lower(), text
    assert [line.split()[1] for line in text.splitlines()[1:]] == ["-", "-"]  # perplexity
    assert rows[0]["wire_vs_bf16"] == 1.0
    assert 0.5 < rows[1]["wire_vs_bf16"] < 0.6  # int8 codes + bf16 scale and zero per group


class _FakeEngine:
    def __init__(self, name, log):
        self.name, self.log, self.last_timings = name, log, None

    def generate(self, steps):
        self.last_timings = {"ttft": 1.0, "decode": []}
        for k in range(steps):
            self.log.append((self.name, k))
            if k:
                self.last_timings["decode"].append(0.5)
            yield k


def test_interleaved_advances_the_settings_a_token_at_a_time_in_turn():
    log, active = [], []

    def retimer(name, steps):
        engine = _FakeEngine(name, log)

        def retime(max_new=steps):
            return engine, engine.generate(max_new), lambda: active.append(name)
        return retime

    out = interleaved([retimer("a", 3), retimer("b", 2)])
    generation = log[:5]
    assert generation == [("a", 0), ("b", 0), ("a", 1), ("b", 1), ("a", 2)]
    assert active[:5] == ["a", "b", "a", "b", "a"]  # each step runs with its own setting set
    assert log[5:] == [("a", 0), ("b", 0)] * TTFT_REPEATS
    assert out == [([1.0] * (1 + TTFT_REPEATS), [0.5, 0.5]), ([1.0] * (1 + TTFT_REPEATS), [0.5])]
