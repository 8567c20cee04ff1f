"""The window on the tiny model: every panel fills, run controls do what they say, errors stay in the window."""

import numpy as np
import pytest
from PySide6.QtCore import QEvent, QPoint, QPointF, Qt
from PySide6.QtGui import QMouseEvent
from PySide6.QtWidgets import QApplication

from app.lecture.mode import fit_to_screen
from app.state.phase import rate
from engine.facts.params import GenerationParams
from tests.app.conftest import close_and_dispose, load, make_window, run_and_wait, wait_idle


def test_a_run_fills_every_panel(qtbot, window):
    sampling = window.sampling.chart
    assert sampling.empty_message and not sampling.plot.getAxis("left").style["showValues"]   # no numbers yet
    assert not window.timing.ttft_line.isVisible()                  # no TTFT marker without a run
    window.controls.max_tokens.setValue(20)
    run = run_and_wait(qtbot, window)
    assert sampling.empty_message is None and window.timing.ttft_line.isVisible()
    n = run.n_steps
    assert run.reason in ("max_tokens", "eos") and n >= 1
    # token stream: every prompt and generated token is in the document
    assert window.tokens.rendered_tokens() == run.prompt_tokens + n
    doc = window.tokens.text.toPlainText().replace("↵", "")
    assert "".join(run.started.prompt_pieces) + "".join(s.text for s in run.steps) == doc.replace("▫", "")
    # KV heatmap: one row per layer, one column per cached position, each cell the layer's measured bytes
    # (from the last step's event) over the positions its tensors hold; the formula is the check beside it
    image = window.kv.image.image
    assert image.shape == (run.model.num_layers, run.kv_tokens)
    last = run.steps[-1]
    for layer, ((k, v), held) in enumerate(zip(last.kv_bytes_per_layer, last.kv_positions_per_layer)):
        assert np.all(image[layer] == (k + v) / held)
    assert "equals the formula" in window.kv.info.text()
    bar = window.kv.colorbar.getAxis("right")                # the colour scale says what the colours mean
    labels = [label for _value, label in bar._tickLevels[0]]
    assert labels[0] == "0" and labels[-1] == f"{np.nanmax(image):,.0f}" and not bar.style["hideOverlappingLabels"]
    # timing: a latency point per decode step, cumulative tokens for every step, a timeline bar per decode step
    items = window.timing._items[run.run_id]
    assert len(items.latency.getData()[0]) == n - 1
    assert len(items.cumulative.getData()[1]) == n
    assert len(items.boundaries.getData()[0]) == 2 * (n - 2)          # a tick between consecutive steps
    assert f"{rate(run.summary().decode_tok_s)} tok/s" in window.timing.summary.text()
    # sampling: at least ten candidates for the newest step, the drawn one marked
    assert len(window.sampling.raw_bars.opts["width"]) >= 10
    assert f"Step {n - 1}" in window.sampling.caption.text()
    assert len(window.sampling.chosen.data) == 1
    # status strip
    assert window.status.labels["ttft"].text().startswith("TTFT")
    assert f"context {run.prompt_tokens + n:,} of 256" == window.status.labels["context"].text()


def test_heatmap_modes_show_key_and_value_norms(qtbot, window):
    window.controls.max_tokens.setValue(6)
    run = run_and_wait(qtbot, window)
    window.kv.set_mode("k")
    np.testing.assert_array_equal(window.kv.image.image, run.norm_grid("k"))
    assert run.norm_grid("k").min() > 0
    window.kv.set_mode("v")
    np.testing.assert_array_equal(window.kv.image.image, run.norm_grid("v"))
    assert not np.array_equal(run.norm_grid("k"), run.norm_grid("v"))


def test_parameter_widgets_reach_the_engine_with_the_values_shown(qtbot, window):
    c = window.controls
    c.max_tokens.setValue(9)
    c.temperature.setValue(0.8)
    c.top_k.setValue(40)
    c.top_p.setValue(0.9)
    c.seed.setValue(7)
    c.kv_box.setChecked(False)
    c.chat_box.setChecked(False)
    run = run_and_wait(qtbot, window)
    assert run.started.params == GenerationParams(max_new_tokens=9, temperature=0.8, top_k=40, top_p=0.9, seed=7,
                                                  kv_cache=False, chat_template=False)
    assert run.n_steps <= 9 and run.kv_tokens == 0


def test_stop_mid_run_ends_with_stopped(qtbot, window):
    window.controls.max_tokens.setValue(200)
    window.controls.slow.setValue(40)
    window.controller.run()
    qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.n_steps >= 3, timeout=30_000)
    qtbot.keyClick(window, Qt.Key.Key_Escape)
    wait_idle(qtbot, window)
    run = window.store.current
    assert run.reason == "stopped" and 3 <= run.n_steps < 200


def test_step_advances_exactly_one_token_then_resume_finishes(qtbot, window):
    window.controls.max_tokens.setValue(8)
    control = window.client.control
    qtbot.keyClick(window, Qt.Key.Key_F10)                     # idle: starts paused after the prefill
    qtbot.waitUntil(lambda: control.held)                      # the worker waits at the gate: nothing can come
    window.refresh(force=True)
    qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.n_steps == 1)
    assert control.held and window.store.current.n_steps == 1 and not window.store.current.finished
    for expected in (2, 3):
        qtbot.keyClick(window, Qt.Key.Key_F10)
        qtbot.waitUntil(lambda e=expected: window.store.current.n_steps == e)
        qtbot.waitUntil(lambda: control.held)
        qtbot.wait(50)                                         # the held worker's events reach the store
        assert control.held and window.store.current.n_steps == expected
    qtbot.keyClick(window, Qt.Key.Key_F9)                      # resume
    wait_idle(qtbot, window)
    assert window.store.current.finished and window.store.current.n_steps == 8


def test_opening_a_trace_reproduces_the_run(qtbot, window, tmp_path):
    window.controls.max_tokens.setValue(12)
    window.controls.temperature.setValue(0.9)
    original = run_and_wait(qtbot, window)
    doc = window.tokens.text.toPlainText()
    path = tmp_path / "run.jsonl"
    window.files.save_trace(str(path))
    window.controller.clear_runs()
    assert window.store.current is None
    window.controller.replay_speed = 0.0
    window.files.open_trace(str(path))
    wait_idle(qtbot, window)
    window.refresh(force=True)
    replayed = window.store.current
    assert replayed.events == original.events
    assert window.tokens.text.toPlainText() == doc
    np.testing.assert_array_equal(window.kv.image.image, original.memory_grid())
    assert replayed.summary() == original.summary()


def test_bad_model_path_shows_an_error_and_the_app_stays_usable(qtbot, window):
    load(window, "/no/such/model", "cpu", "float32")
    wait_idle(qtbot, window)
    assert window.banner.isVisible() and "No such file or folder" in window.banner.label.text()
    window.controls.max_tokens.setValue(3)
    run = run_and_wait(qtbot, window)                          # the previous model still runs
    assert run.n_steps == 3


def test_empty_prompt_is_refused_in_the_window(qtbot, window):
    window.controls.prompt.setPlainText("   ")
    window.controller.run()
    assert window.banner.isVisible() and "prompt is empty" in window.banner.label.text()
    assert window.client.busy is None and window.store.current is None


def test_closing_during_a_run_does_not_hang(qtbot, tiny_model_dir):
    w = make_window(qtbot, tiny_model_dir)
    w.controls.max_tokens.setValue(250)
    w.controls.slow.setValue(200)
    w.controller.run()
    qtbot.waitUntil(lambda: w.store.current is not None and w.store.current.n_steps >= 1)
    w.close()
    assert w.worker_stopped and w.client.thread.isFinished()
    assert w.store.current.n_steps < 250                         # the 50 s of slow motion were not waited out
    close_and_dispose(w)


def test_settings_are_remembered(qtbot, tiny_model_dir):
    w = make_window(qtbot)
    w.controls.temperature.setValue(1.25)
    w.controls.prompt.setPlainText("remember me")
    w.controls.kv_box.setChecked(False)
    w.tokens.set_mode("probability")
    close_and_dispose(w)
    again = make_window(qtbot)
    assert again.controls.temperature.value() == 1.25
    assert again.controls.prompt_text() == "remember me"
    assert not again.controls.kv_box.isChecked() and again.tokens.mode == "probability"
    close_and_dispose(again)


def test_lecture_mode_shows_a_scene_in_large_type_and_esc_returns_to_the_workbench(qtbot, window):
    qtbot.keyClick(window, Qt.Key.Key_F11)
    assert window.lecture.active and window.menuBar().isHidden() and window.state.scene == "prefill"
    assert window.stack.currentWidget() is window.scene_view
    assert window.scene_view.caption.font().pointSizeF() >= 15 * 1.3
    assert window.timing.latency.plot.getAxis("bottom").style["tickFont"].pointSizeF() >= 15   # 20 px at 96 dpi
    qtbot.keyClick(window, Qt.Key.Key_Escape)
    assert not window.lecture.active and not window.menuBar().isHidden() and window.state.scene is None
    assert window.stack.currentWidget() is window.workbench


@pytest.mark.parametrize("mode", ["latency", "probability"])
def test_token_colour_modes_render_every_token(qtbot, window, mode):
    window.controls.max_tokens.setValue(5)
    run = run_and_wait(qtbot, window)
    window.tokens.set_mode(mode)
    assert window.tokens.rendered_tokens() == run.prompt_tokens + run.n_steps


def test_every_axis_has_a_label_and_plain_numbers(qtbot, window):
    window.controls.max_tokens.setValue(5)
    run_and_wait(qtbot, window)
    plots = [window.kv.plot, window.kv.bars_plot, window.timing.timeline.plot, window.timing.latency.plot,
             window.timing.rate.plot, window.timing.cumulative.plot, window.sampling.plot]
    for plot in plots:
        for side in ("bottom", "left"):
            axis = plot.getAxis(side)
            if axis.isVisible():
                assert axis.labelText, (plot, side)
                assert axis.autoSIPrefixScale == 1.0, (plot, side, axis.labelText)
    units = {plot.getAxis(side).labelUnits for plot in plots for side in ("bottom", "left")}
    assert {"ms", "tok/s", "tokens", "s"} <= units


def test_the_heatmap_says_the_prefill_is_running_before_the_cache_fills(qtbot, window, tiny):
    from engine.facts.events import RunStarted
    from engine.facts.params import GenerationParams as Params

    params = Params(max_new_tokens=3)
    window.controller.on_events([RunStarted("r1", "x", tiny.facts, params, "hi", [1, 2], ["a", "b"], "now")])
    window.refresh(force=True)
    assert "prefill is running" in window.kv.info.text() and "KV cache is off" not in window.kv.info.text()
    assert "prefill running" in window.kv.strip_label.text()
    window.controller.on_events([RunStarted("r2", "x", tiny.facts, params.with_(kv_cache=False), "hi", [1, 2],
                                            ["a", "b"], "now")])
    window.refresh(force=True)
    assert "KV cache is off for this run" in window.kv.info.text()


def test_waiting_between_steps_is_drawn_apart_and_not_counted_as_decode(qtbot, window):
    window.controls.max_tokens.setValue(5)
    window.controls.slow.setValue(60)                     # slow motion: 60 ms before each decode step
    run = run_and_wait(qtbot, window)
    items = window.timing._items[run.run_id]
    assert len(items.wait_bars.opts["x0"]) == run.n_steps - 1          # one grey gap before each decode step
    assert all(w >= 60 for w in items.wait_bars.opts["width"])
    assert len(items.decode_bars.opts["x0"]) == run.n_steps - 1        # the decode bar is split at every wait
    s = run.summary()
    assert s.waited_ms >= 60 * (run.n_steps - 1) and s.decode_ms < s.waited_ms
    assert f"{s.waited_ms / 1000:,.1f} s waiting (grey) not counted" in window.timing.summary.text()
    assert "waiting (grey in the timeline) not counted" in window.timing.details.text()


def test_the_sampling_caption_and_bars_show_the_same_step_while_stepping(qtbot, window):
    window.controls.max_tokens.setValue(6)
    window.controller.step()                                     # starts paused after the prefill
    for expected in range(4):
        qtbot.waitUntil(lambda: (r := window.store.current) is not None and r.n_steps == expected + 1)
        window.refresh(force=True)
        step = window.store.current.steps[-1]
        assert f"Step {step.step}</b>" in window.sampling.caption.text()
        widths = list(window.sampling.raw_bars.opts["width"])[:len(step.candidates)]
        assert widths == [c.p_raw for c in step.candidates]
        window.controller.step()
    window.controller.stop()
    wait_idle(qtbot, window)


def test_a_sliding_layer_row_is_drawn_only_over_the_positions_it_holds(qtbot, tmp_path):
    """Rendered pixels, not data: a transposed image looked right while every cell was equal."""
    from tests.architectures import WINDOW, build

    w = make_window(qtbot, build("gemma2-alternating", tmp_path / "gemma2"))
    try:
        w.controls.max_tokens.setValue(30)
        run = run_and_wait(qtbot, w)
        seen = run.kv_tokens
        assert seen > WINDOW + 10
        image = w.kv.image
        image.render()
        pixels = image.qimage
        assert (pixels.width(), pixels.height()) == (seen, run.model.num_layers)
        sliding_row, full_row = 0, 1                           # gemma2 alternates: layer 0 slides, layer 1 is full
        assert pixels.pixelColor(0, sliding_row).alpha() == 0              # dropped by the window: not drawn
        assert pixels.pixelColor(seen - 1, sliding_row).alpha() == 255
        assert pixels.pixelColor(seen - WINDOW, sliding_row).alpha() == 0   # it holds window - 1 positions
        assert pixels.pixelColor(seen - WINDOW + 1, sliding_row).alpha() == 255
        assert all(pixels.pixelColor(x, full_row).alpha() == 255 for x in (0, seen // 2, seen - 1))
    finally:
        close_and_dispose(w)


def test_the_window_fits_its_screen_in_every_mode(qtbot, window):
    area = window.screen().availableGeometry()
    window.resize(area.width() + 600, area.height() + 400)          # as a geometry saved on a larger screen
    window.move(area.x() + 300, area.y() + 200)
    fit_to_screen(window)
    assert area.contains(window.frameGeometry())
    window.lecture.enter("batch")
    assert window.geometry() == window.screen().geometry()
    for scene in ("chat", "memory", "prefill"):
        window.lecture.show(scene)
        assert window.geometry() == window.screen().geometry()
    window.lecture.leave()
    assert area.contains(window.frameGeometry())


def test_the_mouse_over_a_token_names_that_token_and_a_click_pins_it(qtbot, window):
    window.controls.max_tokens.setValue(6)
    run = run_and_wait(qtbot, window)
    text = window.tokens.text
    for position in (1, run.prompt_tokens + 2):              # a prompt token, a generated one
        index = text.keys.index(position)
        cursor = text.textCursor()
        cursor.setPosition(text.starts[index])
        point = text.cursorRect(cursor).center()
        point.setX(point.x() + 3)                             # inside the token's first character
        move = QMouseEvent(QEvent.Type.MouseMove, QPointF(point), text.viewport().mapToGlobal(QPointF(point)),
                           Qt.MouseButton.NoButton, Qt.MouseButton.NoButton, Qt.KeyboardModifier.NoModifier)
        QApplication.sendEvent(text.viewport(), move)                 # the pointer moves over it, no button
        assert text.token_at(point) == position
        assert f"position {position:,}" in window.tokens.detail.text(), window.tokens.detail.text()
    qtbot.mouseClick(text.viewport(), Qt.MouseButton.LeftButton, pos=point)
    assert window.tokens._pinned == run.prompt_tokens + 2
    assert text.token_at(QPoint(text.viewport().width() - 3, text.viewport().height() - 3)) == -1   # empty space


def test_a_compiled_run_starts_at_once_and_the_charts_mark_the_step_where_decode_became_compiled(
        qtbot, window, monkeypatch):
    """On a CPU the run does not wait for the compiled graph: it decodes eagerly while the graph is built beside
    it (held back here until steps 1 and 2 have run, stepping) and switches at the next step boundary; the
    timeline and the latency chart mark that step, the summary names it."""
    from engine.model import compiled as compiled_graphs

    session = window.client.worker.session
    monkeypatch.setattr(compiled_graphs, "_READ", {})          # built here, not read from an earlier test's
    # the prefill package is built after the decode graph, for 40 s after this run ends: not what is tested here
    # (tests/engine/test_compiled_prefill.py)
    monkeypatch.setattr(session, "compiled_prefill", None)
    compiled_graphs.configure()
    compiled_graphs.saved_graph(compiled_graphs.graph_key(session.model, compiled_graphs.SHORTEST)).unlink(
        missing_ok=True)
    compiled = session.compiled
    window.controls.max_tokens.setValue(8)
    window.controls.static_box.setChecked(True)
    window.controls.compile_box.setChecked(True)
    compiled.build_lock.acquire()
    window.controller.step()                                     # starts paused after the prefill
    assert window.statusBar().currentMessage().startswith("Compiled decode: a new cache length's graph is built")
    for steps in (1, 2, 3):
        qtbot.waitUntil(lambda: (r := window.store.current) is not None and r.n_steps == steps, timeout=60_000)
        if steps < 3:
            window.controller.step()
    compiled.build_lock.release()
    qtbot.waitUntil(lambda: all(g.ready.is_set() for g in compiled.graphs()), timeout=300_000)
    window.controller.set_paused(False)
    run = run_and_wait(qtbot, window)
    assert [s.compiled for s in run.steps[1:]] == [False, False] + [True] * (run.n_steps - 3)
    timeline_line, latency_line = window.timing.compiled_lines
    assert timeline_line.isVisible() and latency_line.value() == 3
    third = run.steps[3]
    assert timeline_line.value() == pytest.approx(third.t_ms - third.latency_ms)
    assert "compiled from step 3" in window.timing.summary.text()
    assert "Compiled from step 3: its graph built in" in window.timing.details.text()
    window.controls.compile_box.setChecked(False)
    run_and_wait(qtbot, window)
    assert not timeline_line.isVisible() and not latency_line.isVisible()
