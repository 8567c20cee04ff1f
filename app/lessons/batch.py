"""Batch size against throughput and per-token latency: one point per batch size, labelled, and the trade-off in
words."""

from __future__ import annotations

import pyqtgraph as pg

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import LessonView, Scene, WindowLesson, add_labels
from engine.lessons import batch
from engine.lessons.batch import BatchPoint, BatchResult, latency_words


class BatchView(LessonView):
    lesson = batch.LESSON
    axes = ("per-token latency of each request", "ms", "throughput of all requests", "tok/s")
    point = BatchPoint

    def draw(self, record: ExperimentRecord) -> None:
        points = [p for p in record.typed(BatchPoint) if p.per_token_ms is not None]
        if not points:
            return
        x, y = [p.per_token_ms for p in points], [p.decode_tok_s for p in points]
        self.chart.add(pg.PlotDataItem(x, y, pen=pg.mkPen(th.DECODE, width=self.theme.line_width * 1.5), symbol="o",
                                       symbolBrush=th.DECODE), "batch sizes (measured)")
        add_labels(self.chart, [(p.per_token_ms, p.decode_tok_s, f"B={p.batch}") for p in points])

    def explanation(self, record: ExperimentRecord) -> str:
        r: BatchResult = record.result
        if r.throughput_gain is None:
            return ""
        return (f"A batch of {r.largest_batch} decodes <b>{r.throughput_gain:.1f}x the tokens per second</b> of a "
                f"single request, while each request's token comes <b>{latency_words(r.latency_growth)}</b> "
                "(measured). Decode reads all the weights for every step whatever the batch, so more rows share "
                "that cost: throughput rises, and latency per request rises too.")


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    """The lecture scene's claim with its live number (plain text)."""
    r = record.result if record is not None else None
    if r is None or r.throughput_gain is None:
        return ""
    return (f"a batch of {r.largest_batch} decodes {r.throughput_gain:.1f}x the tokens/s, each token "
            f"{latency_words(r.latency_growth)} (measured)")


WINDOW = WindowLesson(
    lesson=batch.LESSON, view=BatchView, caption=caption,
    scene=Scene("batch", "Latency vs throughput", order=5, action="batch sweep", side_by_side=True))
