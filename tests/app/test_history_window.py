"""The run history in the window: runs of one launch listed at the next, four picked drawn side by side in their
fixed colours, and opened in every panel as one replay."""

from __future__ import annotations

from tests.app.conftest import close_and_dispose, make_window, run_and_wait, wait_idle


def test_runs_outlive_the_window_and_four_picked_are_compared_and_replayed_together(qtbot, tiny_model_dir, tmp_path,
                                                                                   monkeypatch):
    import pyqtgraph as pg

    from app.shell.history_dialog import COMPARED

    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path))
    first = make_window(qtbot, tiny_model_dir)
    try:
        for tokens in (4, 5, 6, 7, 8):
            first.run_settings.update(max_new_tokens=tokens)
            run_and_wait(qtbot, first)
    finally:
        close_and_dispose(first)

    second = make_window(qtbot)                                     # the next launch: no model, no runs
    try:
        second.lookups.show_run_history()
        dialog = second.lookups.history_dialog
        assert dialog.table.rowCount() == 5
        assert [dialog.table.item(r, 10).text() for r in range(5)] == ["8", "7", "6", "5", "4"]     # newest first
        dialog.table.selectAll()                                     # five picked: the first four compared
        assert [r.generated_tokens for r in dialog.picked()] == [8, 7, 6, 5]
        assert "5 picked: the first 4 are compared" in dialog.status.text()
        curves = [i for i in dialog.chart.plot.listDataItems() if isinstance(i, pg.PlotDataItem)]
        assert [c.opts["pen"].color().name().lower() for c in curves] == [c.lower() for c in COMPARED]
        assert [len(c.getData()[0]) for c in curves] == [7, 6, 5, 4]         # one point per decode step
        assert len(dialog.chart.legend_names()) == 4
        dialog.open_picked()
        qtbot.waitUntil(lambda: len(second.store.runs) == 4)
        wait_idle(qtbot, second)
        assert len({run.source for run in second.store.runs}) == 1          # one recording: drawn together
        second.state.select(second.store.runs[-1].run_id, "test")
        assert len(second.timing.visible_runs()) == 4
    finally:
        close_and_dispose(second)


def test_a_history_that_is_not_a_database_is_one_line_in_the_view_and_kept(qtbot, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSCOPE_DATA_DIR", str(tmp_path))
    (tmp_path / "history.sqlite").write_bytes(b"someone else's notes, not a database\n" * 50)
    window = make_window(qtbot)
    try:
        window.lookups.show_run_history()
        dialog = window.lookups.history_dialog
        assert dialog.table.rowCount() == 0 and "could not be read" in dialog.status.text()
        [aside] = tmp_path.glob("history.damaged-*.sqlite")
        assert aside.read_bytes().startswith(b"someone else's notes")
        assert not dialog.open_button.isEnabled()
    finally:
        close_and_dispose(window)
