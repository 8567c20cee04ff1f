"""Every lesson in the registry follows one lifecycle in the window: started by its scene's key (or its tab where
it has no scene) with the settings its tab holds, and stopped part-way by the stop key, whichever lesson it is."""

from __future__ import annotations

import time

import pytest
from PySide6.QtGui import QKeySequence

from app import lessons as app_lessons
from app.lesson_view import CONTROLS_PROMPT
from app.scene_list import SCENES
from engine import lessons
from engine.facts.events import ExperimentFinished
from engine.model import kvcache
from engine.run import paged
from engine.run.experiment import SERVER
from tests.app.conftest import close_and_dispose, load, make_window, wait_idle
from tests.replay_server import ReplayServer, llamacpp_routes

PROMPT = "The cache keeps what attention has already read."
TAB = {"server load": {"requests": 20, "every_s": 2.0},       # a load test is paced by its own clock
       "continuous": {"requests": 5},                           # not the default 8: the tab's value is used
       "speculative": {"prompt": CONTROLS_PROMPT},              # the default prompt is longer than 256 positions
       "chat": {"new_tokens": 8},                               # the whole conversation fits 256 positions
       "architectures": {"designs": ("gpt-oss-20b", "Qwen3-Next-80B-A3B")},   # the quickest two to build
       "offload": {"disk_shares": (0.0, 0.5)},                  # not the default three splits
       "kv-compression": {"prompt": CONTROLS_PROMPT},           # the sample document is longer than 256 positions
       "disaggregation": {"long_prompt": 96, "requests": 4}}    # the tiny model's context is 256 positions


@pytest.fixture
def slowed(monkeypatch):
    """Every forward pass (and every paged step) takes 30 ms longer: whatever a lesson does, it is still at it
    when the stop key comes. Yields the start times of the passes, to count those begun after the stop."""
    forward = kvcache.forward
    snapshot = paged._snapshot
    started: list[float] = []

    def slow_forward(*args, **kwargs):
        started.append(time.monotonic())
        time.sleep(0.03)
        return forward(*args, **kwargs)

    monkeypatch.setattr(kvcache, "forward", slow_forward)
    monkeypatch.setattr(paged, "_snapshot", lambda *a, **k: (time.sleep(0.03), snapshot(*a, **k))[1])
    return started


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
                                                                                       monkeypatch, slowed, kind):
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    with ReplayServer(llamacpp_routes()) as server:
        remote = lessons.lesson(kind).target == SERVER
        window = make_window(qtbot, None if remote else tiny_model_dir)
        try:
            if remote:
                load(window, server.url)
                qtbot.waitUntil(lambda: window.client.model is not None and window.client.busy is None)
            window.controls.prompt.setPlainText(PROMPT)
            window.chat.input.setPlainText("What does the cache keep?")
            wanted = {name: PROMPT if value is CONTROLS_PROMPT else value for name, value in TAB.get(kind, {}).items()}
            view = window.experiments.views.get(kind)
            if view is None:                                          # drawn in another panel: no form of its own
                window.controller.choices.set(lessons.lesson(kind).settings(**wanted))
            for name, value in TAB.get(kind, {}).items() if view is not None else ():
                view.form.set_value(name, value)                      # chosen in the lesson's tab
            where = scene_and_key(kind)
            window.activateWindow()
            if where is None:
                assert window.controller.start_lesson(kind)
            else:
                window.lecture.enter(where[0])
                press(qtbot, window, where[1])
            qtbot.waitUntil(lambda: window.store.latest_experiment(kind) is not None or window.banner.isVisible()
                            or bool(window.scene_view.notice))
            assert not window.banner.isVisible() and not window.scene_view.notice, \
                (window.banner.label.text(), window.scene_view.notice)
            begun = len(slowed)
            qtbot.waitUntil(lambda: len(slowed) > begun or remote, timeout=30_000)   # inside its passes now
            pressed = time.monotonic()
            press(qtbot, window, "Ctrl+.")
            wait_idle(qtbot, window)
            after = [t for t in slowed if t > pressed]
            assert len(after) <= 1, f"{len(after)} forward passes began after the stop key"
            record = window.store.latest_experiment(kind)
            for name, value in wanted.items():
                assert getattr(record.settings, name) == value, name
            assert isinstance(record.end, ExperimentFinished) and record.end.reason == "stopped", record.end
            assert record.end.result.incomplete
        finally:
            close_and_dispose(window)
