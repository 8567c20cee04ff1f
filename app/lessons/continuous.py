"""Continuous vs static batching on the same arrivals: one lane per request (waiting, prefill, decode),
continuous above static, and the batch size over time below, the time axes aligned."""

from __future__ import annotations

import numpy as np
import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import Joins, LessonView, WindowLesson, token_note
from engine.lessons import continuous
from engine.lessons.continuous import POLICY_WORDS, BatchSizePoint, ContinuousResult, RequestPoint


class ContinuousView(LessonView):
    lesson = continuous.LESSON
    axes = ("time since the first arrival", "ms", "requests", None)
    point = RequestPoint                                 # the batch-size samples are charted, not tabled

    def build(self) -> None:
        self.sizes_chart = Chart("Batch size over time")
        self.sizes_chart.set_least_data(80)              # its axis, with its title, and a few ticks
        self.sizes_chart.plot.setXLink(self.plot)
        self.charts_layout.addWidget(self.sizes_chart, 1)

    def set_compact(self, compact: bool) -> None:
        """In a scene (beside the batch sweep) the lanes carry the claim: the batch size over time stays in the
        tab, where there is room for its axes."""
        super().set_compact(compact)
        self.sizes_chart.setVisible(not compact)

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.sizes_chart.style(theme, "time since the first arrival", "ms", "batch size", "rows")
        for plot in (self.plot, self.sizes_chart.plot):          # same left edge, so the time axes line up
            plot.getAxis("left").setWidth(int(theme.base_pt * 11))

    def draw(self, record: ExperimentRecord) -> None:
        requests = record.typed(RequestPoint)
        n = record.settings.requests or max((r.index + 1 for r in requests), default=0)
        ticks = []
        for policy, offset in ((True, 0), (False, n + 1)):
            rows = [r for r in requests if r.policy == policy]
            for name, stretch, colour in (("waiting", lambda r: (r.arrival_ms, r.admitted_ms), th.WAITING),
                                          ("prefill", lambda r: (r.admitted_ms, r.first_token_ms), th.PREFILL),
                                          ("decode", lambda r: (r.first_token_ms, r.done_ms), th.DECODE)):
                if rows:
                    spans = [stretch(r) for r in rows]
                    bars = pg.BarGraphItem(x0=[start for start, _end in spans],
                                           width=[max(end - start, 0.0) for start, end in spans],
                                           y=[offset + r.index for r in rows], height=0.7, brush=colour, pen=None)
                    self.chart.add(bars, name if policy else None)
            label = POLICY_WORDS[policy]
            ticks.append((offset + (n - 1) / 2, label))
            sizes = [p for p in record.typed(BatchSizePoint) if p.policy == policy]
            if sizes:
                t = np.array([0.0] + [p.t_ms for p in sizes])
                b = np.array([sizes[0].batch_size] + [p.batch_size for p in sizes])
                self.sizes_chart.add(pg.PlotDataItem(np.repeat(t, 2)[1:], np.repeat(b, 2)[:-1],  # a step: the size
                                                     pen=th.run_pen(th.DECODE if policy else th.CACHE_OFF,  # holds
                                                                    self.theme.line_width, not policy)),  # until the
                                     f"{label} (measured)")                                 # next decode step
        self.plot.getAxis("left").setTicks([ticks, []])
        self.plot.invertY(True)

    def explanation(self, record: ExperimentRecord) -> str:
        r: ContinuousResult = record.result
        if r.continuous_tok_s is None:
            return ""
        solo = {True: "each request's tokens equal its solo run ✓", False: "tokens DIFFER from solo runs ✗"}
        return (f"Same arrivals, two policies. Continuous: <b>{r.continuous_tok_s:,.0f} tok/s</b> in all, mean TTFT "
                f"<b>{r.continuous_mean_ttft_ms:,.0f} ms</b>, mean end-to-end {r.continuous_mean_e2e_ms:,.0f} ms. "
                f"Static: {r.static_tok_s:,.0f} tok/s, mean TTFT {r.static_mean_ttft_ms:,.0f} ms, end-to-end "
                f"{r.static_mean_e2e_ms:,.0f} ms (all measured). Static batching makes a newcomer wait for the whole "
                "batch (grey); continuous batching prefills it at the next step and lets finished rows leave. "
                f"{solo.get(r.tokens_match_solo, '')}{token_note(r)}")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or r.continuous_mean_ttft_ms is None:
        return ""
    return (f"continuous batching: mean TTFT {r.continuous_mean_ttft_ms:,.0f} ms vs {r.static_mean_ttft_ms:,.0f} ms "
            "static")


WINDOW = WindowLesson(
    lesson=continuous.LESSON, view=ContinuousView, caption=caption,
    joins=Joins("batch", "C", "continuous batching"))
