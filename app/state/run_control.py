"""``RunControl``: how the GUI steers a run it never waits on.

The engine calls ``before_step`` in the worker thread before every decode step; the GUI calls ``stop``,
``pause``, ``resume``, ``step`` and sets ``delay_s`` from its own thread. Nothing here blocks the GUI.
"""

from __future__ import annotations

import threading
import time


class RunControl:
    def __init__(self) -> None:
        self.cancel = threading.Event()
        self._cond = threading.Condition()
        self._paused = False
        self._credits = 0          # single steps granted while paused
        self.delay_s = 0.0         # slow motion: pause this long before each decode step
        self.held = False          # the worker is waiting at a paused run's gate (no token can come meanwhile)

    # --- GUI thread ---------------------------------------------------------------------------------------
    def reset(self, paused: bool = False) -> None:
        """Before a new run. ``paused`` starts it paused after the prefill (Step with nothing running)."""
        with self._cond:
            self.cancel.clear()
            self._paused, self._credits = paused, 0

    def stop(self) -> None:
        with self._cond:
            self.cancel.set()
            self._cond.notify_all()

    def pause(self) -> None:
        with self._cond:
            self._paused = True

    def resume(self) -> None:
        with self._cond:
            self._paused, self._credits = False, 0
            self._cond.notify_all()

    def step(self) -> None:
        """Let exactly one more token through, then stay paused."""
        with self._cond:
            self._paused = True
            self._credits += 1
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    # --- worker thread ------------------------------------------------------------------------------------
    def before_step(self, _step: int) -> None:
        with self._cond:
            if self.delay_s > 0 and not self._paused:
                deadline = time.monotonic() + self.delay_s
                while not self.cancel.is_set() and not self._paused:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
            while self._paused and self._credits == 0 and not self.cancel.is_set():
                self.held = True
                self._cond.wait()
            self.held = False
            if self._paused and self._credits > 0:
                self._credits -= 1
