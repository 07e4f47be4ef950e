r"""The tokenizer of a checkpoint: a ``tokenizers`` BPE (byte-level, GPT-2 style, or SentencePiece
style with byte fallback), plus the checkpoint's Jinja chat template.

Built either from a GGUF file's metadata (``tokenizer.ggml.*``: tokens, merges or scores, token
types, bos / eos ids, ``tokenizer.chat_template``; :mod:`models.tokenizer_gguf` says which
pipelines it builds: SmolLM2's, Qwen2's, Gemma's / Llama's SentencePiece) or from the
``tokenizer.json`` / ``tokenizer_config.json`` of a Hugging Face directory; :meth:`Tokenizer.save`
writes the latter pair.

Control tokens are special tokens, so ``"<|im_start|>"`` written in text is one id. A checkpoint
without a chat template (e.g. a Gemma GGUF that carries none) refuses
:meth:`Tokenizer.apply_chat_template` with a ``ValueError``.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Sequence

import tokenizers

from models import tokenizer_gguf
from models.chat_template import compile_template, render

__all__ = ["Tokenizer"]


def _token_content(tok) -> str | None:
    if tok is None or isinstance(tok, str):
        return tok
    if isinstance(tok, dict):
        return tok.get("content")
    return None


class Tokenizer:
    """Text ↔ ids and the chat template of a checkpoint."""

    def __init__(self, tok: tokenizers.Tokenizer, *, bos_id: int | None = None,
                 eos_ids: Sequence[int] = (), chat_template: str | None = None,
                 add_bos: bool = False):
        self.tok = tok
        self.bos_id = None if bos_id is None else int(bos_id)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        self.chat_template = chat_template
        self.add_bos = bool(add_bos)  # the checkpoint's own default (llama.cpp add_bos_token)
        self._template = None

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, reader) -> "Tokenizer":
        """From the metadata of a ``gguf.GGUFReader`` (``tokenizer.ggml.model`` ``"gpt2"`` or
        ``"llama"``: :mod:`models.tokenizer_gguf`).

        Raises:
          ValueError: a tokenizer model or pre-tokenizer that module does not support.
        """
        t = tokenizer_gguf.build(reader)
        return cls(t.tok, bos_id=t.bos_id, eos_ids=t.eos_ids, chat_template=t.chat_template,
                   add_bos=t.add_bos)

    @classmethod
    def from_files(cls, directory) -> "Tokenizer":
        """From ``tokenizer.json`` and (if present) ``tokenizer_config.json``,
        ``chat_template.jinja`` and ``generation_config.json`` of a directory."""
        d = pathlib.Path(directory)
        if not (d / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}")
        try:
            tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
            cfg = {}
            if (d / "tokenizer_config.json").is_file():
                cfg = json.loads((d / "tokenizer_config.json").read_text(encoding="utf-8"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ValueError(f"{d}: unreadable tokenizer.json / tokenizer_config.json "
                             f"({type(e).__name__}: {e})") from None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")

        def tid(content):
            return None if content is None else tok.token_to_id(content)

        bos = tid(_token_content(cfg.get("bos_token")))
        eos = [tid(_token_content(cfg.get("eos_token")))]
        if (d / "generation_config.json").is_file():
            gen = json.loads((d / "generation_config.json").read_text(encoding="utf-8"))
            g = gen.get("eos_token_id")
            eos += list(g) if isinstance(g, (list, tuple)) else [g]
            if bos is None:
                bos = gen.get("bos_token_id")
        eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
        return cls(tok, bos_id=bos, eos_ids=eos_ids, chat_template=template,
                   add_bos=bool(cfg.get("add_bos_token", False)))

    def save(self, directory) -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` into ``directory``."""
        d = pathlib.Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        self.tok.save(str(d / "tokenizer.json"))
        added = {}
        for i, t in sorted(self.tok.get_added_tokens_decoder().items()):
            added[str(i)] = {"content": t.content, "lstrip": t.lstrip, "rstrip": t.rstrip,
                             "normalized": t.normalized, "single_word": t.single_word,
                             "special": t.special}
        cfg: dict[str, Any] = {
            # not GPT2Tokenizer: transformers 5 rebuilds that class's own pipeline (plain
            # ByteLevel, no Digits) instead of using tokenizer.json as written
            "tokenizer_class": "PreTrainedTokenizerFast",
            "add_bos_token": self.add_bos, "add_prefix_space": False,
            "clean_up_tokenization_spaces": False,
            "bos_token": self.id_to_token(self.bos_id),
            "eos_token": self.id_to_token(self.eos_ids[0]) if self.eos_ids else None,
            "unk_token": getattr(self.tok.model, "unk_token", None),
            "added_tokens_decoder": added,
        }
        if self.chat_template is not None:
            cfg["chat_template"] = self.chat_template
        (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False)
                                                 + "\n", encoding="utf-8")

    # -- use ------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def id_to_token(self, i: int | None) -> str | None:
        return None if i is None else self.tok.id_to_token(int(i))

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """The ids of ``text`` (special tokens written in it become their ids); ``add_bos``
        prepends the BOS id."""
        ids = self.tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens included unless ``skip_special_tokens``)."""
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            **kwargs) -> str:
        """The prompt text of ``messages`` (``[{"role": ..., "content": ...}, ...]``) under the
        checkpoint's chat template.

        Rendered the way ``transformers`` renders chat templates (``utils/chat_template_utils.py``):
        a sandboxed Jinja environment with ``trim_blocks`` / ``lstrip_blocks`` and the
        ``loopcontrols`` extension, a ``tojson`` filter that does not HTML-escape, and the
        ``raise_exception`` / ``strftime_now`` globals; ``bos_token`` / ``eos_token`` are passed as
        strings. Extra keyword arguments become template variables.

        The render is bounded (the ``TEMPLATE_*`` limits of :mod:`models.chat_template`): every
        loop step, call, attribute lookup and operator checks a deadline of
        ``TEMPLATE_TIME_LIMIT_S``; ``*``, ``**``, ``+``, ``%``, ``~`` and the filters and methods
        that can multiply a size refuse a result larger than ``TEMPLATE_MAX_SIZE`` before they
        build it; ``range`` stops at ``TEMPLATE_MAX_RANGE`` items and the output at
        ``TEMPLATE_MAX_OUTPUT`` characters.

        Raises:
          models.chat_template.ChatTemplateError: (a ``ValueError``) whatever stopped the
            render, limit or error.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = compile_template(self.chat_template)
        variables = {"bos_token": self.id_to_token(self.bos_id) or "",
                     "eos_token": self.id_to_token(self.eos_ids[0]) if self.eos_ids else "",
                     "tools": None, "documents": None, **kwargs}
        return render(self._template, messages=messages,
                       add_generation_prompt=add_generation_prompt, **variables)
