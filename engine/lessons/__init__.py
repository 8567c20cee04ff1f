"""The lessons, one module each, listed once: the CLI's ``sweep`` subcommands, the window's Experiments tabs
and lecture scenes, the trace schema and Perfetto export iterate :data:`LESSONS` instead of naming kinds.

A lesson module declares its settings (a frozen dataclass whose fields carry their bounds and, for the ones a
user can change, a ``Setting`` with the CLI flag and the form label), its typed result, ``run(experiment,
settings)`` and ``table(points, result)``, and ends with ``LESSON = Lesson(...)``. It imports no torch at
module level (the window reads lessons with no model loaded) and no other lesson. Adding a lesson means its
module here, its view in ``app/lessons/``, one line in each registry, its tests and README lines.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.facts.schema import LessonVocabulary
from engine.facts.vocabulary import LessonEvent
from engine.lessons import (
    architectures,
    batch,
    cache,
    chat,
    continuous,
    depth,
    disaggregation,
    formats,
    kv_compression,
    offload,
    paged,
    prefill,
    server_load,
    speculative,
)
from engine.run import faults
from engine.run.experiment import MODEL, SERVER, Lesson

LESSONS: tuple[Lesson, ...] = (prefill.LESSON, cache.LESSON, batch.LESSON, continuous.LESSON, chat.LESSON,
                               formats.LESSON, speculative.LESSON, paged.LESSON, server_load.LESSON,
                               architectures.LESSON, offload.LESSON, depth.LESSON,
                               kv_compression.LESSON, disaggregation.LESSON)
BY_KIND: dict[str, Lesson] = {lesson.kind: lesson for lesson in LESSONS}
faults.declare(*(phase for lesson in LESSONS for phase in lesson.faults))     # what KVSCOPE_FAULTS may name


def run_worker(name: str, argv: Sequence[str]) -> None:
    """Run the process a lesson declares as ``name`` (its ``workers``), with its command line."""
    entries = {worker: entry for lesson in LESSONS for worker, entry in lesson.workers.items()}
    if name not in entries:
        raise KeyError(f"Unknown worker {name!r}: the lessons start {', '.join(entries) or 'none'}")
    entries[name](argv)


def lesson(kind: str) -> Lesson:
    """The lesson called ``kind`` (as traces and the CLI name it)."""
    try:
        return BY_KIND[kind]
    except KeyError:
        raise KeyError(f"Unknown lesson {kind!r}: use one of {', '.join(BY_KIND)}") from None


def vocabulary() -> dict[str, LessonVocabulary]:
    """By kind, what each lesson's experiments may hold: what the trace schema checks them against."""
    return {lesson.kind: LessonVocabulary(lesson.settings, lesson.result, lesson.points, lesson.events)
            for lesson in LESSONS}


def lesson_events() -> tuple[type[LessonEvent], ...]:
    """The events the lessons declare of their own, each once: what a trace may hold besides its own events."""
    return tuple(dict.fromkeys(event for lesson in LESSONS for event in lesson.events))


def sweeps() -> tuple[Lesson, ...]:
    """The lessons ``python -m engine sweep`` runs on a model loaded here."""
    return tuple(lesson for lesson in LESSONS if lesson.target == MODEL)


def server_lesson() -> Lesson:
    """The lesson ``python -m engine load`` runs against a server (there is one)."""
    (lesson,) = server_lessons()
    return lesson


def server_lessons() -> tuple[Lesson, ...]:
    return tuple(lesson for lesson in LESSONS if lesson.target == SERVER)
