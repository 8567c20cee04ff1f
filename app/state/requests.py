"""What the window asks the engine's thread to do, one frozen dataclass per request: the worker dispatches on
the type, so a request carries exactly what its work needs and nothing travels as a loose dict."""

from __future__ import annotations

from dataclasses import dataclass

from engine.facts.events import LessonSettings
from engine.facts.params import GenerationParams, LoadSettings


@dataclass(frozen=True)
class Load(LoadSettings):
    """Load a model (a path, a hub id, ``embedded``) or attach to a server (an ``http(s)://`` address), with the
    load settings as declared (``LoadSettings``), and ``measure_peaks``: measure this machine's peaks after
    loading if none are cached (off in lecture mode: a minute of busy cores must never start in front of a
    room)."""

    measure_peaks: bool = True


@dataclass(frozen=True)
class Run:
    prompt: str
    params: GenerationParams


@dataclass(frozen=True)
class Chat:
    messages: tuple[tuple[str, str], ...]           # (role, content), the whole conversation so far
    params: GenerationParams
    reuse: bool = True


@dataclass(frozen=True)
class Lesson:
    """Run one lesson's experiment with these settings (``engine.run.experiment.run_lesson``)."""

    kind: str
    settings: LessonSettings


@dataclass(frozen=True)
class Replay:
    paths: tuple[str, ...]
    speed: float = 1.0


@dataclass(frozen=True)
class Remeasure:
    """Measure this machine's peaks (and the fastest float) again."""


Request = Load | Run | Chat | Lesson | Replay | Remeasure
BUSY = {Load: "load", Run: "run", Chat: "run", Lesson: "experiment", Replay: "replay", Remeasure: "peaks"}
