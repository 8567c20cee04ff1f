"""Lecture mode in front of a room, at 1920x1080 and 1280x720: every scene's caption in two lines with the footer
on screen and the window inside the screen (in the scenes and after Esc), B that always brings the scene back,
parameter keys that re-run with the new value, captions that claim nothing before it is measured, per-layer
bars level with their heatmap rows, and time axes in seconds once they pass 10 s."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, QPointF, QRect
from PySide6.QtGui import QKeySequence

from app.lecture import mode as lecture
from app.lecture.scene_list import NAMES
from app.lecture.scenes import CAPTION_LINES, run_claim, split_caption
from app.state.store import RunRecord
from app.state.viewstate import ViewState
from app.views import theme
from app.views.chart import Chart
from engine.facts.events import RunStarted
from tests.app.conftest import close_and_dispose, open_replayed, run_and_wait, wait_idle

SIZES = [(1920, 1080), (1280, 720)]


def press(qtbot, window, key: str) -> None:
    sequence = QKeySequence(key)[0]
    qtbot.keyClick(window, sequence.key(), sequence.keyboardModifiers())


def lines(label) -> float:
    return label.heightForWidth(label.width()) / label.fontMetrics().lineSpacing()


def inside(window, area: QRect) -> bool:
    return area.contains(window.frameGeometry())


@pytest.fixture
def screen(monkeypatch, request):
    """The window's screen is ``request.param`` pixels (offscreen Qt has one fixed screen of its own)."""
    area = QRect(0, 0, *request.param)
    monkeypatch.setattr(lecture, "screen_area", lambda window, available=False: QRect(area))
    return area


@pytest.mark.parametrize("screen", SIZES, indirect=True, ids=["1080p", "720p"])
def test_every_scene_fits_the_screen_with_a_two_line_caption_and_the_footer_in_view(qtbot, lecture_trace, screen):
    w = open_replayed(qtbot, lecture_trace, (1600, 1000))
    w.move(40, 40)                                    # a workbench laid out on a larger screen than the projector's
    try:
        for attempt in ("leave", "Esc"):
            w.lecture.enter(NAMES[0])
            for name in [*NAMES, "chat"]:                 # chat again last: it once widened the window on a revisit
                w.state.show_scene(name)
                w.refresh(force=True)

                def fits(name=name) -> None:
                    view = w.scene_view
                    assert w.width() <= screen.width() and w.height() <= screen.height(), (name, w.size())
                    assert lines(view.caption) <= CAPTION_LINES + 0.1, (name, view.caption.text())
                    assert not view.detail.isVisible() or lines(view.detail) <= 2.1, (name, view.detail.text())
                    for line in (view.footer, view.next_run):         # the keys, and the next run's settings
                        bottom = line.mapTo(w, QPoint(0, line.height())).y()
                        assert line.isVisible() and bottom <= w.height(), (name, bottom, w.height())
                        assert line.heightForWidth(line.width()) <= line.height() + 1, name
                        assert lines(line) <= 1.1, (name, line.text())      # one line each, the credit beside

                qtbot.waitUntil(fits, timeout=10_000)        # once the layouts settle (more turns on a busy machine)
            if attempt == "leave":
                w.lecture.leave()
            else:
                press(qtbot, w, "Esc")
            qtbot.wait(50)
            assert not w.lecture.active and inside(w, screen), (attempt, w.frameGeometry())
            assert w.controls.run_button.isVisible()
    finally:
        close_and_dispose(w)


def test_b_then_a_scene_change_then_b_shows_the_scene_again(qtbot, lecture_trace):
    w = open_replayed(qtbot, lecture_trace, (1280, 720))
    try:
        w.lecture.enter("cache")
        w.activateWindow()
        press(qtbot, w, "B")
        assert w.scene_view.cover.isVisible()
        press(qtbot, w, "PgDown")
        assert w.state.scene == NAMES[NAMES.index("cache") + 1] and w.scene_view.cover.isVisible()   # still dark
        press(qtbot, w, "B")
        assert not w.scene_view.cover.isVisible() and w.scene_view.shown == w.state.scene
        press(qtbot, w, "B")
        press(qtbot, w, "Esc")                               # leaving lights the screen; coming back shows it lit
        press(qtbot, w, "F11")
        assert w.lecture.active and not w.scene_view.cover.isVisible()
    finally:
        close_and_dispose(w)


def test_a_parameter_key_changes_the_setting_shows_it_and_runs_again_with_it(qtbot, window):
    window.controls.max_tokens.setValue(16)
    first = run_and_wait(qtbot, window)
    window.lecture.enter("prefill")
    window.activateWindow()
    press(qtbot, window, "T")
    qtbot.waitUntil(lambda: window.store.current is not first and window.store.current.finished)
    wait_idle(qtbot, window)
    assert window.store.current.started.params.temperature == pytest.approx(first.started.params.temperature + 0.1)
    assert "<b>T</b> 0.1" in window.scene_view.footer_text()
    press(qtbot, window, "Shift+M")                            # Shift lowers: half the tokens
    qtbot.waitUntil(lambda: window.client.busy is None and window.store.current.started.params.max_new_tokens == 8)
    assert window.controls.max_tokens.value() == 8               # the workbench's control says the same
    window.lecture.leave()


def test_a_caption_claims_nothing_measured_before_the_prefill_ends(tiny):
    from engine.facts.params import GenerationParams
    from engine.run.session import Session

    events: list = []
    Session(tiny).run("hello", GenerationParams(max_new_tokens=2), events.append)
    started = next(e for e in events if isinstance(e, RunStarted))
    run = RunRecord(started)
    for name in ("prefill", "kv", "memory"):
        claim = run_claim(name, run, ViewState())
        assert "prefill running" in claim and "measured" not in claim and " ms" not in claim, (name, claim)


def test_a_long_claim_is_cut_between_clauses_into_a_headline_and_its_detail():
    title, claim = "3 · Cache: ", "decode 1.4x slower (measured); the cost model counts 32x the FLOPs: weights dominate"
    head, detail = split_caption(title, claim, lambda s: len(s) <= 60)
    assert head == "3 · Cache: decode 1.4x slower (measured)"
    assert detail == "the cost model counts 32x the FLOPs: weights dominate"
    assert split_caption(title, claim, lambda s: True) == (title + claim, "")
    head, detail = split_caption("9 · T: ", "a long first clause without any stop, then more", lambda s: len(s) <= 45)
    assert head == "9 · T: a long first clause without any stop" and detail == "then more"
    assert split_caption("9 · T: ", "a b, c", lambda s: False) == ("9 · T: a b", "c")     # the title stays whole


def test_each_layers_bars_are_level_with_its_heatmap_row(qtbot, window):
    window.controls.max_tokens.setValue(4)
    run_and_wait(qtbot, window)
    window.resize(1280, 720)
    qtbot.wait(50)
    heat, bars = window.kv.plot.getViewBox(), window.kv.bars_plot.getViewBox()
    layers = window.store.current.model.num_layers
    for layer in range(layers):
        row = heat.mapViewToScene(QPointF(0, layer + 0.5)).y()
        bar = bars.mapViewToScene(QPointF(0, layer + 0.5)).y()
        assert abs(row - bar) <= 1.0, (layer, row, bar)
    k_y = window.kv.k_bars.opts["y"]
    assert list(k_y + 0.2) == pytest.approx([layer + 0.5 for layer in range(layers)])


def test_a_time_axis_reads_in_seconds_past_ten_seconds_and_in_ms_below(qtbot):
    chart = Chart("timeline")
    qtbot.addWidget(chart)
    chart.style(theme.current_theme(True), "time since run start", "ms", "run", None)
    axis = chart.plot.getAxis("bottom")
    chart.plot.setXRange(0, 150_000, padding=0)
    assert axis.labelUnits == "s" and axis.tickStrings([0, 50_000, 150_000], axis.scale, 50_000) == ["0", "50", "150"]
    chart.plot.setXRange(0, 5_000, padding=0)
    assert axis.labelUnits == "ms" and axis.tickStrings([0, 1_000, 5_000], axis.scale, 1_000) == ["0", "1000", "5000"]
    assert chart.plot.getAxis("left").labelUnits == ""                         # only time axes change


def test_the_stop_key_in_a_scene_says_so_in_the_footer(qtbot, window):
    window.lecture.enter("cache")
    window.activateWindow()
    press(qtbot, window, "Ctrl+.")
    assert "Nothing to stop" in window.scene_view.footer_text() and window.lecture.active    # Esc would leave


def test_the_stop_key_during_a_run_names_what_stops(qtbot, window):
    window.controls.max_tokens.setValue(200)
    window.controller.run()
    qtbot.waitUntil(lambda: window.client.busy == "run")
    window.controller.stop()
    assert window.status.currentMessage() == "Stopping: the run ends at its next step."
    wait_idle(qtbot, window)


@pytest.mark.parametrize("screen", SIZES, indirect=True, ids=["1080p", "720p"])
def test_the_scene_footers_progress_bar_is_wide_enough_for_its_words_at_lecture_size(qtbot, window, screen):
    w = window
    w.lecture.enter("prefill")
    w.controller.step()                                 # a run held after its prefill: the footer shows its progress
    qtbot.waitUntil(lambda: w.store.current is not None and w.client.control.held)
    bar = w.scene_view.progress

    def fits() -> None:
        w.refresh(force=True)
        assert w.scene_view.progress_box.isVisible() and bar.text().endswith(" of 128")
        assert bar.width() >= bar.fontMetrics().horizontalAdvance(bar.text()) + 2 * bar.fontMetrics().height()

    qtbot.waitUntil(fits, timeout=10_000)
    w.controller.stop()
    wait_idle(qtbot, w)
    w.lecture.leave()


def test_a_stopping_line_goes_when_the_work_has_ended_and_a_line_said_after_it_stays(qtbot, window):
    """An experiment's stop says nothing of its own when it ends: "Stopping" stayed on screen after the stop had
    taken effect, for as long as its timer ran."""
    stopping = "Stopping: the experiment ends at its next step."
    window.surface.show_until_idle(stopping)
    window.surface.busy_changed("experiment")
    assert window.status.currentMessage() == stopping             # still winding down: no timer takes it away
    window.surface.busy_changed(None)
    assert window.status.currentMessage() == ""
    window.surface.show_until_idle(stopping)
    window.surface.show_status("Run #2 stopped at token 3.")
    window.surface.busy_changed(None)
    assert window.status.currentMessage() == "Run #2 stopped at token 3."


def test_the_status_bar_and_the_model_label_name_the_model_and_its_details_keep_why(qtbot, window):
    from app.link.routing import describe_loaded

    loaded = window.client.model
    reason = loaded.dtype_reason
    assert reason and reason != "chosen"                  # the tiny model's load gives one (its kernel, at least)
    window.surface.model_loaded(loaded)                    # what the worker's event does
    said = window.status.currentMessage()
    assert said == describe_loaded(loaded, brief=True) and reason not in said and said.startswith(loaded.model.name)
    assert window.status.fontMetrics().horizontalAdvance(said) < 1280 - 40
    shown = window.controls.model_status.text()
    assert shown == said and reason not in shown                # plain words first: name, size, dtype, device, load
    details = window.controls.model_details
    assert reason in details.text() and not details.label.isVisibleTo(window)      # behind the Details toggle
    details.toggle.click()
    assert details.label.isVisibleTo(window)


def held_run_from_scene_one(qtbot, window):
    """R in scene 1: a six-token run, held by the engine at decode step 2 until the gate is released."""
    from tests.app.screen_audit import Gate

    window.lecture.enter("prefill")
    gate = Gate(("decode", 2))
    window.client.worker.session.fault_hook = gate
    window.controls.max_tokens.setValue(6)
    window.activateWindow()
    press(qtbot, window, "R")
    qtbot.waitUntil(gate.reached.is_set, timeout=60_000)
    return gate


def test_a_refused_r_is_said_only_while_the_work_that_refused_it_runs(qtbot, window):
    from tests.app.screen_audit import let_go

    gate = held_run_from_scene_one(qtbot, window)
    press(qtbot, window, "R")                                # again, in the scene that started it: refused
    assert "R is not available while a run is in progress (Ctrl+. stops it)" in window.scene_view.footer_text()
    let_go(qtbot, window, gate)
    assert "not available" not in window.scene_view.footer_text()          # the run ended: the reason went with it


def test_r_in_another_scene_stops_the_run_started_elsewhere_and_starts_this_scenes(qtbot, window):
    gate = held_run_from_scene_one(qtbot, window)
    first = window.store.current
    window.lecture.show("kv")
    window.client.worker.session.fault_hook = None
    press(qtbot, window, "R")                                # the speaker moved on: scene 2's R takes over
    assert "Stopping the run started elsewhere" in window.scene_view.footer_text()
    gate.release()
    qtbot.waitUntil(lambda: window.store.current is not first and window.store.current.finished
                    and window.client.busy is None, timeout=60_000)
    assert first.finished and first.n_steps < 6                       # stopped part-way
    assert window.store.current.n_steps == 6 and "not available" not in window.scene_view.footer_text()


def test_a_lecture_names_no_run_of_its_traces_and_an_opened_trace_names_its_run(qtbot, window, lecture_trace,
                                                                               tmp_path):
    from app.lecture.lecture_file import LectureScene, write_lecture

    shown: list[str] = []
    real = window.surface.show_status
    window.surface.show_status = lambda text, ms=0: (shown.append(text), real(text, ms))
    window.controller.replay_speed = 0.0
    assert window.controller.open_traces([str(lecture_trace)])
    wait_idle(qtbot, window)
    assert any(text.startswith("Replaying run #") for text in shown)             # a trace the user opened
    window.lecture.leave()
    shown.clear()
    path = write_lecture(tmp_path / "talk.kvscope-lecture.json", [LectureScene("prefill", (lecture_trace,))])
    assert window.lecture.present(str(path))
    wait_idle(qtbot, window)
    assert not any(text.startswith("Replaying run #") for text in shown)         # behind a lecture's first slide
