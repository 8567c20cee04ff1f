"""Chat mode: a conversation whose KV cache is kept between turns, so each turn prefills only what is new.

Each turn shows what llama-server calls ``cache_n`` (positions reused from the cache) next to the positions
prefilled, the prefill time and TTFT; the chart draws TTFT per turn, and *Compare reuse on vs off* runs the
conversation both ways (flat vs growing) and checks the replies are the same tokens.
"""

from __future__ import annotations

import html

import pyqtgraph as pg
from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import (
    QCheckBox,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QTextBrowser,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.paint import TimedGraphics
from app.store import RunRecord, RunStore


class ChatPanel(QWidget):
    send_requested = Signal(list, bool)          # messages, reuse
    compare_requested = Signal(list)             # user turns

    def __init__(self, store: RunStore) -> None:
        super().__init__()
        self.store = store
        self.theme = th.current_theme(False)
        self.messages: list[dict] = []
        self.turn_runs: list[str] = []           # run id of each assistant turn
        self._pending_user: str | None = None
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
        self.new_button.clicked.connect(self.new_conversation)
        self.compare_button.clicked.connect(self._compare)
        self.graphics = TimedGraphics()
        self.plot: pg.PlotItem = self.graphics.addPlot(title="TTFT per turn")
        self.plot.addLegend(offset=(10, 10))
        self.explain = QLabel()
        self.explain.setWordWrap(True)
        self.explain.setTextFormat(Qt.TextFormat.RichText)
        buttons = QHBoxLayout()
        buttons.addWidget(self.reuse)
        buttons.addStretch(1)
        buttons.addWidget(self.new_button)
        buttons.addWidget(self.compare_button)
        buttons.addWidget(self.send_button)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addWidget(self.view, 3)
        layout.addWidget(self.input)
        layout.addLayout(buttons)
        layout.addWidget(self.graphics, 2)
        layout.addWidget(self.explain)
        self._shown = None
        self.set_busy(None)

    # --- conversation -------------------------------------------------------------------------------------
    def send(self) -> None:
        text = self.input.toPlainText().strip()
        if not text or self._pending_user is not None:
            return
        self._pending_user = text
        self.send_requested.emit(self.messages + [{"role": "user", "content": text}], self.reuse.isChecked())

    def turn_started(self, run: RunRecord) -> None:
        """The worker began answering: the user's message is now part of the conversation."""
        if self._pending_user is None or run.started.kind != "chat":
            return
        self.messages.append({"role": "user", "content": self._pending_user})
        self.turn_runs.append(run.run_id)
        self.input.clear()

    def turn_ended(self, run: RunRecord) -> None:
        if self._pending_user is None or run.run_id not in self.turn_runs:
            return
        self._pending_user = None
        if run.reason == "failed":
            self.messages.pop()
            self.turn_runs.pop()
        else:
            self.messages.append({"role": "assistant", "content": run.summary().text})
        self._render()

    def request_failed(self) -> None:
        self._pending_user = None

    def new_conversation(self) -> None:
        self.messages, self.turn_runs, self._pending_user = [], [], None
        self._render()
        self.refresh()

    def user_turns(self) -> list[str]:
        return [m["content"] for m in self.messages if m["role"] == "user"]

    def _compare(self) -> None:
        self.compare_requested.emit(self.user_turns())

    def set_busy(self, busy: str | None) -> None:
        for button in (self.send_button, self.compare_button, self.new_button):
            button.setEnabled(not busy)

    # --- drawing ------------------------------------------------------------------------------------------
    def _render(self) -> None:
        parts, turn = [], 0
        for message in self.messages:
            if message["role"] == "user":
                parts.append(f"<p><b>You:</b> {html.escape(message['content'])}</p>")
                continue
            run = self.store.find(self.turn_runs[turn]) if turn < len(self.turn_runs) else None
            stats = ""
            if run is not None:
                s = run.summary(with_text=False)
                stats = (f"<br><small>turn {turn + 1} · reused {s.reused_tokens:,} (cache_n) · prefilled "
                         f"{s.prompt_tokens:,} · prefill {s.prefill_ms:,.0f} ms · TTFT {s.ttft_ms:,.0f} ms</small>")
                note = run.prefill.cache_note if run.prefill is not None else ""
                if note and self.reuse.isChecked():
                    stats += f"<br><small><i>{html.escape(note)}</i></small>"
            turn += 1
            parts.append(f"<p><b>Assistant:</b> {html.escape(message['content'])}{stats}</p>")
        self.view.setHtml("".join(parts) or "<p><i>Start a conversation below.</i></p>")

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        self.graphics.setBackground(theme.background)
        th.style_plot(self.plot, theme, "turn", None, "TTFT", "ms")
        self._shown = None
        self.refresh()

    def refresh(self) -> None:
        record = self.store.latest_experiment("chat")
        key = (len(self.turn_runs), self.store.version if self._pending_user else 0,
               (record.exp_id, len(record.events)) if record else None)
        if key == self._shown:
            return
        self._shown = key
        self.plot.clear()
        width = self.theme.line_width * 1.5
        live = [self.store.find(r) for r in self.turn_runs]
        live = [r for r in live if r is not None and r.finished]
        if live:
            ttft = [r.summary(with_text=False).ttft_ms for r in live]
            self.plot.plot(list(range(1, len(ttft) + 1)), ttft, pen=pg.mkPen(th.CHOSEN, width=width), symbol="o",
                           symbolBrush=th.CHOSEN, name="this conversation (measured)")
        if record is not None:
            for reuse, colour in ((1.0, th.DECODE), (0.0, th.CACHE_OFF)):
                points = [p.values for p in record.points if p.values.get("reuse") == reuse]
                if points:
                    self.plot.plot([p["turn"] for p in points], [p["ttft_ms"] for p in points],
                                   pen=pg.mkPen(colour, width=width), symbol="o", symbolBrush=colour,
                                   name=f"reuse {'on' if reuse else 'off'} (measured)")
            summary = record.end.summary if record.end is not None and hasattr(record.end, "summary") else {}
            if "tokens_match" in summary and not summary.get("incomplete"):
                on = [p.values for p in record.points if p.values.get("reuse") == 1.0]
                off = [p.values for p in record.points if p.values.get("reuse") == 0.0]
                match = "the same tokens ✓" if summary["tokens_match"] else "DIFFERENT tokens ✗"
                self.explain.setText(
                    f"Both ways gave {match}. Last turn: with reuse {on[-1]['reused_tokens']:,} of "
                    f"{on[-1]['conversation_tokens']:,} positions came from the cache and only "
                    f"{on[-1]['prefilled_tokens']:,} were prefilled (TTFT {on[-1]['ttft_ms']:,.0f} ms); without, "
                    f"all {off[-1]['prefilled_tokens']:,} were prefilled again (TTFT {off[-1]['ttft_ms']:,.0f} ms).")
