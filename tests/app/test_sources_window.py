"""Help > Where these figures come from: the shown run's figures, each with its kind and source."""

from __future__ import annotations

from tests.app.conftest import run_and_wait


def press(window, keys: str) -> None:
    """What the menu item (or its shortcut) does."""
    from PySide6.QtGui import QAction, QKeySequence

    [action] = [a for a in window.findChildren(QAction) if a.shortcut() == QKeySequence(keys)]
    action.trigger()


def test_the_shown_runs_figures_are_listed_with_their_kind_and_source(qtbot, window):
    press(window, "Ctrl+I")                                        # nothing run yet: it says so
    assert window.lookups.sources_dialog.table.rowCount() == 0
    window.lookups.sources_dialog.close()
    run = run_and_wait(qtbot, window)
    press(window, "Ctrl+I")
    table = window.lookups.sources_dialog.table
    rows = {table.item(r, 0).text(): [table.item(r, c).text() for c in range(1, 4)] for r in range(table.rowCount())}
    assert rows["time to first token"][0] == f"{run.summary().ttft_ms:,.1f} ms"
    assert rows["time to first token"][1].startswith("measured here")
    assert rows["decode speed"][1].startswith("achieved") and "measured decode time" in rows["decode speed"][2]
    assert rows["KV cache at full context"][1] == "computed"
    window.lookups.sources_dialog.close()
