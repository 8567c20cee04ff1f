"""Why new models hold less KV: one bar per published design, the KV bytes per token measured from a layer
built with its attention dimensions (log scale: the designs span two orders of magnitude), and beside it the
whole model at 4k, 32k and 128k positions, computed from those measured figures."""

from __future__ import annotations

import math
from html import escape

import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart, fit_ticks
from app.views.lesson_view import LessonView, Scene, WindowLesson
from engine.facts import kvformula
from engine.lessons import architectures
from engine.lessons.architectures import AT_CONTEXTS, BY_NAME, CONTEXTS, ArchitecturesResult, DesignPoint

SHADES = (th.PREFILL, th.DECODE, th.CACHE_OFF)          # 4k, 32k, 128k


def binary(power: int) -> str:
    """``2 ** power`` bytes in the largest binary unit that keeps it whole: ``16 KiB``, ``1 MiB``."""
    unit = min(power // 10, 4)
    return f"{2 ** (power - 10 * unit):,} {('B', 'KiB', 'MiB', 'GiB', 'TiB')[unit]}"


def log_ticks(low: float, high: float, most: int = 6) -> list[tuple[float, str]]:
    """Ticks on a log2 axis of bytes between ``low`` and ``high``: every factor of 4, or of 16 when that would
    crowd the axis past ``most`` labels."""
    first, last = math.floor(math.log2(max(low, 1)) / 2) * 2, math.ceil(math.log2(max(high, 2)) / 2) * 2
    step = 2 if (last - first) // 2 + 1 <= most else 4
    return [(float(p), binary(p)) for p in range(first, last + 1, step)]


class ArchitecturesView(LessonView):
    lesson = architectures.LESSON
    scene_charts = ("chart", "contexts_chart")
    axes = ("KV per token (log scale, measured)", None, "", None)
    point = DesignPoint

    def build(self) -> None:
        self.contexts_chart = Chart("The whole model at 4k, 32k and 128k positions (computed)")
        self.contexts_chart.plot.setYLink(self.plot)
        self.charts_layout.setDirection(self.charts_layout.Direction.LeftToRight)
        self.charts_layout.addWidget(self.contexts_chart, 3)

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.contexts_chart.style(theme, "whole model (log scale, computed)", None, "", None)
        self.contexts_chart.plot.hideAxis("left")

    def cell(self, record: ExperimentRecord, point: DesignPoint, name: str) -> str | None:
        return self._names(record)[point.index] if name == "index" else None

    def _names(self, record: ExperimentRecord) -> list[str]:
        return list(record.settings.designs)

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(DesignPoint)
        if not points:
            return
        names = self._names(record)
        rows = [p.index for p in points]
        measured = [math.log2(max(p.measured, 1)) for p in points]
        self.chart.add(pg.BarGraphItem(x0=[0] * len(points), width=measured, y=rows, height=0.6,
                                       brush=th.DECODE, pen=None), "KV per token, every layer (measured)")
        for value, row, p in zip(measured, rows, points):          # at the bar's end, inside the plot
            self.chart.label_point(kvformula.format_bytes(p.measured), value, row, marker=4.0)
        self.plot.getAxis("left").setTicks([[(row, names[row]) for row in rows], []])
        fit_ticks(self.plot.getAxis("bottom"), log_ticks(min(2 ** v for v in measured), max(2 ** v for v in measured),
                                                         most=4))
        self.plot.invertY(True)
        self.plot.setXRange(min(measured) - 2, max(measured) + 3, padding=0)
        sizes = [[getattr(p, name) for p in points] for name in AT_CONTEXTS]
        for i, (context, values, colour) in enumerate(zip(CONTEXTS, sizes, SHADES)):
            logs = [math.log2(max(v, 1)) for v in values]
            self.contexts_chart.add(pg.BarGraphItem(x0=[0] * len(points), width=logs,
                                                    y=[r - 0.27 + 0.27 * i for r in rows], height=0.25,
                                                    brush=colour, pen=None), f"{context // 1024}k positions")
        every = [v for values in sizes for v in values if v]
        if every:
            fit_ticks(self.contexts_chart.plot.getAxis("bottom"), log_ticks(min(every), max(every), most=5))
            self.contexts_chart.plot.setXRange(math.log2(min(every)) - 1, math.log2(max(every)) + 1.5, padding=0)
        self.contexts_chart.plot.invertY(True)

    def explanation(self, record: ExperimentRecord) -> str:
        r: ArchitecturesResult = record.result
        if not r.designs:
            return ""
        fmt = kvformula.format_bytes
        lines = []
        for d in r.designs:
            check = "= the formula" if d.kv_bytes_per_token_measured == d.kv_bytes_per_token_formula else \
                f"≠ the formula's {fmt(d.kv_bytes_per_token_formula)}"
            state = f" + a fixed {fmt(d.state_bytes)} of state" if d.state_bytes else ""
            lines.append(f"<b>{escape(d.name)}</b> ({escape(d.design)}): {fmt(d.kv_bytes_per_token_measured)} per "
                         f"token {check}{state}")
        return (f"Each bar is one layer of each kind the {len(r.designs)} models have, built with its published "
                "attention dimensions and zero weights, its cache read after a prompt (measured); the whole model "
                "follows from the published layer counts (computed). Fewer KV heads (GQA, MQA), windows that stop "
                "growing, a compressed latent instead of K and V (MLA) and layers with a fixed state instead of a "
                "cache (linear attention) each cut what a token costs.<br>" + "<br>".join(lines) +
                "<br><i>Dimensions: each model's config.json on the Hugging Face hub (" +
                "; ".join(escape(BY_NAME[d.name].source) for d in r.designs if d.name in BY_NAME) + ").</i>")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live numbers (plain text)."""
    r = record.result if record is not None else None
    if r is None or len(r.designs) < 2:
        return "press R to build one layer of each published design and read what its cache holds"
    fmt = kvformula.format_bytes
    first = r.designs[0]
    smallest = min(r.designs[1:], key=lambda d: d.kv_bytes_per_token_measured or math.inf)
    ratio = first.kv_bytes_per_token_measured / max(smallest.kv_bytes_per_token_measured, 1)
    return (f"per token, {first.name} holds {fmt(first.kv_bytes_per_token_measured)}, {smallest.name} "
            f"{fmt(smallest.kv_bytes_per_token_measured)}: {ratio:,.1f}x less (measured); at 128k positions "
            f"{fmt(first.at_contexts[-1])} vs {fmt(smallest.at_contexts[-1])} (computed)")


WINDOW = WindowLesson(
    lesson=architectures.LESSON, view=ArchitecturesView, caption=caption,
    scene=Scene("architectures", "Why new models hold less KV", order=12, action="build and measure each design"))
