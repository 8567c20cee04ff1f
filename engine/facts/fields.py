"""Every bound a value may take, declared once, beside the field that holds it.

Events, lesson settings and lesson results are frozen dataclasses whose fields carry their limits as
``typing.Annotated`` metadata (``Ms = Annotated[float, Range(0, MAX_MS)]``). The trace schema
(``engine.facts.schema``) derives its checks from these declarations, the trace writer runs the same checks as the
reader, the CLI builds its flags and the window its forms from them, and the producers (the session, the
server client) cut what would break a bound at the source, saying what they cut. A limit changed here changes
all of them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

MAX_LAYERS = 4096
MAX_CONTEXT = 1 << 24                # positions: 16.7 million
MAX_VOCAB = 1 << 24
MAX_HEADS = 4096
MAX_HEAD_DIM = 1 << 16
MAX_MS = 30 * 24 * 3600 * 1000.0     # a run longer than 30 days is not a run
MAX_TEXT = 1024                      # characters in one token's text
MAX_CANDIDATES = 100                 # candidates kept for one token
MAX_STRING = 1 << 20                 # any other string
MAX_PROMPT = 64 << 20                # a prompt's text (its ids are at most MAX_CONTEXT)
MAX_VALUES = 256                     # numbers in one experiment point
MAX_ATTENTION = 1 << 22              # weights in one AttentionStep
MAX_BYTES = 1 << 50                  # 1 PiB: no single figure in a trace is larger
MAX_NUMBER = 1e30                    # any other measured or computed number
MAX_BLOCKS = 1 << 20                 # blocks in one paged cache
MAX_REQUESTS = 4096                  # requests in one batching experiment
MAX_DRAFT = 16                       # guesses in one speculative pass
MAX_NOTES = 32                       # notes one run or result may carry
MAX_ITEMS = 4096                     # entries of any other list


@dataclass(frozen=True)
class Range:
    """A number from ``low`` to ``high`` (inclusive). Whole numbers when the field is ``int``. ``least``: above
    ``low`` nothing smaller than it (temperature: 0, greedy, or 0.01 and up), so every rule a value must meet is
    in the declaration that the checks, the controls and a restored setting all read."""

    low: float
    high: float
    least: float | None = None

    def admits(self, value: float) -> bool:
        return self.low <= value <= self.high and not (self.least is not None and self.low < value < self.least)

    def words(self, special: str = "") -> str:
        if self.least is None:
            return f"between {self.low:g} and {self.high:g}"
        return f"{special or format(self.low, 'g')} or between {self.least:g} and {self.high:g}"


@dataclass(frozen=True)
class Text:
    """A string of at most ``limit`` characters, one of ``choices`` when they are given."""

    limit: int
    choices: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Items:
    """A list or tuple of at most ``limit`` entries (each entry checked by the element type)."""

    limit: int


@dataclass(frozen=True)
class Setting:
    """A setting the user can change (a run's or a lesson's): its CLI flag (``--tokens``; for a true/false
    field, the flag that turns it away from its default, ``--no-kv-cache``), the label of its form field or
    control, a help text and a unit shown after the value; ``special``: what the lowest value means, shown in
    its place (``"off"`` for top-k 0); ``none``: the word for None where None is allowed (``"random"`` for the
    seed: a control offers it as a check box beside the number); ``step``: one notch of the control (and of a
    lecture key that changes it); ``needs``: the true/false setting that must be on for this one to apply (the
    control is enabled only then); ``offered``: the texts a text setting's list offers. A settings field without
    it keeps its default everywhere."""

    flag: str
    label: str
    help: str = ""
    unit: str = ""
    special: str = ""
    none: str = ""
    step: float = 0.0
    needs: str = ""                      # a true/false setting this one is offered only beside (compiled: static)
    offered: tuple[str, ...] = ()        # the texts a list offers (any the field's check accepts may be typed)


@dataclass(frozen=True)
class Key:
    """The lecture key that changes a setting a notch (``T``; Shift lowers it): by the setting's ``step``, by
    ``factor`` (doubling), or along ``ladder`` (top-k's 0, 1, 5, 10 ...). Declared on the field, so a scene's
    key, the control and the CLI share one range."""

    letter: str
    factor: float = 0.0
    ladder: tuple[float, ...] = ()
    short: str = ""            # the word a lecture footer puts before the value ("top-k"); none: the value says it


@dataclass(frozen=True)
class Column:
    """A lesson point's figure as a table shows it, declared on the point's field like ``Setting`` on a setting's:
    its header (the unit in it, and how the figure was got: "predicted ms (computed)"), its format, a ``scale``
    the stored number is multiplied by first (FLOPs stored, GFLOPs shown), or the ``words`` a number stands for.
    The CLI's table and the window's table both read it, so a figure is labelled once."""

    label: str
    fmt: str = "{:,.2f}"
    scale: float = 1.0
    words: tuple[str, ...] = ()        # a number that picks a word (0, 1: "off", "on")
    shift: int = 0                     # added after the scale (a repeat counted from 0, shown from 1)
    show: Callable[[float], str] | None = None     # words for the number (bytes as "1.5 MiB")

    def cell(self, value: float | str | None) -> str:
        if value is None:
            return "n/a"
        if isinstance(value, str):
            return value
        if self.show is not None:
            return self.show(value)
        if self.words:
            return self.words[int(value)] if 0 <= int(value) < len(self.words) else f"{value:g}"
        return self.fmt.format(value * self.scale + self.shift if self.scale != 1.0 else value + self.shift)


def column_of(*metadata: object) -> Column | None:
    return next((m for m in metadata if isinstance(m, Column)), None)


def bounds(*metadata: object) -> tuple[Range | None, Text | None, Items | None, Setting | None]:
    """The markers among a field's ``Annotated`` metadata."""
    found: dict[type, object] = {type(m): m for m in metadata}
    return found.get(Range), found.get(Text), found.get(Items), found.get(Setting)


def key_of(*metadata: object) -> Key | None:
    return next((m for m in metadata if isinstance(m, Key)), None)


Ms = Annotated[float, Range(0.0, MAX_MS)]
Count = Annotated[int, Range(0, MAX_CONTEXT)]
Bytes = Annotated[int, Range(0, MAX_BYTES)]
Number = Annotated[float, Range(-MAX_NUMBER, MAX_NUMBER)]
Positive = Annotated[float, Range(0.0, MAX_NUMBER)]
Probability = Annotated[float, Range(0.0, 1.0)]
Share = Annotated[float, Range(0.0, 1000.0)]          # CPU seconds per wall second per compute thread
TokenId = Annotated[int, Range(0, MAX_VOCAB - 1)]
TokenText = Annotated[str, Text(MAX_TEXT)]
Name = Annotated[str, Text(256)]
Ident = Annotated[str, Text(64)]
Message = Annotated[str, Text(4096)]
LongText = Annotated[str, Text(MAX_STRING)]
PromptText = Annotated[str, Text(MAX_PROMPT)]
Notes = Annotated[tuple[Message, ...], Items(MAX_NOTES)]
