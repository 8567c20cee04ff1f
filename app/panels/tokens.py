"""The token stream: prompt (prefill) and generated (decode) tokens with visible boundaries.

Alternate tokens get alternate shades so boundaries show without separators; colour modes swap the shading
for step latency or probability. Hovering or clicking a token shows its details in a line under the text
(not only in a tooltip, so a recording can read it) and tells the sampling view which step to draw.
"""

from __future__ import annotations

import bisect
import functools
import re

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import QPointF, Qt, Signal
from PySide6.QtGui import QColor, QFont, QFontMetrics, QTextCharFormat, QTextCursor
from PySide6.QtWidgets import QComboBox, QHBoxLayout, QLabel, QSizePolicy, QTextEdit, QVBoxLayout, QWidget

from app.state.phase import prefill_passes, run_line
from app.state.store import RunRecord, RunStore
from app.state.viewstate import ViewState
from app.views import theme as th

MODES = ("phase", "latency", "probability")
HINT = "Hover over or click a token to see its id, position, latency and candidates."
WORKBENCH_LINES = 5              # the token stream shows at least this many lines of a reply in the workbench
MODE_LABELS = {"phase": "Phase (prefill / decode)", "latency": "Step latency", "probability": "Probability"}


def visible(text: str) -> str:
    """A token's text with the invisible made visible: newlines as ↵, tabs as →, empty as ▫."""
    if text == "":
        return "▫"
    return text.replace("\n", "↵\n").replace("\t", "→\t")


TOKENS_PER_REFRESH = 2000       # laid out per refresh (about 0.1-0.2 s here); the rest at the next ones
BLOCK_CHARS = 16_000             # a paragraph longer than this ends at the next token boundary: Qt lays out a
#                                 changed paragraph whole, so one paragraph of a 1M-character stream took seconds
#                                 per batch of tokens added to it
BREAK_AFTER = 48               # characters without a space before a token boundary becomes a place to wrap
BREAK = "\u200b"              # zero-width space: a line-break opportunity that shows nothing


def breakable(piece: str, unbroken: int) -> tuple[str, int]:
    """``piece`` as inserted after ``unbroken`` characters with no space, and the count after it. Text with no
    spaces (base64, minified JSON, a URL, DNA) would leave Qt one paragraph with nowhere to wrap, and its layout
    grows with the square of the length (20k tokens: 2 s); a zero-width break at a token boundary every
    ``BREAK_AFTER`` characters keeps it linear, and the boundary is where a token ends anyway."""
    spaced = max(piece.rfind(" "), piece.rfind("\n"), piece.rfind("\t"))
    if spaced >= 0:
        return piece, len(piece) - spaced - 1
    if unbroken + len(piece) > BREAK_AFTER:
        return BREAK + piece, len(piece)
    return piece, unbroken + len(piece)


def with_breaks(text: str) -> str:
    """Long text with a zero-width break after every ``BREAK_AFTER`` characters without a space (a server's
    prompt, shown whole: it has no token boundaries to break at)."""
    return re.sub(r"\S{%d}" % BREAK_AFTER, lambda m: m.group() + BREAK, text)


def escaped(text: str) -> str:
    return repr(text)[1:-1] if text else "(part of a multi-byte character, completed by the next token)"


@functools.lru_cache(maxsize=64)
def shade(colour: str, lightness: float) -> QColor:
    """``colour`` at ``lightness`` (cached: a 100k-token prompt asks for the same two shades 100k times)."""
    c = QColor(colour)
    h, s, _l, _a = c.getHslF()
    return QColor.fromHslF(h, s * 0.9, lightness)


class TokenText(QTextEdit):
    """The token stream as one document. Which token is under the mouse is found from where each token starts
    in the document (not from a per-token anchor), so tokens of the same colour share one format: 100k tokens
    carry a handful of formats instead of 100k."""

    hovered = Signal(int)     # position, or -1
    clicked = Signal(int)

    def __init__(self) -> None:
        super().__init__()
        self.setReadOnly(True)
        self.viewport().setMouseTracking(True)
        self.setUndoRedoEnabled(False)
        self.starts: list[int] = []            # where each token's text starts in the document
        self.keys: list[int] = []              # its position (or step), -1 for text that is not a token
        self._block_start = 0                  # where the paragraph being filled starts

    def reset(self) -> None:
        self.clear()
        self.starts, self.keys, self._block_start = [], [], 0

    def add(self, cursor: QTextCursor, text: str, fmt: QTextCharFormat, key: int) -> None:
        if "\n" in text:
            self._block_start = cursor.position() + text.rindex("\n") + 1
        elif cursor.position() - self._block_start > BLOCK_CHARS:
            cursor.insertBlock()                # see BLOCK_CHARS
            self._block_start = cursor.position()
        self.starts.append(cursor.position())
        self.keys.append(key)
        cursor.insertText(text, fmt)

    def token_at(self, point) -> int:
        """The position of the token under ``point`` (viewport pixels), or -1 over no token."""
        where = QPointF(point.x() + self.horizontalScrollBar().value(), point.y() + self.verticalScrollBar().value())
        character = self.document().documentLayout().hitTest(where, Qt.HitTestAccuracy.ExactHit)
        if character < 0 or not self.starts:
            return -1
        index = bisect.bisect_right(self.starts, character) - 1
        return self.keys[index] if index >= 0 else -1

    def mouseMoveEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.hovered.emit(self.token_at(event.position()))
        super().mouseMoveEvent(event)

    def mousePressEvent(self, event) -> None:  # noqa: N802
        position = self.token_at(event.position())
        if position >= 0:
            self.clicked.emit(position)
        super().mousePressEvent(event)


class TokensPanel(QWidget):
    step_selected = Signal(str, int)   # run id, step (-1 = follow the newest)

    def __init__(self, store: RunStore, state: ViewState) -> None:
        super().__init__()
        self.store, self.state = store, state
        self.mode = "phase"
        self.theme = th.current_theme(False)
        self.mode_box = QComboBox()
        for mode in MODES:
            self.mode_box.addItem(MODE_LABELS[mode], mode)
        self.mode_box.currentIndexChanged.connect(lambda _i: state.set_token_colours(self.mode_box.currentData()))
        state.subscribe(lambda names: self.set_mode(state.token_colours) if "token_colours" in names else None)
        self.legend = QLabel()
        self.legend.setTextFormat(Qt.TextFormat.RichText)
        self.legend.setWordWrap(True)
        top = QHBoxLayout()
        colour = QLabel("Colour:")
        top.addWidget(colour)
        top.addWidget(self.mode_box)
        top.addStretch(1)
        self._controls = [colour, self.mode_box]
        self.text = TokenText()
        self.run_line = QLabel()              # the run's figures and how it ended, under the reply
        self._run_line_wanted = True
        self.run_line.setTextFormat(Qt.TextFormat.PlainText)
        self.run_line.setWordWrap(True)
        self.detail = QLabel(HINT)
        self.detail.setTextFormat(Qt.TextFormat.PlainText)
        self.detail.setWordWrap(True)
        self.detail.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(4, 4, 4, 4)
        layout.addLayout(top)
        layout.addWidget(self.legend)           # its own row: a wrapped legend beside a combo box was cut short
        layout.addWidget(self.text, 1)
        layout.addWidget(self.run_line)
        layout.addWidget(self.detail)
        self.text.hovered.connect(self._hover)
        self.text.clicked.connect(self._click)
        self._run_id: str | None = None
        self._prompt_done = 0         # prompt tokens already in the document
        self._rendered = 0            # generated tokens already in the document
        self._unbroken = 0            # characters at the end of the document since the last space
        self._formats: dict[tuple, QTextCharFormat] = {}     # one per look, for this rendering
        self._pinned: int | None = None
        self._latency_range: tuple[float, float] | None = None
        self._update_legend()

    # --- public -------------------------------------------------------------------------------------------
    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            return
        self.mode = mode
        self.mode_box.setCurrentIndex(MODES.index(mode))
        self._update_legend()
        self._run_id = None           # re-render at the next refresh
        self.refresh()

    def set_theme(self, theme: th.Theme) -> None:
        self.theme = theme
        font = QFont("monospace")
        font.setStyleHint(QFont.StyleHint.Monospace)
        font.setPointSizeF(theme.base_pt + 1.5)
        self.text.setFont(font)
        # The workbench keeps room for a reply's first lines whatever else competes for the height (a 720p
        # projector); a lecture scene sizes the stream itself.
        lines = 2 if theme.lecture else WORKBENCH_LINES
        margins = 2 * (self.text.document().documentMargin() + self.text.frameWidth())
        self.text.setMinimumHeight(int(lines * QFontMetrics(font).lineSpacing() + margins))
        self._run_id = None
        self.refresh()

    def selected(self) -> RunRecord | None:
        return self.store.find(self.state.selected) if self.state.selected else None

    def refresh(self) -> None:
        run = self.selected()
        line = run_line(run)
        if self.run_line.text() != line:
            self.run_line.setText(line)
        self.run_line.setVisible(bool(line) and self._run_line_wanted)
        if run is None:
            if self._run_id is not None:
                self.text.reset()
                self._run_id = None
                self._forget_detail()
            return
        if run.remote and not run.n_steps and not run.finished:
            if self._run_id != ("waiting", run.run_id):
                self.text.reset()
                self.text.setPlainText(f"Sent to {run.model.engine}: waiting for its first token…")
                self._run_id, self._rendered = ("waiting", run.run_id), 0
            return
        if run.prefill is None and not run.finished and not run.remote:
            # Laying out a long prompt takes the GIL (Qt calls keep it) from the prefill that is running now;
            # the prompt appears when its forward pass is done, a few hundred ms later, with the first token.
            if self._run_id != ("waiting", run.run_id):
                self.text.reset()
                self.text.setPlainText(f"Prefill: reading {run.prompt_tokens - run.reused_tokens:,} prompt tokens "
                                       f"{prefill_passes(run)}…")
                self._run_id, self._rendered = ("waiting", run.run_id), 0
            return
        if self.mode == "latency" and self._latency_changed(run):
            self._run_id = None
        if run.run_id != self._run_id:
            if self._run_id is not None and self._run_id != ("waiting", run.run_id):
                self._forget_detail()              # the line described a token of a run no longer shown
            self._render_all(run)
        else:
            self._catch_up(run)

    @property
    def behind(self) -> bool:
        """Tokens of the shown run are still to be laid out (a batch per refresh: see ``TOKENS_PER_REFRESH``)."""
        run = self.selected()
        return run is not None and run.run_id == self._run_id and (
            self._prompt_done < len(run.started.prompt_pieces) or self._rendered < run.n_steps)

    def set_controls_visible(self, visible: bool) -> None:
        """A lecture scene shows the stream and its colour legend; the mode box and hover line stay behind."""
        self._run_line_wanted = visible                # a scene's caption carries the run's figures
        for widget in (*self._controls, self.detail):
            widget.setVisible(visible)
        self.run_line.setVisible(visible and bool(self.run_line.text()))
        vertical = QSizePolicy.Policy.Preferred if visible else QSizePolicy.Policy.Ignored
        self.setSizePolicy(QSizePolicy.Policy.Preferred, vertical)

    def set_legend_wrap(self, wrap: bool) -> None:
        """A wrapping legend makes the panel's height depend on its width, which a layout honours over its
        stretch: stacked over the timeline in a scene (a whole screen wide, where the legend fits one line), it
        does not wrap, so the timeline gets its share of the height."""
        self.legend.setWordWrap(wrap)

    def _forget_detail(self) -> None:
        self._pinned = None
        self.detail.setText(HINT)

    def rendered_tokens(self) -> int:
        """Prompt plus generated tokens now in the document (tests read this)."""
        run = self.selected()
        return (self._prompt_done + self._rendered) if run is not None and self._run_id == run.run_id else 0

    # --- rendering ----------------------------------------------------------------------------------------
    def _render_all(self, run: RunRecord) -> None:
        self.text.reset()
        self._formats = {}
        self._run_id, self._prompt_done, self._rendered, self._unbroken = run.run_id, 0, 0, 0
        if run.remote:                      # the server tokenizes: the prompt is shown as the text that was sent
            prompt = QTextCharFormat()
            prompt.setBackground(shade(th.PREFILL, 0.30 if self.theme.dark else 0.86))
            self.text.add(QTextCursor(self.text.document()), with_breaks(run.started.prompt) + "\n", prompt, -1)
        self._catch_up(run)

    def _catch_up(self, run: RunRecord) -> None:
        """Lay out the next ``TOKENS_PER_REFRESH`` tokens not yet in the document: prompt first, then generated.
        A 100k-token prompt, or a server streaming 20k tokens a second, fills in over a few refreshes while the
        window keeps answering, instead of holding it for seconds."""
        pieces = run.started.prompt_pieces
        budget = TOKENS_PER_REFRESH
        cursor = QTextCursor(self.text.document())
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.beginEditBlock()
        if self._prompt_done < len(pieces):
            end = min(len(pieces), self._prompt_done + budget)
            for i in range(self._prompt_done, end):
                shown, self._unbroken = breakable(visible(pieces[i]), self._unbroken)
                self.text.add(cursor, shown, self._format(run, i, None), i)
            budget -= end - self._prompt_done
            self._prompt_done = end
        if budget > 0 and self._prompt_done == len(pieces) and self._rendered < run.n_steps:
            end = min(run.n_steps, self._rendered + budget)
            for step in run.steps[self._rendered:end]:
                where = step.position if step.position is not None else step.step       # a server's run: by step
                shown, self._unbroken = breakable(visible(step.text), self._unbroken)
                self.text.add(cursor, shown, self._format(run, where, step), where)
            self._rendered = end
        cursor.endEditBlock()
        bar = self.text.verticalScrollBar()
        bar.setValue(bar.maximum())

    def _format(self, run: RunRecord, position: int, step) -> QTextCharFormat:
        """The token's format, shared with every token of the same look (see ``TokenText``)."""
        odd = position % 2 == 1
        light = 0.30 if self.theme.dark else 0.86
        alt = 0.22 if self.theme.dark else 0.76
        background: QColor | None = None
        if step is None:
            colour = th.REUSED if position < run.reused_tokens else th.PREFILL
            background = shade(colour, alt if odd else light)
        elif self.mode == "phase":
            background = shade(th.DECODE, alt if odd else light)
        elif self.mode == "probability":
            if step.prob is not None:                   # a server that sent no logprobs: no colour to give
                background = _ramp(step.prob, self.theme.dark)
        else:
            low, high = self._latency_range or (0.0, 1.0)
            value = (np.log(step.latency_ms) - low) / (high - low) if high > low else 0.5
            background = _ramp(float(value), self.theme.dark)
        special = step is not None and step.special or (step is None and _is_special(run, position))
        key = (background.rgba() if background is not None else None, special)
        fmt = self._formats.get(key)
        if fmt is None:
            fmt = self._formats[key] = QTextCharFormat()
            if background is not None:
                fmt.setBackground(background)
            if special:
                fmt.setFontItalic(True)
                fmt.setForeground(QColor(th.FORMULA))
        return fmt

    def _latency_changed(self, run: RunRecord) -> bool:
        lat = run.series["latency_ms"].values
        if len(lat) == 0:
            return False
        logs = np.log(np.maximum(lat, 1e-3))
        new = (float(logs.min()), float(logs.max()))
        old = self._latency_range
        if old is None or abs(new[0] - old[0]) > 0.1 or abs(new[1] - old[1]) > 0.1:
            self._latency_range = new
            return True
        return False

    def _update_legend(self) -> None:
        if self.mode == "phase":
            reused = shade(th.REUSED, 0.85).name()
            html = (f"<span style='background:{reused}'>&nbsp;earlier turns (cache)&nbsp;</span> "
                    f"<span style='background:{shade(th.PREFILL, 0.8).name()}'>&nbsp;prompt (prefill)&nbsp;</span> "
                    f"<span style='background:{shade(th.DECODE, 0.8).name()}'>&nbsp;generated (decode)&nbsp;</span>"
                    " &nbsp;shades alternate at token boundaries")
        elif self.mode == "probability":
            html = "generated tokens: pale = low probability, strong = high (after temperature/top-k/top-p)"
        else:
            html = "generated tokens: pale = fast step, strong = slow step (log scale, this run's range)"
        self.legend.setText(html)

    # --- hover and click ----------------------------------------------------------------------------------
    def _hover(self, position: int) -> None:
        if self._pinned is None and position >= 0:
            self._show(position)

    def _click(self, position: int) -> None:
        self._pinned = None if self._pinned == position else position
        self._show(position)

    def _show(self, position: int) -> None:
        run = self.selected()
        if run is None:
            return
        self.detail.setText(describe_token(run, position))
        step = run.step_at_position(position)
        self.step_selected.emit(run.run_id, step.step if step is not None else -1)


def describe_token(run: RunRecord, position: int) -> str:
    step = run.step_at_position(position)
    if run.remote:
        if step is None:
            return ""
        prob = (f"p = {step.prob:.3f} (as the server reports it)" if step.prob is not None else
                "no probability: the server sent no logprobs")
        top = ", ".join(f"\"{escaped(c.text)}\" {c.p_raw:.2f}" for c in step.candidates[:5])
        return (f"step {step.step} · \"{escaped(step.text)}\" · arrived {step.latency_ms:.1f} ms after the "
                f"{'request' if step.step == 0 else 'previous token'} (client) · {prob}" + (f" · top: {top}" if top
                                                                                           else ""))
    if step is None:
        if not 0 <= position < run.prompt_tokens:
            return ""
        token_id = run.started.prompt_ids[position]
        text = run.started.prompt_pieces[position]
        if position < run.reused_tokens:
            return (f"position {position} · id {token_id} · \"{escaped(text)}\" · from an earlier turn: its keys and "
                    "values were still in the cache, so this turn did not compute them again")
        return (f"position {position} · id {token_id} · \"{escaped(text)}\" · prompt token, read in the prefill "
                f"pass ({run.prefill.forward_ms:.1f} ms for all {run.prompt_tokens})" if run.prefill else
                f"position {position} · id {token_id} · \"{escaped(text)}\" · prompt token")
    top = ", ".join(f"\"{escaped(c.text)}\" {c.p_raw:.2f}" for c in step.candidates[:5])
    return (f"position {position} · id {step.token_id} · \"{escaped(step.text)}\" · step {step.step} "
            f"({step.phase}) · latency {step.latency_ms:.2f} ms · p = {step.prob:.3f} after filters "
            f"(raw {step.raw_prob:.3f}) · top raw: {top}")


def _is_special(run: RunRecord, position: int) -> bool:
    piece = run.started.prompt_pieces[position] if position < len(run.started.prompt_pieces) else ""
    return piece.startswith("<") and piece.endswith(">") and len(piece) > 2


def _ramp(value: float, dark: bool) -> QColor:
    """0..1 to a sequential colour (cividis), pale for low values, mixed with the background enough that
    text stays readable on it."""
    v = min(max(value, 0.0), 1.0)
    colour = pg.colormap.get("cividis").map(1.0 - v, mode="qcolor")
    back = QColor("#000000" if dark else "#FFFFFF")
    keep = 0.25 + 0.45 * v
    return QColor.fromRgbF(*(keep * a + (1 - keep) * b for a, b in zip(colour.getRgbF()[:3], back.getRgbF()[:3])))
