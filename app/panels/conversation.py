"""Chat mode: a conversation whose KV cache is kept between turns, so each turn prefills only what is new.

Each turn shows what llama-server calls ``cache_n`` (positions reused from the cache) next to the positions
prefilled, the prefill time and TTFT, and why nothing was reused when that happens; the chart draws TTFT per
turn. *Compare reuse on vs off* runs the conversation both ways, several times with the order alternating,
and states a difference only where the spreads of the repeats do not overlap.

The conversation itself lives in ``app.state.viewstate.Conversation``; this panel draws it and asks for turns.
"""

from __future__ import annotations

import html
import re

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QBoxLayout,
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app.lessons import chat as chat_lesson
from app.state.store import RunStore
from app.state.viewstate import Conversation
from app.views import theme as th
from app.views.chart import READABLE_DATA_PX, Chart


class ChatPanel(QWidget):
    send_requested = Signal(str, bool)           # the new message, reuse
    compare_requested = Signal()                 # the chat lesson, on this conversation's turns

    def __init__(self, store: RunStore, conversation: Conversation) -> None:
        super().__init__()
        self.store, self.conversation = store, conversation
        self.theme = th.current_theme(False)
        self.view = QTextBrowser()
        self.input = QPlainTextEdit()
        self.input.setPlaceholderText("Your next message (Ctrl+Shift+Enter sends it)")
        self.input.setMaximumHeight(90)
        self.reuse = QCheckBox("Reuse the KV cache across turns")
        self.reuse.setChecked(True)
        self.send_button = QPushButton("Send")
        self.new_button = QPushButton("New conversation")
        self.compare_button = QPushButton("Compare reuse on vs off")
        self.send_button.clicked.connect(self.send)
        self.new_button.clicked.connect(conversation.clear)
        self.compare_button.clicked.connect(self.compare_requested)
        self.chart = Chart("TTFT per turn", legend_columns=1, least_data_px=READABLE_DATA_PX)
        self.plot = self.chart.plot
        self.explain = QLabel()
        self.explain.setWordWrap(True)
        self.explain.setTextFormat(Qt.TextFormat.RichText)
        buttons = QHBoxLayout()                  # the check box on a row of its own: a narrow lecture column
        buttons.addStretch(1)
        buttons.addWidget(self.new_button)
        buttons.addWidget(self.compare_button)
        buttons.addWidget(self.send_button)
        self.conversation_box = QWidget()
        box = QVBoxLayout(self.conversation_box)
        box.setContentsMargins(0, 0, 0, 0)
        box.addWidget(self.view, 1)
        box.addWidget(self.input)
        box.addWidget(self.reuse)
        box.addLayout(buttons)
        self.content = QBoxLayout(QBoxLayout.Direction.TopToBottom)
        self.content.addWidget(self.conversation_box, 3)
        self.content.addWidget(self.chart, 2)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(self.content, 1)
        layout.addWidget(self.explain)
        self._shown = None
        self._transcript_of: str | None = None          # the comparison whose conversation the transcript shows
        self._dirty = False
        conversation.subscribe(self._conversation_changed)
        self.set_busy(None)
        self._render()

    # --- conversation -------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if text:
            self.send_requested.emit(text, self.reuse.isChecked())

    def _conversation_changed(self, _names: set[str]) -> None:
        """Marked here, drawn at the next refresh: rendering the transcript the moment a turn starts took the
        GIL from the prefill it was waiting for (TTFT grew with the transcript on a 2-core machine)."""
        if self.conversation.messages and self.conversation.messages[-1]["role"] == "user":
            self.input.clear()                   # the model started answering what was typed
        self._dirty = True
        self._shown = None

    def set_wide(self, wide: bool) -> None:
        """A lecture scene is wide: the conversation beside its chart rather than above it."""
        self.content.setDirection(QBoxLayout.Direction.LeftToRight if wide else QBoxLayout.Direction.TopToBottom)
        self.content.setStretch(0, 1 if wide else 3)
        self.content.setStretch(1, 1 if wide else 2)
        self.explain.setVisible(not wide)          # the scene's caption states the comparison

    def set_busy(self, busy: str | None) -> None:
        for button in (self.send_button, self.compare_button, self.new_button):
            button.setEnabled(not busy)

    # --- drawing ------------------------------------------------------------------------------------------
    def _render(self) -> None:
        parts, turn = [], 0
        runs = self.conversation.turn_runs
        for message in self.conversation.messages:
            if message["role"] == "user":
                parts.append(f"<p><b>You:</b> {html.escape(message['content'])}</p>")
                continue
            run = self.store.find(runs[turn]) if turn < len(runs) else None
            stats = ""
            if run is not None:
                s = run.summary(with_text=False)
                if run.remote:
                    reused = (f"{s.server_cached_tokens:,} (the server's cache_n)" if s.server_cached_tokens
                              is not None else "not reported")
                    stats = (f"<br><small>turn {turn + 1} · reused {reused} · TTFT {s.ttft_ms:,.0f} ms "
                             "(client)</small>")
                else:
                    stats = (f"<br><small>turn {turn + 1} · reused {s.reused_tokens:,} (cache_n) · prefilled "
                             f"{s.prompt_tokens:,} · prefill {s.prefill_ms:,.0f} ms · TTFT {s.ttft_ms:,.0f} ms"
                             "</small>")
                note = run.prefill.cache_note if run.prefill is not None else ""
                if note and self.reuse.isChecked():
                    stats += f"<br><small><i>{html.escape(note)}</i></small>"
            turn += 1
            parts.append(f"<p><b>Assistant:</b> {html.escape(message['content'])}{stats}</p>")
        if not parts:
            parts = self._comparison_transcript()
        record = self.store.latest_experiment(chat_lesson.WINDOW.kind)
        if not parts and record is not None and not record.finished:
            parts = ["<p><i>The comparison is running: each turn is sent twice, with the cache kept and re-prefilled; "
                     "its conversation shows here when it ends.</i></p>"]
        text = "".join(parts) or "<p><i>Start a conversation below.</i></p>"
        if self.theme.lecture:
            text = re.sub(r"</?small>", "", text)        # a lecture's back row reads the per-turn figures too
        self.view.setHtml(text)
        bar = self.view.verticalScrollBar()
        bar.setValue(bar.maximum())                      # the newest turn is the one being discussed

    def _comparison_transcript(self) -> list[str]:
        """With no conversation of its own (a replayed comparison, a lecture from traces), the comparison's
        last conversation: what was asked, what the model answered, and what each turn reused."""
        record = self.store.latest_experiment(chat_lesson.WINDOW.kind)
        result = record.result if record is not None else None
        turns = result.turns if result is not None else 0
        points = [p.values for p in record.points if "reuse" in p.values] if record is not None else []
        if not turns or len(points) != len(record.run_ids):
            return []
        reused = [run_id for run_id, p in zip(record.run_ids, points) if p["reuse"]]   # one point per turn run
        runs = [self.store.find(r) for r in reused[-turns:]]
        runs = [r for r in runs if r is not None and r.finished]
        if len(runs) != turns:
            return []
        parts = ["<p><i>The comparison's last conversation with the cache kept:</i></p>"]
        for i, run in enumerate(runs, 1):
            s = run.summary()
            parts.append(f"<p><b>You:</b> {html.escape(run.started.prompt)}</p>")
            parts.append(f"<p><b>Assistant:</b> {html.escape(s.text)}<br><small>turn {i} · reused "
                         f"{s.reused_tokens or 0:,} · prefilled {s.prompt_tokens or 0:,} · TTFT {s.ttft_ms:,.0f} ms"
                         "</small></p>")
        return parts

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.chart.style(theme, "turn", None, "TTFT", "ms")
        self._shown = None
        self.refresh()

    def refresh(self) -> None:
        if self._dirty:
            self._dirty = False
            self._render()
        record = self.store.latest_experiment(chat_lesson.WINDOW.kind)
        runs = [self.store.find(r) for r in self.conversation.turn_runs]
        done = [r for r in runs if r is not None and r.finished]
        key = (len(done), (record.exp_id, len(record.events)) if record else None)
        if key == self._shown:
            return
        finished = record.exp_id if record is not None and record.end is not None else None
        if not self.conversation.messages and finished != self._transcript_of:
            self._transcript_of = finished               # once it has ended: rendering mid-run slows the worker
            self._render()
        self._shown = key
        self.chart.clear_data()
        width = self.theme.line_width * 1.5
        turns = len(done)
        if done:
            ttft = [r.summary(with_text=False).ttft_ms for r in done]
            self.chart.add(pg.PlotDataItem(list(range(1, len(ttft) + 1)), ttft, pen=pg.mkPen(th.CHOSEN, width=width),
                                           symbol="o", symbolBrush=th.CHOSEN), "this conversation (measured)")
        if record is not None:
            turns = max(turns, len(record.settings.turns))
            chat_lesson.draw(self.chart, record, width)
            if record.result is not None:
                self.explain.setText(chat_lesson.explanation(record.result))
        drawn = any(item.getData()[0] is not None and len(item.getData()[0]) for item in self.plot.listDataItems())
        self.chart.set_empty(None if drawn else "TTFT per turn appears when the first turn has been answered")
        if not drawn:
            return
        self.plot.getAxis("bottom").setTicks([[(t, str(t)) for t in range(1, max(turns, 1) + 1)]])
        self.plot.setXRange(0.7, max(turns, 1) + 0.3, padding=0)
        # From zero: a single point's axis would otherwise span a few microseconds around it (20.4244…20.4252 s)
        ys = [item.getData()[1] for item in self.plot.listDataItems()]
        highest = max((float(np.nanmax(y)) for y in ys if y is not None and len(y)), default=None)
        if highest is not None and highest > 0:
            self.plot.setYRange(0, highest * 1.15, padding=0)
