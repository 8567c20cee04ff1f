"""Charts that measure their own painting, so the window refreshes them only as often as it can afford.

On a 2-core machine every millisecond the GUI thread spends painting is taken from the engine (the same
cores, and the GIL). The window keeps chart painting under ``BUDGET`` of wall time by stretching the chart
refresh interval to ``cost / BUDGET``, between ``MIN_MS`` and ``MAX_MS``.
"""

from __future__ import annotations

import time

import pyqtgraph as pg

BUDGET = 0.2
MIN_MS = 100
MAX_MS = 1000


class PaintMeter:
    """Exponential average of the painting done per chart refresh."""

    def __init__(self) -> None:
        self.pending_ms = 0.0      # painted since the last refresh
        self.average_ms = 0.0

    def add(self, ms: float) -> None:
        self.pending_ms += ms

    def close_frame(self, refresh_ms: float) -> None:
        cost = self.pending_ms + refresh_ms
        self.average_ms = cost if self.average_ms == 0 else 0.7 * self.average_ms + 0.3 * cost
        self.pending_ms = 0.0

    def interval_ms(self) -> int:
        return int(min(max(self.average_ms / BUDGET, MIN_MS), MAX_MS))


METER = PaintMeter()


class TimedGraphics(pg.GraphicsLayoutWidget):
    """A ``GraphicsLayoutWidget`` that reports how long each paint took to ``METER``."""

    def add_plot(self, row: int, col: int, title: str | None = None) -> pg.PlotItem:
        """A plot without pyqtgraph's right-click menus (KVScope's charts offer none): a view box made with its
        menu builds none, where one switched off after building it had spent ~5 ms on it, ~0.2 s a window."""
        plot = self.addPlot(row=row, col=col, title=title, viewBox=pg.ViewBox(enableMenu=False))
        plot.setMenuEnabled(False)
        return plot

    def paintEvent(self, event) -> None:  # noqa: N802 (Qt override)
        start = time.perf_counter()
        super().paintEvent(event)
        METER.add((time.perf_counter() - start) * 1000.0)
