"""How many threads torch computes with on a CPU: all of its cores while the machine is quiet, one fewer for each
core other programs keep busy, decided at every pass's boundary.

Why: torch's CPU wheels compute on OpenMP threads that spin at every barrier waiting for each other (libgomp's
default). With as many threads as cores and another program on one of them, the scheduler parks a thread the
others then spin for, at each of a decode step's hundreds of parallel regions (SmolLM2-135M bfloat16 eager, a
2-vCPU AMD EPYC, 64 tokens, tok/s, quiet / beside one busy loop: 2 threads 24.5-29.6 / 6.7-7.2, 1 thread 18.2-20.6
/ 19.7-20.7; beside a loop busy half the time: 2 threads 16.5-20.8, 1 thread 19.5-21.4). Waiting passively instead
(``OMP_WAIT_POLICY=PASSIVE``) kept 17.3-19.4 beside the loop but cost the quiet machine a third (18.4-20.9), and a
shorter spin (``GOMP_SPINCOUNT`` 1,000 / 10,000) either cost the quiet machine as much or saved nothing beside the
loop. So the threads keep spinning, and there are fewer of them while other programs hold cores.

What other programs hold is read from the kernel's per-core counters by a sampler thread (every ``WINDOW_S``;
``engine.facts.contention.read_machine``), never from this process's own CPU time (which spinning inflates). A core
counts as taken from ``TAKE_FROM`` of it and free again below ``FREE_BELOW`` (a band, so a load near the line does
not flip the count at every step). The governor only lowers the count it found (the user's ``OMP_NUM_THREADS``, a
lesson's ``torch.set_num_threads``: a count set by someone else is adopted as the new ceiling), and
``KVSCOPE_THREADS=fixed`` turns it off. A GPU run is left alone: its host threads wait on the device.
"""

from __future__ import annotations

import collections
import contextlib
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from engine.facts.contention import others_cores, read_machine

ENV = "KVSCOPE_THREADS"          # "fixed": never change torch's thread count; "auto" (the default): follow the load
WINDOW_S = 0.25                  # how often the sampler reads the kernel's counters
TAKE_FROM = 0.45                 # a core other programs use this much of is theirs: one thread fewer
FREE_BELOW = 0.3                 # ... and it is given back once they use less than this of it
CHANGES_KEPT = 256               # thread-count changes remembered for the runs' notes


def wanted_threads(ceiling: int, cores: int, others: float, current: int) -> int:
    """The thread count for ``others`` cores' worth of other programs on ``cores`` cores, starting from
    ``current``, never above ``ceiling`` nor below one. Lower as soon as a core is taken; higher only once it is
    free again."""
    lower = cores - math.floor(others + 1.0 - TAKE_FROM)       # what the load leaves, counted strictly
    higher = cores - math.floor(others + 1.0 - FREE_BELOW)     # what it leaves, counted generously
    if current > lower:
        target = lower
    elif current < higher:
        target = higher
    else:
        target = current
    return max(1, min(ceiling, target))


@dataclass(frozen=True)
class Change:
    """The thread count the governor set, when (``time.perf_counter``), and the load it set it for."""

    at: float
    threads: int
    was: int
    others: float
    cores: int


class ThreadGovernor:
    """The process's one governor (``governor()``): a sampler of the other programs' load and ``adjust()``, called
    by a CPU run between passes. Cheap per call: an attribute read and, when the count changes, one
    ``torch.set_num_threads``."""

    def __init__(self, enabled: bool | None = None) -> None:
        if enabled is None:
            enabled = os.environ.get(ENV, "auto").strip().lower() != "fixed"
        self.enabled = enabled
        self.ceiling = torch.get_num_threads()
        self.set_to = self.ceiling
        self.others: float | None = None       # the last window's load (cores), None before the first
        self.cores = 0
        # the latest changes, oldest first (a run reads those after its start); bounded for a window open for days
        self._changes: collections.deque[Change] = collections.deque(maxlen=CHANGES_KEPT)
        self._lock = threading.Lock()
        self._sampler: threading.Thread | None = None
        self._building = 0                     # compiles under way (``building``): the count stays at the ceiling

    def start(self) -> None:
        """Start the sampler (once; a daemon thread that reads two small files a second)."""
        with self._lock:
            if self._sampler is not None or not self.enabled or read_machine() is None:
                return
            self._sampler = threading.Thread(target=self._sample, name="kvscope-load-sampler", daemon=True)
            self._sampler.start()

    def _sample(self) -> None:
        before, started = read_machine(), time.perf_counter()
        while True:
            time.sleep(WINDOW_S)
            after, now = read_machine(), time.perf_counter()
            if before is not None and after is not None:
                others = others_cores(before, after, now - started)
                if others is not None:
                    self.others, self.cores = others, after.cores
            before, started = after, now

    def observe(self, others: float, cores: int) -> None:
        """Take a load reading from elsewhere (the tests' way of being a busy machine without one)."""
        self.others, self.cores = others, cores

    def adjust(self) -> int:
        """Set torch's thread count for the load just read; returns the count in force."""
        current = torch.get_num_threads()
        if not self.enabled:
            return current
        if current != self.set_to:              # someone else set it: that is the new ceiling
            self.ceiling = self.set_to = current
        others = self.others
        if others is None or not self.cores:
            return current
        target = self.ceiling if self._building else wanted_threads(self.ceiling, self.cores, others, current)
        if target != current:
            torch.set_num_threads(target)
            self.set_to = target
            self._changes.append(Change(time.perf_counter(), target, current, others, self.cores))
        return target

    @contextlib.contextmanager
    def building(self) -> Iterator[None]:
        """Hold the full count while a graph is compiled: inductor splits each kernel's work by the thread count it
        compiles at, and a graph built with one thread would keep one in every later launch (its saved name does
        not carry the count). A count lowered for the load is restored first."""
        with self._lock:
            self._building += 1
        try:
            if self.enabled and torch.get_num_threads() != self.ceiling and torch.get_num_threads() == self.set_to:
                torch.set_num_threads(self.ceiling)
                self.set_to = self.ceiling
            yield
        finally:
            with self._lock:
                self._building -= 1

    @property
    def changes(self) -> list[Change]:
        return list(self._changes)

    def since(self, started: float) -> list[Change]:
        return [c for c in self._changes if c.at >= started]


def change_words(changes: Sequence[Change], ceiling: int) -> str:
    """What the governor did during a run, for its notes ("" when it did nothing)."""
    lowered = [c for c in changes if c.threads < ceiling]
    if not lowered:
        return ""                       # only given back what an earlier run had lowered
    lowest = min(c.threads for c in lowered)
    busiest = max(lowered, key=lambda c: c.others)
    last = changes[-1]
    back = f"; back to {last.threads} once they used less" if last.threads > lowest else ""
    return (f"other programs kept {busiest.others:.1f} of this machine's {busiest.cores} cores busy: computed with "
            f"{lowest} thread{'s' if lowest != 1 else ''} instead of {ceiling}{back} (torch's threads spin waiting "
            "for each other at every step, and one parked by the scheduler stalls them all)")


_GOVERNOR: ThreadGovernor | None = None
_CREATE = threading.Lock()


def governor() -> ThreadGovernor:
    """The process's governor, its sampler started."""
    global _GOVERNOR
    with _CREATE:
        if _GOVERNOR is None:
            _GOVERNOR = ThreadGovernor()
    _GOVERNOR.start()
    return _GOVERNOR


def policy() -> dict:
    """How this process's compute threads are run, for a run's JSON: the count now and its ceiling, whether it
    follows the load, and how the threads wait (libgomp spins unless told otherwise)."""
    gov = governor()
    return {"threads": torch.get_num_threads(), "ceiling": gov.ceiling, "follows_load": gov.enabled,
            "wait": os.environ.get("OMP_WAIT_POLICY") or "spin (OpenMP's default)"}


def policy_words() -> str:
    """``policy`` in a line, for a self-test's report."""
    p = policy()
    how = "follow the load" if p["follows_load"] else f"fixed ({ENV}=fixed)"
    return f"compute threads: {p['threads']} of {p['ceiling']}, {how}; waiting: {p['wait']}"
