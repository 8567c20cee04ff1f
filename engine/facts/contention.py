"""Was the machine busy while we measured? A figure taken while other programs competed for the cores is not
the machine's figure, and must say so instead of being charted (or cached) as the truth.

Two readings, the lower one counts. The first is this process's CPU time against the wall time it was measuring,
per compute thread (integrated over the thread count, which ``engine.model.threads`` lowers while the cores are
taken): torch's threads keep their cores busy while a forward pass runs, so when other programs take the cores
the share falls (measured on a 2-core machine: 0.97 quiet, 0.49 while another process computed on both cores).
The second is what other programs did, read from the kernel's per-core counters (``/proc/stat``, Linux, the cores
this process may run on): the share of those cores they left free. It tells a contended run apart where the first
cannot: a run that gave a core back to another program (one thread instead of two) keeps its one thread busy,
yet it ran slower than it would have alone. Each costs two reads per measurement, none per step (the second is
skipped where the kernel does not offer it). On a GPU the host's CPU share says nothing about the device, so no
verdict is given there.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

BUSY_BELOW = 0.7            # the lower share (see above) under which a figure is called busy
RECHECK_S = 0.25            # a running measurement reads the kernel's counters at most this often
STAT = "/proc/stat"
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") and "SC_CLK_TCK" in os.sysconf_names else 100


def compute_threads() -> int:
    """Threads torch computes with on the CPU (read without importing torch if it is not loaded yet)."""
    import sys

    torch = sys.modules.get("torch")
    if torch is not None:
        return max(int(torch.get_num_threads()), 1)
    return max(os.cpu_count() or 1, 1)


def usable_cores() -> list[int]:
    """The cores this process may run on (its affinity), else every core."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


@dataclass(frozen=True)
class MachineReading:
    """The kernel's count of busy time on this process's cores (every program's, this one's included) and this
    process's own CPU time, read at one moment."""

    busy_s: float           # seconds the cores spent running anything but idle, summed over the cores
    own_s: float            # this process's CPU seconds (every thread of it)
    cores: int


def read_machine(stat: str = STAT, cores: list[int] | None = None,
                 own_clock: Callable[[], float] = time.process_time) -> MachineReading | None:
    """Busy seconds of this process's cores from ``stat`` (the kernel's ``cpuN`` lines: user, nice, system,
    irq, softirq and steal count as busy; idle and iowait do not), or None where there is no such file."""
    wanted = set(usable_cores() if cores is None else cores)
    busy = 0
    seen = 0
    try:
        with open(stat, "rb") as f:
            text = f.read(1 << 20).decode("ascii", "replace")
    except OSError:
        return None
    for line in text.splitlines():
        if not line.startswith("cpu") or line.startswith("cpu "):
            continue
        name, *fields = line.split()
        try:
            index = int(name[3:])
            values = [int(v) for v in fields[:8]]
        except ValueError:
            continue
        if index not in wanted or len(values) < 4:
            continue
        user, nice, system, _idle, *rest = values
        iowait = rest[0] if rest else 0
        busy += user + nice + system + sum(rest) - iowait
        seen += 1
    if seen == 0:
        return None
    return MachineReading(busy / _TICKS, own_clock(), seen)


def others_cores(before: MachineReading, after: MachineReading, wall_s: float) -> float | None:
    """How many cores other programs kept busy on average between two readings ``wall_s`` apart (0 to the
    number of cores), or None when the interval is too short for the kernel's tick-counted figures."""
    if wall_s < 0.2 or before.cores != after.cores:
        return None
    others = (after.busy_s - before.busy_s) - (after.own_s - before.own_s)
    return min(max(others / wall_s, 0.0), float(after.cores))


_MACHINE = object()         # LoadMeter's default: read the machine when the clocks are the real ones


class LoadMeter:
    """``start()`` / ``stop()`` around work; ``share()`` is the lower of this process's CPU seconds per wall
    second per compute thread and the share of its cores other programs left free (see above). The clocks are
    this process's CPU time and the wall clock; a test passes its own (and ``machine``, the kernel's reading,
    else none is made) to judge the arithmetic without depending on how busy its machine is. ``threads``: the
    compute thread count, read at every start, stop and reading so far, so a count lowered mid-run is weighed
    by how long it held."""

    def __init__(self, cpu_clock: Callable[[], float] = time.process_time,
                 wall_clock: Callable[[], float] = time.perf_counter,
                 machine: Callable[[], MachineReading | None] | None | object = _MACHINE,
                 threads: Callable[[], int] | None = None) -> None:
        self.cpu_clock, self.wall_clock = cpu_clock, wall_clock
        real = cpu_clock is time.process_time and wall_clock is time.perf_counter
        self.machine: Callable[[], MachineReading | None] | None = (
            (read_machine if real else None) if machine is _MACHINE else machine)      # type: ignore[assignment]
        self.threads = threads or compute_threads
        self._cpu = self._wall = self._mark = 0.0
        self._reading: MachineReading | None = None
        self._checked = 0.0                  # when share_so_far last read the kernel's counters
        self._free_so_far: float | None = None
        self._running = False
        self._threads = 1
        self.cpu_s = self.wall_s = 0.0
        self.thread_s = 0.0                # wall seconds times the compute threads of the time
        self.others_s = 0.0                # core seconds other programs used, where the kernel says (see above)
        self.machine_wall_s = 0.0          # the wall time those were read over
        self.cores = 0

    def start(self) -> None:
        self._cpu, self._wall, self._running = self.cpu_clock(), self.wall_clock(), True
        self._mark, self._threads = self._wall, self.threads()
        self._reading = self.machine() if self.machine is not None else None
        self._checked, self._free_so_far = self._wall, None

    def _weigh_threads(self, now: float) -> float:
        """Thread seconds up to ``now``: the count read at the last mark held since then."""
        return self.thread_s + (now - self._mark) * self._threads

    def stop(self) -> None:
        if self._running:
            now = self.wall_clock()
            self.cpu_s += self.cpu_clock() - self._cpu
            self.wall_s += now - self._wall
            self.thread_s = self._weigh_threads(now)
            self._running = False
            found = self._others_since_start(now)
            if found is not None:
                self.others_s += found[0] * (now - self._wall)
                self.machine_wall_s += now - self._wall
                self.cores = found[1]

    def _others_since_start(self, now: float) -> tuple[float, int] | None:
        """Cores other programs kept busy since ``start`` (and of how many), from a fresh kernel reading; None
        where there is no reading or too little time passed."""
        if self._reading is None or self.machine is None:
            return None
        after = self.machine()
        others = others_cores(self._reading, after, now - self._wall) if after is not None else None
        return None if others is None or after is None else (others, after.cores)

    def share_so_far(self, idle_ms: float = 0.0) -> float | None:
        """``share`` including the interval still being measured: a run's figure while it runs. The kernel's
        reading of other programs is taken again at most every ``RECHECK_S`` (a step of a tiny model takes a
        millisecond; the reading 50 us)."""
        cpu, wall, thread_s = self.cpu_s, self.wall_s, self.thread_s
        if self._running:
            now = self.wall_clock()
            cpu += self.cpu_clock() - self._cpu
            wall += now - self._wall
            thread_s = self.thread_s = self._weigh_threads(now)
            self._mark, self._threads = now, self.threads()
            if now - self._checked >= RECHECK_S:
                self._checked = now
                found = self._others_since_start(now)
                if found is not None:
                    self._free_so_far = 1.0 - found[0] / found[1]
        own = _own_share(cpu, wall, thread_s, idle_ms)
        if own is None or self._free_so_far is None:
            return own
        return min(own, self._free_so_far)

    def share(self, idle_ms: float = 0.0) -> float | None:
        """The CPU share over the measured wall time minus ``idle_ms`` spent waiting on purpose (pauses).
        None when too little was measured to say."""
        own = _own_share(self.cpu_s, self.wall_s, self.thread_s, idle_ms)
        free = self.free_share()
        if own is None or free is None:
            return own
        return min(own, free)

    def others(self) -> float | None:
        """Cores other programs kept busy on average while this measured, where the kernel says."""
        return self.others_s / self.machine_wall_s if self.machine_wall_s > 0 else None

    def free_share(self) -> float | None:
        others = self.others()
        return None if others is None or not self.cores else 1.0 - others / self.cores

    def mean_threads(self) -> float | None:
        return self.thread_s / self.wall_s if self.wall_s > 0 else None


def _own_share(cpu_s: float, wall_s: float, thread_s: float, idle_ms: float) -> float | None:
    wall = wall_s - idle_ms / 1000.0
    if wall < 0.05 or wall_s <= 0:
        return None
    threads = thread_s / wall_s if thread_s > 0 else 1.0
    return cpu_s / (wall * threads)


def busy(cpu_share: float | None) -> bool:
    return cpu_share is not None and cpu_share < BUSY_BELOW


def busy_note(cpu_share: float | None) -> str:
    """The words shown next to a figure measured while the machine was busy; empty otherwise."""
    if not busy(cpu_share):
        return ""
    return (f"measured while the machine was busy (KVScope's compute threads had {cpu_share:.0%} of the CPU time "
            "they would have had alone): other programs competed for the cores")
