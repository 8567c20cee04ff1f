"""The example lesson's tab and scene: TTFT per run, and the median in words."""

from __future__ import annotations

import pyqtgraph as pg
from engine.lessons.example import ExampleMark, ExamplePoint, ExampleResult

from app.state.store import ExperimentRecord
from app.views import theme as th
from app.views.lesson_view import LessonView, Scene, WindowLesson
from engine.lessons import example


class ExampleView(LessonView):
    lesson = example.LESSON
    axes = ("run", None, "time to first token", "ms")
    point = ExamplePoint

    def draw(self, record: ExperimentRecord) -> None:
        points = record.typed(ExamplePoint)
        if points:
            self.chart.add(pg.PlotDataItem([p.repeat + 1 for p in points], [p.ttft_ms for p in points], symbol="o",
                                           pen=pg.mkPen(th.PREFILL, width=self.theme.line_width)),
                           f"TTFT (measured, {len(record.of(ExampleMark))} marks)")

    def explanation(self, record: ExperimentRecord) -> str:
        r: ExampleResult = record.result
        return "" if r.median_ttft_ms is None else f"Median TTFT <b>{r.median_ttft_ms:,.1f} ms</b> (measured)."


def caption(record: ExperimentRecord | None, context: object = None) -> str:
    r = record.result if record is not None else None
    if r is None or r.median_ttft_ms is None:
        return "press R to run the same prompt a few times"
    return f"the same prompt {r.runs} times: median TTFT {r.median_ttft_ms:,.1f} ms (measured)"


WINDOW = WindowLesson(lesson=example.LESSON, view=ExampleView, caption=caption,
                      scene=Scene("example", "An example lesson", order=17, action="run the example", key="Y"))
