"""Weight formats: per format, decode tok/s measured (filled) beside the bandwidth ceiling for the bytes it
reads (outline, computed), with prefill, TTFT, divergence from float32 and perplexity in words."""

from __future__ import annotations

from html import escape

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt

from app import theme as th
from app.lesson_view import LessonView, WindowLesson
from app.store import ExperimentRecord
from engine.lessons import formats
from engine.lessons.formats import FormatsSettings


class FormatsView(LessonView):
    lesson = formats.LESSON
    axes = ("weights", None, "decode throughput", "tok/s")
    columns = [("index", "weights", "{}"), ("bytes_per_token", "MiB/token", "{:,.1f}"),
               ("decode_tok_s", "decode tok/s", "{:,.1f}"), ("decode_ceiling_tok_s", "ceiling (computed)", "{:,.0f}"),
               ("prefill_tok_s", "prefill tok/s", "{:,.0f}"), ("ttft_ms", "TTFT ms", "{:,.0f}"),
               ("diverges_at", "tokens leave fp32 at", "{}"), ("perplexity", "perplexity", "{:,.2f}")]
    table_series = ("format",)

    def cell(self, record: ExperimentRecord, point, key: str) -> object:
        value = point.values.get(key)
        if key == "index":
            return name_of(record.settings, value)
        if key == "bytes_per_token" and value is not None:
            return value / 2**20
        if key == "diverges_at" and value is not None:
            return "never" if value < 0 else f"step {int(value)}"
        return value

    def draw(self, record: ExperimentRecord) -> None:
        points = [p.values for p in record.points if p.series == "format"]
        if not points:
            return
        x = np.arange(len(points))
        ceilings = [(i, v["decode_ceiling_tok_s"]) for i, v in enumerate(points) if "decode_ceiling_tok_s" in v]
        if ceilings:                                # none from a busy machine's measurement
            self.chart.add(pg.BarGraphItem(x=[i for i, _ in ceilings], height=[c for _, c in ceilings], width=0.7,
                                           brush=None, pen=pg.mkPen(th.FORMULA, width=2,
                                                                    style=Qt.PenStyle.DashLine)),
                           "bandwidth ceiling (computed)")
        self.chart.add(pg.BarGraphItem(x=x, height=[v["decode_tok_s"] for v in points], width=0.45, brush=th.DECODE,
                                       pen=None), "decode (measured)")
        self.plot.getAxis("bottom").setTicks([[(i, name_of(record.settings, v["index"])) for i, v in
                                               enumerate(points)]])

    def explanation(self, record: ExperimentRecord) -> str:
        points = [p.values for p in record.points if p.series == "format"]
        lines = [format_line(name_of(record.settings, v["index"]), v) for v in points]
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
