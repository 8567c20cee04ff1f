"""Decode against depth: the median decode step at each depth the cache was filled to, the part of it spent in
the attention modules, and the rest of the step (the weights' reads), so the lecture sees decode slow as the
cache grows and where the time goes; the KV heatmap beside it fills as the depths grow."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import LessonView, Scene, WindowLesson
from engine.facts import kvformula
from engine.lessons import depth
from engine.lessons.depth import DepthPoint, DepthResult


class DepthView(LessonView):
    lesson = depth.LESSON
    axes = ("positions in the cache", "tokens", "decode step", "ms")
    point = DepthPoint

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(DepthPoint)
        if not points:
            return
        x = np.array([p.depth for p in points], dtype=float)
        width = self.theme.line_width * 1.5
        step = np.array([p.decode_ms for p in points])
        self.chart.add(pg.PlotDataItem(x, step, pen=pg.mkPen(th.DECODE, width=width), symbol="o",
                                       symbolBrush=th.DECODE), "decode step (measured)")
        attention = np.array([p.attention_ms for p in points if p.attention_ms is not None])
        if len(attention) == len(x):
            self.chart.add(pg.PlotDataItem(x, attention, pen=pg.mkPen(th.CHOSEN, width=width), symbol="s",
                                           symbolBrush=th.CHOSEN), "in attention (measured)")
            self.chart.add(pg.PlotDataItem(x, np.maximum(step - attention, 0.0),
                                           pen=pg.mkPen(th.FORMULA, width=width, style=Qt.PenStyle.DashLine)),
                           "the rest (measured)")
        self.plot.setYRange(0, float(step.max()) * 1.1, padding=0)

    def explanation(self, record: ExperimentRecord) -> str:
        r: DepthResult = record.result
        if r.slowdown is None:
            return ""
        first, last = r.figures[0], r.figures[-1]
        where = ""
        if first.attention_ms is not None and last.attention_ms is not None:
            where = (f" Attention took {first.attention_ms:,.1f} → <b>{last.attention_ms:,.1f} ms</b> of it "
                     f"({r.attention_share_first:.0%} → {r.attention_share_last:.0%}); the rest of the step "
                     f"{first.decode_ms - first.attention_ms:,.1f} → {last.decode_ms - last.attention_ms:,.1f} ms "
                     "(measured).")
        return (f"A decode step at {last.depth:,} positions takes <b>{last.decode_ms:,.1f} ms</b>, "
                f"{r.slowdown:.2f}x the {first.decode_ms:,.1f} ms at {first.depth:,} (measured).{where} Each step "
                "reads every cached key and value once, so attention's share grows with the cache while the weights' "
                f"reads stay the same; the cache held {kvformula.format_bytes(last.kv_bytes)} at the deepest "
                f"(measured, = the formula's {kvformula.format_bytes(last.kv_formula_bytes)}), "
                f"{kvformula.format_bytes(r.full_context_bytes)} at the whole context (computed).")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or not r.figures:
        return "press R to fill the cache to the model's whole context in steps, timing decode at each depth"
    last = r.figures[-1]
    # Two counts of one cache: the depth its steps were timed at, and the positions after those steps: the
    # difference is named, not left for a reader to find beside the legend's depth.
    added = (f", {last.positions - last.depth:,} of them added by the steps timed at {last.depth:,}"
             if last.positions != last.depth else "")
    held = (f"the cache holds {kvformula.format_bytes(last.kv_bytes)} at {last.positions:,} positions{added} "
            f"(measured; {kvformula.format_bytes(r.full_context_bytes)} at the whole context, computed)")
    if r.slowdown is None:
        return f"{held}; decode {last.decode_ms:,.1f} ms a step there (measured)"
    first = r.figures[0]
    share = (f", attention {r.attention_share_first:.0%} → {r.attention_share_last:.0%} of it"
             if r.attention_share_first is not None and r.attention_share_last is not None else "")
    return (f"{held}; decode {first.decode_ms:,.1f} → {last.decode_ms:,.1f} ms a step from {first.depth:,} to "
            f"{last.depth:,} positions ({r.slowdown:.2f}x{share}, measured)")


WINDOW = WindowLesson(
    lesson=depth.LESSON, view=DepthView, caption=caption,
    scene=Scene("memory", "Memory grows with context", order=8, action="depth sweep", side_by_side=True),
    beside=("kv",),                 # the heatmap fills beside the curves, over the whole context
    shows_runs=True)                # its runs are the ones the run panels show while it runs
