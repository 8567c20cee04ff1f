"""Nothing on screen stands still while an experiment works: before its first point the lesson's tab and its
scene show a clock that moves and the repeat in progress, though no event arrives."""

from __future__ import annotations

import threading

from engine.model import kvcache
from tests.app.conftest import wait_idle


def test_a_sweeps_first_point_shows_a_moving_clock_and_the_repeat_in_progress(qtbot, window, monkeypatch):
    now = [1000.0]
    window.store.clock = lambda: now[0]                 # the window's clock, moved by the test, not by waiting
    window.store.new_frame()
    reached, released = threading.Event(), threading.Event()
    forward = kvcache.forward

    def held(*args, **kwargs):                          # the first timed pass waits inside the engine
        if not reached.is_set():
            reached.set()
            released.wait(60)
        return forward(*args, **kwargs)

    monkeypatch.setattr(kvcache, "forward", held)
    view = window.experiments.views["prefill"]
    view.form.set_value("max_length", 64)
    try:
        assert window.controller.start_lesson("prefill")
        qtbot.waitUntil(reached.is_set)
        qtbot.waitUntil(lambda: window.store.latest_experiment("prefill") is not None
                        and window.store.latest_experiment("prefill").progress is not None)
        window.refresh(force=True)
        first = (view.status.text(), view.chart.empty_message)
        assert "Running for 0.0 s" in first[0] and "warm-up" in first[0]
        assert first[1].startswith("Measuring the first point: 0.0 s so far · prefill of 16 tokens: warm-up")
        now[0] += 1.5                                   # time passes; nothing arrives
        window.refresh(force=True)
        assert "Running for 1.5 s" in view.status.text()
        assert view.chart.empty_message.startswith("Measuring the first point: 1.5 s so far")
        now[0] += 1.0
        for _ in range(30):                             # the refresh timer's own frames, not a forced redraw
            window.frames.refresh()
        assert "Running for 2.5 s" in view.status.text()
        window.lecture.enter("prompt")
        window.refresh(force=True)
        assert "running for 2.5 s" in window.scene_view.claim()
        window.lecture.leave()
    finally:
        released.set()
        window.controller.stop()
        wait_idle(qtbot, window)
