"""What the next run and the next experiment will do, as plain models with no widgets and no Qt: the controls
panel and the lesson forms write them, the controller reads them, and a lecture scene's parameter keys change
them (the controls follow). Each restored value is checked against the same bounds as its control: a value
out of range (a hand-edited settings file, a file from another version) falls back to its default with a note.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from app.viewstate import Observable
from engine.errors import ParameterError
from engine.events import LessonSettings
from engine.params import MAX_TEMPERATURE, MIN_TOP_P, GenerationParams

SEED_MAX = 2**31 - 1          # what a spin box holds
SLOW_MAX_MS = 1000
MAX_NEW_TOKENS = 1 << 20      # until a model says its context


@dataclass(frozen=True)
class Choices:
    """The run settings a user sets in Controls (or with a scene's keys). ``random_seed``: a fresh seed each
    run, reported; ``slow_ms``: slow motion, a pause before each decode step."""

    prompt: str = "hey, what is continuous batching?"
    chat_template: bool = True
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 42
    random_seed: bool = False
    kv_cache: bool = True
    static_cache: bool = False
    compiled: bool = False
    attention: bool = False
    slow_ms: int = 0


BOUNDS: dict[str, tuple[float, float]] = {
    "max_new_tokens": (1, MAX_NEW_TOKENS), "temperature": (0.0, MAX_TEMPERATURE), "top_k": (0, 1 << 24),
    "top_p": (MIN_TOP_P, 1.0), "seed": (0, SEED_MAX), "slow_ms": (0, SLOW_MAX_MS)}


class RunSettings(Observable):
    """The run settings, observed: listeners hear ``"choices"`` after every change."""

    def __init__(self) -> None:
        super().__init__()
        self.choices = Choices()
        self.notes: list[str] = []           # restored values that were out of range, said once

    def update(self, **changes: object) -> None:
        if not changes:
            return
        new = replace(self.choices, **changes)
        if new != self.choices:
            self.choices = new
            self.changed("choices")

    def params(self, attention: bool = False) -> GenerationParams:
        """What a run gets; raises ``ParameterError`` for a combination the engine refuses."""
        c = self.choices
        kv = c.kv_cache
        return GenerationParams(
            max_new_tokens=c.max_new_tokens, temperature=round(c.temperature, 4), top_k=c.top_k,
            top_p=round(c.top_p, 4), seed=None if c.random_seed else c.seed, kv_cache=kv,
            chat_template=c.chat_template, static_cache=c.static_cache and kv,
            compiled=c.compiled and c.static_cache and kv and not (attention or c.attention),
            capture_attention=attention or c.attention)

    def as_dict(self) -> dict:
        return dataclasses.asdict(self.choices)

    def restore(self, stored: Mapping[str, object]) -> None:
        """Take remembered values, each checked: a wrong type or a value out of its control's range is
        replaced by the default, and ``notes`` says which."""
        defaults, values, notes = Choices(), {}, []
        for f in dataclasses.fields(Choices):
            if f.name not in stored:
                continue
            value = _coerce(stored[f.name], type(getattr(defaults, f.name)))
            low, high = BOUNDS.get(f.name, (None, None))
            if value is None or (low is not None and not low <= value <= high):
                notes.append(f"{f.name} ({str(stored[f.name])[:40]})")
                continue
            values[f.name] = value
        self.notes = notes
        self.choices = replace(defaults, **values)
        self.changed("choices")


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
