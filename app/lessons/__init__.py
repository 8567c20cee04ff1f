"""The window's side of the lessons, one module each beside its engine module (``engine.lessons``): its tab
(a ``LessonView``: settings form, chart, words, table), its scene's caption, and where it sits in the lecture.
:data:`LESSONS` lists them once; the Experiments tabs, the scenes and the controller iterate it.

A lesson's app module defines ``LESSON`` (the engine lesson), ``VIEW`` (its ``LessonView`` subclass, or None
when another panel draws it), ``caption(record, context)``, ``SCENE`` (a ``Scene``, or None) and ``JOINS`` (a
``Joins`` when it shares another lesson's scene, or None); and, where they differ from the usual, ``DOCK`` (the
panel that draws it), ``FOLLOWS`` (a settings field it takes from the window: ``(field, "conversation")``),
``BESIDE`` (the workbench panels its scene shows beside its view: ``("kv",)``) and ``SHOWS_RUNS`` (True: the runs
it makes are the ones the run panels show while it runs, as a run of your own would be).
"""

from __future__ import annotations

from dataclasses import replace
from types import ModuleType

from app.lesson_view import Joins, LessonView, Scene
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

LESSONS: tuple[ModuleType, ...] = (prefill, cache, batch, continuous, chat, formats, speculative, paged, server_load,
                                   architectures, offload, depth, kv_compression, disaggregation)
BY_KIND: dict[str, ModuleType] = {module.LESSON.kind: module for module in LESSONS}


def views() -> dict[str, type[LessonView]]:
    """The lessons with a tab of their own, in order."""
    return {kind: module.VIEW for kind, module in BY_KIND.items() if module.VIEW is not None}


def scenes() -> list[Scene]:
    """The lessons' scenes, each knowing the lesson R runs there."""
    return [replace(module.SCENE, lesson=kind) for kind, module in BY_KIND.items() if module.SCENE is not None]


def dock_of(kind: str) -> str:
    """The dock a lesson is drawn in: its tab in Experiments, or the panel it names (``DOCK``: the chat
    comparison is drawn in the Chat panel)."""
    return getattr(BY_KIND[kind], "DOCK", "experiments")


def follows() -> dict[str, tuple[str, str]]:
    """By lesson: the settings field it takes from the window when it starts, and from what (``FOLLOWS``: the
    chat comparison takes the conversation's turns)."""
    return {kind: module.FOLLOWS for kind, module in BY_KIND.items() if getattr(module, "FOLLOWS", None)}


def joins() -> dict[str, tuple[str, Joins]]:
    """By scene: the lesson that joins it, and how (its key and words)."""
    return {module.JOINS.scene: (kind, module.JOINS) for kind, module in BY_KIND.items() if module.JOINS is not None}


def beside(kind: str) -> tuple[str, ...]:
    """The panels a lesson's scene shows beside its view (``BESIDE``)."""
    return getattr(BY_KIND[kind], "BESIDE", ())


def followed() -> frozenset[str]:
    """The lessons whose runs the run panels show as they run (``SHOWS_RUNS``)."""
    return frozenset(kind for kind, module in BY_KIND.items() if getattr(module, "SHOWS_RUNS", False))
