"""Running a lesson in a test: by kind, with keyword settings, on a loaded model (or a session or server)."""

from __future__ import annotations

import threading

from engine import lessons
from engine.run.experiment import run_lesson


def collect(kind: str, target, cancel: threading.Event | None = None, events: list | None = None, **settings):
    """``(events, ExperimentFinished)`` of lesson ``kind`` with ``settings`` (the lesson's defaults for the rest);
    ``events`` collects them as they come (what was emitted before a failure stays in it)."""
    from engine.run.session import Session

    lesson = lessons.lesson(kind)
    session = target if hasattr(target, "run") else Session(target)
    events = [] if events is None else events
    finished = run_lesson(lesson, session, lesson.settings(**settings), events.append, cancel)
    return events, finished
