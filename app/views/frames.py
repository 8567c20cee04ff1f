"""The refresh timer: panels redraw from the store on a ~30 fps timer, never once per event.

The token text and status strip follow the store at once (a long text in batches, one per tick, while
``behind`` says there is more; during a prefill, its clock ten times a second). While a run streams, the
charts refresh no more often than their measured painting cost allows (``app.views.paint``), one chart per tick so
no single tick paints them all; forced, or once the shown run has finished, all at once. Every refresh goes
through ``guard`` so a panel that raises ends in a banner instead of stopping the timer.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from PySide6.QtCore import QElapsedTimer, QObject, QTimer

from app.state.store import RunStore
from app.state.viewstate import ViewState
from app.views.paint import METER

REFRESH_MS = 33


class Refreshable(Protocol):
    def refresh(self) -> None: ...


Guard = Callable[[str, Callable[[], None]], bool]


class FrameScheduler(QObject):
    def __init__(self, store: RunStore, state: ViewState, text: Sequence[tuple[str, Callable[[], None]]],
                 charts: Sequence[tuple[str, Refreshable]], guard: Guard, parent: QObject | None = None,
                 behind: Callable[[], bool] = lambda: False, take_in: Callable[[], None] = lambda: None) -> None:
        super().__init__(parent)
        self.store, self.state, self.behind, self.take_in = store, state, behind, take_in
        self.text, self.charts, self.guard = list(text), list(charts), guard
        self._text_version = self._chart_version = -1
        self._queue: list[tuple[str, Refreshable]] = []
        self._cost = 0.0
        self.frames = self.chart_frames = 0
        self._clock = QElapsedTimer()
        self._clock.start()
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.tick)
        self.timer.start()

    def stop(self) -> None:
        self.timer.stop()

    def tick(self) -> None:
        """Take in the next batch of events the worker sent, if it sent more than one batch; then redraw."""
        self.guard("Taking in the engine's events", self.take_in)
        self.refresh()

    def refresh(self, force: bool = False) -> None:
        self.store.new_frame()
        run = self.store.find(self.state.selected) if self.state.selected else None
        # A prefill sends nothing until its pass ends: its clock and growing bar are redrawn ten times a second,
        # so a long prompt never looks hung.
        prefilling = run is not None and not run.finished and not run.n_steps and not run.remote
        # So does an experiment's clock between its reports: a sweep's first point can take half a minute.
        ticking = prefilling or self.store.activity == "experiment"
        version = (self.store.version, self.state.selected, round(self.store.now() * 10) if ticking else None)
        if force or version != self._text_version or self.behind():
            self._text_version = version
            self.frames += 1
            for what, draw in self.text:
                self.guard(what, draw)
        if force or (version != self._chart_version and (run is None or run.finished)):
            self._chart_version, self._queue = version, []
            for what, panel in self.charts:
                self.guard(what, panel.refresh)
            self.chart_frames += 1
            return
        if not self._queue and version != self._chart_version and self._clock.elapsed() >= METER.interval_ms():
            self._chart_version, self._queue = version, list(self.charts)
            self._clock.restart()
            self._cost = 0.0
        if self._queue:
            started = time.perf_counter()
            what, panel = self._queue.pop(0)
            self.guard(what, panel.refresh)
            self._cost += (time.perf_counter() - started) * 1000.0
            if not self._queue:
                self.chart_frames += 1
                METER.close_frame(self._cost)
