"""What every CLI command shares: a parser that refuses a bad argument with one line and status 2, bounded
numbers, the model arguments, loading with progress on stderr, lesson settings as flags, and text made safe for
a terminal.

A lesson's flags come from its settings class (``engine.facts.fields.Setting`` on a field): the flag, its help, its
range and its default are the ones the window's form uses, so the CLI and the window cannot disagree.
Everything printed from outside KVScope (a server's tokens and errors, a model's name, a file name) goes
through ``engine.facts.textstream.safe``: control characters and bidirectional overrides are shown as escapes, never
sent to the terminal, which would obey them (clear the screen, retitle the window, reorder text).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

from engine.facts.errors import ParameterError
from engine.facts.events import LoadProgress
from engine.facts.params import LoadSettings
from engine.facts.textstream import clean_text, safe_line
from engine.facts.validation import MISSING, shape_of, shapes

EXIT_BAD_INPUT = 2
EXIT_RUN_FAILED = 1
EXIT_INTERRUPTED = 130


def program(command: str = "") -> str:
    """How the user started the CLI, for usage lines: ``kvscope-cli`` (the installed script) or ``python -m
    engine``, with the subcommand after it."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    base = "kvscope-cli" if name.startswith("kvscope-cli") else "python -m engine"
    return f"{base} {command}".strip()


class Parser(argparse.ArgumentParser):
    """argparse with one line on stderr for a bad argument (not usage plus error), exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"error: {safe_line(message)} (see {self.prog} --help)\n")


def bounded(low: float, high: float, whole: bool = True) -> Callable[[str], float]:
    """An argparse type: a whole number (or a number) in ``[low, high]``, refused with the range."""
    def parse(text: str) -> float:
        try:
            value = int(text) if whole else float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a {'whole ' if whole else ''}number") from None
        if not low <= value <= high:                     # NaN fails too
            raise argparse.ArgumentTypeError(f"{value:,} is out of range: use {low:,} to {high:,}" if whole else
                                             f"{value:g} is out of range: use {low:g} to {high:g}")
        return value
    parse.__name__ = "whole number" if whole else "number"
    return parse


def prompt_text(text: str) -> str:
    """The text as valid Unicode; bytes that were not UTF-8 become U+FFFD, and stderr says so."""
    fixed, replaced = clean_text(text)
    if replaced:
        print(f"warning: the prompt was not valid UTF-8: {replaced} character(s) replaced with U+FFFD",
              file=sys.stderr)
    return fixed


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The load settings' flags (``LoadSettings``: its help, choices and defaults), the server's deadline aside
    (``add_server_arguments``), and where offloaded weights go."""
    add_load_flags(p, ("model", "device", "dtype", "trust_remote_code", "memory_budget"))
    p.add_argument("--offload-folder", default=None, metavar="FOLDER",
                   help="where offloaded weights are written (default: KVScope's cache folder)")


def add_load_flags(p: argparse.ArgumentParser, names: tuple[str, ...], defaults: bool = True,
                   note: str = "") -> None:
    """Flags for the named ``LoadSettings`` fields, from their declarations. ``defaults``: each flag's default is
    the declared one (False: None, for a caller that tells "not given" from the default, as the window does, whose
    ``note`` says what it takes instead)."""
    for name in names:
        shape = shape_of(LoadSettings, name)
        setting = shape.setting
        default = shape.default if defaults else None
        if shape.base is bool:
            p.add_argument(setting.flag, dest=name, action="store_true", help=f"{setting.help} (off by default)")
            continue
        shown = f" (default {setting.special or _shown(shape.default)})" if defaults else note
        choices = shape.text.choices if shape.text is not None and shape.text.choices else None
        p.add_argument(setting.flag, dest=name, default=default, help=(setting.help + shown).replace("%", "%%"),
                       metavar=None if choices else {"bytes": "SIZE", "s": "SECONDS"}.get(setting.unit, name.upper()),
                       choices=choices,
                       type=byte_size if setting.unit == "bytes" else None if shape.base is str else _parser_for(shape))


UNITS = {"": 1, "b": 1, "kib": 1024, "mib": 1024 ** 2, "gib": 1024 ** 3, "tib": 1024 ** 4, "pib": 1024 ** 5,
         "kb": 1000, "mb": 1000 ** 2, "gb": 1000 ** 3, "tb": 1000 ** 4, "pb": 1000 ** 5}


def byte_size(text: str) -> int:
    """``300MiB``, ``1.5GiB``, ``2GB`` or a number of bytes; 0 means no limit. A budget below one byte (``0.4``
    would silently mean none) or above this machine's memory (it would limit nothing) is refused, saying so."""
    from engine.model.memory import total_bytes

    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else ""
    if not match or unit not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: write e.g. 300MiB, 1.5GiB or 2GB")
    size = float(match.group(1)) * UNITS[unit]
    if 0 < size < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is less than one byte: give a size such as 300MiB (0: no limit)")
    machine = total_bytes()
    if machine is not None and size > machine:
        raise argparse.ArgumentTypeError(f"{text!r} is more than this machine's {machine / 2**30:,.1f} GiB of memory: "
                                         "a budget that large limits nothing (0: no limit)")
    return int(size)


OPEN_LINE = [False]          # a progress line on the terminal waits for its end (updated in place)


def end_open_line() -> None:
    """End a progress line left open, so what is printed next (an error, "interrupted") has a line of its own."""
    if OPEN_LINE[0]:
        print(file=sys.stderr, flush=True)
        OPEN_LINE[0] = False


def load_with_progress(args: argparse.Namespace) -> Any:
    """The model the arguments name, loaded with one progress line on stderr (updated in place on a
    terminal, one line per stage in a log)."""
    from engine.model.models import Offload, load

    tty = sys.stderr.isatty()
    last_stage = [""]

    def progress(p: LoadProgress) -> None:
        pct = f"{p.fraction * 100:3.0f}% " if p.fraction is not None else ""
        if tty:
            done = p.stage == "done"
            print(f"\r[{pct}{safe_line(p.message)}]"[:100].ljust(100), end="\n" if done else "",
                  file=sys.stderr, flush=True)
            OPEN_LINE[0] = not done
        elif p.stage != last_stage[0] or p.stage == "done":
            print(f"[{pct}{safe_line(p.message)}]", file=sys.stderr, flush=True)
        last_stage[0] = p.stage

    loaded = load(args.model, args.device, args.dtype, trust_remote_code=args.trust_remote_code,
                  progress=progress, offload=Offload(memory_budget=getattr(args, "memory_budget", 0),
                                                     folder=getattr(args, "offload_folder", None)))
    for warning in loaded.warnings:
        print(f"warning: {safe_line(warning)}", file=sys.stderr)
    return loaded


def add_server_arguments(p: argparse.ArgumentParser, required: bool = False) -> None:
    p.add_argument("--server", metavar="URL", required=required,
                   help="run through a serving engine instead (llama-server, vLLM, TGI, SGLang: its OpenAI-compatible "
                        "API); an API key is read from the KVSCOPE_API_KEY environment variable, and user:password "
                        "in the URL is sent as HTTP basic authentication, never stored")
    add_load_flags(p, ("deadline_s",))


# --- traces --------------------------------------------------------------------------------------------------------
def trace_writer(path: str | None, inputs: Sequence[str | None] = ()) -> Any:
    """A trace writer for ``--trace PATH`` (checked now: a bad path, or one of the command's ``inputs``, fails
    before anything loads), or None."""
    if not path:
        return None
    from engine.output.trace import TraceWriter

    return TraceWriter(path, inputs)


def keep_partial(writer: Any) -> None:
    """Interrupted (Ctrl+C, SIGTERM, SIGHUP) or failed part-way: write what was measured; a run without its end
    replays marked incomplete."""
    if writer is not None and writer.events:
        close_writer(writer)


def close_writer(writer: Any) -> bool:
    """Write the trace; on a full disk or a vanished folder say so in one line (the previous file is intact)."""
    if writer is None:
        return True
    from engine.facts.errors import TraceError

    try:
        writer.close()
    except (OSError, TraceError) as exc:
        print(f"error: could not write the trace to {safe_line(writer.path)}: "
              f"{safe_line(getattr(exc, 'strerror', None) or exc)}", file=sys.stderr)
        return False
    if writer.note:
        print(f"warning: {safe_line(writer.note)}", file=sys.stderr)
    return True


# --- settings as flags ----------------------------------------------------------------------------------------
class _NoneWord:
    """What a flag's parser returns for the word a field uses for None (``--seed random``)."""


NONE = _NoneWord()


def add_settings_flags(p: argparse.ArgumentParser, cls: type) -> None:
    """One flag per field with a ``Setting`` (a lesson's settings, ``GenerationParams``): its range and choices
    from the field, its default from the class, its help from the declaration. A true/false field's flag turns
    it away from its default (``--no-kv-cache``)."""
    for shape in shapes(cls):
        if shape.setting is None:
            continue
        setting = shape.setting
        default = None if shape.default is MISSING else shape.default
        if shape.base is bool:
            way = ("off", "on") if default else ("on", "off")
            p.add_argument(setting.flag, dest=shape.name, action="store_const", const=not default, default=None,
                           help=f"turns {setting.label.lower()} {way[0]} ({way[1]} by default). "
                           f"{setting.label}: {setting.help}".replace("%", "%%"))
            continue
        shown = setting.none if default is None and setting.none else _shown(default)
        help_text = setting.help + (f" (default {shown})" if default not in (None, "") or
                                    (default is None and setting.none) else "")
        p.add_argument(setting.flag, dest=shape.name, default=None, metavar=_metavar(shape),
                       help=help_text.replace("%", "%%"), type=_parser_for(shape))


def settings_from(cls: type, args: argparse.Namespace, p: argparse.ArgumentParser, **fixed: object) -> Any:
    """The settings the flags ask for (defaults for the rest, ``fixed`` on top), checked by the class; a refusal
    is one line naming the flag."""
    given = {name: value for name, value in vars(args).items() if value is not None and name in
             {s.name for s in shapes(cls) if s.setting is not None}}
    for name, value in given.items():
        if value is NONE:
            given[name] = None
        elif isinstance(value, str):
            given[name] = prompt_text(value)
            if not given[name].strip():
                p.error(f"{_flag(cls, name)} is empty")
    try:
        return cls(**{**given, **fixed})
    except ParameterError as exc:
        p.error(_as_flags(cls, str(exc)))


def _as_flags(cls: type, message: str) -> str:
    """A settings error in the CLI's words: each field name the message mentions becomes its flag."""
    for shape in shapes(cls):
        if shape.setting is not None:
            message = re.sub(rf"(?<![\w-]){shape.name}(?![\w-])", shape.setting.flag, message)
    return message


def _parser_for(shape: Any) -> Callable[[str], object]:
    none_word = shape.setting.none if shape.setting is not None else ""
    if none_word:
        inner = _scalar_parser(shape.base, shape.span, shape.text)

        def parse_or_none(text: str) -> object:
            return NONE if text.strip().lower() == none_word else inner(text)
        parse_or_none.__name__ = inner.__name__
        return parse_or_none
    if shape.base is tuple:
        item = _scalar_parser(shape.element, shape.span, shape.text)

        def parse_list(text: str) -> tuple:
            parts = [part.strip() for part in text.replace(";", ",").split(",") if part.strip()]
            if not parts:
                raise argparse.ArgumentTypeError(f"{text!r} names nothing: give values separated by commas")
            return tuple(item(part) for part in parts)
        parse_list.__name__ = "list"
        return parse_list
    return _scalar_parser(shape.base, shape.span, shape.text)


def _scalar_parser(base: type, span: Any, text: Any) -> Callable[[str], object]:
    if base is int:
        return bounded(span.low if span else -(1 << 62), span.high if span else 1 << 62)
    if base is float:
        return bounded(span.low if span else -1e30, span.high if span else 1e30, whole=False)
    if text is not None and text.choices:
        def choose(value: str) -> str:
            if value not in text.choices:
                raise argparse.ArgumentTypeError(f"{value!r} is not one of {', '.join(text.choices)}")
            return value
        choose.__name__ = "choice"
        return choose

    def string(value: str) -> str:
        if text is not None and len(value) > text.limit:
            raise argparse.ArgumentTypeError(f"is {len(value):,} characters long; at most {text.limit:,} are allowed")
        return value
    string.__name__ = "text"
    return string


def _flag(cls: type, name: str) -> str:
    return next(s.setting.flag for s in shapes(cls) if s.name == name and s.setting is not None)


def _metavar(shape: Any) -> str:
    if shape.base is tuple:
        return "A,B,..."
    return {int: "N", float: "X"}.get(shape.base, "TEXT")


def _shown(value: object) -> str:
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value)
    if isinstance(value, str):
        return "a built-in one" if len(value) > 40 else repr(value)
    if isinstance(value, float):
        return f"{value:g}"
    return f"{value}"
