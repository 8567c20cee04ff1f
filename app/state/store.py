"""``RunStore``: the runs the panels draw, appended event by event, read on the refresh timer.

Per-step numbers go into preallocated numpy arrays that double when full (pyqtgraph's habit), so a panel can
``setData(x[:n], y[:n])`` without copying Python lists at 30 fps. The events themselves are kept too: they are
what a trace saves, and what the token and sampling views look up on hover. History is bounded: the oldest
runs go when there are more than ``max_runs``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from engine.facts import kvformula, vocabulary
from engine.facts.events import (
    AttentionStep,
    ExperimentFailed,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentProgress,
    ExperimentStarted,
    HardwarePeaks,
    KVNorms,
    LayerTimes,
    LessonResult,
    LessonSettings,
    ModelFacts,
    PrefillDone,
    RunFailed,
    RunFinished,
    RunStarted,
    RunSummary,
    ServerFacts,
    TokenStep,
)
from engine.facts.tally import RunTally
from engine.facts.vocabulary import LessonEvent, LessonPoint

E = TypeVar("E", bound=LessonEvent)
P = TypeVar("P", bound=LessonPoint)

STEP_FIELDS = ("t_ms", "latency_ms", "forward_ms", "prob", "raw_prob", "kv_bytes", "waited_ms")


class Series:
    """A growable float64 column."""

    def __init__(self, capacity: int = 256) -> None:
        self._data = np.zeros(capacity)
        self.n = 0

    def append(self, value: float) -> None:
        if self.n == len(self._data):
            self._data = np.concatenate([self._data, np.zeros(len(self._data))])
        self._data[self.n] = value
        self.n += 1

    @property
    def values(self) -> np.ndarray:
        return self._data[: self.n]


class RunRecord:
    """One run: its events, per-step series and the KV grids (layers x positions)."""

    def __init__(self, started: RunStarted, number: int = 1, peaks: HardwarePeaks | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.started = started
        self.clock = clock            # seconds: the wall clock, or a render's virtual one (its frames' times)
        self.number = number          # 1, 2, 3... in this session: how legends name runs
        self.peaks = peaks            # the peaks of the machine that ran it (a replay: its trace's, if any)
        self.model: ModelFacts | ServerFacts = started.model
        self.remote = isinstance(started.model, ServerFacts)     # a server's run: no per-layer anything
        layers = 0 if self.remote else self.model.num_layers
        self.events: list[object] = [started]
        self.tally = RunTally()
        self.tally.add(started)
        self.prefill: PrefillDone | None = None
        self.steps: list[TokenStep] = []
        self.attention: list[AttentionStep] = []     # one per step, when the run captured attention
        self.layer_times: list[LayerTimes] = []      # one per step, when the model is split across devices
        self.series = {name: Series() for name in STEP_FIELDS}
        self.end: RunFinished | RunFailed | None = None
        self._layers = layers
        self._norms = np.zeros((2, layers, 0), dtype=np.float32)   # K, V x layers x positions
        self.norm_positions = 0       # positions whose norms have arrived (they come in batches)
        self.incomplete = False       # a replayed trace ended before this run did
        self.source = ""              # the trace it was replayed from ("": run in this session)
        self.recorded = ""            # where and when that trace was recorded, in words
        self.steering = ""            # "paused" or "stepping" (single steps) while the user holds it, else ""
        self.arrived = clock()        # when the window heard it start (a prefill's elapsed time counts from it)

    # --- identity -----------------------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.started.run_id

    @property
    def label(self) -> str:
        return self.started.label

    @property
    def prompt_tokens(self) -> int:
        return len(self.started.prompt_ids)

    @property
    def reused_tokens(self) -> int:
        """Positions taken over from an earlier turn's cache (0 unless a chat reuses its cache)."""
        return self.prefill.reused_tokens if self.prefill is not None else 0

    @property
    def finished(self) -> bool:
        return self.end is not None or self.incomplete

    @property
    def reason(self) -> str:
        if self.incomplete:
            return "incomplete"
        if isinstance(self.end, RunFinished):
            return self.end.reason
        return "failed" if isinstance(self.end, RunFailed) else "running"

    # --- appending ----------------------------------------------------------------------------------------
    def add(self, event: object) -> None:
        self.events.append(event)
        self.tally.add(event)
        if isinstance(event, PrefillDone):
            self.prefill = event
        elif isinstance(event, KVNorms):
            end = event.first_position + len(event.k_norms[0])
            self._grow(end)
            self._norms[0, :, event.first_position:end] = event.k_norms
            self._norms[1, :, event.first_position:end] = event.v_norms
            self.norm_positions = max(self.norm_positions, end)
        elif isinstance(event, TokenStep):
            self.steps.append(event)
            held = kvformula.held_bytes(event.kv_bytes_per_layer)
            for name, value in (("t_ms", event.t_ms), ("latency_ms", event.latency_ms),
                                ("forward_ms", event.forward_ms), ("prob", event.prob),
                                ("raw_prob", event.raw_prob), ("kv_bytes", None if self.remote else held),
                                ("waited_ms", event.waited_ms)):
                self.series[name].append(np.nan if value is None else value)      # absent: a gap, not a zero
        elif isinstance(event, AttentionStep):
            self.attention.append(event)
        elif isinstance(event, LayerTimes):
            self.layer_times.append(event)
        elif isinstance(event, (RunFinished, RunFailed)):
            self.end = event

    def _grow(self, positions: int) -> None:
        """Capacity doubles, so memory follows the tokens used, not the context size."""
        have = self._norms.shape[2]
        if positions > have:
            extra = max(positions, 2 * have, 64) - have
            self._norms = np.concatenate([self._norms, np.zeros((2, self.model.num_layers, extra),
                                                                dtype=np.float32)], axis=2)

    # --- reading ------------------------------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        return len(self.steps)

    def step_at_position(self, position: int) -> TokenStep | None:
        index = position - self.prompt_tokens
        return self.steps[index] if 0 <= index < len(self.steps) else None

    def summary(self, with_text: bool = True) -> RunSummary:
        """The final summary once finished; while running, the figures so far from the same builder the engine
        uses (``engine.facts.tally``), so nothing shown changes when the run ends. ``with_text=False`` skips the text
        and ids, which cost O(tokens): the status strip asks 30 times a second."""
        if self.end is not None:
            return self.end.summary
        return self.tally.summary(with_text=with_text)

    @property
    def prefilled(self) -> bool:
        """The prompt's pass has ended (until then no figure of the run is measured yet)."""
        return self.prefill is not None or bool(self.steps)

    # --- the cache, as last read (the tally owns these figures; the record only reads them) ------------------
    @property
    def kv_bytes_per_layer(self) -> list[list[int]]:
        return self.tally.kv_bytes_per_layer or [[0, 0] for _ in range(self._layers)]

    @property
    def kv_positions_per_layer(self) -> list[int]:
        return self.tally.kv_positions_per_layer or [0] * self._layers

    @property
    def kv_storage_per_layer(self) -> list[int]:
        """Bytes each layer's storages allocated, where that differs from what its tensors expose."""
        return self.tally.kv_storage_per_layer

    @property
    def kv_tokens(self) -> int:
        """Positions the cache has been fed (sliding layers may hold fewer; the newest token is not fed yet)."""
        return self.tally.kv_tokens

    @property
    def kv_allocated(self) -> int:
        """A static cache: positions allocated up front (0: the cache grows)."""
        return self.tally.kv_static_positions

    def kv_check(self) -> kvformula.KVCheck:
        """What the cache holds, held to the formula, as every view that says it judges it."""
        return self.tally.kv_check(self.model, self.started.params.kv_method)

    def norm_grid(self, which: str) -> np.ndarray:
        """Mean L2 norm of the cached key (``"k"``) or value (``"v"``) vectors, ``[layers, positions]``."""
        grid = self._norms[0 if which == "k" else 1]
        return grid[:, : self.norm_positions]

    def memory_grid(self) -> np.ndarray:
        """Bytes held per layer and position (``[layers, positions seen]``), as measured: each layer's bytes
        and the positions its tensors hold came from the cache in the last event, and a layer that holds fewer
        positions than were seen (a sliding window) holds the most recent ones; the others are NaN. The
        formula is not used here: it is the separate check beside the heatmap."""
        seen = self.kv_tokens
        grid = np.full((self.model.num_layers, seen), np.nan, dtype=np.float32)     # NaN: not held (drawn empty)
        for layer, ((k, v), held) in enumerate(zip(self.kv_bytes_per_layer, self.kv_positions_per_layer)):
            held = min(held, seen)
            if held > 0:                   # a static cache's bytes cover its whole allocation, used or not
                grid[layer, seen - held:seen] = (k + v) / (self.kv_allocated or held)
        return grid

    def token_rate(self, window: int = 8) -> np.ndarray:
        """Running decode tokens/s: tokens over the last ``window`` steps' latency."""
        lat = self.series["latency_ms"].values
        if len(lat) < 2:
            return np.zeros(0)
        decode = lat[1:]
        csum = np.concatenate([[0.0], np.cumsum(decode)])
        idx = np.arange(1, len(decode) + 1)
        lo = np.maximum(idx - window, 0)
        span = csum[idx] - csum[lo]
        return np.where(span > 0, (idx - lo) / (span / 1000.0), 0.0)


class ExperimentRecord:
    """One experiment: its typed settings, the points measured so far, progress, the runs it started, and its
    typed result once it finished."""

    def __init__(self, started: ExperimentStarted, clock: Callable[[], float] = time.monotonic) -> None:
        self.started = started
        self.clock = clock                         # what "now" is for its elapsed time (a render: its frames')
        self.arrived = clock()                     # when its start reached the window
        self.events: list[object] = [started]
        self.points: list[ExperimentPoint] = []
        self._by_type: dict[type, list[object]] = {}      # the lesson's own events, by class
        self._typed: dict[type, tuple[list, int]] = {}      # points read typed, and how many points were read
        self.progress: ExperimentProgress | None = None
        self.end: ExperimentFinished | ExperimentFailed | None = None
        self.run_ids: list[str] = []
        self.recorded = ""                         # replayed: where and when its trace was recorded

    @property
    def kind(self) -> str:
        return self.started.kind

    @property
    def exp_id(self) -> str:
        return self.started.exp_id

    @property
    def finished(self) -> bool:
        return self.end is not None

    @property
    def settings(self) -> LessonSettings:
        return self.started.settings

    @property
    def result(self) -> LessonResult | None:
        """The lesson's result once it finished (None while it runs, or if it failed)."""
        return self.end.result if isinstance(self.end, ExperimentFinished) else None

    def add(self, event: object) -> None:
        self.events.append(event)
        if isinstance(event, ExperimentPoint):
            self.points.append(event)
        elif isinstance(event, LessonEvent):
            self._by_type.setdefault(type(event), []).append(event)
        elif isinstance(event, ExperimentProgress):
            self.progress = event
        elif isinstance(event, (ExperimentFinished, ExperimentFailed)):
            self.end = event

    @property
    def observations(self) -> int:
        """How many of the lesson's own events arrived (a block table, a draft pass): drawn by its view, though
        not points."""
        return sum(len(events) for events in self._by_type.values())

    def of(self, *kinds: type[E]) -> list[E]:
        """The lesson's own events of these classes (``engine.facts.vocabulary.LessonEvent``), in the order they
        came."""
        if len(kinds) == 1:
            return list(self._by_type.get(kinds[0], ()))
        return [e for e in self.events if isinstance(e, kinds)]

    def typed(self, kind: type[P]) -> list[P]:
        """The points that are ``kind`` (a lesson's declared ``LessonPoint``), typed, in order. Points only ever
        arrive, so each is read once: a view redrawn at every event reads only the new ones."""
        read, seen = self._typed.get(kind, ([], 0))
        read = read + vocabulary.of(self.points[seen:], kind)
        self._typed[kind] = (read, len(self.points))
        return list(read)


class RunStore:
    """All runs of this session, newest last. Listeners hear about run-level changes only; per-step changes
    are picked up by the panels' refresh timer through ``version``."""

    def __init__(self, max_runs: int = 20, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock            # what "now" is for the runs' elapsed times (a render sets a virtual one)
        self._frame: float | None = None     # "now" for every view of one frame (``new_frame``)
        self.activity: str | None = None     # what the engine is busy with ("run", "load", ...), None when idle
        self.source = ""              # the trace the events now arriving come from ("": this session's own)
        self.recorded = ""            # where and when that trace was recorded, in words ("": here, now)
        self.runs: list[RunRecord] = []
        self.experiments: list[ExperimentRecord] = []
        self.peaks: HardwarePeaks | None = None
        self.loaded: ModelFacts | ServerFacts | None = None    # the model runs go to now (the controller sets it)
        self.max_runs = max_runs
        self.version = 0
        self._count = 0
        self._listeners: list[Callable[[str, RunRecord], None]] = []

    def new_frame(self) -> None:
        """Every view drawn from now until the next frame reads the same "now": a running prefill's clock says one
        time on one screen, however long the views take to draw."""
        self._frame = self.clock()

    def now(self) -> float:
        return self._frame if self._frame is not None else self.clock()

    def set_activity(self, busy: str | None) -> None:
        if busy != self.activity:
            self.activity = busy
            self.version += 1

    def steer(self, run_id: str | None, steering: str) -> None:
        """The user paused a run (``"paused"``), holds it to single steps (``"stepping"``) or let it run (``""``)."""
        record = self.find(run_id) if run_id else None
        if record is not None and record.steering != steering:
            record.steering = steering
            self.version += 1

    def subscribe(self, listener: Callable[[str, RunRecord], None]) -> None:
        """``listener(kind, run)`` with kind ``"started"`` or ``"ended"``."""
        self._listeners.append(listener)

    @property
    def current(self) -> RunRecord | None:
        return self.runs[-1] if self.runs else None

    def find(self, run_id: str) -> RunRecord | None:
        return next((r for r in reversed(self.runs) if r.run_id == run_id), None)

    def experiment(self, exp_id: str) -> ExperimentRecord | None:
        return next((e for e in reversed(self.experiments) if e.exp_id == exp_id), None)

    def _experiment_of(self, run_id: str) -> ExperimentRecord | None:
        return next((e for e in reversed(self.experiments) if run_id in e.run_ids), None)

    def latest_experiment(self, kind: str) -> ExperimentRecord | None:
        return next((e for e in reversed(self.experiments) if e.kind == kind), None)

    def add(self, event: object) -> None:
        if isinstance(event, HardwarePeaks):
            self.peaks = event
            self.version += 1
            return
        if isinstance(event, ExperimentStarted):
            self.experiments.append(ExperimentRecord(event, self.now))
            self.experiments[-1].recorded = self.recorded
            self.trim()
            self.peaks = event.peaks or self.peaks
            self.version += 1
            return
        exp_id = getattr(event, "exp_id", None)
        if exp_id is not None:
            experiment = self.experiment(exp_id)
            if experiment is not None:
                experiment.add(event)
                self.version += 1
            return
        if isinstance(event, RunStarted):
            self._count += 1
            record = RunRecord(event, self._count, self.peaks, self.now)
            record.source, record.recorded = self.source, self.recorded
            self.runs.append(record)
            self.trim()
            owner = self.experiment(event.experiment) if event.experiment else None
            if owner is not None:
                owner.run_ids.append(record.run_id)          # a run the experiment made: its trace carries it
                owner.events.append(event)
            self.version += 1
            self._notify("started", record)
            return
        run_id = getattr(event, "run_id", None)
        record = self.find(run_id) if run_id is not None else None
        if record is None:
            return
        record.add(event)
        owner = self._experiment_of(run_id)
        if owner is not None:
            owner.events.append(event)        # an experiment's trace carries the runs it made
        self.version += 1
        if isinstance(event, (RunFinished, RunFailed)):
            self._notify("ended", record)

    def mark_incomplete(self, run_id: str) -> None:
        """A replayed trace ended before this run finished: show it as far as it goes, marked."""
        record = self.find(run_id)
        if record is not None:
            record.incomplete = True
            self.version += 1
            self._notify("ended", record)

    def trim(self) -> None:
        """Keep the newest ``max_runs`` runs of your own and the newest ``max_runs`` experiments with every run
        they made (an experiment of 24 runs must not push your runs out); the rest goes, with its memory."""
        del self.experiments[: max(0, len(self.experiments) - self.max_runs)]
        kept_experiments = {e.exp_id for e in self.experiments}
        own = [r for r in self.runs if not r.started.experiment]
        kept_own = {id(r) for r in own[max(0, len(own) - self.max_runs):]}
        self.runs = [r for r in self.runs if (r.started.experiment in kept_experiments if r.started.experiment
                                               else id(r) in kept_own)]
        self.version += 1

    def clear(self) -> None:
        self.runs.clear()
        self.experiments.clear()
        self.version += 1

    def _notify(self, kind: str, record: RunRecord) -> None:
        for listener in list(self._listeners):
            listener(kind, record)
