"""The KV compression lab: the trade in one chart (bytes held against the KL divergence from the full cache,
one point per cache), the KL of each step as the context grows, which positions each cache keeps in full,
quantized or not at all, and one layer's key channels before and after a Hadamard rotation."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg
from PySide6.QtCore import Qt
from PySide6.QtWidgets import QHBoxLayout

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import CONTROLS_PROMPT, LessonView, Scene, WindowLesson
from engine.facts import kvformula
from engine.lessons import kv_compression
from engine.lessons.kv_compression import (
    ChannelPoint,
    CompressionResult,
    MethodFigures,
    MethodPoint,
    StepPoint,
    departure_text,
)

KL_FLOOR = 1e-6               # a log axis has no zero: a KL below this is drawn at it


KEPT_COLOURS = ("#EBEBEB", "#78C8AA", th.DECODE)          # dropped, held quantized, held in full
KEPT_WORDS = ("dropped", "held quantized", "held in full")
PALETTE = ("#009E73", "#56B4E9", "#E69F00", "#0072B2", "#CC79A7", "#D55E00", "#F0E442", "#000000")


def colour(name: str, names: tuple[str, ...]) -> str:
    """Each cache its own colour (Okabe-Ito, told apart by colour-blind eyes), the same in every chart; evicted
    caches are also dashed."""
    others = [n for n in names if n != "full"]
    return th.FORMULA if name == "full" else PALETTE[others.index(name) % len(PALETTE)]


def short(name: str) -> str:
    return name.replace("sinks:", "sinks ").replace("h2o:", "H2O ")


class CompressionView(LessonView):
    lesson = kv_compression.LESSON
    scene_charts = ("chart", "steps_chart")
    axes = ("KV cache held", "MiB", "KL per token", "nats")
    point = MethodPoint
    presets = {"prompt": [("the sample long document", None), ("the prompt in Controls", CONTROLS_PROMPT)]}

    def build(self) -> None:
        self.steps_chart = Chart("KL per step as the context grows (measured)")
        self.kept_chart = Chart("Which positions each cache holds, in most of its layers: in full, quantized, dropped",
                                legend_beside=True)
        self.channel_chart = Chart("Key channels of one layer: largest |value| (computed)", legend_beside=True)
        top, bottom = QHBoxLayout(), QHBoxLayout()
        self.charts_layout.removeWidget(self.chart)
        top.addWidget(self.chart, 3)
        top.addWidget(self.steps_chart, 2)
        bottom.addWidget(self.kept_chart, 3)
        bottom.addWidget(self.channel_chart, 2)
        self.charts_layout.addLayout(top, 5)
        self.charts_layout.addLayout(bottom, 3)
        self.rows += [top, bottom]
        self.kept_image = pg.ImageItem(axisOrder="row-major")
        self.kept_image.setLookupTable(np.array([pg.mkColor(c).getRgb()[:3] for c in KEPT_COLOURS], dtype=np.uint8))
        self.kept_image.setLevels([0, 2])

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.plot.setLogMode(x=False, y=True)
        self.steps_chart.style(theme, "step", None, "KL", "nats")
        self.steps_chart.plot.setLogMode(x=False, y=True)
        self.kept_chart.style(theme, "position", "tokens", "", None)
        self.channel_chart.style(theme, "channel of the head", None, "largest |key|", None)

    def cell(self, record: ExperimentRecord, point: MethodPoint, name: str) -> str | None:
        names = record.settings.methods
        if name == "index" and point.index < len(names):
            return names[point.index]
        if name == "departure" and point.departure is None:
            return "none"
        return None

    def draw(self, record: ExperimentRecord) -> None:
        names = record.settings.methods
        methods = record.typed(MethodPoint)
        reference = next((m for m in methods if names[m.index] == "full"), None)
        others = [m for m in methods if names[m.index] != "full"]
        if reference is not None:                 # KL 0 has no place on a log axis: a line at its bytes
            kls = [max(m.kl_mean, KL_FLOOR) for m in others] or [KL_FLOOR * 10]
            x = reference.bytes / 2**20
            self.chart.add(pg.PlotDataItem([x, x], [min(kls) / 10, max(kls) * 10], pen=pg.mkPen(
                th.FORMULA, width=self.theme.line_width, style=Qt.PenStyle.DashLine)))
            self.chart.label_point(f"full precision: {kvformula.format_bytes(reference.bytes)} (KL 0)", x,
                                   float(np.log10(max(kls) * 10)), marker=0)
        for m in others:                          # PlotDataItems: they follow the log axis (a scatter does not)
            name = names[m.index]
            self.chart.add(pg.PlotDataItem([m.bytes / 2**20], [max(m.kl_mean, KL_FLOOR)], pen=None,
                                           symbol="o", symbolSize=14, symbolBrush=colour(name, names),
                                           symbolPen=None))
        for m in others:                          # labels sit in view coordinates: log10 on a log axis
            self.chart.label_point(short(names[m.index]), m.bytes / 2**20, float(np.log10(max(m.kl_mean, KL_FLOOR))))
        self._draw_steps(record, names)
        self._draw_channels(record)
        result = record.result if isinstance(record.result, CompressionResult) else None
        if result is not None:
            self._draw_kept(result)

    def _draw_steps(self, record: ExperimentRecord, names: tuple[str, ...]) -> None:
        steps = record.typed(StepPoint)
        for index in sorted({p.method for p in steps}):
            name = names[index]
            if name == "full":
                continue
            mine = [p for p in steps if p.method == index]
            dashed = name.startswith(("sinks", "h2o"))
            self.steps_chart.add(pg.PlotDataItem([p.step + 1 for p in mine],
                                                 [max(p.kl, KL_FLOOR) for p in mine],
                                                 pen=th.run_pen(colour(name, names), self.theme.line_width, dashed)),
                                 short(name))

    def _draw_channels(self, record: ExperimentRecord) -> None:
        channels = record.typed(ChannelPoint)
        if not channels:
            return
        x = [p.channel for p in channels]
        self.channel_chart.add(pg.BarGraphItem(x=x, height=[p.absmax for p in channels], width=0.8,
                                               brush=th.FORMULA, pen=None), "as written")
        rotated = [p.absmax_rotated for p in channels]
        if all(v is not None for v in rotated):
            self.channel_chart.add(pg.PlotDataItem(x, rotated, pen=None, symbol="o", symbolSize=6,
                                                   symbolBrush=th.CHOSEN, symbolPen=None), "after the rotation")

    def _draw_kept(self, result: CompressionResult) -> None:
        shown = [m for m in result.methods if m.name != "full" and m.full_share]
        if not shown:
            return
        width = max(len(m.full_share) for m in shown)
        rows: dict[bytes, tuple[np.ndarray, list[str]]] = {}      # caches that hold the same positions: one row
        for m in shown:
            full, quantized = np.array(m.full_share), np.array(m.quantized_share or [0.0] * len(m.full_share))
            row = np.zeros(width, dtype=np.float32)
            row[: len(full)] = np.where(full >= 0.5, 2, np.where(quantized >= 0.5, 1, 0))
            rows.setdefault(row.tobytes(), (row, []))[1].append(short(m.name))
        grid = np.stack([row for row, _names in rows.values()])
        labels = [", ".join(names) for _row, names in rows.values()]
        self.kept_image.setImage(grid, autoLevels=False)
        self.kept_chart.add(self.kept_image)
        for state in (2, 1, 0):                   # the key: empty bars inside the rows, named in the legend
            self.kept_chart.add(pg.BarGraphItem(x0=[0], y=[0.5], width=[0], height=[0], brush=KEPT_COLOURS[state],
                                                pen=None), KEPT_WORDS[state])
        self.kept_chart.plot.getAxis("left").setStyle(textFillLimits=[(0, 1.0)])    # a name on every row
        self.kept_chart.plot.getAxis("left").setTicks([[(i + 0.5, text) for i, text in enumerate(labels)]])
        self.kept_chart.plot.setYRange(0, len(labels), padding=0)
        self.kept_chart.plot.setXRange(0, width, padding=0)

    def explanation(self, record: ExperimentRecord) -> str:
        r: CompressionResult = record.result
        rows = [m for m in r.methods if m.name != "full"]
        if not rows:
            return ""
        parts = [f"<b>{m.words}</b>: {m.ratio:.2f}x fewer bytes, KL {m.kl_mean:.2e} per token, top token kept at "
                 f"{m.agreement:.0%} of steps, free-running departs at {departure_text(m, r.steps)}" for m in rows]
        rotation = (f" Layer {r.channel_layer}'s keys quantized to 4 bits in groups of 32: {r.int4_error_plain:.1%} "
                    f"relative error as written, {r.int4_error_rotated:.1%} after a Hadamard rotation spreads their "
                    "outlier channels (computed)." if r.int4_error_plain is not None and r.int4_error_rotated
                    is not None else "")
        skipped = f" Not run here: {'; '.join(r.skipped)}." if r.skipped else ""
        return ("; ".join(parts) + " (measured, teacher-forced on the full cache's tokens)." + rotation + skipped +
                " The ms per step are this CPU's: a quantized cache is dequantized whole at every step here, which "
                "a GPU kernel does not do.")


def best(result: CompressionResult, evicted: bool) -> MethodFigures | None:
    """The method of a family (quantized or evicted) that saves the most bytes while keeping the top token at
    least 80% of the steps; else the one that keeps it most."""
    family = [m for m in result.methods if m.name != "full" and m.name.startswith(("sinks", "h2o")) == evicted]
    good = [m for m in family if m.agreement >= 0.8]
    if good:
        return max(good, key=lambda m: m.ratio)
    return max(family, key=lambda m: m.agreement, default=None)


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live numbers (plain text)."""
    r = record.result if record is not None else None
    if r is None or not r.methods:
        return "press R to run the same text under each cache: full, quantized, evicted"
    said = []
    for m in (best(r, evicted=False), best(r, evicted=True)):
        if m is not None:
            said.append(f"{short(m.name)}: {1 / m.ratio:.0%} of the bytes, KL {m.kl_mean:.3f} nats per token, top "
                        f"token kept {m.agreement:.0%} of steps")
    return "; ".join(said) + " (measured)"


WINDOW = WindowLesson(
    lesson=kv_compression.LESSON, view=CompressionView, caption=caption,
    scene=Scene("compression", "The cache in fewer bytes", order=15, action="compare caches", key="Q"))
