r"""The GGUF tokenizer families :mod:`models.tokenizer_gguf` builds besides SmolLM2's: Qwen2
(``gpt2`` model, ``qwen2`` pre-tokenizer) and SentencePiece BPE (``llama`` model: Gemma, Llama 2).

The fast tests write small synthetic GGUFs (tokenizer metadata only, ``gguf.GGUFWriter``) and
check encodings derived by hand from the vocabularies below (llama.cpp, through llama-cpp-python
0.3.36, tokenizes these synthetic files the same way). The ``slow`` test at the end checks
the real Qwen2.5-Coder-1.5B-Instruct and Gemma 3 270M GGUFs, where present, against fixed ids.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from models.tokenizer import Tokenizer
from models.tokenizer_gguf import QWEN2_SPLIT, spm_merges

NORMAL, UNKNOWN, CONTROL, USER, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def byte_chars() -> list[str]:
    """GPT-2's byte → printable character table, indexed by byte value."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    table = dict(zip(bs, cs))
    return [chr(table[b]) for b in range(256)]


def write_tokenizer_gguf(path, *, model, tokens, types, pre=None, merges=None, scores=None,
                         bos=None, eos=None, unk=None, pad=None, add_bos=None,
                         add_space_prefix=None, chat_template=None) -> Tokenizer:
    """A GGUF holding only tokenizer metadata; returns ``Tokenizer.from_gguf`` of it."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is not None:
        w.add_token_merges(merges)
    if scores is not None:
        w.add_token_scores(scores)
    for value, add in ((bos, w.add_bos_token_id), (eos, w.add_eos_token_id),
                       (unk, w.add_unk_token_id), (pad, w.add_pad_token_id),
                       (add_bos, w.add_add_bos_token), (add_space_prefix, w.add_add_space_prefix),
                       (chat_template, w.add_chat_template)):
        if value is not None:
            add(value)
    for step in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file,
                 w.close):
        step()
    return Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


# -- Qwen2: byte-level BPE, qwen2 split ---------------------------------------------------------

# ids 0..255: the byte-level character of byte i; then merged tokens, then added tokens
QWEN_MERGES = ["Ġ t", "h e", "Ġt he", "' s", "1 2", "Ġ 1", "Ã ©", "i t"]
QWEN_EXTRA = [m.replace(" ", "") for m in QWEN_MERGES]  # 256 Ġt, 257 he, 258 Ġthe, 259 's,
# 260 12, 261 Ġ1, 262 Ã© (é in UTF-8), 263 it
QWEN_SPECIAL = [("<|endoftext|>", CONTROL), ("<|im_start|>", CONTROL), ("<|im_end|>", CONTROL),
                ("<tool_call>", USER), ("[PAD268]", UNUSED)]  # 264..268
QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                 "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                 "{% endif %}")


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    tokens = byte_chars() + QWEN_EXTRA + [t for t, _ in QWEN_SPECIAL]
    types = [NORMAL] * (256 + len(QWEN_EXTRA)) + [k for _, k in QWEN_SPECIAL]
    return write_tokenizer_gguf(
        tmp_path_factory.mktemp("qwen") / "qwen.gguf", model="gpt2", pre="qwen2",
        tokens=tokens, types=types, merges=QWEN_MERGES, bos=264, eos=266, pad=264,
        add_bos=False, chat_template=QWEN_TEMPLATE)


def test_qwen2_merges_within_words(qwen):
    # "the": "h e" only ("Ġt he" needs the space); " theme": Ġt, he, then Ġthe
    assert qwen.encode("the theme") == [ord("t"), 257, 258, ord("m"), ord("e")]
    assert qwen.decode(qwen.encode("the theme")) == "the theme"


def test_qwen2_digits_one_at_a_time_and_contractions(qwen):
    # it | 's | " " | 2 | 0 | 1 | 2 | ! : every \p{N} alone, so neither "1 2" nor "Ġ 1" applies
    assert qwen.encode("it's 2012!") == [263, 259, 32, 50, 48, 49, 50, 33]
    assert qwen.encode(" 12") == [32, 49, 50]
    # 'S is a contraction too (no merge for it: two byte tokens); "'x" is not one
    assert qwen.encode("IT'S") == [ord("I"), ord("T"), ord("'"), ord("S")]
    pre = qwen.tok.pre_tokenizer.pre_tokenize_str
    assert [p for p, _ in pre("IT'S it'x")] == ["IT", "'S", "Ġit", "'x"]
    # llama.cpp's spelling of the contractions: 'ſ (which case-folds to s) is no contraction
    assert [p for p, _ in pre("x'ſt")] == ["x", "'Å¿t"]


def test_qwen2_split_of_spaces_newlines_and_punctuation(qwen):
    pre = qwen.tok.pre_tokenizer.pre_tokenize_str
    # \s+(?!\S) leaves the last space of a run to the word after it
    assert [p for p, _ in pre("a  b\n\n  c?!\n")] == ["a", "Ġ", "Ġb", "ĊĊ", "Ġ", "Ġc", "?!Ċ"]
    assert [p for p, _ in pre("x   ")] == ["x", "ĠĠĠ"]
    assert "'[sS]" in QWEN2_SPLIT


def test_qwen2_nfc_normalizer(qwen):
    # "e" + U+0301 is composed to é (C3 A9 → "Ã©", id 262) before the split
    assert qwen.encode("cafe\u0301") == qwen.encode("café") == [99, 97, 102, 262]


def test_qwen2_special_tokens(qwen):
    ids = qwen.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids == [265, 117, 115, 101, 114, 10, 104, 105, 266]
    assert qwen.decode(ids, skip_special_tokens=True) == "user\nhi"
    assert qwen.encode("<tool_call>x") == [267, ord("x")]  # user-defined: whole, not special
    assert qwen.decode([267], skip_special_tokens=True) == "<tool_call>"
    # an unused (type 5) token is plain text: "[PAD" | 2 | 6 | 8 | ]
    assert qwen.encode("[PAD268]") == [91, 80, 65, 68, 50, 54, 56, 93]
    assert (qwen.bos_id, qwen.eos_ids, qwen.add_bos) == (264, (266,), False)


def test_qwen2_chat_template(qwen):
    text = qwen.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert qwen.encode(text)[:2] == [265, 117] and qwen.encode(text)[-1] == 10


def test_gpt2_unknown_pre_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre.*'qwen35'.*qwen2"):
        write_tokenizer_gguf(tmp_path / "t.gguf", model="gpt2", pre="qwen35",
                             tokens=byte_chars(), types=[NORMAL] * 256, merges=[])


def test_unknown_model_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer model 'bert' is not supported"):
        write_tokenizer_gguf(tmp_path / "t.gguf", model="bert", tokens=["a"], types=[NORMAL])


# -- SentencePiece BPE (llama model) ------------------------------------------------------------

SPM_HEAD = [("<pad>", CONTROL, 0.0), ("<eos>", CONTROL, 0.0), ("<bos>", CONTROL, 0.0),
            ("<unk>", UNKNOWN, 0.0), ("<start_of_turn>", CONTROL, 0.0), ("\n", USER, 0.0),
            ("  ", USER, 0.0)]  # 0..6; Gemma's GGUF spells its runs of spaces with real spaces
BYTES = [(f"<0x{b:02X}>", BYTE, 0.0) for b in range(256)]  # 7..262
# 263.. (the single characters' scores never matter: no merge yields a single character)
SPM_PIECES = [(c, NORMAL, -100.0) for c in "▁abcehlo"] + [
    ("ab", NORMAL, -3.0),     # 271: listed before "bc"...
    ("bc", NORMAL, -1.0),     # 272: ... but scores better
    ("he", NORMAL, -2.0),     # 273
    ("ll", NORMAL, -4.0),     # 274
    ("llo", NORMAL, -5.0),    # 275
    ("hello", NORMAL, -6.0),  # 276
    ("▁hello", NORMAL, -7.0),  # 277
    ("▁b", NORMAL, -8.0),     # 278
]
SPM = SPM_HEAD + BYTES + SPM_PIECES
ID = {t: i for i, (t, _, _) in enumerate(SPM)}


def spm(path, **kw):
    return write_tokenizer_gguf(
        path, model="llama", pre="default", tokens=[t for t, _, _ in SPM],
        types=[k for _, k, _ in SPM], scores=[s for _, _, s in SPM],
        **{"bos": 2, "eos": 1, "unk": 3, "pad": 0, **kw})


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    return spm(tmp_path_factory.mktemp("gemma") / "gemma.gguf", add_bos=True,
               add_space_prefix=False)


def test_spm_merges_from_scores():
    tokens = [t for t, _, _ in SPM]
    merges = spm_merges(tokens, [s for _, _, s in SPM])
    # by the merged token's score, best first (bytes and specials split into no two tokens)
    assert merges == [("b", "c"), ("h", "e"), ("a", "b"), ("l", "l"), ("ll", "o"),
                      ("he", "llo"), ("▁", "hello"), ("▁", "b")]
    assert spm_merges(["a", "aa", "aaa"], [0, -1, -2]) == [("a", "a"), ("aa", "a"), ("a", "aa")]
    # equal scores: the longer left part first, then the longer right part, then token order
    assert spm_merges(["a", "aa", "aaa"], [0, -1, -1]) == [("aa", "a"), ("a", "aa"), ("a", "a")]
    assert spm_merges(["b", "a", "ba", "ab"], [0, 0, -1, -1]) == [("b", "a"), ("a", "b")]


def test_spm_merge_order_is_the_score(gemma):
    # "ab" comes first in the vocabulary, "bc" scores better: a | bc (llama.cpp's choice)
    assert gemma.encode("abc") == [ID["a"], ID["bc"]]
    # h e l l o → he l l o → he ll o → he llo → hello
    assert gemma.encode("hello") == [ID["hello"]]


def test_spm_spaces_and_no_prefix(gemma):
    # add_space_prefix false: no "▁" in front; a space is "▁" and merges as one
    assert gemma.encode("hello hello") == [ID["hello"], ID["▁hello"]]
    assert gemma.encode(" b") == [ID["▁b"]]
    # the user-defined "  " is matched in the raw text first, as llama.cpp partitions it out:
    # "a   b" is a | "  " | ▁b, and "\n" is one token
    assert gemma.encode("a  b") == [ID["a"], ID["  "], ID["b"]]
    assert gemma.encode("a   b\n") == [ID["a"], ID["  "], ID["▁b"], ID["\n"]]
    for text in ("hello hello", "a   b\n", " b  "):
        assert gemma.decode(gemma.encode(text)) == text


def test_spm_byte_fallback(gemma):
    # "€" (E2 82 AC) and "d" are no tokens: their UTF-8 bytes
    ids = gemma.encode("a€d")
    assert ids == [ID["a"], 7 + 0xE2, 7 + 0x82, 7 + 0xAC, 7 + ord("d")]
    assert gemma.decode(ids) == "a€d"
    assert gemma.decode([7 + 0xE2]) == "\ufffd"  # a lone continuation-less byte


def test_spm_special_tokens_bos_and_template(gemma):
    ids = gemma.encode("<start_of_turn>hello<eos>")
    assert ids == [4, ID["hello"], 1]
    assert gemma.decode(ids, skip_special_tokens=True) == "hello"
    assert gemma.encode("a<unk>") == [ID["a"], 3]  # the unknown token (type 2) is special too
    assert (gemma.bos_id, gemma.eos_ids, gemma.add_bos) == (2, (1,), True)
    assert gemma.encode("abc", add_bos=True) == [2, ID["a"], ID["bc"]]
    assert gemma.tok.encode("abc").ids == [2, ID["a"], ID["bc"]]  # saved files add it too
    with pytest.raises(ValueError, match="no chat template"):
        gemma.apply_chat_template([{"role": "user", "content": "hi"}])


def test_spm_save_round_trip(gemma, tmp_path):
    gemma.save(tmp_path)
    back = Tokenizer.from_files(tmp_path)
    for text in ("abc hello", "a   b\n€", "<start_of_turn>x"):
        assert back.encode(text) == gemma.encode(text)
    assert (back.bos_id, back.eos_ids, back.add_bos) == (2, (1,), True)


def test_spm_space_prefix(tmp_path):
    """``add_space_prefix`` (llama.cpp's default for SentencePiece): a "▁" before the text and
    after every special token, as llama.cpp adds a space there; decode drops the first."""
    tok = spm(tmp_path / "llama.gguf")  # no add_bos / add_space_prefix keys: both default true
    assert tok.add_bos
    assert tok.encode("hello") == [ID["▁hello"]]
    assert tok.encode("<start_of_turn>hello") == [4, ID["▁hello"]]
    assert tok.encode("b") == [ID["▁b"]]
    assert tok.decode(tok.encode("hello hello")) == "hello hello"


def test_spm_unknown_pre_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"tokenizer.ggml.pre.*'llama3'.*'llama'"):
        write_tokenizer_gguf(tmp_path / "t.gguf", model="llama", pre="llama3", tokens=["a"],
                             types=[NORMAL], scores=[0.0])


# -- the real checkpoints -----------------------------------------------------------------------

REAL = Path(os.environ.get("TOKENIZER_GGUF_DIR", "/work/dl"))

# (text, ids): the ids transformers 5 gives (``AutoTokenizer.from_pretrained(dir,
# gguf_file=...)``, ``encode(text, add_special_tokens=False)``); llama.cpp (llama-cpp-python
# 0.3.36, ``tokenize(text, add_bos=False, special=True)``) gives the same ones.
QWEN_IDS = [
    ("Hello world, I'm here!  12345 €", [9707, 1879, 11, 358, 2776, 1588, 0, 220, 220, 16, 17,
                                         18, 19, 20, 12984]),
    ("def f(x):\n    return x*2\n\n\n", [750, 282, 2075, 982, 262, 470, 856, 9, 17, 1406]),
    ("naïve café 🚀 中文", [3376, 37572, 586, 51950, 11162, 248, 222, 72858, 16744]),
    ("<|im_start|>user\nHi<|im_end|>\n<tool_call>", [151644, 872, 198, 13048, 151645, 198,
                                                       151657]),
]
GEMMA_IDS = [
    ("Hello world, I'm here!  12345 €", [9259, 1902, 236764, 564, 236789, 236757, 1590, 236888,
                                         138, 236770, 236778, 236800, 236812, 236810, 11361]),
    ("def f(x):\n    return x*2\n\n\n", [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123,
                                         236829, 236778, 109]),
    ("naïve café 🚀 中文", [1789, 238527, 560, 33443, 236743, 242015, 17346, 237364]),
    ("<start_of_turn>user\nHi<end_of_turn>\n<b>", [105, 2364, 107, 10979, 106, 107, 200]),
]
# Where transformers' conversion differs, llama.cpp's ids (the ones these tokenizers give):
# Qwen2 on text not in NFC: ours composes it first (the NFC of Qwen2's tokenizer.json) and
# gives the ids of "é"; llama.cpp and transformers do not ([68, 53839]: "e", then U+0301).
QWEN_NFC = ("e\u0301", [963])
# Gemma on a run of 32+ spaces: llama.cpp matches the longest user-defined run (31 spaces, id 167)
# first; transformers respells those tokens "▁▁..." and merges them (16 + 16 spaces, [152, 152]).
GEMMA_SPACES = (" " * 32, [167, 236743])


def _real(name):
    path = REAL / f"{name}.gguf"
    if not path.is_file():
        pytest.skip(f"no {path} (set TOKENIZER_GGUF_DIR)")
    import gguf

    return Tokenizer.from_gguf(gguf.GGUFReader(str(path)))


@pytest.mark.slow
def test_real_qwen_and_gemma():
    qwen = _real("qwen")
    assert (qwen.vocab_size, qwen.bos_id, qwen.eos_ids, qwen.add_bos) == (
        151936, 151643, (151645,), False)
    for text, ids in QWEN_IDS + [QWEN_NFC]:
        assert qwen.encode(text) == ids, text
    assert qwen.decode(QWEN_IDS[0][1]) == QWEN_IDS[0][0]
    assert qwen.apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
        "assistant.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    del qwen
    gemma = _real("gemma")
    assert (gemma.vocab_size, gemma.bos_id, gemma.eos_ids, gemma.add_bos) == (
        262144, 2, (1,), True)
    for text, ids in GEMMA_IDS + [GEMMA_SPACES]:
        assert gemma.encode(text) == ids, text
        assert gemma.decode(ids) == text
    with pytest.raises(ValueError, match="no chat template"):  # the GGUF carries none
        gemma.apply_chat_template([{"role": "user", "content": "Hi"}])
