"""The attention view: rows placed where each layer's keys start, a caption with the sink share and the
measured cost, steps pinned from the token stream, and R in the attention scene recording attention."""

from __future__ import annotations

import math

import numpy as np

from app.panels.attention import empty_text, layer_grid, row_ticks, shares
from engine.facts.events import AttentionStep
from tests.app.conftest import run_and_wait, wait_idle


def _step() -> AttentionStep:
    """Four layers: a full one, a sliding one holding the last 3 positions, none for layer 2 (state-space),
    a full one; two heads each, query at position 5."""
    full = [[0.5, 0.1, 0.1, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.1, 0.2, 0.2]]
    sliding = [[0.2, 0.3, 0.5], [0.4, 0.4, 0.2]]
    return AttentionStep("r", 1.0, 2, 5, [0, 1, 3], [0, 3, 0], [full, sliding, full], 0.2, "sdpa hook")


def test_layer_rows_start_where_the_layer_holds_keys_and_missing_layers_stay_empty():
    grid, first = layer_grid(_step(), num_layers=4)
    assert first == 0 and grid.shape == (4, 6)
    assert np.allclose(grid[0], [0.4, 0.1, 0.1, 0.1, 0.15, 0.15])
    assert np.isnan(grid[1, :3]).all() and np.allclose(grid[1, 3:], [0.3, 0.35, 0.35])
    assert np.isnan(grid[2]).all()


def test_sink_share_counts_only_layers_that_still_hold_the_first_token():
    sink, recent = shares(_step())
    assert math.isclose(sink, 0.4) and math.isclose(recent, 1.0)


def test_row_labels_sit_at_row_centres_and_always_name_the_last_row():
    ticks = row_ticks(30)
    assert ticks[0] == (0.5, "0") and ticks[-1] == (29.5, "29") and len(ticks) <= 9
    assert [label for _, label in row_ticks(3)] == ["0", "1", "2"]


def test_a_recorded_run_fills_the_view_and_a_clicked_token_pins_its_step(qtbot, window):
    window.controls.max_tokens.setValue(5)
    plain = run_and_wait(qtbot, window)
    window.refresh(force=True)
    assert window.attention.caption.text() == empty_text(plain) and not window.attention.layers_image.isVisible()
    assert f"Run #{plain.number} did not record attention" in empty_text(plain)
    window.controls.attention_box.setChecked(True)
    run = run_and_wait(qtbot, window)
    window.refresh(force=True)
    assert run.run_id != plain.run_id and len(run.attention) == run.n_steps == 5
    text = window.attention.caption.text()
    assert f"position {run.attention[-1].position:,}" in text and "Recording cost" in text and "%" in text
    window.tokens.step_selected.emit(run.run_id, 0)
    assert f"position {run.prompt_tokens - 1:,} read" in window.attention.caption.text()
    image = window.attention.layers_image.image
    assert image.shape == (run.model.num_layers, run.prompt_tokens)


def test_r_in_the_attention_scene_records_attention_with_the_box_unticked(qtbot, window):
    window.controls.max_tokens.setValue(3)
    assert not window.controls.attention_box.isChecked()
    window.lecture.enter("attention")
    window.lecture.action()
    wait_idle(qtbot, window)
    window.refresh(force=True)
    run = window.store.current
    assert run.started.params.capture_attention and len(run.attention) == 3
    assert "cached positions" in window.scene_view.claim()
    window.lecture.leave()
