"""A load test on a serving engine: one lane per request (grey: sent, waiting for the first token; vermillion:
tokens streaming, by this client's clock), below it what the server itself says on /metrics, and, when the test
subscribed to the engine's KV events, its prefix cache as a tree of blocks (``app.views.prefix_chart``)."""

from __future__ import annotations

from html import escape

import pyqtgraph as pg
from PySide6.QtGui import QFontMetrics

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.chart import Chart
from app.views.lesson_view import LessonView, Scene, WindowLesson
from app.views.prefix_chart import PrefixChart
from engine.lessons import server_load
from engine.lessons.server_load import MetricsPoint, ServedRequest, ServerLoadResult, SlotsPoint
from engine.serve.block_events import KVBlocks, RequestBlocks
from engine.serve.metrics import QUANTITIES
from engine.serve.prefix_tree import tree_of


class ServerLoadView(LessonView):
    lesson = server_load.LESSON
    scene_charts = ("tree_chart",)
    axes = ("time since the first request", "ms", "request", None)
    point = ServedRequest                                # /metrics polls are charted, not tabled

    def build(self) -> None:
        self.metrics_chart = Chart("What the server reports on /metrics")
        self.metrics_chart.set_least_data(115)           # an axis with a few ticks
        self.metrics_chart.plot.setXLink(self.plot)
        self.plot.getViewBox().sigResized.connect(lambda *_: self._label_lanes())
        self.charts_layout.addWidget(self.metrics_chart, 1)
        self.slots_chart = Chart("llama-server's slots, from /slots: the positions each one's cache holds")
        self.slots_chart.set_least_data(90)
        self.slots_chart.hide()                          # shown for a server that answers /slots
        self.charts_layout.addWidget(self.slots_chart, 1)
        self.tree_chart = PrefixChart("The engine's prefix cache, from its KV events: one box per block")
        self.tree_chart.set_least_data(145)
        self.tree_chart.hide()                           # shown for a test that subscribed to KV events
        self.charts_layout.addWidget(self.tree_chart, 2)

    def set_compact(self, compact: bool) -> None:
        super().set_compact(compact)
        self.compact = compact
        self._place_metrics()
        self.charts_layout.setStretchFactor(self.tree_chart, 5 if compact else 2)

    def _place_metrics(self) -> None:
        """In its scene the tree is the claim, and the lanes until the server was polled: the /metrics chart
        steps back where there is a tree to show or nothing polled (empty at 720p, its axis had 66 px, its title
        cut)."""
        compact, polled = getattr(self, "compact", False), getattr(self, "polled", False)
        self.metrics_chart.setVisible(not compact or (polled and not self.tree_chart.isVisibleTo(self)))

    def style_charts(self, theme: th.Theme) -> None:
        super().style_charts(theme)
        self.metrics_chart.style(theme, "time since the first request", "ms", "requests", None)
        self.tree_chart.style_tree(theme)
        self.slots_chart.style(theme, "positions held", "tokens", "slot", None)
        for plot in (self.plot, self.metrics_chart.plot):
            plot.getAxis("left").setWidth(int(theme.base_pt * 11))

    def draw(self, record: ExperimentRecord) -> None:
        requests = sorted(record.typed(ServedRequest), key=lambda r: r.index)
        spans = {"waiting for the first token (client)": ([r.arrival_ms for r in requests],
                                                          [r.ttft_ms for r in requests], th.WAITING),
                 "streaming tokens (client)": ([r.arrival_ms + r.ttft_ms for r in requests],
                                               [max(r.e2e_ms - r.ttft_ms, 0.0) for r in requests], th.DECODE)}
        for name, (starts, widths, colour) in spans.items():
            if requests:
                self.chart.add(pg.BarGraphItem(x0=starts, width=[max(w, 0.0) for w in widths],
                                               y=[r.index for r in requests], height=0.7, brush=colour, pen=None), name)
        self.lanes = [r.index for r in requests]
        self._label_lanes()
        self.plot.invertY(True)
        samples = [p for p in record.typed(MetricsPoint) if p.series == MetricsPoint.series]     # the server's sum
        for quantity, colour, of in (("running", th.DECODE, lambda m: m.running),
                                     ("waiting", th.WAITING, lambda m: m.waiting)):
            values = [(m.t_ms, of(m)) for m in samples if of(m) is not None]
            if values:
                t, y = zip(*values)
                self.metrics_chart.add(pg.PlotDataItem(t, y, pen=pg.mkPen(colour, width=self.theme.line_width * 1.5),
                                                       symbol="o", symbolSize=5, symbolBrush=colour),
                                       f"{QUANTITIES.get(quantity, quantity)} (/metrics)")
        if samples:                                      # counts of requests: never below zero
            top = max((v or 0.0 for m in samples for v in (m.running, m.waiting)), default=0.0)
            self.metrics_chart.plot.getViewBox().setLimits(yMin=-0.05 * max(top, 1.0))
        self.polled = bool(samples)
        polls = record.typed(SlotsPoint)
        self.slots_chart.setVisible(bool(polls))
        if polls:                                        # the latest poll: each slot's context and what it holds
            last = polls[-1].more
            ids = sorted(int(k.split()[1]) for k in last if k.startswith("ctx "))
            contexts = [last[f"ctx {i}"] for i in ids]
            self.slots_chart.add(pg.BarGraphItem(x0=[0] * len(ids), y=ids, width=contexts, height=0.6,
                                                 brush=None, pen=pg.mkPen(th.FORMULA)), "its context (n_ctx)")
            for busy, colour, name in ((1.0, th.DECODE, "held, working"), (0.0, th.PREFILL, "held, idle")):
                rows = [i for i in ids if last[f"busy {i}"] == busy and last[f"held {i}"] > 0]
                if rows:
                    self.slots_chart.add(pg.BarGraphItem(x0=[0] * len(rows), y=rows, height=0.6, brush=colour,
                                                         width=[last[f"held {i}"] for i in rows], pen=None), name)
            self.slots_chart.plot.getAxis("left").setTicks([[(i, f"slot {i}") for i in ids]])
        blocks = record.of(KVBlocks, RequestBlocks)
        self.tree_chart.setVisible(bool(blocks))
        self._place_metrics()
        if blocks:
            self.tree_chart.show(tree_of(blocks))

    def _label_lanes(self) -> None:
        """As many lane labels as fit one above the other in the axis's own type (at most 6: 64 lanes must not print
        64 names), again whenever the chart's height changes: in a scene the lanes are a few pixels each, and
        every label drawn there covered its neighbours."""
        lanes = getattr(self, "lanes", [])
        if not lanes or getattr(self, "theme", None) is None:
            return
        line = QFontMetrics(self.theme.axis_font).height()
        fit = max(2, int(self.plot.getViewBox().height() // (line * 1.5)))
        every = max(1, -(-len(lanes) // min(6, fit)))
        self.plot.getAxis("left").setTicks([[(i, f"#{i}") for i in lanes[::every]], [(i, "") for i in lanes]])

    def explanation(self, record: ExperimentRecord) -> str:
        r: ServerLoadResult = record.result
        engine = escape(getattr(record.started.model, "engine", "the server"))
        if r.mean_ttft_ms is None:
            return f"No request completed ({r.failed} failed): see each run's message in the timing panel."
        text = (f"{r.completed} of {r.requested} requests completed: mean TTFT <b>{r.mean_ttft_ms:,.0f} ms</b>, "
                f"<b>{r.total_tok_s:,.1f} tok/s</b> in all, {r.mean_decode_tok_s:,.1f} tok/s per request (measured by "
                "this client).")
        if r.mean_server_prompt_ms is not None:
            text += (f" {engine} itself reported a mean prompt time of {r.mean_server_prompt_ms:,.0f} ms: TTFT as a "
                     f"user sees it is {r.mean_client_minus_server_ms:,.0f} ms longer (queueing, HTTP, the first "
                     "step).")
        peaks = [f"{QUANTITIES.get(q, q)} {getattr(r, 'peak_' + q):g}" for q in ("running", "waiting", "kv_usage")
                 if getattr(r, "peak_" + q) is not None]
        if peaks:
            text += f" /metrics at its peak: {escape(', '.join(peaks))}."
        elif not getattr(self, "polled", False):
            text += f" {engine} has no /metrics here (llama-server needs --metrics)."
        if r.metrics_error:
            text += (f" {r.metrics_failed:,} /metrics poll(s) failed, each tried again at the next: "
                     f"{escape(r.metrics_error)}")
        if r.notes:
            text += f" Not read from /metrics: {escape('; '.join(r.notes))}."
        text += "".join(f" {escape(line)}." for line in server_load.prefix_lines(r))
        return text + " The same idea inside KVScope, with every step visible: the Continuous batching tab."


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    r = record.result if record is not None else None
    if r is None or r.mean_ttft_ms is None:
        return "requests sharing a system prompt, fired at a serving engine: its KV blocks drawn as a tree"
    engine = getattr(record.started.model, "engine", "the server")
    parts = [f"{r.completed} requests to {engine}"]
    if r.server_cached_tokens is not None and r.server_prompt_tokens:
        parts.append(f"{r.server_cached_tokens:,} of {r.server_prompt_tokens:,} prompt tokens came from its prefix "
                     f"cache ({r.server_cached_tokens / r.server_prompt_tokens:.0%}, the server's answers)")
    if r.tree_prompt_tokens:
        differ = f", {r.mispredicted_requests:,} requests otherwise" if r.mispredicted_requests else ""
        share = r.tree_reused_tokens / r.tree_prompt_tokens
        parts.append(f"predicted at send from its KV events: {r.tree_reused_tokens:,} tokens ({share:.0%}{differ})")
    parts.append(f"mean TTFT {r.mean_ttft_ms:,.0f} ms (client)")
    if len(parts) == 2:
        parts[1] = (f"mean TTFT {r.mean_ttft_ms:,.0f} ms, {r.total_tok_s:,.1f} tok/s in all (measured by this "
                    "client)")
    return "; ".join(parts)


WINDOW = WindowLesson(
    lesson=server_load.LESSON, view=ServerLoadView, caption=caption,
    scene=Scene("serving", "A real server's prefix cache", order=14, action="the load test", key="V"))
