"""Weight formats: per format, decode tok/s measured (filled) beside the bandwidth ceiling for the bytes it
reads (outline, computed), with prefill, TTFT, divergence from float32 and perplexity in words."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import LessonView, WindowLesson
from engine.lessons import formats
from engine.lessons.formats import FormatPoint, FormatsSettings


class FormatsView(LessonView):
    lesson = formats.LESSON
    axes = ("weights", None, "decode throughput", "tok/s")
    point = FormatPoint

    def cell(self, record: ExperimentRecord, point: FormatPoint, name: str) -> str | None:
        return name_of(record.settings, point.index) if name == "index" else None

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(FormatPoint)
        if not points:
            return
        x = np.arange(len(points))
        ceilings = [(i, p.decode_ceiling_tok_s) for i, p in enumerate(points) if p.decode_ceiling_tok_s is not None]
        if ceilings:                                # none from a busy machine's measurement
            self.chart.add(pg.BarGraphItem(x=[i for i, _ in ceilings], height=[c for _, c in ceilings], width=0.7,
                                           brush=None, pen=pg.mkPen(th.FORMULA, width=2,
                                                                    style=Qt.PenStyle.DashLine)),
                           "bandwidth ceiling (computed)")
        self.chart.add(pg.BarGraphItem(x=x, height=[p.decode_tok_s for p in points], width=0.45, brush=th.DECODE,
                                       pen=None), "decode (measured)")
        self.plot.getAxis("bottom").setTicks([[(i, name_of(record.settings, p.index)) for i, p in
                                               enumerate(points)]])

    def explanation(self, record: ExperimentRecord) -> str:
        points = record.typed(FormatPoint)
        lines = [format_line(name_of(record.settings, p.index), p.values()) for p in points]
        if record.result.measured:
            lines.append("Decode reads every weight once per token: fewer bytes, faster decode; prefill is arithmetic "
                         "and gains far less. The smaller formats pay in perplexity (measured on a held paragraph).")
        lines += [escape(f"Skipped {s}") for s in record.result.skipped]
        return "<br>".join(lines)


def name_of(settings: FormatsSettings, index: float | None) -> str:
    i = int(index) if index is not None else -1
    return settings.formats[i] if 0 <= i < len(settings.formats) else "?"


def format_line(name: str, v: dict) -> str:
    diverges = "" if v["diverges_at"] < 0 else f", greedy tokens leave float32's at step {int(v['diverges_at'])}"
    ceiling = (f" of a {v['decode_ceiling_tok_s']:,.0f} tok/s ceiling" if "decode_ceiling_tok_s" in v else
               " (no ceiling: the machine was busy when its bandwidth was measured)")
    kernels = formats.kernel_words(v)
    return (f"<b>{escape(name)}</b>: {v['bytes_per_token'] / 2**20:,.0f} MiB read per token, "
            f"<b>{v['decode_tok_s']:,.1f} tok/s</b>{ceiling}, prefill "
            f"{v['prefill_tok_s']:,.0f} tok/s, perplexity {v['perplexity']:,.2f}{diverges}"
            + (f"; {escape(kernels)}" if kernels else ""))


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or len(r.measured) < 2:
        return "press R to decode with each weight format: fewer bytes per token, faster decode"
    first, last = r.measured[0], r.measured[-1]
    return (f"{first.name} → {last.name}: {first.bytes_per_token / 2**20:,.0f} → {last.bytes_per_token / 2**20:,.0f} "
            f"MiB read per token, decode {first.decode_tok_s:,.1f} → {last.decode_tok_s:,.1f} tok/s (measured)")


WINDOW = WindowLesson(lesson=formats.LESSON, view=FormatsView, caption=caption)
