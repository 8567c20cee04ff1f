"""A stopwatch that is right on every device.

On CPU a forward pass is synchronous, so ``perf_counter`` marks around it are the truth. On CUDA kernels are
queued, and a host clock read without a sync measures the queueing, not the work: there a mark is a recorded
CUDA event, and intervals are resolved at the end of the step (one sync, which sampling needs anyway).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class StepClock:
    """``a = clock.mark(); ...; b = clock.mark(); ms = clock.elapsed_ms(a, b)``."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def elapsed_ms(self, start: Any, end: Any) -> float:
        if self.cuda:
            end.synchronize()
            return float(start.elapsed_time(end))
        return (end - start) * 1000.0
