"""Prefill time against prompt length, on log-log axes: the measured times, TTFT, the cost model's roofline
prediction, and the fitted exponent in words."""

from __future__ import annotations

import math
from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import LessonView, Scene, WindowLesson
from engine.facts import costmodel
from engine.lessons import prefill
from engine.lessons.prefill import PrefillPoint, PrefillResult


class PrefillView(LessonView):
    lesson = prefill.LESSON
    axes = ("prompt length", "tokens", "time", "ms")
    point = PrefillPoint

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.plot.setLogMode(x=True, y=True)

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(PrefillPoint)
        if not points:
            return
        n = np.array([p.tokens for p in points], dtype=float)
        width = self.theme.line_width * 1.5
        times = np.array([p.prefill_ms for p in points])
        self.chart.add(pg.PlotDataItem(n, times, pen=pg.mkPen(th.PREFILL, width=width), symbol="o",
                                       symbolBrush=th.PREFILL), "prefill time (measured)")
        self.chart.add(pg.PlotDataItem(n, [p.ttft_ms for p in points], pen=pg.mkPen(th.CHOSEN, width=width)),
                       "TTFT (measured)")
        predicted = np.array([p.predicted_ms for p in points if p.predicted_ms is not None])
        if len(predicted) == len(n):
            self.chart.add(pg.PlotDataItem(n, predicted, pen=pg.mkPen(th.FORMULA, width=width,
                                                                       style=Qt.PenStyle.DashLine)),
                           "cost model, roofline (computed)")
        values = np.concatenate([times, predicted]) if len(predicted) == len(n) else times
        self.plot.getAxis("bottom").setTicks([log_ticks(n, base=2)])
        ticks, unit = time_ticks(values[values > 0])
        self.plot.getAxis("left").setTicks([ticks])
        th.label_axis(self.plot.getAxis("left"), self.axes[2], unit, self.theme)   # the ticks' own unit

    def explanation(self, record: ExperimentRecord) -> str:
        r: PrefillResult = record.result
        if r.exponent is None:
            return ""
        noisy = (f" The repeats of one length spread up to {r.largest_spread:.2f}x: the exponents are rough."
                 if r.noisy else "")
        return (f"<b>time ~ n<sup>{r.exponent:.2f}</sup></b> (measured fit); short prompts "
                f"n<sup>{r.exponent_short:.2f}</sup>, long prompts n<sup>{r.exponent_long:.2f}</sup> (a doubling "
                f"{2 ** r.exponent_long:.1f}x by the fit). The last doubling alone, {r.doubled_from:,} → "
                f"{r.doubled_to:,}: <b>{r.last_doubling_x:.1f}x</b> measured, "
                f"{r.flops_doubling_x:.1f}x FLOPs (computed). Short prompts are dominated by reading the weights and "
                "fixed per-pass costs, so time grows slower than n; as prompts grow, the 2&nbsp;×&nbsp;parameters "
                "FLOPs per token (linear) and then attention's n² term take over and the exponent rises toward 1 "
                f"and beyond.{escape(noisy)}{widened_words(r)}")


def widened_words(r: PrefillResult) -> str:
    """Why the curves step down part way, where the sweep crossed the rows from which products are widened."""
    if not r.widened_from:
        return ""
    return (f" From {r.widened_from:,} tokens this CPU runs the products in float32 over the weights widened for "
            "the pass, faster than the half float it emulates below that: the time and the roofline both step down "
            "there.")


def log_ticks(values: np.ndarray, base: int) -> list[tuple[float, str]]:
    """Ticks for a log axis at powers of ``base`` (2: token counts; 10: times) within the data, at most six, so
    labels never pile up ("4·10¹5·10¹6·10¹")."""
    if not len(values):
        return []
    low, high = math.floor(math.log(float(values.min()), base)), math.ceil(math.log(float(values.max()), base))
    powers = list(range(low, high + 1))
    stride = max(1, math.ceil(len(powers) / 6))
    return [(math.log10(base**p), f"{base**p:,}" if base**p >= 1 else f"{base**p:g}") for p in powers[::stride]]


def time_ticks(ms: np.ndarray) -> tuple[list[tuple[float, str]], str]:
    """Powers of ten of a time in ms, and the unit they are labelled in: seconds once the largest passes 10 s
    (never "150000"), so every tick and the axis's unit agree."""
    ticks = log_ticks(ms, base=10)
    if not ticks or float(ticks[-1][1].replace(",", "")) < 10_000:
        return ticks, "ms"
    return [(position, f"{float(label.replace(',', '')) / 1000:g}") for position, label in ticks], "s"


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or r.exponent is None:
        return "press R to time prefill for prompts of growing length"
    # The fit and the last doubling are two measures of one growth: the fit's own doubling (2^exponent) is said
    # beside it, so "n^1.04" and "2.5x" are not left to disagree on screen.
    return (f"prefill time ~ n^{r.exponent_long:.2f} for long prompts (fitted: {2 ** r.exponent_long:.1f}x a "
            f"doubling); the last doubling alone, {r.doubled_from:,} → {r.doubled_to:,} tokens, took "
            f"{r.last_doubling_x:.1f}x as long (FLOPs {r.flops_doubling_x:.1f}x, computed); the course's "
            f"{costmodel.course_doubling():.1f}x counts attention's n² alone, which a whole model's prompt of this "
            "length barely reaches: its weights' 2 FLOPs per parameter per token grow only linearly")


WINDOW = WindowLesson(
    lesson=prefill.LESSON, view=PrefillView, caption=caption,
    scene=Scene("prompt", "Prompt length", order=4, action="prefill sweep"))
