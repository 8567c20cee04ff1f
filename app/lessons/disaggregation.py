"""Prefill and decode apart: one row per request in each mode (its wait, prefill, hand-over and a tick per token,
so a stall is a stretch without ticks), the inter-token gaps of one short request in both modes, and each
hand-over's time against its bytes."""

from __future__ import annotations

import pyqtgraph as pg
from PySide6.QtWidgets import QHBoxLayout

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import LessonView, Scene, WindowLesson, token_note
from engine.facts import kvformula
from engine.lessons import disaggregation
from engine.lessons.disaggregation import MODES, DisaggregationResult, GapPoint, ServedPoint

HANDOVER = th.CHOSEN


def watched(requests: list[ServedPoint]) -> int | None:
    """The short request a long prefill held back the most when colocated: the one whose gaps tell the story."""
    shortest = min((q.prompt_tokens for q in requests), default=0)
    short = [r for r in requests if r.mode == 0 and r.prompt_tokens == shortest]
    best = max(short, key=lambda r: r.max_gap_ms or 0.0, default=None)
    return best.index if best is not None else None


class DisaggregationView(LessonView):
    lesson = disaggregation.LESSON
    axes = ("time since the first arrival", "ms", "", None)
    point = ServedPoint

    def build(self) -> None:
        self.gaps_chart = Chart("Inter-token gaps of one short request (measured)", legend_beside=True)
        self.cost_chart = Chart("Each hand-over: time against bytes")
        self.charts_layout.removeWidget(self.chart)
        self.charts_layout.addWidget(self.chart, 2)
        bottom = QHBoxLayout()
        bottom.addWidget(self.gaps_chart, 3)
        bottom.addWidget(self.cost_chart, 2)
        self.charts_layout.addLayout(bottom, 1)
        self.rows.append(bottom)

    def set_compact(self, compact: bool) -> None:
        """In the scene the rows and the gaps carry the claim; the hand-over costs stay in the tab, where their
        axes have room (the caption says the bytes and the mean time)."""
        super().set_compact(compact)
        self.cost_chart.setVisible(not compact)

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.gaps_chart.style(theme, "time since the first arrival", "ms", "gap", "ms")
        self.cost_chart.style(theme, "bytes handed over", "MiB", "hand-over", "ms")
        self.plot.getAxis("left").setStyle(textFillLimits=[(0, 1.0)])

    def draw(self, record: ExperimentRecord) -> None:
        """One row per request, colocated above disaggregated: its wait, its prefill, its hand-over, and a tick
        at each token it got; a long prefill in the colocated worker shows as a stretch with no ticks in every
        row that was decoding."""
        requests = record.typed(ServedPoint)
        gaps = record.typed(GapPoint)
        n = record.settings.requests or max((r.index + 1 for r in requests), default=0)
        result = record.result if isinstance(record.result, DisaggregationResult) else None
        ticks, shown = [], set()
        for m, mode in enumerate(MODES):
            offset = m * (n + 1)
            rows = [r for r in requests if r.mode == m]
            for name, stretch, colour in (("waiting", lambda r: (r.arrival_ms, r.prefill_start_ms), th.WAITING),
                                          ("prefill", lambda r: (r.prefill_start_ms, r.prefill_end_ms), th.PREFILL),
                                          ("hand-over", lambda r: (r.prefill_end_ms, r.handover_ready_ms), HANDOVER)):
                drawn = [(r, *stretch(r)) for r in rows if None not in stretch(r)]
                if drawn:
                    self.chart.add(pg.BarGraphItem(
                        x0=[start for _r, start, _end in drawn],
                        width=[max(end - start, 0.0) for _r, start, end in drawn],
                        y=[offset + r.index for r, _start, _end in drawn], height=0.7, brush=colour, pen=None),
                        None if name in shown else f"{name} (measured)")
                    shown.add(name)
            mine = [g for g in gaps if g.mode == m]
            if mine:
                self.chart.add(pg.ScatterPlotItem(x=[g.t_ms for g in mine],
                                                  y=[offset + g.request for g in mine], symbol="|", size=10,
                                                  pen=pg.mkPen(th.DECODE, width=1.5), brush=th.DECODE),
                               None if "token" in shown else "a decoded token")
                shown.add("token")
            for r in rows:                         # the long requests' hand-overs carry their bytes
                if r.handover_bytes and r.prompt_tokens > min(q.prompt_tokens for q in rows):
                    self.chart.label_point(kvformula.format_bytes(r.handover_bytes), r.handover_ready_ms,
                                           offset + r.index, marker=6.0)
            if result is not None and result.colocated_threads:
                workers = (f"one worker, {result.colocated_threads} threads" if m == 0 else
                           f"{result.prefill_threads} + {result.decode_threads} threads")
            else:
                workers = ""
            ticks.append((offset + (n - 1) / 2, f"{mode}\n{workers}" if workers else mode))
        self.plot.getAxis("left").setTicks([ticks, []])
        self.plot.invertY(True)
        self._draw_gaps(record)
        self._draw_cost(record)

    def _draw_gaps(self, record: ExperimentRecord) -> None:
        requests = record.typed(ServedPoint)
        index = watched(requests)
        if index is None:
            return
        for m, mode in enumerate(MODES):
            gaps = [g for g in record.typed(GapPoint) if g.mode == m and g.request == index]
            if gaps:                               # between a token and the next, the gap it waited: a step
                first = next((r.prefill_end_ms for r in requests if r.mode == m and r.index == index),
                             gaps[0].t_ms - gaps[0].gap_ms)
                self.gaps_chart.add(pg.PlotDataItem([first] + [g.t_ms for g in gaps], [g.gap_ms for g in gaps],
                                                    stepMode="center",
                                                    pen=th.run_pen(th.CACHE_OFF if m == 0 else th.DECODE,
                                                                   self.theme.line_width, m == 0)),
                                    f"request {index}, {mode}")

    def _draw_cost(self, record: ExperimentRecord) -> None:
        handed = [p for p in record.typed(ServedPoint) if p.handover_bytes]
        if not handed:
            return
        self.cost_chart.add(pg.PlotDataItem([h.handover_bytes / 2**20 for h in handed],
                                            [h.handover_ms for h in handed], pen=None, symbol="o",
                                            symbolSize=10, symbolBrush=HANDOVER, symbolPen=None),
                            "hand-over (measured)")
        reading = [h for h in handed if h.transfer_ms]
        if reading:
            self.cost_chart.add(pg.PlotDataItem([h.handover_bytes / 2**20 for h in reading],
                                                [h.transfer_ms for h in reading], pen=None, symbol="t",
                                                symbolSize=10, symbolBrush=th.FORMULA, symbolPen=None),
                                "of it, reading the bytes (measured)")

    def explanation(self, record: ExperimentRecord) -> str:
        r: DisaggregationResult = record.result
        if len(r.modes) < 2:
            return f"Ended early: {r.failure}" if r.failure else ""
        co, dis = r.modes
        same = {True: "the same tokens in both modes ✓", False: "tokens DIFFER between the modes ✗"}
        solo = {True: ", equal to a plain run of each ✓", False: ", DIFFERENT from plain runs ✗"}
        return (f"Colocated (one worker, {r.colocated_threads} threads): inter-token gap p50 "
                f"<b>{co.p50_gap_ms:,.0f} ms</b>, p99 <b>{co.p99_gap_ms:,.0f} ms</b>, mean TTFT "
                f"{co.mean_ttft_ms:,.0f} ms, {co.tok_s:,.1f} tok/s. Disaggregated (prefill worker "
                f"{r.prefill_threads} thread(s), decode worker {r.decode_threads}, in two processes): p50 "
                f"<b>{dis.p50_gap_ms:,.0f} ms</b>, p99 <b>{dis.p99_gap_ms:,.0f} ms</b>, mean TTFT "
                f"{dis.mean_ttft_ms:,.0f} ms, {dis.tok_s:,.1f} tok/s; each cache handed over a Unix socket in "
                f"{dis.handover_ms:,.1f} ms on average, {kvformula.format_bytes(dis.handover_bytes)} in all (all "
                "measured). A long prefill in the colocated worker holds back every running request's next token; "
                "apart, decode goes on while the other process prefills. One machine's cores are split here; on a "
                f"GPU pair each worker has its own. {same.get(r.same_tokens_both_modes, '')}"
                f"{solo.get(r.tokens_match_solo, '')}{token_note(r)}")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live numbers (plain text)."""
    r = record.result if record is not None else None
    if r is None:
        return "press R to serve the same arrivals with one worker, then with prefill and decode apart"
    if len(r.modes) < 2:
        return f"ended early: {r.failure}" if r.failure else ""
    co, dis = r.modes
    return (f"apart, the p99 inter-token gap is {dis.p99_gap_ms:,.0f} ms instead of {co.p99_gap_ms:,.0f} ms "
            f"(measured); the price: {kvformula.format_bytes(dis.handover_bytes)} handed over, "
            f"{dis.handover_ms:,.0f} ms each on average, and a second worker")


WINDOW = WindowLesson(
    lesson=disaggregation.LESSON, view=DisaggregationView, caption=caption,
    scene=Scene("disaggregation", "Prefill and decode apart", order=16, action="serve both ways", key="D"))
