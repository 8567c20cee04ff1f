"""The run history: every run and experiment remembered across launches, listed newest first, filtered by
words and date; up to four picked are drawn side by side (decode speed against context depth, each in its fixed
colour) and open in every panel as a replay of their own events."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from html import escape

import pyqtgraph as pg
from PySide6.QtCore import QItemSelectionModel, Qt
from PySide6.QtWidgets import (
    QAbstractItemView,
    QDialog,
    QDialogButtonBox,
    QHBoxLayout,
    QHeaderView,
    QLabel,
    QLineEdit,
    QPushButton,
    QSplitter,
    QTableWidget,
    QTableWidgetItem,
    QVBoxLayout,
    QWidget,
)

from app.views import theme as th
from app.views.chart import Chart
from engine.facts.contention import busy
from engine.facts.errors import TraceError
from engine.output.history import History, HistoryError, HistoryRun
from engine.store.paths import cache_dir

COLUMNS = ("#", "When (UTC)", "Model", "Engine", "Format", "Device", "What", "Ended", "TTFT (ms)",
           "Decode (tok/s, achieved)", "New tokens", "Machine")
ENDED = {"eos": "end of text", "max_tokens": "max tokens", "stopped": "stopped", "context_full": "context full",
         "done": "done"}
MOST_COMPARED = 4
COMPARED = (th.PREFILL, th.DECODE, th.CHOSEN, th.CACHE_OFF)     # the 1st to 4th run picked, in every chart


class HistoryDialog(QDialog):
    """``open_traces(paths)`` replays the picked runs in every panel (the window's own replay)."""

    def __init__(self, parent: QWidget | None, open_traces: Callable[[list[str]], object]) -> None:
        super().__init__(parent)
        self._open_traces = open_traces
        self.history: History | None = None
        self.shown: list[HistoryRun] = []
        self.problem = ""                 # a read that failed, in one line
        self.setWindowTitle("Run history: every run remembered")
        self.resize(1200, 720)
        self.find = QLineEdit()
        self.find.setPlaceholderText("Filter: words in the model, engine, kind or title")
        self.find.setClearButtonEnabled(True)
        self.since = QLineEdit()
        self.since.setPlaceholderText("Since (2026-12-01)")
        self.since.setMaximumWidth(180)
        for edit in (self.find, self.since):
            edit.textChanged.connect(self.refresh)
        self.table = QTableWidget(0, len(COLUMNS))
        self.table.setHorizontalHeaderLabels(list(COLUMNS))
        self.table.setEditTriggers(QAbstractItemView.EditTrigger.NoEditTriggers)
        self.table.setSelectionBehavior(QAbstractItemView.SelectionBehavior.SelectRows)
        self.table.setSelectionMode(QAbstractItemView.SelectionMode.ExtendedSelection)
        self.table.verticalHeader().setVisible(False)
        self.table.horizontalHeader().setSectionResizeMode(QHeaderView.ResizeMode.Interactive)
        self.table.horizontalHeader().setStretchLastSection(True)
        self.table.itemSelectionChanged.connect(self._picked)
        self.table.itemActivated.connect(lambda _item: self.open_picked())
        self.chart = Chart("Decode speed against context depth, the picked runs side by side", legend_columns=2)
        self.chart.style(th.current_theme(False), "context depth", "positions", "decode speed", "tok/s")
        self.chart.set_empty("Pick up to four runs above to draw their decode speed at each context depth")
        self.status = QLabel()
        self.status.setWordWrap(True)
        self.status.setTextFormat(Qt.TextFormat.PlainText)
        self.open_button = QPushButton("Open in every panel")
        self.open_button.setToolTip("Replay the picked runs (up to four) in every panel, from their own events")
        self.open_button.clicked.connect(self.open_picked)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Close)
        buttons.rejected.connect(self.reject)
        top = QHBoxLayout()
        top.addWidget(self.find, 1)
        top.addWidget(self.since)
        split = QSplitter(Qt.Orientation.Vertical)
        split.addWidget(self.table)
        split.addWidget(self.chart)
        split.setSizes([330, 330])
        row = QHBoxLayout()
        row.addWidget(self.status, 1)
        row.addWidget(self.open_button)
        row.addWidget(buttons)
        layout = QVBoxLayout(self)
        layout.addLayout(top)
        layout.addWidget(split, 1)
        layout.addLayout(row)

    def showEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.refresh()
        super().showEvent(event)

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self._close_history()
        super().closeEvent(event)

    def reject(self) -> None:
        self._close_history()
        super().reject()

    def _close_history(self) -> None:
        if self.history is not None:
            self.history.close()
            self.history = None

    # --- the list -----------------------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the history again (the engine adds to it as runs end); the picked runs stay picked."""
        if self.history is None:
            self.history = History()
        picked = {r.id for r in self.picked()}
        self.problem = ""
        try:
            self.shown = self.history.runs(self.find.text(), self.since.text().strip())
        except HistoryError as exc:
            self.shown, self.problem = [], str(exc)
        self.table.setRowCount(len(self.shown))
        for row, r in enumerate(self.shown):
            decode = _number(r.decode_tok_s, 2) + (" (busy)" if busy(r.cpu_share) else "")
            cells = (str(r.id), r.at.replace("T", " ")[:19], r.model, r.engine, r.format, r.device, r.kind,
                     ENDED.get(r.ended, r.ended), _number(r.ttft_ms, 1), decode,
                     "" if r.generated_tokens is None else f"{r.generated_tokens:,}", r.machine)
            for column, text in enumerate(cells):
                item = QTableWidgetItem(text)
                item.setData(Qt.ItemDataRole.UserRole, r.id)
                if column in (0, 8, 9, 10):
                    item.setTextAlignment(Qt.AlignmentFlag.AlignRight | Qt.AlignmentFlag.AlignVCenter)
                self.table.setItem(row, column, item)
        self.table.resizeColumnsToContents()
        selection = self.table.selectionModel()
        flags = QItemSelectionModel.SelectionFlag.Select | QItemSelectionModel.SelectionFlag.Rows
        self.table.blockSignals(True)
        selection.clear()
        for row, r in enumerate(self.shown):
            if r.id in picked:
                selection.select(self.table.model().index(row, 0), flags)
        self.table.blockSignals(False)
        self._picked()

    def picked(self) -> list[HistoryRun]:
        """The runs picked, in list order, at most ``MOST_COMPARED``."""
        rows = sorted({i.row() for i in self.table.selectedIndexes()})
        return [self.shown[r] for r in rows if r < len(self.shown)][:MOST_COMPARED]

    def _picked(self) -> None:
        picked = self.picked()
        rows = len({i.row() for i in self.table.selectedIndexes()})
        self.open_button.setEnabled(any(r.has_trace for r in picked))
        self._draw(picked)
        words = f"{len(self.shown):,} runs listed" + (" (the newest 500)" if len(self.shown) >= 500 else "")
        if rows > MOST_COMPARED:
            words += f"; {rows} picked: the first {MOST_COMPARED} are compared"
        if self.history is not None:
            words += f". Kept in {self.history.path}"
            if self.history.problem:
                words += f". {self.history.problem}"
        if self.problem:
            words += f". {self.problem}"
        self.status.setText(words + ".")

    def _draw(self, picked: list[HistoryRun]) -> None:
        self.chart.clear_data()
        drawn = 0
        for colour, run in zip(COMPARED, picked):
            try:
                steps = [s for s in self.history.steps(run.id) if s.step > 0 and s.latency_ms > 0
                         and s.context is not None] if self.history is not None else []
            except HistoryError as exc:
                steps, self.problem = [], str(exc)
            if not steps:
                continue
            x = [s.context for s in steps]
            y = [1000.0 / s.latency_ms for s in steps]
            item = pg.PlotDataItem(x, y, pen=pg.mkPen(colour, width=2), symbol="o", symbolSize=4,
                                   symbolBrush=colour, symbolPen=None)
            where = run.device + (f", {run.format}" if run.format else "")
            self.chart.add(item, escape(f"#{run.id} {run.model} ({where})"))
            drawn += 1
        self.chart.set_empty(None if drawn else
                             "Pick up to four runs above to draw their decode speed at each context depth"
                             if not picked else "The picked runs have no decode steps to draw")

    def open_picked(self) -> None:
        """The picked runs' own events, replayed in every panel: as one recording when they were all measured on
        one machine (drawn side by side), else one after the other (figures from two machines are never
        overlaid)."""
        if self.history is None:
            return
        picked = [r for r in self.picked() if r.has_trace]
        if not picked:
            return
        folder = opened_runs_dir()
        shutil.rmtree(folder, ignore_errors=True)        # the last replay read its files before it began
        folder.mkdir(parents=True, exist_ok=True)
        one_machine = len({r.machine for r in picked}) == 1
        groups = [[r.id for r in picked]] if one_machine else [[r.id] for r in picked]
        paths = []
        try:
            for group in groups:
                name = "runs-" + "-".join(map(str, group)) + ".jsonl"
                paths.append(str(self.history.write_trace(group, os.path.join(folder, name))))
        except (TraceError, HistoryError, OSError) as exc:
            self.status.setText(f"Not opened: {exc}")
            return
        if not one_machine:
            self.status.setText("These runs were measured on different machines: they replay one after the other, "
                                "each in its own recording, never overlaid.")
        self._open_traces(paths)


def opened_runs_dir():
    """Where runs opened from the history are written as traces for the replay to read."""
    return cache_dir() / "history-open"


def _number(value: float | None, decimals: int) -> str:
    return "" if value is None else f"{value:,.{decimals}f}"
