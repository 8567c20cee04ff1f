"""The window's side of the lessons, one module each beside its engine module (``engine.lessons``): its tab
(a ``LessonView``: settings form, chart, words, table), its scene's caption, and where it sits in the lecture.
:data:`LESSONS` lists them once; the Experiments tabs, the scenes and the controller iterate it.

A lesson's app module defines ``LESSON`` (the engine lesson), ``VIEW`` (its ``LessonView`` subclass, or None
when another panel draws it), ``caption(record, context)``, ``SCENE`` (a ``Scene``, or None) and ``JOINS`` (a
``Joins`` when it shares another lesson's scene, or None).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from app.lesson_view import Joins, LessonView, Scene
from app.lessons import batch, cache, chat, continuous, formats, paged, prefill, server_load, speculative

LESSONS: tuple[ModuleType, ...] = (prefill, cache, batch, continuous, chat, formats, speculative, paged, server_load)
BY_KIND: dict[str, ModuleType] = {module.LESSON.kind: module for module in LESSONS}


def views() -> dict[str, type[LessonView]]:
    """The lessons with a tab of their own, in order."""
    return {kind: module.VIEW for kind, module in BY_KIND.items() if module.VIEW is not None}


def scenes() -> list[Scene]:
    """The lessons' scenes, each knowing the lesson R runs there."""
    return [replace(module.SCENE, lesson=kind) for kind, module in BY_KIND.items() if module.SCENE is not None]


def joins() -> dict[str, tuple[str, Joins]]:
    """By scene: the lesson that joins it, and how (its key and words)."""
    return {module.JOINS.scene: (kind, module.JOINS) for kind, module in BY_KIND.items() if module.JOINS is not None}
