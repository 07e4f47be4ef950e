r"""The tokenizer of a checkpoint: byte-level BPE (GPT-2 style) through the ``tokenizers`` library,
plus the checkpoint's Jinja chat template.

Built either from a GGUF file's metadata (``tokenizer.ggml.*``: tokens, merges, token types, bos /
eos ids, ``tokenizer.chat_template``) or from the ``tokenizer.json`` / ``tokenizer_config.json``
of a Hugging Face directory; :meth:`Tokenizer.save` writes the latter pair.

For a GGUF (``tokenizer.ggml.model == "gpt2"``) the pipeline is the one of SmolLM2's own
``tokenizer.json`` when ``tokenizer.ggml.pre`` is ``smollm``: no normalizer; pre-tokenizer
``Sequence([Digits(individual_digits=True), ByteLevel(add_prefix_space=False, use_regex=True)])``
(llama.cpp's ``smollm`` split: ``\p{N}``, then GPT-2's regex); BPE over the vocabulary and
merges, no unknown token; ByteLevel decoder. Control tokens (GGUF token type 3) are special
tokens, so ``"<|im_start|>"`` in text is one id. Other ``pre`` names are refused unless known to
split the same way (or as plain GPT-2).

Note: ``transformers``' own GGUF tokenizer conversion (5.x) has no entry for ``smollm`` and
falls back to GPT-2's split. SmolLM2's merges never touch an ASCII digit, so the two agree on
ASCII text; they differ around non-ASCII numerals (``²``, ``٣``, ``Ⅻ``: a run of them, or one
after a space), which GPT-2's split lets BPE merge and llama.cpp's / HF's ``Digits`` keep apart.
"""

from __future__ import annotations

import functools
import json
import math
import pathlib
import threading
import time
from typing import Any, Sequence

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, processors

__all__ = ["Tokenizer", "ChatTemplateError", "TEMPLATE_TIME_LIMIT_S", "TEMPLATE_MAX_OUTPUT",
           "TEMPLATE_MAX_SIZE", "TEMPLATE_MAX_RANGE"]

#: Limits of one chat template render (the template is data from the checkpoint file, so it is
#: bounded in work, not only in what it may call): wall time, ...
TEMPLATE_TIME_LIMIT_S = 2.0
#: ... characters of the rendered prompt, ...
TEMPLATE_MAX_OUTPUT = 1 << 22
#: ... the size of any value the template builds (a string's characters, a container's items
#: counted deep; also the largest int argument a filter or method takes: a width, a count), ...
TEMPLATE_MAX_SIZE = 1 << 21
#: ... the items of one ``range()``, ...
TEMPLATE_MAX_RANGE = 10_000
#: ... and the bits of an int a ``*`` or ``**`` makes.
TEMPLATE_MAX_INT_BITS = 4096


class ChatTemplateError(ValueError):
    """The chat template failed to compile or render: a syntax error, the template's own
    ``raise_exception``, a sandbox refusal, or one of the limits above."""


_CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_USER_DEFINED = 4
# ``tokenizer.ggml.pre`` names whose split llama.cpp (src/llama-vocab.cpp) does as ``\p{N}`` then
# GPT-2's regex, i.e. every numeric character alone: HF's ``Digits(individual_digits=True)``
# (Rust ``char::is_numeric``, \p{N}) followed by ``ByteLevel(use_regex=True)``.
_DIGITS_THEN_GPT2 = frozenset({"smollm", "starcoder", "refact", "command-r"})
# ... and those llama.cpp splits with GPT-2's regex alone: ``ByteLevel(use_regex=True)``.
_GPT2 = frozenset({"gpt-2", "phi-2", "mpt"})


def _field(reader, key, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


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
        """From the metadata of a ``gguf.GGUFReader`` (``tokenizer.ggml.model == "gpt2"``)."""
        kind = _field(reader, "tokenizer.ggml.model")
        if kind != "gpt2":
            raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (only byte-level "
                             f"BPE, 'gpt2')")
        tokens = _field(reader, "tokenizer.ggml.tokens")
        merges = _field(reader, "tokenizer.ggml.merges") or []
        types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
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
        else:
            raise ValueError(f"GGUF pre-tokenizer (tokenizer.ggml.pre) {pre!r} is not supported "
                             f"(known: {', '.join(sorted(_DIGITS_THEN_GPT2 | _GPT2))})")
        tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True,
                                         use_regex=True)
        tok.post_processor = processors.ByteLevel(add_prefix_space=True, trim_offsets=False,
                                                  use_regex=True)
        special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False)
                   for i, t in enumerate(types) if t == _CONTROL]
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
        return cls(tok, bos_id=bos, eos_ids=eos_ids,
                   chat_template=_field(reader, "tokenizer.chat_template"),
                   add_bos=bool(_field(reader, "tokenizer.ggml.add_bos_token", False)))

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
            "unk_token": None, "added_tokens_decoder": added,
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

        The render is bounded (the ``TEMPLATE_*`` limits of this module): every loop step, call,
        attribute lookup and operator checks a deadline of ``TEMPLATE_TIME_LIMIT_S``; ``*``,
        ``**``, ``+``, ``%``, ``~`` and the filters and methods that can multiply a size refuse a
        result larger than ``TEMPLATE_MAX_SIZE`` before they build it; ``range`` stops at
        ``TEMPLATE_MAX_RANGE`` items and the output at ``TEMPLATE_MAX_OUTPUT`` characters.

        Raises:
          ChatTemplateError: (a ``ValueError``) whatever stopped the render, limit or error.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        variables = {"bos_token": self.id_to_token(self.bos_id) or "",
                     "eos_token": self.id_to_token(self.eos_ids[0]) if self.eos_ids else "",
                     "tools": None, "documents": None, **kwargs}
        return _render(self._template, messages=messages,
                       add_generation_prompt=add_generation_prompt, **variables)


class _Limit(BaseException):
    """A template limit: a BaseException so that nothing inside Jinja (filters that catch
    ValueError, ``default``...) can swallow it; :func:`_render` turns it into
    :class:`ChatTemplateError`."""


def _weight(x, budget: int = TEMPLATE_MAX_SIZE) -> int:
    """The size of ``x`` counted deep (characters of strings, 1 per item plus the items'
    weights), stopping once it exceeds ``budget``."""
    if isinstance(x, (str, bytes, bytearray)):
        return len(x)
    if isinstance(x, dict):
        x = [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple, set, frozenset)):
        total = len(x)
        for item in x:
            if total > budget:
                break
            total += _weight(item, budget - total)
        return total
    return 1


def _refuse_size(size: int, what: str) -> None:
    if size > TEMPLATE_MAX_SIZE:
        raise _Limit(f"chat template: {what} would build a value of {size} items, more than "
                     f"the limit {TEMPLATE_MAX_SIZE}")


def _refuse_ints(args, what: str) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > TEMPLATE_MAX_SIZE:
            raise _Limit(f"chat template: {what} with the argument {a}, above the limit "
                         f"{TEMPLATE_MAX_SIZE}")


def _format_widths(fmt: str) -> int:
    """The largest width or precision written in a ``%`` or ``{}`` format string (``*``
    counts as unbounded)."""
    if "*" in fmt and "%" in fmt:
        return TEMPLATE_MAX_SIZE + 1
    import re

    return max((int(n) for n in re.findall(r"\d+", fmt) if len(n) < 30), default=0) \
        if "%" in fmt or "{" in fmt else 0


def _estimate(name: str, args) -> int | None:
    """A bound on the size of ``name(*args)`` for the operations that multiply sizes."""
    if name == "join" and args:  # the filter: (items, separator)
        items, sep = args[0], args[1] if len(args) > 1 else ""
        return _weight(items) + len(items) * len(sep) if isinstance(sep, str) else None
    if name == "replace" and len(args) >= 3 and all(isinstance(a, str) for a in args[:3]):
        s, old, new = args[:3]
        n = len(s) + 1 if not old else s.count(old)
        return len(s) + n * max(len(new) - len(old), 0)
    if name == "indent" and args and isinstance(args[0], str):
        width = args[1] if len(args) > 1 else 4
        w = len(width) if isinstance(width, str) else int(width or 0)
        return len(args[0]) + (args[0].count("\n") + 1) * w
    if name in ("format", "%") and args and isinstance(args[0], str):
        return len(args[0]) + _format_widths(args[0]) + _weight(list(args[1:]))
    return None


def _guard_filter(name: str, f):
    """The filter ``f`` that refuses big int arguments, a result it can tell will be too big
    before building it, and any too big result; it checks the deadline first."""
    @functools.wraps(f)
    def guarded(*args, **kwargs):
        _tick()
        skip = sum(1 for a in args[:1] if hasattr(a, "environment"))  # a context / eval ctx
        if name == "join" and len(args) > skip and not isinstance(args[skip], (str, list)):
            args = (*args[:skip], list(args[skip]), *args[skip + 1:])  # counted, then joined
        plain = list(args[skip:])
        _refuse_ints([*plain, *kwargs.values()], f"the filter {name}")
        bound = _estimate(name, plain)
        if bound is not None:
            _refuse_size(bound, f"the filter {name}")
        out = f(*args, **kwargs)
        _refuse_size(_weight(out), f"the filter {name}")
        return out

    return guarded


_STATE = threading.local()  # the deadline of the render in progress on this thread


def _tick() -> None:
    deadline = getattr(_STATE, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise _Limit(f"chat template: rendering took longer than {TEMPLATE_TIME_LIMIT_S} s")


def _range(*args):
    _tick()
    r = range(*args)
    if len(r) > TEMPLATE_MAX_RANGE:
        raise _Limit(f"chat template: range of {len(r)} items, more than the limit "
                     f"{TEMPLATE_MAX_RANGE}")
    return r


def _render(template, **variables) -> str:
    _STATE.deadline = time.monotonic() + TEMPLATE_TIME_LIMIT_S
    pieces, size = [], 0
    try:
        for piece in template.generate(**variables):
            size += len(piece)
            if size > TEMPLATE_MAX_OUTPUT:
                raise _Limit(f"chat template: the output exceeds {TEMPLATE_MAX_OUTPUT} "
                             f"characters")
            pieces.append(piece)
            _tick()
    except _Limit as e:
        raise ChatTemplateError(str(e)) from None
    except RecursionError:
        raise ChatTemplateError("chat template: recursion too deep") from None
    except MemoryError:
        raise ChatTemplateError("chat template: out of memory") from None
    except Exception as e:  # noqa: BLE001 - the template is data: any failure is its error
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e
    finally:
        _STATE.deadline = None
    return "".join(pieces)


def _compile_template(source: str):
    """A chat template compiled in a bounded sandbox (see :meth:`Tokenizer.apply_chat_template`)
    that renders like ``transformers``' one."""
    import datetime

    import jinja2.ext
    from jinja2 import nodes, pass_context
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            _tick()
            ints = all(isinstance(v, int) for v in (left, right))
            if operator == "*" and ints:
                bits = abs(left).bit_length() + abs(right).bit_length()
                if bits > TEMPLATE_MAX_INT_BITS:
                    raise _Limit(f"chat template: {left} * {right} has more than "
                                 f"{TEMPLATE_MAX_INT_BITS} bits")
            elif operator == "*":
                seq, n = (left, right) if isinstance(right, int) else (right, left)
                if isinstance(n, int) and not isinstance(seq, (int, float)):
                    _refuse_size(_weight(seq) * max(n, 0), f"'*' of {type(seq).__name__}")
            elif operator == "**" and ints and abs(left) > 1:
                if right * math.log2(abs(left)) > TEMPLATE_MAX_INT_BITS:
                    raise _Limit(f"chat template: {left} ** {right} has more than "
                                 f"{TEMPLATE_MAX_INT_BITS} bits")
            elif operator == "+" and not ints:
                _refuse_size(_weight(left) + _weight(right), "'+'")
            elif operator == "%" and isinstance(left, str):
                _refuse_size(_estimate("%", [left, right]), "'%' formatting")
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - Jinja's signature
            _tick()
            if __obj is not _range:
                _refuse_ints([*args, *kwargs.values()], f"the call of {__obj!r}"[:80])
                method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
                name = getattr(method, "__name__", "")
                owner = getattr(method, "__self__", None)
                if isinstance(owner, str):
                    if name == "join" and args and not isinstance(args[0], (str, list)):
                        args = (list(args[0]), *args[1:])  # counted, then joined
                    bound = _estimate(name, [*args[:1], owner] if name == "join"
                                      else [owner, *args])
                    if bound is not None:
                        _refuse_size(bound, f"str.{name}")
            out = super().call(__context, __obj, *args, **kwargs)
            _refuse_size(_weight(out), f"the call of {getattr(__obj, '__name__', 'a function')}")
            return out

        def getattr(self, obj, attribute):
            _tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            _tick()
            return super().getitem(obj, argument)

    @pass_context
    def bounded_iter(context, iterable):
        """A loop's iterable, checking the deadline at every step."""
        for item in iterable:
            _tick()
            yield item

    @pass_context
    def bounded_concat(context, parts):
        """``a ~ b``, refused when the result would be too big."""
        texts = [str(p) for p in parts]
        _refuse_size(sum(len(t) for t in texts), "'~'")
        return "".join(texts)

    class Bound(NodeTransformer):
        """Loops iterate through ``bounded_iter``; ``~`` goes through ``bounded_concat``."""

        def visit_For(self, node):
            self.generic_visit(node)
            node.iter = nodes.Filter(node.iter, "_bounded_iter", [], [], None, None,
                                     lineno=node.lineno)
            return node

        def visit_Concat(self, node):
            self.generic_visit(node)
            return nodes.Filter(nodes.List(node.nodes, lineno=node.lineno), "_bounded_concat",
                                [], [], None, None, lineno=node.lineno)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _guard_filter(name, f) for name, f in env.filters.items()}
    env.filters["_bounded_iter"] = bounded_iter
    env.filters["_bounded_concat"] = bounded_concat
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.globals["range"] = _range
    try:
        return env.from_string(Bound().visit(env.parse(source)))
    except _Limit as e:
        raise ChatTemplateError(str(e)) from None
    except RecursionError:
        raise ChatTemplateError("chat template: nested too deep to compile") from None
    except Exception as e:  # noqa: BLE001 - a syntax error, or anything the compiler raises
        raise ChatTemplateError(f"chat template: {type(e).__name__}: {e}") from e
