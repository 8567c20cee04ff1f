"""Every lesson in the registry follows one lifecycle in the window: started by its scene's key (or its tab where
it has no scene) with the settings its tab holds (the lesson's own quick settings, chosen in its tab), and stopped
part-way by the stop key, whichever lesson it is: no table of lessons here."""

from __future__ import annotations

import threading
import time

import pytest
from PySide6.QtGui import QKeySequence
from PySide6.QtWidgets import QComboBox

from app import lessons as app_lessons
from app.lecture.scene_list import SCENES
from app.views.lesson_view import CONTROLS_PROMPT
from engine import lessons
from engine.facts.events import ExperimentFinished
from engine.model import kvcache
from engine.run import paged_serving
from engine.run.experiment import SERVER
from tests.app.conftest import close_and_dispose, load, make_window, wait_idle
from tests.replay_server import ReplayServer, llamacpp_routes

PROMPT = "The cache keeps what attention has already read."


class Hold:
    """Counts the passes a lesson makes (forward passes, paged steps, requests to a server) and, once armed,
    holds the first one inside the engine until released: the stop key always comes while the lesson is in its
    passes, however fast its quick settings or however busy the machine."""

    def __init__(self) -> None:
        self.started: list[float] = []
        self.armed = False
        self.reached, self.released = threading.Event(), threading.Event()

    def __call__(self) -> None:
        self.started.append(time.monotonic())
        if self.armed and not self.reached.is_set():
            self.reached.set()
            self.released.wait(60)


@pytest.fixture
def hold(monkeypatch):
    from engine.serve.remote import RemoteSession

    gate = Hold()
    forward, snapshot, chat = kvcache.forward, paged_serving._snapshot, RemoteSession.chat

    def held(function):
        def call(*args, **kwargs):
            gate()
            return function(*args, **kwargs)
        return call

    monkeypatch.setattr(kvcache, "forward", held(forward))
    monkeypatch.setattr(paged_serving, "_snapshot", held(snapshot))
    monkeypatch.setattr(RemoteSession, "chat", held(chat))
    yield gate
    gate.released.set()


def scene_and_key(kind: str) -> tuple[str, str] | None:
    """The scene that starts lesson ``kind`` and the key that does it there (R, or a joined lesson's own)."""
    for scene in SCENES:
        if scene.lesson == kind:
            return scene.name, "R"
    joined = {k: (scene, j.key) for scene, (k, j) in app_lessons.joins().items()}
    return joined.get(kind)


def press(qtbot, window, key: str) -> None:
    sequence = QKeySequence(key)[0]
    qtbot.keyClick(window, sequence.key(), sequence.keyboardModifiers())


@pytest.mark.parametrize("kind", [lesson.kind for lesson in lessons.LESSONS])
def test_each_lesson_starts_with_its_tabs_settings_and_the_stop_key_stops_it_part_way(qtbot, tiny_model_dir, tmp_path,
                                                                                       monkeypatch, hold, kind):
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    lesson = lessons.lesson(kind)
    with ReplayServer(llamacpp_routes()) as server:
        remote = lesson.target == SERVER
        window = make_window(qtbot, None if remote else tiny_model_dir)
        try:
            if remote:
                load(window, server.url)
                qtbot.waitUntil(lambda: window.client.model is not None and window.client.busy is None)
            window.controls.prompt.setPlainText(PROMPT)
            window.chat.input.setPlainText("What does the cache keep?")
            view = window.experiments.views.get(kind)
            wanted = {name: value for name, value in lesson.quick.items()    # what its tab can choose
                      if view is None or name in view.form.widgets}
            if view is None:                                          # drawn in another panel: no form of its own
                window.controller.choices.set(lesson.settings(**wanted))
            for name, value in wanted.items() if view is not None else ():
                widget = view.form.widgets[name]
                if isinstance(value, str) and isinstance(widget, QComboBox) and \
                        widget.findData(CONTROLS_PROMPT) >= 0:        # a text the tab takes from Controls
                    window.controls.prompt.setPlainText(value)
                    value = CONTROLS_PROMPT
                view.form.set_value(name, value)                      # chosen in the lesson's tab
            where = scene_and_key(kind)
            window.activateWindow()
            hold.armed = True
            if where is None:
                assert window.controller.start_lesson(kind)
            else:
                window.lecture.enter(where[0])
                press(qtbot, window, where[1])
            qtbot.waitUntil(lambda: hold.reached.is_set() or window.banner.isVisible()
                            or bool(window.scene_view.notice), timeout=60_000)
            assert not window.banner.isVisible() and not window.scene_view.notice, \
                (window.banner.label.text(), window.scene_view.notice)
            qtbot.waitUntil(lambda: window.store.latest_experiment(kind) is not None)
            pressed = time.monotonic()
            press(qtbot, window, "Ctrl+.")                            # while a pass is held in the engine
            hold.released.set()
            wait_idle(qtbot, window)
            after = [t for t in hold.started if t > pressed]
            assert len(after) <= 1, f"{len(after)} passes began after the stop key"
            record = window.store.latest_experiment(kind)
            for name, value in wanted.items():
                assert getattr(record.settings, name) == value, name
            assert isinstance(record.end, ExperimentFinished) and record.end.reason == "stopped", record.end
            assert record.end.result.incomplete
        finally:
            close_and_dispose(window)
