"""A model folder's chat template, rendered within bounds.

A chat template is a Jinja program that comes with the model folder, from anywhere. Jinja's sandbox stops it
from reaching Python's internals, but not from running for ever (loops nest; the sandbox bounds one ``range``,
not a loop inside a loop) or from building gigabytes (a long string printed many times). So KVScope renders it
here, with what transformers gives a template (its filters and globals, the tokenizer's special tokens) and
three bounds: loop iterations and the size of any string or list the template builds are counted as it runs,
its output is counted as it is produced, and a watchdog ends it after a few seconds whatever it does. Over a
bound, or on any template error, the user gets one line naming the template and what happened, with every
character from the folder made visible (an ESC from a template never reaches a terminal). A template that
renders nothing is refused like an empty prompt. The ids come from the tokenizer as transformers' own
``apply_chat_template`` makes them (the rendered text tokenized without added special tokens).
"""

from __future__ import annotations

import ctypes
import json
import re
import threading
import time
from collections.abc import Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.facts.errors import PromptError
from engine.facts.textstream import safe_line

MAX_SECONDS = 5.0                 # a template that takes longer than this is not formatting a conversation
MAX_ITERATIONS = 2_000_000        # loop iterations over ranges, in one rendering
MAX_CHARS = 8 << 20               # characters of output (a 64 MiB prompt's worth of tokens is far fewer)
MAX_SOURCE = 1 << 20               # characters of the template itself (real ones are kilobytes)
MAX_BUILT = 1 << 22               # length of one string or list built by * or + inside the template


class TemplateBound(Exception):
    """The template went past one of the bounds above."""


class _Budget:
    """One rendering's counters, checked as the template runs."""

    def __init__(self) -> None:
        self.iterations = 0
        self.chars = 0

    def tick(self) -> None:
        self.iterations += 1
        if self.iterations > MAX_ITERATIONS:
            raise TemplateBound(f"its loops ran more than {MAX_ITERATIONS:,} times")


_current: threading.local = threading.local()


class _Range:
    """``range`` for templates: the sandbox's length check, and every iteration counted against the budget."""

    def __init__(self, *args: int) -> None:
        self.inner = range(*args)
        if len(self.inner) > 100_000:
            raise TemplateBound("it asked for a range of more than 100,000 numbers")

    def __iter__(self):
        budget = _current.budget
        for value in self.inner:
            budget.tick()
            yield value

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


def _too_big(size: int) -> None:
    if size > MAX_BUILT:
        raise TemplateBound(f"it built a value of more than {MAX_BUILT:,} characters or items")


def _size(value: object) -> int:
    """A cheap upper estimate of the characters ``str(value)`` makes (a container's items at 16 each)."""
    return len(value) if isinstance(value, str) else 16 * len(value) if hasattr(value, "__len__") else 32


_NUMBERS = re.compile(r"[0-9]+")


def _format_bound(fmt: str, values: Sequence[object]) -> None:
    """``fmt % values`` or ``fmt.format(*values)``: a width or precision past the bound, or each placeholder
    filled with the longest value, is refused before Python pads or repeats anything."""
    if any(len(n) > 7 or int(n) > MAX_BUILT for n in _NUMBERS.findall(fmt)):
        raise TemplateBound(f"it asked for a width of more than {MAX_BUILT:,} characters")
    longest = max((_size(v) for v in values), default=0)
    _too_big(len(fmt) + (fmt.count("%") + fmt.count("{")) * longest)


def _width(args: tuple, kwargs: dict, name: str = "width") -> int:
    value = args[0] if args else kwargs.get(name, 0)
    return len(value) if isinstance(value, str) else value if isinstance(value, int) else 0


def _bound_str_method(text: str, name: str, args: tuple, kwargs: dict) -> None:
    """The string methods that make a result larger than their input, checked before they run."""
    if name in ("ljust", "rjust", "center", "zfill"):
        _too_big(_width(args, kwargs))
    elif name == "expandtabs":
        _too_big(len(text) * max(_width(args, kwargs, "tabsize"), 1))
    elif name in ("format", "format_map"):
        _format_bound(text, list(args) + list(kwargs.values()) + (list(args[0].values()) if name == "format_map"
                                                                  and args and isinstance(args[0], dict) else []))
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        times = len(text) + 1 if not args[0] else text.count(args[0])
        _too_big(len(text) + times * max(len(args[1]) - len(args[0]), 0))
    elif name == "join" and args and hasattr(args[0], "__len__"):
        _too_big(sum(_size(v) for v in args[0]) + len(text) * len(args[0]))


class _BoundedCompiler(jinja2.compiler.CodeGenerator):
    """``a ~ b`` through the environment's ``concat`` (Jinja joins it with a plain ``str.join``, unchecked)."""

    def visit_Concat(self, node: jinja2.nodes.Concat, frame: jinja2.compiler.Frame) -> None:
        self.write("environment.concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class _BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, with every way a template grows a value checked before the value is built: ``*``, ``+``,
    ``%`` and ``~``; the padding, formatting, replacing and joining methods and filters."""

    intercepted_binops = frozenset(["*", "+", "**", "%"])
    code_generator_class = _BoundedCompiler

    def call_binop(self, context, operator, left, right):
        if operator == "*":
            for seq, times in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(times, int) and len(seq) * times > MAX_BUILT:
                    raise TemplateBound(f"it built a value of more than {MAX_BUILT:,} characters or items")
        elif operator == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_BUILT:
                raise TemplateBound(f"it built a value of more than {MAX_BUILT:,} characters or items")
        elif operator == "**" and isinstance(right, (int, float)) and abs(right) > 1024:
            raise TemplateBound("it raised a number to a power of more than 1,024")
        elif operator == "%" and isinstance(left, str):
            _format_bound(left, list(right) if isinstance(right, tuple) else [right])
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's own signature)
        owner = getattr(__obj, "__self__", None)
        if isinstance(owner, str):
            _bound_str_method(owner, getattr(__obj, "__name__", ""), args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any) -> Any:
        """``str.format`` reaches a template wrapped at attribute access (Jinja's sandbox), not through ``call``."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        text, name = value.__self__, value.__name__

        def bounded(*args: object, **kwargs: object) -> str:
            _bound_str_method(text, name, args, kwargs)
            return wrapped(*args, **kwargs)

        return bounded

    @staticmethod
    def concat(parts: tuple) -> str:
        texts = [str(p) for p in parts]
        _too_big(sum(map(len, texts)))
        return "".join(texts)


def _bounded_filters(filters: dict) -> dict:
    """Jinja's filters that pad, format, replace or join, each checked first as the string method is."""
    def center(value: object, width: int = 80) -> str:
        _too_big(_width((width,), {}))
        return filters["center"](value, width)

    def indent(value: object, width: int | str = 4, first: bool = False, blank: bool = False) -> str:
        _too_big(len(str(value)) * (1 + _width((width,), {})))
        return filters["indent"](value, width, first, blank)

    def format_(value: str, *args: object, **kwargs: object) -> str:
        _format_bound(str(value), list(args) + list(kwargs.values()))
        return filters["format"](value, *args, **kwargs)

    @jinja2.pass_eval_context
    def replace(eval_ctx, value: str, old: str, new: str, count: int | None = None) -> str:
        _bound_str_method(str(value), "replace", (str(old), str(new)), {})
        return filters["replace"](eval_ctx, value, old, new, count)

    @jinja2.pass_eval_context
    def join(eval_ctx, value, d: str = "", attribute=None) -> str:
        items = list(value) if hasattr(value, "__iter__") and not isinstance(value, str) else [value]
        _bound_str_method(str(d), "join", (items,), {})
        return filters["join"](eval_ctx, items, d, attribute)

    return {"center": center, "indent": indent, "format": format_, "replace": replace, "join": join}


class _Generation(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (transformers' assistant-mask tag): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    if isinstance(indent, int) and indent > 64 or isinstance(indent, str) and len(indent) > 64:
        raise TemplateBound("it asked tojson for an indent of more than 64")
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Namespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names (no way toward Python's internals), as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 (jinja's own signature trick)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_' ({name!r})")


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    env = _BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                              extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters.update(_bounded_filters(dict(env.filters)), tojson=_tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_Namespace, range=_Range, dict=dict)
    return env.from_string(source)


class _Watchdog:
    """Ends the rendering thread's template with ``TemplateBound`` after ``MAX_SECONDS``: Jinja runs as Python
    code, so an exception set on the thread arrives at its next bytecode, inside the loop that would not end."""

    def __init__(self, seconds: float) -> None:
        self.thread_id = threading.get_ident()
        self.lock = threading.Lock()
        self.rendering = True
        self.timer = threading.Timer(seconds, self._fire)
        self.timer.daemon = True

    def _fire(self) -> None:
        with self.lock:
            if self.rendering:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.thread_id),
                                                           ctypes.py_object(_TimedOut))

    def done(self) -> None:
        with self.lock:
            self.rendering = False
        self.timer.cancel()


class _TimedOut(TemplateBound):
    pass


def template_of(tokenizer: Any) -> str | None:
    """The tokenizer's default chat template (a folder may ship several by name), or None."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return template if isinstance(template, str) and template.strip() else None


def render(tokenizer: Any, messages: list[dict], source_name: str = "") -> str:
    """The conversation as the template formats it, for the assistant's next turn, within the bounds."""
    source = template_of(tokenizer)
    where = f"The chat template of {safe_line(source_name or getattr(tokenizer, 'name_or_path', '') or 'the model')}"
    if source is None:
        raise PromptError(f"{where} is missing")
    if len(source) > MAX_SOURCE:
        raise PromptError(f"{where} is {len(source):,} characters long; a chat template is at most {MAX_SOURCE:,}")
    special = {k: v for k, v in (getattr(tokenizer, "special_tokens_map", {}) or {}).items()
               if isinstance(v, str) or (isinstance(v, list) and all(isinstance(t, str) for t in v))}
    try:
        template = _compile(source)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise PromptError(f"{where} has a syntax error at line {exc.lineno}: {safe_line(exc.message)[:300]}") from None
    except (jinja2.exceptions.TemplateError, RecursionError) as exc:
        raise PromptError(f"{where} cannot be read: {safe_line(exc)[:300]}") from None
    budget = _current.budget = _Budget()
    watchdog = _Watchdog(MAX_SECONDS)
    parts: list[str] = []
    started = time.monotonic()
    try:
        watchdog.timer.start()
        try:
            for part in template.generate(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                          **special):
                budget.chars += len(part)
                if budget.chars > MAX_CHARS:
                    raise TemplateBound(f"its output passed {MAX_CHARS:,} characters")
                parts.append(part)
        finally:
            watchdog.done()
            for _ in range(3):                  # a timeout set just before done() is delivered in here
                pass
    except _TimedOut:
        raise PromptError(f"{where} was stopped after {time.monotonic() - started:,.1f} s: it ran longer than the "
                          f"{MAX_SECONDS:g} s a template may take (a loop that does not end?)") from None
    except TemplateBound as exc:
        raise PromptError(f"{where} was stopped: {exc}, more than a conversation needs") from None
    except jinja2.exceptions.SecurityError as exc:
        raise PromptError(f"{where} tried something the sandbox forbids: {safe_line(exc)[:300]}") from None
    except jinja2.exceptions.UndefinedError as exc:
        raise PromptError(f"{where} failed: {safe_line(exc)[:300]}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise PromptError(f"{where} refused the conversation: {safe_line(exc)[:300]}") from None
    except RecursionError:
        raise PromptError(f"{where} recursed too deeply (a macro that calls itself?)") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ZeroDivisionError, OverflowError) as exc:
        raise PromptError(f"{where} failed: {type(exc).__name__}: {safe_line(exc)[:300]}") from None
    finally:
        _current.budget = None
    text = "".join(parts)
    if not text.strip():
        raise PromptError(f"{where} rendered nothing for this conversation: there is nothing for the model to read")
    return text


def render_ids(tokenizer: Any, messages: list[dict], source_name: str = "") -> list[int]:
    """The conversation's ids, as ``apply_chat_template(messages, add_generation_prompt=True)`` gives them."""
    return list(tokenizer(render(tokenizer, messages, source_name), add_special_tokens=False)["input_ids"])
