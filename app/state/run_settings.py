"""What the next run and the next experiment will do, as plain models with no widgets and no Qt: the controls
panel and the lesson forms write them, the controller reads them, and a lecture scene's parameter keys change
them (the controls follow).

Every range, default and lecture-key step comes from the declarations on ``GenerationParams`` and the lessons'
settings classes (``engine.facts.fields``); the loaded model narrows two of them (top-k to its vocabulary, max new
tokens to its context) through ``set_model_limits``. A restored value is checked against the same bounds: one
out of range (a hand-edited settings file, a file from another version) falls back to its default with a note.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import field, make_dataclass, replace

from app.state import requests as rq
from app.state.viewstate import Observable
from engine.facts.errors import ParameterError
from engine.facts.events import LessonSettings
from engine.facts.fields import Key, Range
from engine.facts.kvformula import format_bytes
from engine.facts.params import GenerationParams
from engine.facts.validation import FieldShape, shape_of, shapes
from engine.serve.client import without_credentials

SLOW_MAX_MS = 1000
PARAMS = GenerationParams()           # the declared defaults, shared with the CLI


DEFAULT_PROMPT = "hey, what is continuous batching?"


def none_choice(shape: FieldShape) -> str | None:
    """The check box a setting that may be None gets beside its number, named by its declared word for None
    (the seed's ``random``: ``random_seed``); None for a setting without one."""
    return f"{shape.setting.none}_{shape.name}" if shape.setting is not None and shape.setting.none else None


def _choice_fields() -> list[tuple[str, type, object]]:
    """The prompt, every declared run setting at its default (and its None check box), and slow motion."""
    out: list[tuple[str, type, object]] = [("prompt", str, field(default=DEFAULT_PROMPT))]
    for shape in shapes(GenerationParams):
        out.append((shape.name, shape.base, field(default=shape.default)))
        if none_choice(shape):
            out.append((none_choice(shape), bool, field(default=False)))
    return out + [("slow_ms", int, field(default=0))]


Choices = make_dataclass("Choices", _choice_fields(), frozen=True, namespace={"__doc__": (
    "The run settings a user sets in Controls (or with a scene's keys), made from ``GenerationParams``'s "
    "declarations: every run setting under its own name, a check box for each that may be None (the seed's "
    "``random_seed``: a fresh seed each run, reported), plus what only the window has: the prompt and slow motion "
    "(``slow_ms``, a pause before each decode step).")})
WINDOW_ONLY = ("prompt", "slow_ms")
RENAMED = {"attention": "capture_attention"}        # names a settings file from an earlier version may hold


def param_shape(name: str) -> FieldShape:
    """The declaration a run setting follows."""
    return shape_of(GenerationParams, name)


def declared_bounds() -> dict[str, tuple[float, float]]:
    """Each number's range, as declared (plus slow motion, which only the window has)."""
    out = {s.name: (s.span.low, s.span.high) for s in shapes(GenerationParams) if s.span is not None}
    out["slow_ms"] = (0, SLOW_MAX_MS)
    return out


BOUNDS = declared_bounds()


def declared_span(name: str) -> Range | None:
    """A setting's whole declared range, every rule included (temperature's gap above 0)."""
    if name == "slow_ms":
        return Range(0, SLOW_MAX_MS)
    field = next((s for s in shapes(GenerationParams) if s.name == name), None)
    return field.span if field is not None else None
MODEL_LIMITED = ("max_new_tokens", "top_k")       # the ranges a loaded model narrows
# The lecture's parameter keys in the order the footer lists them (temperature, top-p, top-k, max tokens).
PARAMETER_LETTERS = tuple(sorted(((s.key.letter, s.name) for s in shapes(GenerationParams) if s.key is not None),
                                 key=lambda key: "TPKM".find(key[0])))


class RunSettings(Observable):
    """The run settings, observed: listeners hear ``"choices"`` after every change and ``"limits"`` when a model
    narrows the ranges."""

    def __init__(self) -> None:
        super().__init__()
        self.choices = Choices()
        self.notes: list[str] = []           # restored values that were out of range, said once
        self.limits: dict[str, int] = {}     # the loaded model's: max new tokens and top-k at most

    def update(self, **changes: object) -> None:
        if not changes:
            return
        new = replace(self.choices, **changes)
        if new != self.choices:
            self.choices = new
            self.changed("choices")

    def bounds(self, name: str) -> tuple[float, float]:
        """The range ``name`` may take now: the declared one, narrowed by the loaded model."""
        low, high = BOUNDS[name]
        return low, min(high, self.limits.get(name, high))

    def set_model_limits(self, max_context: int | None, vocab_size: int | None) -> list[str]:
        """The loaded model's limits (None: the model does not say, as a server may not). A choice past a new
        limit is brought within it; the returned notes say which, in words."""
        limits = {}
        if max_context:
            limits["max_new_tokens"] = max(int(max_context) - 1, 1)      # at least one position for the prompt
        if vocab_size:
            limits["top_k"] = int(vocab_size)
        notes, changes = [], {}
        for name, high in limits.items():
            value = getattr(self.choices, name)
            if value > high:
                changes[name] = high
                what = "positions of context" if name == "max_new_tokens" else "tokens in its vocabulary"
                notes.append(f"{param_shape(name).setting.label.lower()} {value:,} → {high:,} (the model has "
                             f"{high + 1 if name == 'max_new_tokens' else high:,} {what})")
        with self.batch():
            self.limits = limits
            self.changed("limits")
            self.update(**changes)
        return notes

    def notch(self, name: str, direction: int) -> float:
        """``name`` moved one notch of its declared lecture key (``Key``: its step, its factor or its ladder),
        within its bounds now."""
        shape = param_shape(name)
        return notch(shape, getattr(self.choices, name), direction, self.bounds(name))

    def params(self, attention: bool = False) -> GenerationParams:
        """What a run gets: every declared setting as chosen, None where its check box says so, a setting whose
        ``needs`` is off left off, and the combinations the engine refuses resolved the way the controls show them
        (a static cache needs the KV cache; attention, the scene's or the box's, is recorded eagerly). Raises
        ``ParameterError`` for a value the engine refuses."""
        c = self.choices
        values = {}
        for shape in shapes(GenerationParams):
            value = getattr(c, shape.name)
            if none_choice(shape) and getattr(c, none_choice(shape)):
                value = None
            elif isinstance(value, float):
                value = round(value, 4)
            values[shape.name] = value
        values["capture_attention"] = attention or c.capture_attention
        values["static_cache"] = c.static_cache and c.kv_cache
        for shape in shapes(GenerationParams):
            needs = shape.setting.needs if shape.setting is not None else ""
            if needs and not values[needs]:
                values[shape.name] = False
        values["compiled"] = values["compiled"] and not values["capture_attention"]
        return GenerationParams(**values)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self.choices)

    def differences(self, shown: GenerationParams | None) -> list[str]:
        """The settings the next run would take that differ from those ``shown`` ran with, in words ("temperature
        0.9 (ran 0.7)"); [] when they agree or there is no run to compare with."""
        if shown is None:
            return []
        try:
            upcoming = self.params()
        except ParameterError:
            return []
        out = []
        for shape in shapes(GenerationParams):
            name = shape.name
            if none_choice(shape) and getattr(self.choices, none_choice(shape)):
                continue                                 # a fresh seed every run: no value to compare
            now, ran = getattr(upcoming, name), getattr(shown, name)
            if now != ran:
                label = shape.setting.label.lower() if shape.setting is not None else name.replace("_", " ")
                out.append(f"{label} {_value(now)} (ran {_value(ran)})")
        return out

    def restore(self, stored: Mapping[str, object]) -> None:
        """Take remembered values, each checked: a wrong type or a value out of its declared range is replaced
        by the default, and ``notes`` says which."""
        defaults, values, notes = Choices(), {}, []
        stored = {RENAMED.get(name, name): value for name, value in stored.items()}
        declared = set(GenerationParams.field_names())
        for f in dataclasses.fields(Choices):
            if f.name not in stored:
                continue
            value = _coerce(stored[f.name], type(getattr(defaults, f.name)))
            if value is not None and f.name in declared and not GenerationParams.admits(f.name, value):
                value = None                             # the declaration's own rules, every one of them
            span = declared_span(f.name)
            if value is None or (span is not None and not span.admits(value)):
                notes.append(f"{f.name} ({str(stored[f.name])[:40]})")
                continue
            values[f.name] = value
        self.notes = notes
        self.choices = replace(defaults, **values)
        self.changed("choices")


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def notch(shape: FieldShape, value: float, direction: int, bounds: tuple[float, float]) -> float:
    """One notch of ``shape``'s lecture key from ``value``, kept within ``bounds``."""
    key: Key = shape.key
    low, high = bounds
    if key.ladder:                      # the next rung up or down (a value between rungs goes to the next)
        rungs = sorted({v for v in key.ladder if low <= v <= high} | {high if direction > 0 else low})
        ahead = [v for v in rungs if (v > value if direction > 0 else v < value)]
        new = (min(ahead) if direction > 0 else max(ahead)) if ahead else value
    elif key.factor:
        new = value * key.factor if direction > 0 else value / key.factor
    else:
        new = value + direction * (shape.setting.step or 1)
    new = min(max(new, low), high)
    return int(round(new)) if shape.base is int else round(float(new), 4)


def _coerce(value: object, kind: type) -> object:
    """A stored value (QSettings gives strings from an ini file) as ``kind``, or None if it is not one."""
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            return {"true": True, "1": True, "false": False, "0": False}.get(text)
        if kind is int:
            number = int(str(value).strip()) if not isinstance(value, bool) else None
            return number
        if kind is float:
            number = float(str(value).strip())
            return number if math.isfinite(number) else None
        return str(value) if isinstance(value, str) else None
    except (TypeError, ValueError, OverflowError):
        return None


class LessonChoices(Observable):
    """Each lesson's settings as its form last set them: the tab's Run button and the scene's action key start
    the same experiment with the same settings. ``follows``: by lesson, a settings field filled in when it starts,
    and from what: ``"prompt"`` (a form's "the prompt in Controls") or ``"conversation"`` (the chat's turns)."""

    def __init__(self, follows: dict[str, tuple[str, str]] | None = None) -> None:
        super().__init__()
        self.settings: dict[str, LessonSettings] = {}
        self.follows: dict[str, tuple[str, str]] = dict(follows or {})

    def set(self, settings: LessonSettings) -> None:
        if self.settings.get(settings.kind) != settings:
            self.settings[settings.kind] = settings
            self.changed(settings.kind)

    def keyed(self, kind: str, default: type[LessonSettings], letter: str) -> FieldShape | None:
        """The setting of lesson ``kind`` that the lecture key ``letter`` changes, if it declares one."""
        return next((s for s in shapes(default) if s.key is not None and s.key.letter == letter), None)

    def step(self, kind: str, default: type[LessonSettings], letter: str, direction: int) -> LessonSettings | None:
        """Lesson ``kind``'s settings with the field keyed ``letter`` moved a notch (None: it has no such key)."""
        shape = self.keyed(kind, default, letter)
        if shape is None:
            return None
        settings = self.settings.get(kind) or default()
        value = notch(shape, getattr(settings, shape.name), direction, (shape.span.low, shape.span.high))
        self.set(replace(settings, **{shape.name: value}))
        return self.settings[kind]

    def follow_prompt(self, kind: str, field_name: str | None) -> None:
        """A form's prompt field follows the prompt in Controls (``field_name``), or no longer does (None)."""
        if field_name is not None:
            self.follows[kind] = (field_name, "prompt")
        elif self.follows.get(kind, ("", ""))[1] == "prompt":
            del self.follows[kind]

    def for_run(self, kind: str, default: type[LessonSettings], prompt: str,
                conversation: tuple[str, ...] = ()) -> LessonSettings:
        """The settings a start of ``kind`` uses now: the form's, with the prompt in Controls or the chat's turns
        filled in where the lesson follows them (an empty conversation leaves the lesson's own turns)."""
        settings = self.settings.get(kind) or default()
        name, source = self.follows.get(kind, (None, None))
        if source == "prompt":
            if not prompt.strip():
                raise ParameterError("The prompt in Controls is empty: type one there or pick a prompt in the tab")
            settings = replace(settings, **{name: prompt})
        elif source == "conversation" and conversation:
            settings = replace(settings, **{name: conversation})
        return settings


class ModelChoice(Observable):
    """The model the controls name (``asked``) beside the one that is loaded (``loaded``): what differs is
    *pending* until Load model applies it, and says so, so a control never shows one model while runs use
    another. ``failed``: the source whose last load failed (it stays in the box, pending, with that said).
    Listeners hear ``"model"``."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = rq.Load("embedded")
        self.loaded: rq.Load | None = None
        self.failed = ""

    def ask(self, request: rq.Load) -> None:
        if request != self.asked:
            self.asked = request
            self.changed("model")

    def loaded_with(self, request: rq.Load) -> None:
        self.loaded, self.failed = request, ""
        self.changed("model")

    def load_failed(self, request: rq.Load) -> None:
        self.failed = request.model
        self.changed("model")

    def pending(self) -> list[str]:
        """What the controls name that the loaded model does not have, in words ("dtype bfloat16")."""
        asked, loaded = self.asked, self.loaded
        if loaded is None:
            return []
        out = []
        if without_credentials(asked.model) != without_credentials(loaded.model):
            failed = " (its last load failed)" if self.failed and self.failed == asked.model else ""
            out.append(f"source {without_credentials(asked.model)}{failed}")
        for name in ("device", "dtype"):
            if getattr(asked, name) != getattr(loaded, name):
                out.append(f"{name} {getattr(asked, name)}")
        if asked.memory_budget != loaded.memory_budget:
            out.append("memory budget " + (format_bytes(asked.memory_budget) if asked.memory_budget else "no limit"))
        return out

    def pending_text(self) -> str:
        """One line for the controls and the status bar, or "" when the controls show what is loaded."""
        pending = self.pending()
        if not pending:
            return ""
        loaded = self.loaded
        return (f"{', '.join(pending)}: press Load model (Ctrl+L) to apply. Runs use the loaded "
                f"{without_credentials(loaded.model)}, device {loaded.device}, dtype {loaded.dtype}.")
