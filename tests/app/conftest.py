"""Window fixtures: a real MainWindow on the tiny model, settings in a temporary ini file."""

from __future__ import annotations

from pathlib import Path

import pytest


def load(window, model: str, device: str = "auto", dtype: str = "auto") -> None:
    """What Load model does with these choices."""
    from app.state.requests import Load

    window.controller.load_model(Load(model, device, dtype))


def start_lesson(window, kind: str, **settings) -> bool:
    """What a lesson's Run button does, its form set to ``settings`` (the rest the lesson's defaults)."""
    from engine import lessons

    window.controller.choices.set(lessons.lesson(kind).settings(**settings))
    return window.controller.start_lesson(kind)


def wait_idle(qtbot, window, timeout: int = 60_000) -> None:
    qtbot.waitUntil(lambda: window.client.busy is None, timeout=timeout)


def make_window(qtbot, model_dir=None):
    from app.main import build, parse_args

    _app, window = build(parse_args(["--no-load"]))
    window.show()
    if model_dir is not None:
        load(window, str(model_dir), "cpu", "float32")
        qtbot.waitUntil(lambda: window.client.model is not None and window.client.busy is None, timeout=60_000)
    return window


@pytest.fixture
def window(qtbot, tiny_model_dir):
    w = make_window(qtbot, tiny_model_dir)
    yield w
    close_and_dispose(w)


def arrange_at(qtbot, window, size: tuple[int, int]) -> None:
    """Resize the window and wait until its docks are arranged for the new size."""
    from app.shell.dock_layout import is_compact

    window.resize(*size)
    qtbot.waitUntil(lambda: window.dock_layout.compact is is_compact(*size) and window.dock_layout.settled,
                    timeout=5000)


def close_and_dispose(window) -> None:
    from PySide6.QtWidgets import QApplication

    from app.main import dispose

    window.close()
    dispose(QApplication.instance(), window)


def run_and_wait(qtbot, window, timeout: int = 60_000):
    window.controller.run()
    qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.finished
                    and window.client.busy is None, timeout=timeout)
    window.refresh(force=True)
    return window.store.current


@pytest.fixture(scope="session")
def lecture_trace(tiny, tmp_path_factory):
    """One trace with what every scene draws: a run, and every lesson a scene shows, run with its quick settings
    (on the tiny model: the shapes of the real thing, in seconds)."""
    from app import lessons as app_lessons
    from engine.facts.params import GenerationParams
    from engine.output.trace import read_trace, write_trace
    from engine.run.experiment import MODEL
    from engine.run.session import Session
    from tests.lessons import collect

    session = Session(tiny)
    events: list = []
    session.run("hello <b>world</b>", GenerationParams(max_new_tokens=24, temperature=0.8, top_k=20, seed=1,
                                                       capture_attention=True), events.append)
    for shown in app_lessons.LESSONS:
        if (shown.scene is not None or shown.joins is not None) and shown.lesson.target == MODEL:
            collect(shown.kind, session, events=events, **shown.lesson.quick)
    # and a load test recorded from a real vLLM (its KV events, its prefix tree): a serving engine, replayed
    events += read_trace(Path(__file__).parents[1] / "fixtures" / "vllm_load.kvscope.jsonl")
    return write_trace(tmp_path_factory.mktemp("lecture") / "lecture.kvscope.jsonl", events)


@pytest.fixture(scope="session")
def busy_lecture_trace(lecture_trace, tmp_path_factory):
    """The lecture trace as if every figure in it had been measured on a busy machine: every caption at its
    longest (it says so), whatever the machine that made the trace was doing."""
    import dataclasses

    from engine.facts.events import ExperimentFinished, RunFinished
    from engine.output.trace import read_trace, write_trace

    def busy(event):
        if isinstance(event, ExperimentFinished) and event.result is not None:
            return dataclasses.replace(event, result=dataclasses.replace(event.result, lowest_cpu_share=0.2))
        if isinstance(event, RunFinished):
            return dataclasses.replace(event, summary=dataclasses.replace(event.summary, cpu_share=0.2))
        return event

    events = [busy(e) for e in read_trace(lecture_trace)]
    return write_trace(tmp_path_factory.mktemp("busy-lecture") / "lecture.kvscope.jsonl", events)


def open_replayed(qtbot, trace, size):
    w = make_window(qtbot)
    w.resize(*size)
    w.controller.replay_speed = 0.0
    w.files.open_trace(str(trace))
    wait_idle(qtbot, w)
    return w
