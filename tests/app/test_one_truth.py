"""One truth per screen: every view, in every phase of a run, says what is known then and nothing more.

A run is walked through its phases (nothing yet, prefill running, decoding, stopped, finished, failed, replayed
from a trace) on the tiny model, and at each one every text the window shows is read: the status strip, the
timing summary, the line under the reply, the KV panel, the attention and sampling captions and every run scene's
caption at 1280x720. No TTFT or rate before one exists, "measured" only beside a measured figure, a stopped or
failed run says so, and a scene's caption describes the step its chart shows."""

from __future__ import annotations

import re

import pytest
from PySide6.QtCore import QRect

from app.lecture import mode as lecture
from app.lecture.scenes import RUN_SCENES, scene_claim
from app.state.phase import FAILED, FINISHED, NOTHING, PREFILL, STEPPING, STOPPED, figures, run_phase
from engine.run.faults import parse
from tests.app.conftest import close_and_dispose, open_replayed, run_and_wait, wait_idle

RATE = re.compile(r"\d[\d,.]* tok/s")
TTFT = re.compile(r"TTFT [\d,.]+ ms")


def texts(window) -> dict[str, str]:
    """Every text the window shows about the selected run, by where it is shown (scenes: their whole caption)."""
    window.refresh(force=True)
    out = {f"status {name}": label.text() for name, label in window.status.labels.items() if name != "memory"}
    out.update({"timing summary": window.timing.summary.text(), "run line": window.tokens.run_line.text(),
                "kv info": window.kv.info.text(), "attention": window.attention.caption.text(),
                "sampling": window.sampling.caption.text()})
    for scene in RUN_SCENES:
        out[f"scene {scene}"] = scene_claim(scene, window.scene_view.context)
    return out


def assert_true_to(window, phase_name: str) -> dict[str, str]:
    run = window.store.find(window.state.selected)              # the run every view shows
    phase = run_phase(run)
    assert phase.name == phase_name, (phase, run and run.reason)
    f = figures(run)
    shown = texts(window)
    for where, text in shown.items():
        if f.ttft_ms is None:
            assert not TTFT.search(text), (phase_name, where, text)
        for rate in RATE.finditer(text):        # a rate is shown only once it exists: prefill's, or decode's
            of_prefill = "prefill" in text[max(rate.start() - 40, 0):rate.start()]
            assert (f.prefill_tok_s if of_prefill else f.decode_tok_s) is not None, (phase_name, where, text)
        if "measured" in text and "not measured" not in text and "nothing was measured" not in text:
            assert f.ttft_ms is not None or "formula" in text or "(computed)" in text, (phase_name, where, text)
    if phase_name in (STOPPED, FAILED):
        said = phase_name if phase_name == FAILED else "stopped"
        for where in ("run line", "timing summary", "scene prefill", "scene kv"):
            assert said in shown[where], (where, shown[where])
    return shown


@pytest.fixture
def screen(monkeypatch):
    area = QRect(0, 0, 1280, 720)
    monkeypatch.setattr(lecture, "screen_area", lambda window, available=False: QRect(area))
    return area


def test_every_view_says_only_what_is_known_in_every_phase_of_a_live_run(qtbot, window, screen):
    w = window
    w.controls.max_tokens.setValue(12)
    assert w.store.current is None
    shown = texts(w)
    assert not any(TTFT.search(t) or RATE.search(t) for t in shown.values()), shown
    assert "No run yet" in w.kv.info.text() and "No run yet" in w.attention.caption.text()
    assert not w.timing.timeline.plot.getAxis("bottom").style["showValues"]      # no 0…1 axis pretending to be data
    assert w.timing.timeline.empty_message and w.timing.latency.empty_message
    assert run_phase(None).name == NOTHING

    # prefill running: the forward pass is held for 3 s
    w.client.worker.session.fault_hook = parse("prefill:0:sleep=3")
    w.controller.run()
    qtbot.waitUntil(lambda: w.store.current is not None)
    shown = assert_true_to(w, PREFILL)
    assert shown["status ttft"].startswith("prefill running") and "prefill running" in shown["scene prefill"]
    assert w.timing.timeline.empty_message is None              # the prefill's bar grows there, with its clock
    items = w.timing._items[w.state.selected]
    # What the growing bar is, in words, is the header's (words drawn on the bar crossed its moving end)
    assert "prefill running:" in w.timing.summary.text() and "prompt tokens in one" in w.timing.summary.text()
    run = w.store.current
    now = run.clock()
    widths = []
    for later in (1.0, 1.5):                                    # a second on, then half a second more, no event
        run.clock = lambda later=later: now + later
        w.timing.refresh()
        widths.append(items.prefill_bar.opts["width"][0])
    assert widths[1] - widths[0] == pytest.approx(500, abs=1)
    run.clock = w.store.clock
    wait_idle(qtbot, w)
    w.client.worker.session.fault_hook = None

    # step by step: a run held after its prefill, then let through two steps
    w.controller.run(paused=True)
    qtbot.waitUntil(lambda: w.store.current.n_steps == 1 and w.client.control.paused)
    assert_true_to(w, STEPPING)
    for _ in range(2):
        before = w.store.current.n_steps
        w.controller.step()
        qtbot.waitUntil(lambda: w.store.current.n_steps == before + 1)
    shown = assert_true_to(w, STEPPING)
    assert "step by step: token 3 of at most 12" in shown["run line"]
    assert RATE.search(shown["status decode"]) and w.timing.latency.empty_message is None

    # stopped there: what was measured is kept, and every view says it stopped
    w.controller.stop()
    wait_idle(qtbot, w)
    shown = assert_true_to(w, STOPPED)
    assert "stopped after 3 tokens" in shown["run line"]

    # finished, in words
    run = run_and_wait(qtbot, w)
    shown = assert_true_to(w, FINISHED)
    assert "finished after" in shown["run line"] and (
        "reached the limit of 12 new tokens" in shown["run line"] or "end-of-sequence" in shown["run line"])

    # failed at step 2: the figures so far stay, the failure is said
    w.client.worker.session.fault_hook = parse("decode:2:error")
    run_and_wait(qtbot, w)
    w.client.worker.session.fault_hook = None
    shown = assert_true_to(w, FAILED)
    assert "injected failure" in shown["run line"]
    assert run.reason in ("max_tokens", "eos")


def test_a_replayed_run_reads_the_same_as_it_did_live(qtbot, lecture_trace, screen):
    w = open_replayed(qtbot, lecture_trace, (1280, 720))
    try:
        w.state.select(next(r for r in w.store.runs if not r.started.experiment).run_id, "replay")
        shown = assert_true_to(w, FINISHED)
        assert TTFT.search(shown["status ttft"]) and "(measured)" in shown["run line"]
    finally:
        close_and_dispose(w)


def test_the_sampling_scene_caption_describes_the_step_its_chart_shows(qtbot, lecture_trace, screen):
    w = open_replayed(qtbot, lecture_trace, (1280, 720))
    try:
        w.lecture.enter("sampling")
        run = w.store.find(w.state.selected)
        for delta in (-1, -1, -1, 2):
            w.lecture.step_tokens(delta)
            w.refresh(force=True)
            step = w.state.shown_step(run.run_id, run.n_steps)
            heading = re.search(r"Step (\d+)", w.sampling.caption.text()).group(1)
            caption = re.search(r"Step (\d+)", w.scene_view.claim()).group(1)
            assert int(heading) == int(caption) == step, (heading, caption, step)
        w.lecture.leave()
    finally:
        close_and_dispose(w)


def test_a_stopped_experiment_scene_says_how_far_it_got_and_claims_no_measurement_before_one(qtbot, window, screen):
    from tests.app.conftest import start_lesson

    w = window
    w.lecture.enter("cache")
    w.client.worker.session.fault_hook = parse("prefill:0:sleep=2")      # every run's prefill is held 2 s
    assert start_lesson(w, "cache", new_tokens=8)
    qtbot.waitUntil(lambda: w.store.latest_experiment("cache") is not None)
    w.lecture.stop()
    assert "Stopping…" in w.scene_view.footer_text()
    wait_idle(qtbot, w)
    w.client.worker.session.fault_hook = None
    w.refresh(force=True)
    claim = w.scene_view.claim()
    record = w.store.latest_experiment("cache")
    assert record.end.reason == "stopped" and claim.startswith("3 · KV cache on vs off: stopped"), claim
    assert not record.points and "nothing was measured" in claim and "busy" not in claim
    assert w.experiments.views["cache"].chart.legend_names() == []
    assert "Stopping…" not in w.scene_view.footer_text()        # the stop has taken effect: the word goes
    w.lecture.leave()


def test_a_paged_lesson_stopped_after_its_first_block_table_says_its_chart_is_unfinished_not_empty(
        qtbot, tiny, tmp_path, screen):
    import threading

    from engine.output.trace import write_trace
    from engine.serve.block_events import BlockTable
    from tests.lessons import collect

    cancel = threading.Event()

    class Stopping(list):                       # the user's stop, as the first block table arrives
        def append(self, event) -> None:
            super().append(event)
            if isinstance(event, BlockTable):
                cancel.set()

    events, finished = collect("paged", tiny, cancel=cancel, events=Stopping(), requests=3, new_tokens=4)
    assert finished.reason == "stopped"
    w = open_replayed(qtbot, write_trace(tmp_path / "stopped.kvscope.jsonl", list(events)), (1280, 720))
    try:
        record = w.store.latest_experiment("paged")
        view = w.experiments.views["paged"]
        assert record.of(BlockTable) and not record.points
        w.lecture.enter("paged")
        w.refresh(force=True)
        claim = w.scene_view.claim()
        assert view.chart.shows_data() and "drawn, unfinished" in claim, claim
        assert "nothing was measured" not in claim and "nothing was measured" not in view.status.text()
        w.lecture.leave()
    finally:
        close_and_dispose(w)


def test_a_replayed_run_takes_no_ceiling_from_this_machines_peaks(qtbot, window, lecture_trace):
    from engine.facts.events import HardwarePeaks

    here = HardwarePeaks("this CPU", "float32", flops_per_s=2e12, bytes_per_s=5e11, cpu_share=0.97)
    window.store.peaks = here
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(lecture_trace))
    wait_idle(qtbot, window)
    replayed = next(r for r in window.store.runs if not r.started.experiment)
    assert replayed.peaks is None or replayed.peaks.device != "this CPU"
    assert window.store.peaks is here                    # this machine's peaks are back for runs here
    window.controls.max_tokens.setValue(2)
    assert run_and_wait(qtbot, window).peaks is here


def test_an_experiment_that_has_reported_no_progress_yet_says_starting_not_zero_of_zero():
    from app.state.phase import RUNNING_EXPERIMENT, ExperimentPhase

    assert ExperimentPhase(RUNNING_EXPERIMENT, 0, 0, 0, "", 2500.0).words() == "running for 2.5 s: starting"
    assert (ExperimentPhase(RUNNING_EXPERIMENT, 1, 4, 1, "prompt 2", 61_000.0).words()
            == "running for 61.0 s: 1 of 4 · prompt 2")


def test_a_static_caches_bytes_are_judged_once_the_same_in_the_heatmap_the_kv_scene_and_the_report(qtbot, window):
    """A static cache's tensors cover every position it allocated up front: the heatmap, the KV scene and the
    CLI's report hold them to the formula at that allocation (the scene held them to the positions in use and
    called the cache wrong), all through ``RunRecord.kv_check``."""
    from app.lecture.scenes import run_claim
    from engine.facts import kvformula
    from engine.facts.report import kv_line

    window.controls.static_box.setChecked(True)
    window.controls.max_tokens.setValue(6)
    run = run_and_wait(qtbot, window)
    kv = run.kv_check()
    assert run.kv_allocated > kv.positions > 0
    assert kv.held == kvformula.predicted_kv_bytes(run.model, run.kv_allocated) and kv.equal
    assert "✓ equals the formula" in window.kv.info.text() and "allocated up front" in window.kv.info.text()
    claim = run_claim("kv", run, window.state)
    assert "= the formula ✓" in claim and f"{run.kv_allocated:,} positions allocated up front" in claim
    assert "= the formula" in kv_line(run.model, kv)
