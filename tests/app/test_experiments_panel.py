"""The experiments panel on the tiny model: each experiment runs from its tab, fills chart, table and text."""

import csv
import io

import pytest

from app.views import export
from engine.facts.events import HardwarePeaks
from engine.lessons.batch import BatchPoint
from engine.lessons.prefill import PrefillPoint
from engine.lessons.speculative import DraftPass
from engine.serve.block_events import BlockTable
from tests.app.conftest import arrange_at, run_and_wait, wait_idle

# Peaks as a quiet machine measures them, set by the test: measured here, on a busy machine, they would give no
# ceiling at all (the window draws none from a busy measurement), and the verdict would depend on the load.
QUIET_PEAKS = HardwarePeaks("a quiet CPU", "float32", flops_per_s=2e12, bytes_per_s=5e11, cpu_share=0.97)


def run_experiment(qtbot, window, kind, **setup):
    """Set the tab's form as a user would, then press its Run button."""
    view = window.experiments.views[kind]
    window.experiments.setCurrentWidget(view)
    for name, value in setup.items():
        view.form.set_value(name, value)
    view.run_button.click()
    wait_idle(qtbot, window, timeout=120_000)
    window.refresh(force=True)
    return view, window.store.latest_experiment(kind)


def test_prefill_sweep_fills_chart_table_and_explanation(qtbot, window):
    window.client.worker.peaks = QUIET_PEAKS
    view, record = run_experiment(qtbot, window, "prefill", max_length=128, repeats=1)
    assert record is not None and record.finished and record.end.reason == "done"
    assert [p.tokens for p in record.typed(PrefillPoint)] == [16, 32, 64, 128]
    names = view.chart.legend_names()
    assert "prefill time (measured)" in names and "cost model, roofline (computed)" in names
    assert view.table.rowCount() == 4 and view.table.item(3, 0).text() == "128"
    assert "time ~ n" in view.explain.text() and "The last doubling alone, 64 → 128" in view.explain.text()
    assert view.progress.value() == view.progress.maximum()


def test_cache_experiment_overlays_both_runs(qtbot, window):
    view, record = run_experiment(qtbot, window, "cache", new_tokens=16)
    assert record.result.tokens_match is True
    assert len(record.run_ids) == 2
    names = view.chart.legend_names()
    assert names == ["KV cache on (measured)", "KV cache off (measured)"]
    assert "identical ✓" in view.explain.text()
    assert {window.store.find(r).started.params.kv_cache for r in record.run_ids} == {True, False}


def test_batch_experiment_draws_throughput_against_latency(qtbot, window):
    view, record = run_experiment(qtbot, window, "batch", sizes="1, 2, 4", new_tokens=4)
    assert [p.batch for p in record.typed(BatchPoint)] == [1, 2, 4]
    curve = view.plot.listDataItems()[0]
    xs, ys = curve.getData()
    assert len(xs) == 3 and all(y > 0 for y in ys)
    assert "tokens per second" in view.explain.text()
    rows = list(csv.reader(io.StringIO(export.experiment_csv(record))))
    assert rows[0][:3] == ["series", "batch", "ttft_ms"] and len(rows) == 4


def test_bad_batch_sizes_are_refused_in_the_tab(qtbot, window):
    view = window.experiments.views["batch"]
    view.form.set_value("sizes", "1, two, 4")
    assert "whole numbers" in view.status.text()
    view.form.set_value("sizes", "1, 2000")
    assert "sizes[1] must be between 1 and 1,024" in view.status.text()
    view.run_button.click()                       # with the last good settings (the defaults here), not the bad ones
    wait_idle(qtbot, window, timeout=120_000)
    record = window.store.latest_experiment("batch")
    assert record.settings.sizes == (1, 2, 4, 8, 16)


def test_cancel_keeps_the_points_measured_so_far(qtbot, window, monkeypatch):
    import time

    session = window.client.worker.session
    prefill = session.timed_prefill
    monkeypatch.setattr(session, "timed_prefill", lambda *a, **k: (time.sleep(0.05), prefill(*a, **k))[1])
    view = window.experiments.views["prefill"]
    view.form.set_value("max_length", 256)
    view.form.set_value("repeats", 10)           # 4 lengths x 11 passes x >= 50 ms: cancel lands mid-sweep
    view.run_button.click()
    qtbot.waitUntil(lambda: (r := window.store.latest_experiment("prefill")) is not None and len(r.points) >= 1,
                    timeout=60_000)
    view.cancel_button.click()
    wait_idle(qtbot, window)
    record = window.store.latest_experiment("prefill")
    assert record.end.reason == "stopped" and 1 <= len(record.points) < 4
    qtbot.waitUntil(lambda: "Stopped: " in view.status.text() and "so far, kept" in view.status.text(),
                    timeout=5_000)      # at the next chart refresh


def test_timing_panel_labels_measured_computed_and_achieved_figures(qtbot, window):
    window.controls.max_tokens.setValue(6)
    run = run_and_wait(qtbot, window)
    run.peaks = QUIET_PEAKS                     # as if this machine had been measured quietly
    window.store.version += 1
    window.refresh(force=True)
    text = window.timing.details.text()
    assert "tok/s measured vs ceiling" in text and "tok/s</b> computed, bandwidth-bound (500.0 GB/s ÷" in text
    # prefill FLOP/s is the cost model's FLOPs over a measured time: "achieved", with the derivation shown
    assert "GFLOP/s achieved (" in text and "GFLOP computed ÷" in text
    assert f"{run.summary().prefill_ms:,.1f} ms measured) vs peak" in text


@pytest.mark.parametrize("suffix", [".png", ".svg"])
def test_experiment_chart_exports(qtbot, window, tmp_path, suffix):
    view, _record = run_experiment(qtbot, window, "batch", sizes="1, 2", new_tokens=3)
    path = export.export_widget(view, tmp_path / f"batch{suffix}")
    assert path.stat().st_size > 2000


def test_continuous_batching_draws_lanes_and_batch_sizes(qtbot, window):
    view, record = run_experiment(qtbot, window, "continuous", requests=4, arrive_every=2)
    r = record.result
    assert r.tokens_match_solo is True and r.same_tokens_both_policies is True
    lanes = [item for item in view.plot.items if isinstance(item, __import__("pyqtgraph").BarGraphItem)]
    assert len(lanes) == 6                                          # waiting, prefill, decode x two policies
    assert len(view.sizes_chart.plot.listDataItems()) == 2
    assert view.table.rowCount() == 8 and view.table.item(0, 0).text() == "continuous"
    assert "Continuous:" in view.explain.text() and "solo run ✓" in view.explain.text()


def test_an_experiment_saved_as_a_trace_replays_with_its_runs(qtbot, window, tmp_path):
    view, original = run_experiment(qtbot, window, "cache", new_tokens=6)
    path = tmp_path / "cache.jsonl"
    window.files.save_trace(str(path), original.events)
    kinds = {type(e).__name__ for e in original.events}
    assert {"ExperimentStarted", "RunStarted", "TokenStep", "ExperimentFinished"} <= kinds
    window.controller.clear_runs()
    window.experiments.setCurrentWidget(window.experiments.views["batch"])
    window.docks["timing"].raise_()
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(path))
    wait_idle(qtbot, window)
    window.refresh(force=True)
    replayed = window.store.latest_experiment("cache")
    assert replayed.events == original.events and len(replayed.run_ids) == 2
    assert window.experiments.currentWidget() is view and not window.docks["experiments"].visibleRegion().isEmpty()
    assert view.chart.legend_names() == ["KV cache on (measured)", "KV cache off (measured)"]


def test_speculative_decoding_marks_every_kept_and_rejected_guess(qtbot, window):
    view = window.experiments.views["speculative"]
    prompt = view.form.widgets["prompt"]
    prompt.setCurrentIndex(prompt.count() - 1)                           # the prompt in Controls
    window.controls.prompt.setPlainText("hello world hello world hello world")
    view, record = run_experiment(qtbot, window, "speculative", new_tokens=12, draft_tokens=3)
    r = record.result
    assert record.end.reason == "done" and r.tokens_match is True
    assert record.settings.prompt == "hello world hello world hello world"
    passes = record.of(DraftPass)
    last = [p for p in passes if p.repeat == max(p.repeat for p in passes)]
    text = view.passes_text.text()
    assert text.count("<u ") == sum(p.accepted for p in last)
    assert text.count("<s ") == sum(len(p.drafted) - p.accepted for p in last)
    assert text.count("<b ") == len(last) == r.passes
    assert view.table.rowCount() == 2 * record.settings.repeats
    assert f"{r.tokens_per_pass:.1f} tokens per forward pass" in view.explain.text()
    assert "same tokens as plain greedy decode ✓" in view.explain.text()
    assert view.chart.legend_names() == ["guesses kept", "the model's own token", "guesses rejected"]


def test_paged_kv_draws_each_requests_blocks_and_scrubs_through_the_steps(qtbot, window):
    view, record = run_experiment(qtbot, window, "paged", requests=3, new_tokens=4, arrive_every=1)
    assert record.end.reason == "done" and record.result.tokens_match_solo is True
    names = view.chart.legend_names()
    assert "shared prefix block" in names and "the request's own block" in names
    assert view.step_slider.maximum() == len(record.of(BlockTable)) - 1
    peak = view.step_slider.value()
    assert "(the most held)" in view.explain.text() and "MiB" in view.explain.text()
    assert 0 <= peak < len(record.of(BlockTable))
    view.step_slider.setValue(0)
    first = record.of(BlockTable)[0]
    assert f"Step {first.step}, 1 of {len(record.of(BlockTable))}" in view.explain.text()
    ticks = [label for _, label in view.plot.getAxis("left")._tickLevels[0]]
    assert ticks == [f"#{r}" for r in first.running] + [f"pool ({first.total_blocks:,} blocks)"]   # a unit


def test_a_ceiling_is_never_shown_below_a_rate_the_same_run_measured(qtbot, window):
    """Peaks measured too low (a busy machine) would put the ceiling under the measurement: the panel says the
    peaks are wrong instead, and draws no ceiling from a busy measurement at all."""
    from app.panels.timing import bounds_text

    window.controls.max_tokens.setValue(6)
    run = run_and_wait(qtbot, window)
    s = run.summary()
    low = HardwarePeaks("a CPU", "float32", flops_per_s=1e6, bytes_per_s=1e3, cpu_share=0.97)
    text = bounds_text(run, s, low)
    assert "vs ceiling" not in text and "above the" in text and "the measured peaks are too low" in text
    busy = HardwarePeaks("a CPU", "float32", flops_per_s=2e12, bytes_per_s=5e11, cpu_share=0.3)
    assert "ceiling" not in bounds_text(run, s, busy).split("ceilings:")[0]
    assert "busy when its peaks were taken" in bounds_text(run, s, busy)
    assert "ceilings: none, the peaks of the machine that ran it were not measured" in bounds_text(run, s, None)
    # the bound that applies, with its own arithmetic: compute-bound where the matmul peak is the lower roof
    compute = bounds_text(run, s, HardwarePeaks("a CPU", "float32", flops_per_s=1e12, bytes_per_s=1e15,
                                                cpu_share=0.97))
    assert "compute-bound (1,000.0 GFLOP/s ÷" in compute and "GB/s ÷" not in compute


def test_a_prefill_whose_products_ran_widened_is_compared_with_float32s_peak(qtbot, window):
    from app.panels.timing import bounds_text

    window.controls.max_tokens.setValue(2)
    s = run_and_wait(qtbot, window).summary()
    run = window.store.current

    def peaks(wide_rows: int) -> HardwarePeaks:
        return HardwarePeaks("a CPU", "bfloat16", flops_per_s=2e9, bytes_per_s=1e15, cpu_share=0.97,
                             wide_rows=wide_rows, wide_flops_per_s=300e9)

    widened = bounds_text(run, s, peaks(s.prompt_tokens))
    assert "vs peak 300 GFLOP/s (measured matmul in float32: products of " in widened
    short = bounds_text(run, s, peaks(s.prompt_tokens + 1))            # fewer rows: the products' own float
    assert "vs peak 2 GFLOP/s (measured matmul)" in short or "above the peak of 2 GFLOP/s" in short


def test_every_lesson_view_before_its_first_run_shows_no_numbers_and_says_what_will_appear(qtbot, window):
    from app.views.chart import Chart

    window.refresh(force=True)
    for kind, view in window.experiments.views.items():
        assert window.store.latest_experiment(kind) is None
        for chart in view.findChildren(Chart):
            assert chart.empty_message is not None and chart.empty_message.startswith("Not run yet"), kind
            assert not chart.plot.getAxis("left").style["showValues"], kind


def test_in_a_short_dock_a_lessons_form_and_table_fold_so_its_chart_keeps_a_readable_height(qtbot, window):
    from app.views.chart import READABLE_DATA_PX

    arrange_at(qtbot, window, (1280, 600))                    # a dock shorter than form, table and chart need
    window.docks["experiments"].raise_()
    view, record = run_experiment(qtbot, window, "cache", new_tokens=8)
    qtbot.waitUntil(lambda: view.folds.isVisible(), timeout=5000)
    assert not view.form.isVisible() and not view.table.isVisible() and view.run_button.isVisible()
    assert "8 tokens" in view.form_summary.text() and view.table_fold.text() == "Table (2 rows)"
    qtbot.waitUntil(lambda: view.chart.plot.getViewBox().height() >= READABLE_DATA_PX - 1, timeout=5000)
    view.settings_fold.click()
    assert view.form.isVisible() and not view.table.isVisible()
    view.form.set_value("new_tokens", 12)
    assert "12 tokens" in view.form_summary.text()
    arrange_at(qtbot, window, (2400, 1500))                   # room for all of it: nothing folded
    assert not window.docks["experiments"].visibleRegion().isEmpty()        # still the panel on top
    qtbot.waitUntil(lambda: not view.folds.isVisible() and view.table.isVisible(), timeout=5000)
