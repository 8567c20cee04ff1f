"""What a lesson declares of its own, beside its settings and result: its points and its events.

A **point** (``LessonPoint``) is one measured row of a lesson's sweep, a frozen dataclass whose fields carry their
bounds and a ``Column`` (header, unit, format). A trace stores it as an ``ExperimentPoint`` (its ``series`` and
its numbers by field name), so traces stay one format for every lesson; the trace schema checks a stored point
against the lesson's declaration, and the CLI's table, the window's table and its charts read it back typed
(``Point.read``), so no figure's name is spelled twice.

An **event** (``LessonEvent``) is anything else a lesson's run reports (a speculative pass, a block table): it
belongs to an experiment (``exp_id``, ``t_ms``) and says what makes it impossible (``check``, against the facts
of the model the experiment runs). The lesson lists it; the trace schema, the writer and the window's store
take it from the registry, so a lesson's vocabulary lives in its own module.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from engine.facts.events import ExperimentPoint
from engine.facts.fields import Column, Ident, Ms
from engine.facts.validation import MISSING, FieldError, shapes

P = TypeVar("P", bound="LessonPoint")
MORE = "more"              # the field of an open point: figures whose names the lesson learns as it runs


@dataclass(frozen=True)
class LessonPoint:
    """One measured point of a lesson, typed. ``series`` names its kind among the lesson's points (a trace's
    ``ExperimentPoint.series``). Numbers that are None (not measured, or a ratio over nothing) are left out of the
    stored values: absent, never NaN. A point whose figures are named at run time (a server's metrics, one per
    slot) declares ``more: dict[str, float]`` for them."""

    series: ClassVar[str] = ""
    family: ClassVar[tuple[str, ...]] = ()          # series of the same shape told apart by name ("plain", ...)
    series_column: ClassVar[Column | None] = None    # how a table shows which of the family a point is

    @classmethod
    def matches(cls, series: str) -> bool:
        """Whether a stored point of ``series`` is one of these."""
        return series == cls.series or series in cls.family

    def values(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == MORE:
                out.update({k: float(v) for k, v in value.items() if _finite(v)})
            elif _finite(value):
                out[f.name] = float(value)
        return out

    @classmethod
    def read(cls: type[P], point: ExperimentPoint) -> P:
        """The stored point as this type: whole numbers and flags as declared, an absent figure None (or its
        default), the names it does not declare in ``more``."""
        typed = cls.from_values(point.values, strict=False)
        if point.series != cls.series:
            object.__setattr__(typed, "series", point.series)        # which one of a family it is
        return typed

    @classmethod
    def from_values(cls: type[P], values: dict[str, float], strict: bool = True) -> P:
        """A point from figures by name (a lesson that gathers them in a dict); ``strict``: a name this point does
        not declare (and no ``more`` to keep it) is a mistake, said at once rather than dropped."""
        known, given = set(), {}
        for shape in shapes(cls):
            known.add(shape.name)
            if shape.name == MORE:
                continue
            value = values.get(shape.name)
            if value is None:
                if shape.optional:
                    given[shape.name] = None
                continue
            given[shape.name] = bool(value) if shape.base is bool else int(value) if shape.base is int else value
        if MORE in known:
            given[MORE] = {k: v for k, v in values.items() if k not in known}
        elif strict and not values.keys() <= known:
            raise TypeError(f"{cls.__name__} declares no {', '.join(sorted(values.keys() - known))}")
        return cls(**given)

    @classmethod
    def check(cls, values: dict[str, float]) -> None:
        """Refuse stored values this point cannot be: a required figure missing, a name it does not declare."""
        names = {s.name for s in shapes(cls)}
        missing = [s.name for s in shapes(cls) if s.name != MORE and not s.optional and s.default is MISSING
                   and s.name not in values]
        if missing:
            raise FieldError(f"a {cls.series!r} point is missing {', '.join(missing)}")
        if MORE not in names:
            unknown = sorted(set(values) - names)
            if unknown:
                raise FieldError(f"a {cls.series!r} point has no figure(s) {', '.join(unknown[:5])}")


def _finite(value: object) -> bool:
    return value is not None and not isinstance(value, str) and math.isfinite(value)


def of(points: Iterable[ExperimentPoint], kind: type[P]) -> list[P]:
    """The stored points that are ``kind``, typed, in order."""
    return [kind.read(p) for p in points if isinstance(p, ExperimentPoint) and kind.matches(p.series)]


def columns(kind: type[LessonPoint]) -> list[tuple[str, Column]]:
    """The figures a table of ``kind`` shows, in declared order: (field, its ``Column``), after the series where
    the kind is a family."""
    first = [("series", kind.series_column)] if kind.series_column is not None else []
    return first + [(s.name, s.column) for s in shapes(kind) if s.column is not None]


def table_lines(points: Sequence[LessonPoint], kind: type[LessonPoint]) -> list[str]:
    """A text table of ``points`` (the CLI's), its headers and formats from the declared columns, each column as
    wide as its widest cell: numbers to the right, words (a mode, a policy) to the left."""
    shown = columns(kind)
    cells = [[column.cell(getattr(p, name)) for name, column in shown] for p in points]
    widths = [max([len(column.label)] + [len(row[i]) for row in cells]) for i, (_n, column) in enumerate(shown)]
    words = [bool(column.words) or name == "series" for name, column in shown]
    lines = [" | ".join(column.label.ljust(w) for (_n, column), w in zip(shown, widths)),
             "-+-".join("-" * w for w in widths)]
    lines += [" | ".join(cell.ljust(w) if left else cell.rjust(w) for cell, w, left in zip(row, widths, words))
              for row in cells]
    return lines


@dataclass(frozen=True)
class SkippedPoint(LessonPoint):
    """Something a lesson was asked to try and cannot here: a weight format this device cannot load, a cache this
    model cannot be kept as. ``index``: its place in the settings' list, so the table names it and the chart
    leaves it out."""

    series = "skipped"

    index: int


@dataclass(frozen=True)
class LessonEvent:
    """An event a lesson declares for itself: it belongs to one experiment and checks itself against what that
    experiment runs on (``vocab_size``, ``max_context``, zero for a server that does not say). ``check`` raises
    ``FieldError`` with words a user can act on."""

    exp_id: Ident
    t_ms: Ms

    def check(self, vocab_size: int, max_context: int) -> None:
        return None


def event_types(declared: Iterable[Any]) -> dict[str, type[LessonEvent]]:
    """Lesson events by the name a trace gives them (their class's), refusing two of one name."""
    out: dict[str, type[LessonEvent]] = {}
    for cls in declared:
        if out.get(cls.__name__, cls) is not cls:
            raise TypeError(f"two lesson events are called {cls.__name__}")
        out[cls.__name__] = cls
    return out
