"""The chat template is data from the checkpoint file: its render is bounded in time, output and
the size of what it builds (models/chat_template.py), and renders real templates exactly
as the unbounded sandbox did."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import tokenizers

from models import chat_template as tokmod
from models.chat_template import ChatTemplateError
from models.tokenizer import Tokenizer
from tests.support.devices import use_worker_xla_flags

ROOT = Path(__file__).resolve().parents[2]

#: SmolLM2-135M-Instruct's template, as its GGUF ships it (tokenizer.chat_template)
SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

#: a template in the style of larger models' ones: namespace, loop.index, tojson, ~, filters,
#: raise_exception on a bad role, macros
RICH = """{%- set ns = namespace(system='') -%}
{%- macro line(role, text) -%}<|{{ role }}|>{{ text | trim }}{{ eos_token }}
{% endmacro -%}
{%- for m in messages -%}
{%- if m.role not in ['system', 'user', 'assistant'] -%}{{ raise_exception('bad role ' ~ m.role) }}{%- endif -%}
{%- if m.role == 'system' -%}{%- set ns.system = ns.system ~ m.content -%}
{%- else -%}{{ line(m.role, m.content) }}{%- endif -%}
{%- if loop.last and ns.system %}[system: {{ ns.system | length }} chars, {{ messages | length * 2 }}]
{% endif -%}
{%- endfor -%}
{{ messages | map(attribute='role') | join(',') }} {{ '/'.join(messages | map(attribute='role')) }} {{ {'n': 1, 'x': [1, 2]} | tojson }} {{ '%05d' % 7 }} {{ '{}-{}'.format('a', 3) }}
{%- for i in range(3) %}{{ i ** 2 }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"""

MESSAGES = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "ünïcødé ~ {{x}} %s"}],
    [{"role": "user", "content": "x" * 100_000}],
]


def _tokenizer(template: str) -> Tokenizer:
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<s>": 0, "</s>": 1, "a": 2}, "a"))
    return Tokenizer(tok, bos_id=0, eos_ids=(1,), chat_template=template)


def _unbounded(template: str, messages, add_generation_prompt: bool) -> str:
    """The render before the limits: transformers' sandbox as it was configured."""
    import jinja2.ext
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
        sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                    separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, bos_token="<s>",
        eos_token="</s>", tools=None, documents=None)


@pytest.mark.parametrize("template", [SMOLLM2, RICH], ids=["smollm2", "rich"])
@pytest.mark.parametrize("gen", [True, False])
@pytest.mark.parametrize("which", range(len(MESSAGES)))
def test_real_templates_render_as_before(template, gen, which):
    msgs = MESSAGES[which]
    assert _tokenizer(template).apply_chat_template(msgs, add_generation_prompt=gen) == \
        _unbounded(template, msgs, gen)


def test_smollm2_exact_text():
    assert _tokenizer(SMOLLM2).apply_chat_template([{"role": "user", "content": "Hi"}]) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def _refused(template: str, match: str, within_s: float):
    start = time.perf_counter()
    with pytest.raises(ChatTemplateError, match=match):
        _tokenizer(template).apply_chat_template([{"role": "user", "content": "Hi"}])
    elapsed = time.perf_counter() - start
    assert elapsed < within_s, elapsed


def test_nested_range_99999_fails_fast():
    """The issue's probe: nested loops over range(99999) (10^10 steps; minutes before)."""
    _refused("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
             "range of 99999 items", 2.0)


@pytest.mark.parametrize("template", [
    "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}",
    "{% for c in 'x' * 100000 %}{% for d in 'x' * 100000 %}{% endfor %}{% endfor %}",
    "{% for i in range(9999) %}{% for j in range(9999) %}{% if j is even %}{% endif %}"
    "{% endfor %}{% endfor %}",
], ids=["range", "strings", "tests"])
def test_long_loops_stop_at_the_time_limit(template):
    _refused(template, "longer than", tokmod.TEMPLATE_TIME_LIMIT_S + 3.0)


def test_string_times_10_to_the_10_fails_without_allocating():
    """The issue's probe: {{'x'*10**10}} (a MemoryError or 10 GB before): refused before the
    multiplication."""
    import tracemalloc

    tracemalloc.start()
    try:
        _refused("{{'x'*10**10}}", "limit", 1.0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 << 20, peak


@pytest.mark.parametrize("template,match", [
    ("{{ ['a' * 1000] * 100000 }}", "'\\*' of list"),
    ("{{ 'x' | center(10**10) }}", "filter center"),
    ("{{ ('x' * 1000000) | list | join('y' * 1000000) }}", "filter join"),
    ("{{ ('y' * 1000000).join(('x' * 1000000) | list) }}", "str.join"),
    ("{{ ('a' * 1000) | replace('a', 'b' * 10000) }}", "filter replace"),
    ("{{ 'x'.ljust(10**10) }}", "argument 10000000000"),
    ("{{ '{:>10000000000}'.format(1) }}", "str.format"),
    ("{{ '%10000000000d' % 1 }}", "'%' formatting"),
    ("{{ 2 ** 100000 }}", "bits"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "'~'"),
    ("{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "'\\+'"),
    ("{% for i in range(10000) %}{{ 'x' * 1000 }}{% endfor %}", "output exceeds"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursion"),
], ids=["list-times", "center", "join-filter", "join-method", "replace", "ljust", "format",
        "percent", "pow", "concat-doubling", "plus-doubling", "output", "recursion"])
def test_size_limits(template, match):
    _refused(template, match, 2.0)


@pytest.mark.parametrize("template,match", [
    ("{{ raise_exception('only user and assistant roles') }}", "only user and assistant"),
    ("{% for x in y %}", "TemplateSyntaxError"),
    ("{{ ''.__class__.__mro__ }}", "SecurityError|Undefined|unsafe"),
    ("{{ messages.append(1) }}", "SecurityError|unsafe|Undefined"),
])
def test_template_errors_are_chat_template_errors(template, match):
    """Every failure is a ChatTemplateError, a ValueError: the CLIs report it on one line."""
    with pytest.raises(ChatTemplateError, match=match) as e:
        _tokenizer(template).apply_chat_template([{"role": "user", "content": "Hi"}])
    assert isinstance(e.value, ValueError)


def test_generate_with_a_runaway_template_is_one_error_line(tmp_path):
    """models.generate on a checkpoint whose template loops for ever: one error line, exit 2,
    within seconds of the model load (before: minutes of a busy CPU)."""
    from safetensors.numpy import save_file

    from tests.support.tiny_llama import TINY, tiny_tensors

    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(TINY.to_hf()))
    save_file(tiny_tensors(), str(d / "model.safetensors"))
    vocab = {f"t{i}": i for i in range(TINY.vocab_size)}
    tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "t0")).save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "t1", "eos_token": "t2", "chat_template":
        "{% for i in range(9999) %}{% for j in range(9999) %}{% endfor %}{% endfor %}"}))
    env = dict(os.environ)
    use_worker_xla_flags(env)  # the suite's compile level, not its device count
    start = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "models.generate", "--model", str(d), "--prompt",
                        "hi", "--max-new-tokens", "2"], cwd=ROOT, env=env, text=True,
                       capture_output=True, timeout=300)
    elapsed = time.perf_counter() - start
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("python -m models.generate: error: chat template: rendering took "
                           "longer than"), last
    assert elapsed < 120, elapsed
