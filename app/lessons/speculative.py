"""Speculative decoding: per verification pass of the last speculative repeat, the guesses kept (green), the
model's own token (blue) and the guesses rejected (grey), stacked; below, the text with the same marks."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QFrame, QLabel, QScrollArea

from app.state.store import ExperimentRecord
from app.views.lesson_view import CONTROLS_PROMPT, LessonView, Scene, WindowLesson, token_note
from engine.facts import contention
from engine.lessons import speculative
from engine.lessons.speculative import PROMPT_LOOKUP, SELF, DecodePoint, DraftPass, SpeculativeResult
from engine.store.resources import SPECULATIVE_PROMPTS

KEPT, REJECTED, OWN, PREFILL_TEXT = "#009E73", "#BBBBBB", "#0072B2", "#666666"


class SpeculativeView(LessonView):
    lesson = speculative.LESSON
    axes = ("verification pass", None, "tokens", None)
    point = DecodePoint
    presets = {
        "prompt": [(f"a prompt whose answer {name}" if name == "repeats itself" else f"a {name} prompt", text)
                   for name, text in SPECULATIVE_PROMPTS.items()] + [("the prompt in Controls", CONTROLS_PROMPT)],
        "drafter": [("prompt lookup (n-grams of the text so far)", PROMPT_LOOKUP),
                    ("this model, with the draft weights below", SELF)]}

    def build(self) -> None:
        self.passes_text = QLabel()
        self.passes_text.setWordWrap(True)
        self.passes_text.setTextFormat(Qt.TextFormat.RichText)
        self.passes_text.setAlignment(Qt.AlignmentFlag.AlignTop | Qt.AlignmentFlag.AlignLeft)
        scroll = QScrollArea()                           # scrolls, so a long answer never squeezes the chart
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(self.passes_text)
        self.passes_scroll = scroll
        self.charts_layout.addWidget(scroll, 1)

    def set_compact(self, compact: bool) -> None:
        """In a scene the chart takes the height: the passes' text keeps three lines (it scrolls)."""
        super().set_compact(compact)
        lines = self.passes_text.fontMetrics().lineSpacing() * 3 + 8
        self.passes_scroll.setMaximumHeight(lines if compact else 16_777_215)

    def draw(self, record: ExperimentRecord) -> None:
        every = record.of(DraftPass)
        last = max((q.repeat for q in every), default=0)
        passes = [p for p in every if p.repeat == last]
        if not passes:
            self.passes_text.setText("")
            return
        x = np.array([p.index for p in passes], dtype=float)
        kept = np.array([p.accepted for p in passes], dtype=float)
        rejected = np.array([len(p.drafted) - p.accepted for p in passes], dtype=float)
        self.chart.add(pg.BarGraphItem(x=x, height=kept, width=0.7, brush=KEPT, pen=None), "guesses kept")
        self.chart.add(pg.BarGraphItem(x=x, y0=kept, height=np.ones(len(x)), width=0.7, brush=OWN, pen=None),
                       "the model's own token")
        self.chart.add(pg.BarGraphItem(x=x, y0=kept + 1, height=rejected, width=0.7, brush=REJECTED, pen=None),
                       "guesses rejected")
        r = record.result
        first = (f'<span style="color:{PREFILL_TEXT}">{escape(r.first_text)}</span>|'
                 if r is not None and r.first_text else "")
        self.passes_text.setText(first + marked_text(passes))

    def explanation(self, record: ExperimentRecord) -> str:
        r: SpeculativeResult = record.result
        if r.speedup is None:
            return ""
        same = ("the same tokens as plain greedy decode ✓" if r.tokens_match else
                f"tokens DIFFER from plain decode from token {r.first_difference} ✗{token_note(r)}")
        busy = (f" Measured on a busy machine (down to {r.lowest_cpu_share:.0%} CPU)."
                if contention.busy(r.lowest_cpu_share) else "")
        return (f"{escape(r.drafter)} guessed {r.drafted} tokens, the model kept <b>{r.accepted} ({r.acceptance:.0%})"
                f"</b>: <b>{r.tokens_per_pass:.1f} tokens per forward pass</b> instead of 1, decode "
                f"<b>{r.speedup:.2f}x</b> as fast ({r.plain_decode_ms:,.0f} → {r.speculative_decode_ms:,.0f} ms, "
                f"medians, measured; drafting took {r.draft_share:.0%}). {same}. A pass over several tokens costs "
                "little more than over one because decode is bound by reading the weights; a rejected guess costs "
                f"its share of that pass.{busy}")


def marked_text(passes: list) -> str:
    """The generated text, pass by pass: kept guesses underlined green, rejected ones struck out grey, the
    model's own token bold blue (the first token, from the prefill, comes before the first pass)."""
    parts = []
    for p in passes:
        for i, text in enumerate(p.drafted_text):
            if i < p.accepted:
                parts.append(f'<u style="color:{KEPT}">{escape(text).replace(chr(10), "↵<br>")}</u>')
            else:                                        # a rejected line break is not a line break
                parts.append(f'<s style="color:{REJECTED}">{escape(text).replace(chr(10), "↵")}</s>')
        parts.append(f'<b style="color:{OWN}">{escape(p.text).replace(chr(10), "↵<br>")}</b>')
        parts.append('<span style="color:#888888">|</span>')
    return "".join(parts)


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or r.speedup is None:
        return "press R: a drafter guesses the next tokens, the model checks them all in one pass"
    same = "same tokens as plain decode ✓" if r.tokens_match else \
        f"tokens leave plain decode's at token {r.first_difference}" + (" (16-bit rounding)" if r.tokens_note else " ✗")
    return (f"{r.drafter}: {r.accepted} of {r.drafted} guesses kept, {r.tokens_per_pass:.1f} tokens per pass, decode "
            f"{r.speedup:.1f}x as fast (measured); {same}")


WINDOW = WindowLesson(
    lesson=speculative.LESSON, view=SpeculativeView, caption=caption,
    scene=Scene("speculative", "Speculative decoding", order=10, action="plain vs speculative"))
