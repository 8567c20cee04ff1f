"""Offloading: decode speed measured and predicted for each split (layers on disk), and beside it every decoder
layer's time per step in the most offloaded split, coloured by where its weights were read from: the slow
layers are the ones on disk."""

from __future__ import annotations

import statistics

import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import LessonView, Scene, WindowLesson
from engine.facts import kvformula
from engine.lessons import offload
from engine.lessons.offload import OffloadResult, SplitPoint, split_line

LABEL_ROOM = 1.3            # the value axis runs this far past the tallest bar: its figure is drawn over it


class OffloadView(LessonView):
    lesson = offload.LESSON
    scene_charts = ("chart", "layers_chart")
    axes = ("decoder layers on disk", None, "decode", "tok/s")
    point = SplitPoint

    def build(self) -> None:
        self.layers_chart = Chart("Each layer's time per step, most offloaded split (measured)")
        self.charts_layout.setDirection(self.charts_layout.Direction.LeftToRight)
        self.charts_layout.addWidget(self.layers_chart, 3)

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.layers_chart.style(theme, "decoder layer", None, "time per step", "ms")

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(SplitPoint)
        if not points:
            return
        x = [p.disk_layers for p in points]
        width = max(max(x) / max(len(x), 1) * 0.35, 0.4)
        self.chart.add(pg.BarGraphItem(x=[v - width / 2 for v in x], height=[p.decode_tok_s for p in points],
                                       width=width, brush=th.DECODE, pen=None), "measured")
        predicted = [(v, p.predicted_decode_tok_s) for v, p in zip(x, points) if p.predicted_decode_tok_s]
        if predicted:
            self.chart.add(pg.BarGraphItem(x=[v + width / 2 for v, _ in predicted], height=[h for _, h in predicted],
                                           width=width, brush=th.FORMULA, pen=None), "predicted (computed)")
        for v, p in zip(x, points):                # each measured bar's figure over it, clear of the pair's taller
            label = pg.TextItem(f"{p.decode_tok_s:,.0f} tok/s", color=self.theme.foreground, anchor=(0.5, 1))
            label.setFont(self.theme.axis_font)
            label.setPos(v - width / 2, max(p.decode_tok_s, p.predicted_decode_tok_s or 0.0))
            self.chart.add(label)
        # Room over the tallest bar for its figure: an invisible point the chart's own auto-range keeps in view
        # (a range set here was undone when the chart left its empty state).
        top = max(max(p.decode_tok_s, p.predicted_decode_tok_s or 0.0) for p in points)
        self.chart.add(pg.ScatterPlotItem([x[0]], [top * LABEL_ROOM], size=0, pen=None, brush=None))
        self.plot.getAxis("bottom").setTicks([[(v, f"{v:,.0f}") for v in x], []])
        times = self._layer_times(record)
        if times:
            devices, ms = times
            for where, colour in (("memory", th.DECODE), ("disk", th.CACHE_OFF)):
                rows = [i for i, d in enumerate(devices) if (d == "disk") == (where == "disk")]
                if rows:
                    self.layers_chart.add(pg.BarGraphItem(x=rows, height=[ms[i] for i in rows], width=0.8,
                                                          brush=colour, pen=None),
                                          "on disk" if where == "disk" else "in memory")
            self.layers_chart.plot.setXRange(-0.6, len(devices) - 0.4, padding=0)   # every layer, at any size
            stride = max(1, len(devices) // 8)                   # whole layers only: no "layer 0.5"
            self.layers_chart.plot.getAxis("bottom").setTicks([[(i, str(i)) for i in range(0, len(devices), stride)],
                                                               []])

    def _layer_times(self, record: ExperimentRecord) -> tuple[list[str], list[float]] | None:
        """Each layer's median time per decode step in the most offloaded split recorded so far."""
        by_run = {}
        for run_id in record.run_ids:
            run = self.store.find(run_id)
            if run is not None and run.layer_times:
                by_run[run_id] = run.layer_times
        if not by_run:
            return None
        steps = max(by_run.values(), key=lambda t: sum(d == "disk" for d in t[0].devices))
        decode = [t for t in steps if t.step > 0] or steps
        layers = len(decode[0].ms)
        return list(decode[0].devices), [statistics.median(t.ms[i] for t in decode) for i in range(layers)]

    def explanation(self, record: ExperimentRecord) -> str:
        r: OffloadResult = record.result
        if not r.splits:
            return ""
        base = r.splits[0]
        lines = [split_line(s, base) for s in r.splits]
        moved = " and ".join(f"{kvformula.format_bytes(b)} at {n:,} positions"
                             for n, b in zip(r.kv_positions, r.kv_moved_per_token))
        if r.kv_offload_measured and r.kv_offload_decode_tok_s:
            kv = (f"<br>With the KV cache offloaded to the CPU between layers: decode {r.kv_offload_decode_tok_s:,.1f} "
                  f"tok/s (measured), tokens {'the same' if r.kv_offload_tokens_match else 'different'}; per token "
                  f"it would move {moved} (computed: each layer's cache to the CPU and back).")
        else:
            kv = (f"<br>Offloading the KV cache instead would move, per token, {moved} (computed: each layer's "
                  "cache to the CPU and back); measuring it needs a GPU." if moved else "")
        return ("A layer on disk has its weights read back before every use, so each step pays the offloaded bytes "
                "over the rate they are read at; the prediction is the all-in-memory step plus exactly that.<br>" +
                "<br>".join(lines) + kv)


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live numbers (plain text)."""
    r = record.result if record is not None else None
    if r is None or len(r.splits) < 2:
        return "press R to decode the same prompt with none, a quarter and half of the layers on disk"
    return split_line(r.splits[-1], r.splits[0])


WINDOW = WindowLesson(
    lesson=offload.LESSON, view=OffloadView, caption=caption,
    scene=Scene("offload", "When the model does not fit", order=13, action="split the layers across memory and disk",
              key="O"))
