"""The sandbox a checkpoint's Jinja chat template renders in: the template is data from the
checkpoint file, so its render is bounded in work (the ``TEMPLATE_*`` limits), not only in what
it may call; every failure is a :class:`ChatTemplateError`.

Also the one place that decides how a CLI hands a user prompt to a model
(:func:`prompt_ids`): inside the chat template, or, for a checkpoint that carries none (Gemma 3
270M's GGUF), the prompt itself after BOS.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import threading
import time
import weakref

__all__ = ["ChatTemplateError", "compile_template", "render", "prompt_ids", "NO_TEMPLATE_NOTE",
           "TEMPLATE_TIME_LIMIT_S", "TEMPLATE_MAX_OUTPUT", "TEMPLATE_MAX_SIZE",
           "TEMPLATE_MAX_RANGE", "TEMPLATE_MAX_INT_BITS"]

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



class _Limit(BaseException):
    """A template limit: a BaseException so that nothing inside Jinja (filters that catch
    ValueError, ``default``...) can swallow it; :func:`render` turns it into
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


def render(template, **variables) -> str:
    """The text of a compiled template (:func:`compile_template`) with ``variables``, within
    the limits.

    Raises:
      ChatTemplateError: whatever stopped the render, limit or error.
    """
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


def compile_template(source: str):
    # long function: the sandbox subclasses jinja2's classes, and jinja2 loads only with a template
    """A chat template compiled in a bounded sandbox that renders like ``transformers``' one
    (:meth:`models.tokenizer.Tokenizer.apply_chat_template` says how it is bounded).

    Raises:
      ChatTemplateError: a syntax error, or a limit met while compiling.
    """
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


#: What :func:`prompt_ids` says (once per tokenizer) when the checkpoint has no chat template.
NO_TEMPLATE_NOTE = ("note: the checkpoint has no chat template: each prompt is given as it is, "
                    "after BOS")
_NOTED = weakref.WeakSet()  # the tokenizers the note was printed for


def prompt_ids(tok, prompt: str, log=None) -> list[int]:
    """The token ids a CLI gives the model for the user prompt ``prompt``: the checkpoint's chat
    template around it (one user message, then the generation prompt), or, when the tokenizer
    has no chat template (``tok.chat_template is None``: a base model, or a GGUF that carries
    none such as Gemma 3 270M's), the prompt itself encoded after BOS
    (``tok.encode(prompt, add_bos=True)``), which :data:`NO_TEMPLATE_NOTE` says on ``log``
    (default stderr) once per tokenizer.

    Raises:
      ChatTemplateError: the template's render failed (a ``ValueError``).
    """
    if getattr(tok, "chat_template", "") is None:
        try:
            first = tok not in _NOTED
            _NOTED.add(tok)
        except TypeError:  # not weakly referenceable: say it every time
            first = True
        if first:
            print(NO_TEMPLATE_NOTE, file=sys.stderr if log is None else log, flush=True)
        return tok.encode(prompt, add_bos=True)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
