"""The window's side of the lessons, one module each beside its engine module (``engine.lessons``): its tab
(a ``LessonView``: settings form, chart, words, table), its scene's caption, and where it sits in the lecture,
all in one typed value, the module's ``WINDOW`` (a ``WindowLesson``). :data:`LESSONS` lists them once; the
Experiments tabs, the scenes and the controller iterate it.
"""

from __future__ import annotations

from dataclasses import replace

from app.lessons import (
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
from app.views.lesson_view import Joins, LessonView, Scene, WindowLesson

LESSONS: tuple[WindowLesson, ...] = tuple(module.WINDOW for module in (
    prefill, cache, batch, continuous, chat, formats, speculative, paged, server_load, architectures, offload, depth,
    kv_compression, disaggregation))
BY_KIND: dict[str, WindowLesson] = {lesson.kind: lesson for lesson in LESSONS}


def views() -> dict[str, type[LessonView]]:
    """The lessons with a tab of their own, in order."""
    return {kind: lesson.view for kind, lesson in BY_KIND.items() if lesson.view is not None}


def scenes() -> list[Scene]:
    """The lessons' scenes, each knowing the lesson R runs there."""
    return [replace(lesson.scene, lesson=kind) for kind, lesson in BY_KIND.items() if lesson.scene is not None]


def dock_of(kind: str) -> str:
    """The dock a lesson is drawn in: its tab in Experiments, or the panel it names (the chat comparison is
    drawn in the Chat panel)."""
    return BY_KIND[kind].dock


def drawn_in(dock: str) -> str | None:
    """The lesson a workbench panel draws besides its own content (the Chat panel: the chat comparison)."""
    return next((kind for kind, lesson in BY_KIND.items() if lesson.dock == dock), None)


def follows() -> dict[str, tuple[str, str]]:
    """By lesson: the settings field it takes from the window when it starts, and from what (the chat comparison
    takes the conversation's turns)."""
    return {kind: lesson.follows for kind, lesson in BY_KIND.items() if lesson.follows}


def joins() -> dict[str, tuple[str, Joins]]:
    """By scene: the lesson that joins it, and how (its key and words)."""
    return {lesson.joins.scene: (kind, lesson.joins) for kind, lesson in BY_KIND.items() if lesson.joins is not None}


def beside(kind: str) -> tuple[str, ...]:
    """The panels a lesson's scene shows beside its view."""
    return BY_KIND[kind].beside


def followed() -> frozenset[str]:
    """The lessons whose runs the run panels show as they run."""
    return frozenset(kind for kind, lesson in BY_KIND.items() if lesson.shows_runs)
