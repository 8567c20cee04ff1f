"""Checks derived from a dataclass's declared fields: one builder per class, compiled once, run on parsed JSON
(a trace line) or on a Python value (lesson settings checking themselves).

Each field's type and ``engine.facts.fields`` markers decide its check: whole numbers and numbers within a
``Range`` (NaN and infinities never pass), strings within a ``Text`` limit or its choices, lists and tuples
within ``Items`` (each entry checked by its own type), ``X | None``, nested dataclasses, and ``dict[str,
number]``. Unknown fields and missing required ones are refused. A message names the field and says what it
must be, in words a user can act on; the caller adds the file and line.

Lists of plain numbers are checked in one comprehension (no call per entry): a full-context trace holds
millions of them, and ``make bench`` measures the reading rate.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Annotated, Any, Union, get_args, get_origin

from engine.facts.fields import MAX_ITEMS, MAX_NUMBER, MAX_STRING, Items, Range, Text, bounds, column_of, key_of

Check = Callable[[object, str], object]        # (value, field name) -> the value as the field holds it


class FieldError(ValueError):
    """One field is wrong; the message names it (a reader adds the file and line)."""


class _Missing:
    def __repr__(self) -> str:
        return "nothing"


MISSING = _Missing()


def short(value: object, limit: int = 60) -> str:
    """A value as a message shows it: ``repr`` cut to ``limit`` characters, containers by their kind."""
    text = repr(value) if not isinstance(value, (list, dict, tuple)) else f"a {type(value).__name__}"
    return text if len(text) <= limit else text[: limit - 1] + "…"


def wrong(name: str, value: object, expected: str) -> FieldError:
    if value is MISSING:
        return FieldError(f"{name} is missing")
    return FieldError(f"{name} must be {expected}, not {short(value)}")


# --- scalars ------------------------------------------------------------------------------------------------
def whole(low: float, high: float) -> Check:
    def check(value: object, name: str) -> int:
        if type(value) is not int:
            raise wrong(name, value, "a whole number")
        if not low <= value <= high:
            raise FieldError(f"{name} must be between {int(low):,} and {int(high):,}, not {value:,}")
        return value
    return check


def number(low: float, high: float, least: float | None = None) -> Check:
    span = Range(low, high, least)

    def check(value: object, name: str) -> float:
        if type(value) is int:
            value = float(value)
        elif type(value) is not float:
            raise wrong(name, value, "a number")
        if not span.admits(value):                          # NaN fails every comparison
            raise FieldError(f"{name} must be {span.words()}, not {value!r}")
        return value
    return check


def string(limit: int, choices: tuple[str, ...] | None = None) -> Check:
    def check(value: object, name: str) -> str:
        if type(value) is not str:
            raise wrong(name, value, "a string")
        if len(value) > limit:
            raise FieldError(f"{name} is {len(value):,} characters long; at most {limit:,} are allowed")
        if choices is not None and value not in choices:
            raise FieldError(f"{name} must be one of {', '.join(choices)}, not {short(value)}")
        return value
    return check


def boolean(value: object, name: str) -> bool:
    if type(value) is not bool:
        raise wrong(name, value, "true or false")
    return value


def optional(inner: Check) -> Check:
    def check(value: object, name: str) -> object:
        return None if value is None else inner(value, name)
    return check


def anything(value: object, name: str) -> object:
    return value


# --- containers -----------------------------------------------------------------------------------------------
def sequence(item: Check, limit: int, as_tuple: bool, numbers: tuple[bool, float, float] | None = None) -> Check:
    """A list (JSON) or tuple (Python) of at most ``limit`` entries; ``numbers`` = (whole, low, high) checks
    plain numbers in one pass."""
    def check(value: object, name: str) -> object:
        if type(value) is not list and type(value) is not tuple:
            raise wrong(name, value, "a list")
        if len(value) > limit:
            raise FieldError(f"{name} has {len(value):,} entries; at most {limit:,} are allowed")
        if numbers is not None:
            is_int, low, high = numbers
            if is_int:
                good = all(type(v) is int and low <= v <= high for v in value)
            else:
                good = all((type(v) is float or type(v) is int) and low <= v <= high for v in value)
            if good:
                return tuple(value) if as_tuple else list(value)
        out = [item(v, f"{name}[{i}]") for i, v in enumerate(value)]
        return tuple(out) if as_tuple else out
    return check


def mapping(value_check: Check, limit: int) -> Check:
    def check(value: object, name: str) -> dict:
        if type(value) is not dict:
            raise wrong(name, value, "an object")
        if len(value) > limit:
            raise FieldError(f"{name} has {len(value):,} entries; at most {limit:,} are allowed")
        for key, v in value.items():
            if type(key) is not str or len(key) > 64:
                raise FieldError(f"{name} has a key that is not a short name: {short(key, 40)}")
            value_check(v, f"{name}.{key}")
        return dict(value)
    return check


# --- dataclasses ----------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Plan:
    """How to build one dataclass from a dict: a check per field, which are required, the class."""

    cls: type
    checks: dict[str, Check]
    required: frozenset[str]

    def build(self, data: object, name: str = "") -> Any:
        if type(data) is not dict:
            raise wrong(name or self.cls.__name__, data, "an object")
        allowed = self.checks
        if len(data) > len(allowed) + 1 or not all(k in allowed or k == "type" for k in data):
            unknown = [k for k in data if k not in allowed and k != "type"]
            shown = ", ".join(short(k, 40) for k in unknown[:5]) + (
                f" and {len(unknown) - 5:,} more" if len(unknown) > 5 else "")
            raise FieldError(f"{self.cls.__name__} has no field(s) {shown}")
        values = {}
        for field_name, check in allowed.items():
            if field_name in data:
                values[field_name] = check(data[field_name], field_name)
            elif field_name in self.required:
                raise FieldError(f"{self.cls.__name__} is missing {field_name}")
        try:
            return self.cls(**values)
        except (TypeError, ValueError) as exc:         # a class that checks itself further (GenerationParams)
            raise FieldError(f"{name or self.cls.__name__}: {exc}") from None


@cache
def plan(cls: type) -> Plan:
    """The checks of ``cls``'s fields, from their annotations (resolved in the module that defines it)."""
    hints = typing.get_type_hints(cls, include_extras=True)
    checks, required = {}, set()
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        checks[f.name] = check_for(hints[f.name])
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.add(f.name)
    return Plan(cls, checks, frozenset(required))


def nested(cls: type) -> Check:
    def check(value: object, name: str) -> object:
        if isinstance(value, cls):                          # built already (a lesson's typed settings)
            return value
        try:
            return plan(cls).build(value, name)
        except FieldError as exc:
            if name.endswith("]"):                          # an entry of a list says which one
                raise FieldError(f"{name}: {exc}") from None
            raise
    return check


def check_for(tp: object, metadata: tuple = ()) -> Check:
    """The check for a declared type (``Annotated`` markers included)."""
    origin = get_origin(tp)
    if origin is Annotated:
        base, *extra = get_args(tp)
        return check_for(base, metadata + tuple(extra))
    span, text, items, _setting = bounds(*metadata)
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        inner = check_for(args[0], metadata) if len(args) == 1 else union(args)
        return optional(inner) if type(None) in get_args(tp) else inner
    if tp is bool:
        return boolean
    if tp is int:
        return whole(*(span.low, span.high) if span else (-(1 << 62), 1 << 62))
    if tp is float:
        return number(*(span.low, span.high, span.least) if span else (-MAX_NUMBER, MAX_NUMBER))
    if tp is str:
        return string(text.limit if text else MAX_STRING, text.choices if text else None)
    if origin in (list, tuple):
        args = get_args(tp)
        element = args[0] if args else object
        limit = items.limit if items else MAX_ITEMS
        return sequence(check_for(element), limit, origin is tuple, _plain_numbers(element))
    if origin is dict:
        return mapping(check_for(get_args(tp)[1]), items.limit if items else MAX_ITEMS)
    if dataclasses.is_dataclass(tp):
        return nested(tp)
    if tp is object or tp is Any:
        return anything
    raise TypeError(f"no check for the declared type {tp!r}")


def union(options: list) -> Check:
    """Several dataclasses, told apart by their fields: the one whose required fields are all present and that
    knows every field given (ModelFacts has ``num_layers``, ServerFacts ``url``); its message if it fails."""
    checks = [(check_for(option), plan(option)) for option in options]

    def check(value: object, name: str) -> object:
        if type(value) is dict:
            for one, shape in checks:
                if shape.required <= value.keys() and all(k in shape.checks or k == "type" for k in value):
                    return one(value, name)
        return checks[0][0](value, name)
    return check


def _plain_numbers(element: object) -> tuple[bool, float, float] | None:
    """(whole, low, high) when ``element`` is a plain bounded number, for the one-pass list check."""
    metadata: tuple = ()
    if get_origin(element) is Annotated:
        element, *extra = get_args(element)
        metadata = tuple(extra)
    if element not in (int, float):
        return None
    span = next((m for m in metadata if isinstance(m, Range)), None)
    low, high = (span.low, span.high) if span else (-MAX_NUMBER, MAX_NUMBER)
    return element is int, low, high


# --- a value checking itself ------------------------------------------------------------------------------------
def check_instance(obj: object) -> None:
    """Check a dataclass instance's fields against their declarations (raises ``FieldError``): what settings
    objects call in ``__post_init__``, so a bad value is refused where it is made."""
    for name, check in plan(type(obj)).checks.items():
        check(getattr(obj, name), name)


def finite(value: object) -> bool:
    return (type(value) is int or type(value) is float) and math.isfinite(value)


__all__ = ["Check", "FieldError", "Items", "MISSING", "Plan", "Range", "Text", "check_for", "check_instance",
           "plan", "short", "wrong"]


# --- what a form or a command line needs to know of a field ---------------------------------------------------
@dataclasses.dataclass(frozen=True)
class FieldShape:
    """A settings field as a CLI flag or a form widget sees it: its plain type (``int``, ``float``, ``str``,
    ``bool``, or ``tuple`` of ``element``), whether None is allowed, its markers and its default."""

    name: str
    base: type
    optional: bool
    element: type | None
    span: Range | None
    text: Text | None
    items: Items | None
    setting: Any
    default: object
    key: Any = None            # the lecture key that changes it (``engine.facts.fields.Key``), if any
    column: Any = None         # how a table shows it (``engine.facts.fields.Column``), on a lesson's point


@cache
def _shapes(cls: type) -> tuple[FieldShape, ...]:
    hints = typing.get_type_hints(cls, include_extras=True)
    out = []
    for f in dataclasses.fields(cls):
        tp, metadata, optional = hints[f.name], (), False
        while True:
            origin = get_origin(tp)
            if origin is Annotated:
                tp, *extra = get_args(tp)
                metadata += tuple(extra)
            elif origin in (Union, types.UnionType):
                optional = type(None) in get_args(tp)
                tp = next(a for a in get_args(tp) if a is not type(None))
            else:
                break
        element = None
        if get_origin(tp) in (list, tuple):
            element_tp = get_args(tp)[0]
            if get_origin(element_tp) is Annotated:
                element_tp, *extra = get_args(element_tp)
                metadata += tuple(m for m in extra if not isinstance(m, Items))
            element, tp = element_tp, tuple
        span, text, items, setting = bounds(*metadata)
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else MISSING)
        out.append(FieldShape(f.name, tp, optional, element, span, text, items, setting, default,
                              key_of(*metadata), column_of(*metadata)))
    return tuple(out)


def shapes(cls: type) -> list[FieldShape]:
    """The fields of a settings class, in order, with what ``Setting`` each carries (None: not exposed)."""
    return list(_shapes(cls))


def shape_of(cls: type, name: str) -> FieldShape:
    """One field's shape (``shapes`` of the class, by name)."""
    return next(s for s in shapes(cls) if s.name == name)
