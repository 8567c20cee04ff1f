"""Cases the screen audit found or was asked about, each pinned by its own test: the Pause control follows the
run's state whatever pressed it, a failed run's released memory is said beside its KV figure, a run saved from
the window replays with the peaks it was judged with, the first token's phase reads the prefill's figures."""

from __future__ import annotations

from app.state.phase import PAUSED, PREFILLED, STEPPING, run_phase
from app.views.status import run_texts
from tests.app.conftest import open_replayed, run_and_wait
from tests.app.screen_audit import Gate, held, let_go


def test_the_pause_control_follows_the_run_through_f9_and_step_not_its_own_clicks(qtbot, window):
    w = window
    w.controls.max_tokens.setValue(12)
    pause = w.controls.pause_button
    f9 = next(a for a in w.actions() if a.text() == "Pause / resume")      # what F9 triggers
    gate = Gate(("decode", 6))                                   # the run cannot end before the walk is done
    w.client.worker.session.fault_hook = gate
    w.controller.step()                                          # Step with nothing running: held after its prefill
    qtbot.waitUntil(lambda: w.store.current is not None and w.store.current.n_steps == 1 and w.client.control.held)
    assert run_phase(w.store.current).name == STEPPING and pause.text().startswith("Resume")
    f9.trigger()                                                 # F9 lets it run on ...
    qtbot.waitUntil(lambda: w.store.current.n_steps == 6)
    assert pause.text().startswith("Pause") and not pause.isChecked()
    f9.trigger()                                                 # ... and pauses it again
    assert pause.text().startswith("Resume") and pause.isChecked()
    assert run_phase(w.store.current).name == PAUSED
    w.refresh(force=True)
    assert "paused" in w.tokens.run_line.text() and w.status.labels["phase"].text().startswith("paused")
    pause.click()                                                # the button resumes it as F9 would
    assert pause.text().startswith("Pause") and not w.client.control.paused
    let_go(qtbot, w, gate)
    assert pause.text().startswith("Pause") and not pause.isEnabled()


def test_a_run_that_failed_for_memory_says_its_cache_was_released_beside_its_kv_figure(qtbot, window):
    from engine.run.faults import parse

    w = window
    w.controls.max_tokens.setValue(8)
    w.client.worker.session.fault_hook = parse("decode:2:oom")
    run = run_and_wait(qtbot, w)
    w.client.worker.session.fault_hook = None
    texts = run_texts(run)
    assert run_phase(run).released and texts["kv"].endswith(", released") and "memory released" in texts["phase"]
    assert "Released" in w.kv.info.text()


def test_the_first_tokens_phase_shows_the_prefills_figures_everywhere_and_no_ttft(qtbot, window):
    w = window
    gate = Gate(("first", 0))
    held(qtbot, w, gate, w.controller.run, lambda: w.store.current is not None and w.store.current.prefill
         is not None)
    w.refresh(force=True)
    run = w.store.current
    assert run_phase(run).name == PREFILLED
    texts = run_texts(run)
    assert not texts.get("ttft") and texts["kv"].startswith("KV ")                  # the cache was read; no token yet
    assert "<b>Measured</b> (read from the cache tensors)" in w.kv.info.text()
    assert "choosing the first token" in w.tokens.run_line.text()
    assert "TTFT" not in w.timing.summary.text() and "prefill" in w.timing.summary.text()
    let_go(qtbot, w, gate)


def test_a_run_saved_from_the_window_replays_with_the_peaks_it_was_judged_with(qtbot, window, tmp_path):
    from engine.facts.events import HardwarePeaks

    w = window
    w.store.peaks = HardwarePeaks("this CPU", "float32", flops_per_s=5e9, bytes_per_s=2e10, cpu_share=0.4)
    w.controls.max_tokens.setValue(4)
    run = run_and_wait(qtbot, w)
    assert run.peaks is w.store.peaks
    live = w.timing.details.text()
    assert "busy when its peaks were taken" in live
    w.files.save_trace(str(tmp_path / "run.kvscope.jsonl"))
    replayed = open_replayed(qtbot, tmp_path / "run.kvscope.jsonl", (1280, 720))
    try:
        again = replayed.store.find(replayed.state.selected)
        assert again.peaks is not None and again.peaks.cpu_share == 0.4
        replayed.refresh(force=True)
        assert "busy when its peaks were taken" in replayed.timing.details.text()
        assert "were not measured" not in replayed.timing.details.text()
    finally:
        from tests.app.conftest import close_and_dispose

        close_and_dispose(replayed)


def test_the_prefills_words_say_when_its_first_pass_went_through_the_compiled_package():
    from types import SimpleNamespace

    from app.state.phase import prefill_passes
    from engine.facts.events import PrefillDone

    def run(**fields):
        return SimpleNamespace(prefill=PrefillDone("r", 1.0, 12, 0.1, 5.0, [], **fields), started=None)

    assert prefill_passes(run()) == "in one forward pass"
    assert prefill_passes(run(compiled=True)) == "in one compiled forward pass"
    assert prefill_passes(run(compiled=True), forward=False) == "in one compiled pass"
    assert prefill_passes(run(compiled=True, passes=3)) == \
        "in 3 passes, the first compiled (so Stop works between them)"
    assert prefill_passes(run(passes=3)) == "in 3 passes (so Stop works between them)"
