"""Hostile input in the window: what the trace reader accepts draws without an exception, what a panel raises
ends in a banner with the window still working, and text from a model or a file is never read as HTML."""

from __future__ import annotations

import random

import pytest

from engine.facts.errors import TraceError
from engine.facts.events import TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import ReplayGap, ReplayIncomplete, read_trace, replay, write_trace
from engine.run.session import Session
from tests.app.conftest import run_and_wait, wait_idle
from tests.engine.test_trace_schema import mutate
from tests.traces import rows_of


@pytest.fixture(scope="module")
def valid_rows(tiny, tmp_path_factory) -> list[dict]:
    events: list = []
    Session(tiny).run("hello <b>world</b> & more", GenerationParams(max_new_tokens=10, temperature=0.9, seed=5),
                      events.append)
    return rows_of(events, tmp_path_factory.mktemp("rows") / "run.jsonl")


def test_every_fuzzed_trace_the_reader_accepts_draws_without_an_exception(qtbot, window, valid_rows, tmp_path):
    rng = random.Random(11)
    drawn = 0
    for case in range(150):
        path = tmp_path / f"f{case}.jsonl"
        path.write_text(mutate(valid_rows, rng))
        try:
            events = read_trace(path)
        except TraceError:
            continue
        window.store.clear()
        for event in replay(events, speed=0):
            if isinstance(event, ReplayIncomplete):
                window.store.mark_incomplete(event.run_id)
            elif not isinstance(event, ReplayGap):
                window.store.add(event)
        window.refresh(force=True)
        assert window.surface._failure_shown is None, (case, window.banner.label.text())
        drawn += 1
    assert drawn >= 5


def test_a_panel_that_raises_ends_in_a_banner_and_the_window_keeps_working(qtbot, window, monkeypatch):
    def broken() -> None:
        raise ValueError("injected drawing failure")

    monkeypatch.setattr(window.kv, "refresh", broken)
    window.controls.max_tokens.setValue(3)
    run = run_and_wait(qtbot, window)
    assert window.banner.isVisible()
    assert "Drawing the KV heatmap failed (ValueError: injected drawing failure)" in window.banner.label.text()
    assert window.tokens.rendered_tokens() == run.prompt_tokens + run.n_steps     # the other panels drew
    monkeypatch.undo()
    assert run_and_wait(qtbot, window).n_steps == 3 and window.kv.image.image.shape[1] > 0


def test_a_failure_that_goes_on_is_said_again_after_a_new_run_cleared_the_banner(qtbot, window):
    def broken() -> None:
        raise ValueError("injected drawing failure")

    assert not window.guarded("Drawing the KV heatmap", broken) and window.banner.isVisible()
    window.banner.hide()
    assert not window.guarded("Drawing the KV heatmap", broken) and not window.banner.isVisible()   # said once
    window.surface.clear_banner()                          # what a new run's start does
    assert not window.guarded("Drawing the KV heatmap", broken) and window.banner.isVisible()


def test_model_and_file_text_is_shown_as_text_not_html(qtbot, window, tiny, tmp_path):
    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=3), events.append)
    facts = events[0].model
    hostile = facts.__class__(**{**vars(facts), "layer_devices": ["<b>cpu</b>"] * facts.num_layers})
    events[0] = events[0].__class__(**{**vars(events[0]), "model": hostile})
    last = next(i for i in range(len(events) - 1, -1, -1) if isinstance(events[i], TokenStep))
    events[last] = TokenStep(**{**vars(events[last]), "text": "<b>&amp;"})
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(write_trace(tmp_path / "html.jsonl", events)))
    wait_idle(qtbot, window)
    window.refresh(force=True)
    assert "&lt;b&gt;cpu&lt;/b&gt;" in window.kv.info.text()
    assert "&lt;b&gt;&amp;amp;" in window.sampling.caption.text()        # "<b>&amp;", escaped for rich text
    window.tokens._show(window.store.current.steps[-1].position)
    assert "<b>&amp;" in window.tokens.detail.text()                     # a plain-text label, shown as is


def test_an_incomplete_trace_replays_marked(qtbot, window, tiny, tmp_path):
    events: list = []
    Session(tiny).run("hi", GenerationParams(max_new_tokens=4), events.append)
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(write_trace(tmp_path / "cut.jsonl", events[:-2])))
    wait_idle(qtbot, window)
    assert window.store.current.reason == "incomplete"
    assert "marked incomplete" in window.banner.label.text()
