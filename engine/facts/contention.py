"""Was the machine busy while we measured? A figure taken while other programs competed for the cores is not
the machine's figure, and must say so instead of being charted (or cached) as the truth.

The signal is this process's CPU time against the wall time it was measuring, per compute thread: torch's
threads keep their cores busy while a forward pass runs, so when other programs take the cores the share
falls (measured on a 2-core machine: 0.97 quiet, 0.49 while another process computed on both cores). It costs
two clock reads per measurement, none per step. On a GPU the host's CPU share says nothing about the
device, so no verdict is given there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

BUSY_BELOW = 0.7            # process CPU seconds per wall second per compute thread


def compute_threads() -> int:
    """Threads torch computes with on the CPU (read without importing torch if it is not loaded yet)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return max(int(torch.get_num_threads()), 1)
    return max(os.cpu_count() or 1, 1)


class LoadMeter:
    """``start()`` / ``stop()`` around work; ``share()`` is CPU seconds per wall second per compute thread.
    The clocks are this process's CPU time and the wall clock; a test passes its own to judge the arithmetic
    without depending on how busy its machine is."""

    def __init__(self, cpu_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.perf_counter) -> None:
        self.cpu_clock, self.wall_clock = cpu_clock, wall_clock
        self._cpu = self._wall = 0.0
        self._running = False
        self.cpu_s = self.wall_s = 0.0

    def start(self) -> None:
        self._cpu, self._wall, self._running = self.cpu_clock(), self.wall_clock(), True

    def stop(self) -> None:
        if self._running:
            self.cpu_s += self.cpu_clock() - self._cpu
            self.wall_s += self.wall_clock() - self._wall
            self._running = False

    def share_so_far(self, idle_ms: float = 0.0) -> float | None:
        """``share`` including the interval still being measured: a run's figure while it runs."""
        cpu, wall = self.cpu_s, self.wall_s
        if self._running:
            cpu += self.cpu_clock() - self._cpu
            wall += self.wall_clock() - self._wall
        wall -= idle_ms / 1000.0
        if wall < 0.05:
            return None
        return cpu / (wall * compute_threads())

    def share(self, idle_ms: float = 0.0) -> float | None:
        """The CPU share over the measured wall time minus ``idle_ms`` spent waiting on purpose (pauses).
        None when too little was measured to say."""
        wall = self.wall_s - idle_ms / 1000.0
        if wall < 0.05:
            return None
        return self.cpu_s / (wall * compute_threads())


def busy(cpu_share: float | None) -> bool:
    return cpu_share is not None and cpu_share < BUSY_BELOW


def busy_note(cpu_share: float | None) -> str:
    """The words shown next to a figure measured while the machine was busy; empty otherwise."""
    if not busy(cpu_share):
        return ""
    return (f"measured while the machine was busy (this process got {cpu_share:.0%} of its compute threads' "
            "time): other programs competed for the cores")
