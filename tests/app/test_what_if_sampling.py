"""What-if sampling in the window: the sampling view filters the shown step's recorded candidates again with
other settings at once, with no rerun, drawn beside what ran and saying whether it is exact; in the sampling
scene W turns it on and T, K and P step it."""

from __future__ import annotations

import pytest
from PySide6.QtGui import QKeySequence

from app.state.viewstate import WhatIfSettings
from engine.facts.what_if import refilter
from tests.app.conftest import run_and_wait


def press(qtbot, window, key: str) -> None:
    sequence = QKeySequence(key)[0]
    qtbot.keyClick(window, sequence.key(), sequence.keyboardModifiers())


def bar_widths(bars) -> list[float]:
    return [float(w) for w in bars.opts["width"]]


def test_what_if_refilters_the_shown_step_with_no_rerun_and_says_it_is_exact(qtbot, window):
    window.run_settings.update(temperature=0.8, top_k=20, max_new_tokens=6)
    run = run_and_wait(qtbot, window)
    panel = window.sampling
    assert not panel.what_if_bars.opts["width"].__len__()          # nothing tried yet: only what ran
    panel.what_if.setChecked(True)
    assert window.state.what_if == WhatIfSettings(0.8, 20, 1.0)      # starts from what ran
    panel.filters["top_k"].setValue(3)
    panel.filters["temperature"].setValue(1.5)
    step = panel.current_step()
    expected = refilter([c.p_raw for c in step.candidates], 1.5, 3, 1.0)
    assert bar_widths(panel.what_if_bars) == pytest.approx(list(expected.probs))
    assert sum(1 for w in bar_widths(panel.what_if_bars) if w > 0) == 3
    text = panel.caption.text()
    assert "What if T=1.5, top-k 3" in text and "3 of the 10 recorded candidates survive" in text
    assert "exact" in text
    assert len(window.store.runs) == 1 and window.store.current is run                 # no rerun
    panel.reset.click()
    assert window.state.what_if == WhatIfSettings(0.8, 20, 1.0)
    panel.what_if.setChecked(False)
    assert window.state.what_if is None and not len(panel.what_if_bars.opts["width"])


def test_a_temperature_with_no_top_k_says_the_shares_are_relative(qtbot, window):
    window.run_settings.update(temperature=1.0, max_new_tokens=4)
    run_and_wait(qtbot, window)
    window.state.set_what_if(WhatIfSettings(0.5, 0, 1.0))
    window.refresh(force=True)
    assert "relative shares only" in window.sampling.caption.text()


def test_in_the_sampling_scene_w_then_k_steps_the_what_if_and_runs_nothing(qtbot, window):
    window.run_settings.update(temperature=0.8, top_k=20, max_new_tokens=6)
    run_and_wait(qtbot, window)
    window.lecture.enter("sampling")
    window.activateWindow()
    press(qtbot, window, "W")
    assert window.state.what_if == WhatIfSettings(0.8, 20, 1.0)
    press(qtbot, window, "Shift+K")                                  # top-k one rung down the ladder
    lowered = window.state.what_if.top_k
    assert 0 < lowered < 20
    assert len(window.store.runs) == 1 and window.client.busy is None                 # no run started
    assert window.run_settings.choices.top_k == 20                   # the next run's settings untouched
    press(qtbot, window, "W")
    assert window.state.what_if is None
    window.lecture.leave()


def test_a_candidates_leading_and_trailing_spaces_are_drawn_so_two_tokens_never_read_alike():
    """Scene 6 listed "of" twice: " of" and "of", the axis dropping the space."""
    from app.panels.sampling import _label

    assert _label(" of") == "␣of" and _label("of") == "of" and _label("of ") == "of␣"
    assert _label("  ") == "␣␣" and _label("") == "▫" and _label("a b") == "a b"


def test_typing_one_point_five_into_the_what_if_temperature_box_gives_one_point_five(qtbot, window):
    from PySide6.QtCore import Qt

    window.run_settings.update(max_new_tokens=3)
    run_and_wait(qtbot, window)
    panel = window.sampling
    panel.what_if.setChecked(True)
    box = panel.filters["temperature"]
    box.setFocus()
    box.selectAll()
    qtbot.keyClicks(box, "1.5")            # each key writes the state, which the box follows back
    qtbot.keyClick(box, Qt.Key.Key_Return)
    assert box.value() == pytest.approx(1.5) and box.text() == "T 1.50"
    assert window.state.what_if.temperature == pytest.approx(1.5)


def test_the_what_if_row_stays_put_while_its_words_rewrap(qtbot, window):
    window.run_settings.update(max_new_tokens=3, temperature=0.8)
    run_and_wait(qtbot, window)
    window.resize(1280, 720)
    window.docks["sampling"].raise_()
    panel = window.sampling
    panel.what_if.setChecked(True)
    tops, lines = set(), set()
    for temperature, top_k, top_p in ((1.0, 0, 1.0), (0.37, 3, 0.55), (1.0, 0, 1.0), (0.05, 1, 0.2)):
        for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
            panel.filters[name].setValue(value)
        window.refresh(force=True)
        qtbot.wait(20)
        tops.add(panel.what_if_row.y())
        lines.add(panel.caption.height())
    assert len(lines) > 1 and len(tops) == 1            # the words re-wrapped; the row did not move
