r"""A ``tokenizers.Tokenizer`` from the tokenizer metadata of a GGUF file (``tokenizer.ggml.*``),
built to tokenize as llama.cpp does (``src/llama-vocab.cpp``) and laid out like the model's own
Hugging Face ``tokenizer.json``. :meth:`models.tokenizer.Tokenizer.from_gguf` is the entry point.

``tokenizer.ggml.model`` picks the kind:

``gpt2``: byte-level BPE over ``tokenizer.ggml.tokens`` / ``merges``, no unknown token, ByteLevel
decoder. ``tokenizer.ggml.pre`` picks the split before BPE:

- ``smollm`` (and ``starcoder``, ``refact``, ``command-r``): no normalizer; pre-tokenizer
  ``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False,
  use_regex=True)])``, SmolLM2's own pipeline (llama.cpp's split: ``\p{N}``, then GPT-2's
  regex).
- ``gpt-2`` (and ``phi-2``, ``mpt``): GPT-2's regex alone, ``ByteLevel(use_regex=True)``.
- ``qwen2``: Qwen2's own pipeline: normalizer NFC; pre-tokenizer ``Sequence([Split(Regex(
  QWEN2_SPLIT), behavior="isolated"), ByteLevel(add_prefix_space=False, use_regex=False)])``:
  contractions, letters with at most one non-letter before them, every ``\p{N}`` alone,
  punctuation runs, newlines, spaces. ``QWEN2_SPLIT`` is llama.cpp's spelling of the regex of
  Qwen2's ``tokenizer.json``: ``'[sS]``... for ``(?i:'s...)``, which also takes a character that
  case-folds to one of those letters (``'ſ``). llama.cpp applies no normalizer, so on text not in
  NFC (``"e\u0301"``) it, and transformers' GGUF conversion, give other ids than this one.

``llama``: SentencePiece BPE (Gemma, Llama 2): ``tokenizer.ggml.tokens`` with ``scores`` and
``<0xXX>`` byte tokens, no merges. Built as Hugging Face's Gemma / Llama ``tokenizer.json``:
normalizer ``Replace(" ", "▁")``, after a ``Prepend("▁")`` when ``tokenizer.ggml.add_space_prefix``
is true (llama.cpp's default when the key is absent: it puts that space before the text and
after every special token, as the normalizer does on each piece between them); no pre-tokenizer;
BPE with ``byte_fallback=True`` and the unknown token, over the merges :func:`spm_merges` derives
from the vocabulary and scores; decoder ``Sequence([Replace("▁", " "), ByteFallback(), Fuse()])``
(then ``Strip(" ", 1, 0)`` with the space prefix); with ``add_bos_token`` a post-processor that
prepends BOS, for the saved ``tokenizer.json``. llama.cpp merges the adjacent pair whose merged
token scores best, the leftmost on a tie, and spells a character that is no token as its UTF-8
bytes; the ranked merges do the same wherever different tokens have different scores, as in
Gemma's and Llama's vocabularies. Only ``tokenizer.ggml.pre`` ``default`` (or none) is accepted:
llama.cpp splits nothing for this kind.

Both: control and unknown tokens (token types 3 and 2) are special tokens, so
``"<|im_start|>"`` in text is one id; user-defined tokens (type 4: ``<tool_call>``, Gemma's
``"\n\n"`` and runs of spaces, which its GGUF spells with real spaces) are added tokens matched in
the raw text before the normalizer, as llama.cpp partitions them out first. Other ``model`` /
``pre`` names are refused.

Note: ``transformers``' own GGUF tokenizer conversion (5.x) departs from llama.cpp twice. It has
no entry for ``smollm`` and falls back to GPT-2's split: SmolLM2's merges never touch an ASCII
digit, so the two agree on ASCII text, and differ around non-ASCII numerals (``²``, ``٣``,
``Ⅻ``: a run of them, or one after a space), which GPT-2's split lets BPE merge and llama.cpp's /
HF's ``Digits`` keep apart. For Gemma it respells the runs of spaces as ``"▁▁"``... and ranks
merges by token position, so runs of 32 spaces or more, and ``"▁"`` written in the text next to
a space or another ``"▁"``, come out otherwise than in llama.cpp.
"""

from __future__ import annotations

from typing import NamedTuple

import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors

__all__ = ["GGUFTokenizer", "QWEN2_SPLIT", "build", "spm_merges"]

_UNKNOWN = 2  # llama.cpp's LLAMA_TOKEN_TYPE_UNKNOWN (Llama 2's <unk>)
_CONTROL = 3  # LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4
# ``tokenizer.ggml.pre`` names whose split llama.cpp does as ``\p{N}`` then GPT-2's regex, i.e.
# every numeric character alone: HF's ``Digits(individual_digits=True)`` (Rust
# ``char::is_numeric``, \p{N}) followed by ``ByteLevel(use_regex=True)``.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r"})
# ... and those llama.cpp splits with GPT-2's regex alone: ``ByteLevel(use_regex=True)``.
_GPT2 = frozenset({"gpt-2", "phi-2", "mpt"})
# llama.cpp's LLAMA_VOCAB_PRE_TYPE_QWEN2 regex (Qwen2's tokenizer.json writes the contractions
# as ``(?i:'s|'t|'re|'ve|'m|'ll|'d)``).
QWEN2_SPLIT = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
               r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_QWEN2 = frozenset({"qwen2"})
_SPM_PRE = frozenset({None, "default"})  # llama.cpp has no pre-tokenizer for SentencePiece


class GGUFTokenizer(NamedTuple):
    """What a GGUF says about its tokenizer: the built tokenizer and the special ids."""
    tok: tokenizers.Tokenizer
    bos_id: int | None
    eos_ids: tuple[int, ...]
    chat_template: str | None
    add_bos: bool


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def build(reader) -> GGUFTokenizer:
    """The tokenizer of a ``gguf.GGUFReader``'s metadata (see the module docstring).

    Raises:
      ValueError: a ``tokenizer.ggml.model`` or ``tokenizer.ggml.pre`` not supported.
    """
    kind = _field(reader, "tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_bpe(reader)
    elif kind == "llama":
        tok = _sentencepiece_bpe(reader)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level BPE, "
                         f"'gpt2', and SentencePiece BPE, 'llama')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
               for i, t in enumerate(types) if t in (_CONTROL, _UNKNOWN)]
    user = [tokenizers.AddedToken(tokens[i], special=False, normalized=False)
            for i, t in enumerate(types) if t == _USER_DEFINED]
    if special:
        tok.add_special_tokens(special)
    if user:
        tok.add_tokens(user)
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    eot = _field(reader, "tokenizer.ggml.eot_token_id")
    eos_ids = tuple(dict.fromkeys(i for i in (eos, eot) if i is not None))
    add_bos = _field(reader, "tokenizer.ggml.add_bos_token", kind == "llama")  # llama.cpp default
    if kind == "llama" and add_bos and bos is not None and 0 <= bos < len(tokens):
        # as HF's Gemma / Llama tokenizer.json (only ``encode(add_special_tokens=True)`` of the
        # saved files sees it: Tokenizer.encode adds the BOS itself)
        b = tokens[bos]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, bos)])
    return GGUFTokenizer(tok, bos, eos_ids, _field(reader, "tokenizer.chat_template"),
                         bool(add_bos))


def _byte_level_bpe(reader) -> tokenizers.Tokenizer:
    tokens = _field(reader, "tokenizer.ggml.tokens")
    merges = _field(reader, "tokenizer.ggml.merges") or []
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tok = tokenizers.Tokenizer(bpe)
    pre = _field(reader, "tokenizer.ggml.pre")  # absent: llama.cpp's "default" split
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True,
                                          use_regex=True)
    if pre in _DIGITS_THEN_GPT2:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True), byte_level])
    elif pre in _GPT2:
        tok.pre_tokenizer = byte_level
    elif pre in _QWEN2:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(QWEN2_SPLIT), behavior="isolated",
                                 invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                     use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False,
                                                  use_regex=False)
        return tok
    else:
        known = _DIGITS_THEN_GPT2 | _GPT2 | _QWEN2
        raise ValueError(f"GGUF pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported "
                         f"for tokenizer model 'gpt2' (known: {', '.join(sorted(known))})")
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False,
                                              use_regex=True)
    return tok


def spm_merges(tokens, scores) -> list[tuple[str, str]]:
    """The BPE merges a SentencePiece vocabulary implies, best first: every ``(left, right)``
    whose parts and concatenation are all tokens, ranked by the score of the concatenation
    (higher first), then the longer ``left``, then the longer ``right``, then token order (as
    ``transformers``' ``generate_merges(vocab, vocab_scores)``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, map(float, scores)))  # a repeated token: first place, last score
    found = []
    for token, s in score.items():
        local = []
        for k in range(1, len(token)):
            left = token[:k]
            if left in vocab:
                right = token[k:]
                if right in vocab:
                    local.append((vocab[left], vocab[right], left, right))
        local.sort()
        for _, _, left, right in local:
            found.append((-s, -len(left), -len(right), len(found), left, right))
    found.sort()
    return [(m[4], m[5]) for m in found]


def _sentencepiece_bpe(reader) -> tokenizers.Tokenizer:
    pre = _field(reader, "tokenizer.ggml.pre")
    if pre not in _SPM_PRE:
        raise ValueError(f"GGUF pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported for "
                         f"tokenizer model 'llama' (SentencePiece splits nothing: only 'default')")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    scores = _field(reader, "tokenizer.ggml.scores") or [0.0] * len(tokens)
    if len(scores) != len(tokens):
        raise ValueError(f"GGUF tokenizer.ggml.scores has {len(scores)} entries for "
                         f"{len(tokens)} tokens")
    unk_id = _field(reader, "tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if unk_id is not None and 0 <= unk_id < len(tokens) else None
    vocab = {t: i for i, t in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=spm_merges(tokens, scores), unk_token=unk,
                     fuse_unk=True, byte_fallback=True)
    tok = tokenizers.Tokenizer(bpe)
    replace = normalizers.Replace(" ", "▁")
    decode = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if _field(reader, "tokenizer.ggml.add_space_prefix", True):
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), replace])
        decode.append(decoders.Strip(" ", 1, 0))
    else:
        tok.normalizer = replace
    tok.decoder = decoders.Sequence(decode)
    return tok
