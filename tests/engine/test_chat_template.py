"""A model folder's chat template runs within bounds: whatever it does, the user gets one line naming the template
and what happened, and nothing from the folder reaches a terminal unescaped."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.facts.errors import PromptError
from engine.facts.params import GenerationParams
from engine.model import chat_template
from engine.run.session import Session
from tests.tiny_model import CHAT_TEMPLATE, build_tokenizer

ROOT = Path(__file__).resolve().parents[2]
HELLO = [{"role": "user", "content": "hello"}]


def tokenizer_with(template: str):
    tok = build_tokenizer()
    tok.chat_template = template
    return tok


def refused(template: str, messages: list[dict] = HELLO) -> str:
    with pytest.raises(PromptError) as info:
        chat_template.render(tokenizer_with(template), messages, "hostile-folder")
    message = str(info.value)
    assert message.startswith("The chat template of hostile-folder ") and "\n" not in message
    return message


def test_the_bounded_rendering_gives_the_ids_transformers_gives():
    tok = tokenizer_with(CHAT_TEMPLATE)
    messages = [{"role": "user", "content": "日本語 😀 <b>x</b>"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "and?"}]
    assert chat_template.render_ids(tok, messages) == list(
        tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))


@pytest.mark.parametrize("template, words", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
     "was stopped: its loops ran more than 2,000,000 times"),
    ("{% for i in range(100000) %}{{ 'spam ' * 1000 }}{% endfor %}", "was stopped: its output passed"),
    ("{{ 'x' * 1000000000 }}", "was stopped: it built a value of more than"),
    ("{% set s = 'x' * 4000000 %}{{ s + s }}", "was stopped: it built a value of more than"),
    ("{{ 10 ** 100000 }}", "was stopped: it raised a number to a power"),
    ("{% for m in messages %}{{ m['content'] }", "has a syntax error at line 1"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "tried something the sandbox forbids"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recursed too deeply"),
    ("{% if false %}x{% endif %}   ", "rendered nothing for this conversation"),
    ("{{ messages[5]['content'] }}", "failed: list object has no element 5"),
])
def test_a_hostile_template_is_stopped_with_one_line_naming_it(template, words):
    assert words in refused(template)


@pytest.mark.parametrize("template", [
    "{{ 'x'|center(1000000000) }}", "{{ 'x'|indent(1000000000) }}", "{{ '%1000000000s'|format('a') }}",
    "{{ '%1000000000s' % 'a' }}", "{{ 'x'.ljust(1000000000) }}", "{{ 'x'.zfill(1000000000) }}",
    "{{ '{:>1000000000}'.format('a') }}", "{{ ('\t' * 4000000).expandtabs(1000000) }}",
    "{{ ('x' * 4000000)|replace('x', 'yyyyyyyyyy') }}", "{{ ('x' * 4000000).replace('x', 'yy') }}",
    "{% set a = 'x' * 4000000 %}{{ [a, a, a]|join }}", "{{ 'x' * 4000000 ~ 'y' * 4000000 }}",
    "{{ messages|tojson(indent=1000000000) }}",
])
def test_a_template_that_pads_or_repeats_is_stopped_before_it_builds_the_string(template):
    """Padding, formatting, replacing, joining and ``~`` built gigabytes before the output bound saw them
    (``center(10**9)``: 3.8 GiB and 27 s); each is now checked against the bound before Python builds it."""
    import tracemalloc

    tracemalloc.start()
    try:
        message = refused(template)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "was stopped" in message
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB held before the template was stopped"


def test_an_exception_a_template_raises_is_shown_with_its_control_characters_escaped():
    message = refused("{{ raise_exception('no\x1b[2J\x07 way\x1b]0;owned\x07') }}")
    assert "refused the conversation: no\\x1b[2J\\x07 way" in message
    assert "\x1b" not in message and "\x07" not in message


def test_a_template_that_never_ends_is_stopped_by_the_clock(monkeypatch):
    """Loops over the conversation itself are not ranges the budget counts: the watchdog ends them."""
    monkeypatch.setattr(chat_template, "MAX_SECONDS", 0.5)
    loop = "{% for a in messages[0]['content'] %}" * 4 + "{% endfor %}" * 4 + "x"
    message = refused(loop, [{"role": "user", "content": "z" * 1000}])
    assert "was stopped after" in message and "longer than the 0.5 s a template may take" in message
    assert chat_template.render(tokenizer_with(CHAT_TEMPLATE), HELLO)        # the thread is fine afterwards


def test_a_run_refuses_a_hostile_template_before_any_compute(tiny):
    session = Session(tiny)
    original = session.tokenizer.chat_template
    session.tokenizer.chat_template = "{{ raise_exception('no') }}"
    try:
        with pytest.raises(PromptError, match="refused the conversation: no"):
            session.run("hello", GenerationParams(max_new_tokens=2))
    finally:
        session.tokenizer.chat_template = original


def test_the_cli_refuses_a_hostile_template_in_one_escaped_line_with_status_2(tiny_model_dir, tmp_path, cache_root):
    folder = tmp_path / "hostile"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "chat_template.jinja").write_text("{{ raise_exception('boom\x1b[2J\x07') }}")
    r = subprocess.run([sys.executable, "-m", "engine", "--model", str(folder), "--device", "cpu", "--prompt", "hi"],
                       cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root), "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: The chat template of ")
    assert "boom\\x1b[2J\\x07" in r.stderr and "\x1b" not in r.stderr and "Traceback" not in r.stderr
