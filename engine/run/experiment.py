"""One lifecycle for every lesson: a lesson is a module (``engine.lessons``) that declares its settings and
result types, its run function and its table; this module starts it, gives it a clock, progress, points and a
cancel flag, tags the runs it makes, and finishes or fails it, the same way for every lesson. The CLI, the
window's Experiments tabs and its lecture scenes all start lessons through :func:`run_lesson`, so the stop key,
a scene's action key and a tab's Run button behave alike everywhere.

No torch here (a lesson's run function imports what it drives): the window reads lessons with no model loaded.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.facts.contention import LoadMeter, busy_note
from engine.facts.costmodel import Cost, Device, ModelCost
from engine.facts.errors import ParameterError
from engine.facts.events import (
    ExperimentFailed,
    ExperimentFinished,
    ExperimentPoint,
    ExperimentProgress,
    ExperimentStarted,
    HardwarePeaks,
    LessonResult,
    LessonSettings,
    ModelFacts,
    RunStarted,
    ServerFacts,
)
from engine.facts.vocabulary import LessonEvent, LessonPoint
from engine.run.faults import FaultPhase

Sink = Callable[[object], None]
MODEL, SERVER = "model", "server"        # what a lesson runs against: a model loaded here, or a serving engine


@dataclass(frozen=True)
class Span:
    """A stretch of time on a named track, for timeline exports (Perfetto): ``start_ms`` from the experiment's
    start, as measured; ``category`` (the name where none is given) and ``args`` as Perfetto shows them."""

    track: str
    name: str
    start_ms: float
    duration_ms: float
    category: str = ""
    args: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter:
    """Values of a named counter at one moment, for timeline exports."""

    name: str
    t_ms: float
    values: dict[str, float]


@dataclass(frozen=True)
class Lesson:
    """A lesson as the registry lists it, and everything it declares of its own. ``run(experiment, settings)``
    measures and returns the typed result; ``check(target, settings)`` refuses settings the loaded model cannot
    run, before anything starts; ``table(points, result)`` is what the CLI prints; ``timeline(items)`` what an
    experiment's points and own events (all of them, in order) add to a Perfetto trace (lanes, counters), if
    anything; ``timed`` is False for a lesson whose figures are bytes, which no busy machine changes (no busy
    note). ``quick``: settings for a short run on a small model (a 256-position context, seconds), what the tests
    that take every lesson and a quick demonstration use; ``course``: what the shipped course records (the
    embedded model, a few minutes on a two-core laptop), over the lesson's defaults. ``points``: the typed points
    it reports (``engine.facts.vocabulary.LessonPoint``: its table's columns, the schema's checks); ``events``:
    the events of its own (``LessonEvent``), which the trace schema and the window learn from here; ``faults``:
    the ``KVSCOPE_FAULTS`` phases its processes read; ``workers``: the processes it starts, by name, each an entry
    taking its command line (the engine's ``worker`` command runs one)."""

    kind: str
    title: str
    settings: type[LessonSettings]
    result: type[LessonResult]
    run: Callable[[Experiment, Any], LessonResult]
    table: Callable[[Sequence[ExperimentPoint], LessonResult], str]
    target: str = MODEL
    check: Callable[[Any, Any], None] | None = None
    timeline: Callable[[Sequence[object]], list[Span | Counter]] | None = None
    timed: bool = True          # False: it measures bytes, not time, so a busy machine changes nothing
    quick: Mapping[str, Any] = field(default_factory=dict)
    course: Mapping[str, Any] = field(default_factory=dict)
    points: tuple[type[LessonPoint], ...] = ()
    events: tuple[type[LessonEvent], ...] = ()
    faults: tuple[FaultPhase, ...] = ()
    workers: Mapping[str, Callable[[Sequence[str]], None]] = field(default_factory=dict)

    def report(self, points: Sequence[ExperimentPoint], result: LessonResult) -> str:
        """What the CLI prints: the lesson's own table, then what every lesson's ends with, said here once: a
        timed lesson's busy-machine note and the thread count's note."""
        lines = [self.table(points, result)]
        busy = busy_note(result.lowest_cpu_share) if self.timed else ""
        lines += [f"note: {note}" for note in (busy, result.threads_note) if note]
        return "\n".join(lines)


class Experiment:
    """What a lesson's run function works with: the session (or server) it measures, a clock since the start,
    ``progress`` and ``point`` to report, ``emit`` for its own events (runs it makes are tagged with its id),
    and ``cancelled`` to check between measurements."""

    def __init__(self, lesson: Lesson, target: Any, emit: Sink, cancel: threading.Event | None,
                 peaks: HardwarePeaks | None) -> None:
        self.exp_id = uuid.uuid4().hex[:12]
        self.lesson, self.target, self.peaks = lesson, target, peaks
        self.cancel = cancel or threading.Event()
        self._sink = emit
        self.t0 = time.perf_counter()
        # Ceilings only from peaks measured on a quiet machine (a busy one's would sit below what runs achieve).
        self.device = Device.of(peaks) if peaks and peaks.quiet else None
        facts = target.facts
        self.cost = ModelCost(facts) if isinstance(facts, ModelFacts) else None      # a server: none
        self.meter = LoadMeter()

    @property
    def session(self) -> Any:
        return self.target

    @property
    def cancelled(self) -> bool:
        return self.cancel.is_set()

    def ms(self) -> float:
        return (time.perf_counter() - self.t0) * 1000.0

    def emit(self, event: object) -> None:
        if isinstance(event, RunStarted) and not event.experiment:
            event = dataclasses.replace(event, experiment=self.exp_id)
        self._sink(event)

    def progress(self, done: int, total: int, message: str) -> None:
        self.emit(ExperimentProgress(self.exp_id, self.ms(), min(done, total), total, message[:1024]))

    def point(self, point: LessonPoint, series: str = "") -> None:
        """One measured point, one of the lesson's declared ``points``; a figure that is not a finite number (a
        ratio over nothing) is left out: absent, never NaN. ``series``: where a point type names a family of
        series (one per engine of a server), which one."""
        if type(point) not in self.lesson.points:
            raise TypeError(f"{self.lesson.title} declares no {type(point).__name__} point")
        self.emit(ExperimentPoint(self.exp_id, self.ms(), series or point.series, point.values()))

    def predicted_ms(self, cost: Cost) -> float | None:
        return cost.predicted_s(self.device) * 1000.0 if self.device else None


def run_lesson(lesson: Lesson, target: Any, settings: LessonSettings, emit: Sink,
               cancel: threading.Event | None = None, peaks: HardwarePeaks | None = None) -> ExperimentFinished:
    """Run one lesson: refused before it starts if the target or settings cannot run it; otherwise
    ``ExperimentStarted``, what the lesson emits, then ``ExperimentFinished`` (``"stopped"`` when cancelled,
    with what was measured). If the lesson breaks after it started, ``ExperimentFailed`` closes its record
    before the error goes on to the caller."""
    if not isinstance(settings, lesson.settings):
        raise ParameterError(f"{lesson.title} takes {lesson.settings.__name__}, not {type(settings).__name__}")
    remote = isinstance(target.facts, ServerFacts)
    if remote != (lesson.target == SERVER):
        raise ParameterError(
            "This experiment runs the model inside KVScope: load a local model for it (against a server, use the "
            "load test)" if lesson.target == MODEL else
            "The load test runs against a server: start KVScope with --server URL (or type the server's address "
            "as the model)")
    if lesson.check is not None:
        lesson.check(target, settings)
    experiment = Experiment(lesson, target, emit, cancel, peaks)
    emit(ExperimentStarted(experiment.exp_id, 0.0, lesson.kind, target.facts, settings, peaks))
    on_cpu = not remote and str(getattr(target.facts, "device", "")).startswith("cpu")
    began = time.perf_counter()                 # the thread governor's changes from here on are this experiment's
    if on_cpu:
        experiment.meter.start()
    try:
        result = lesson.run(experiment, settings)
    except BaseException as exc:
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        emit(ExperimentFailed(experiment.exp_id, experiment.ms(), type(exc).__name__[:128], message[:4096]))
        raise
    finally:
        experiment.meter.stop()
    if result.lowest_cpu_share is None and on_cpu and lesson.timed:
        result = dataclasses.replace(result, lowest_cpu_share=experiment.meter.share())
    if on_cpu and lesson.timed and not result.threads_note:
        from engine.model import threads  # torch comes with it: a lesson's module is read without it

        gov = threads.governor()
        result = dataclasses.replace(result, threads_note=threads.change_words(gov.since(began), gov.ceiling))
    note = rounding_note(target.facts, result)
    if note and not result.tokens_note:
        result = dataclasses.replace(result, tokens_note=note)
    reason = "stopped" if experiment.cancelled else "done"
    if experiment.cancelled and not result.incomplete:
        # A lesson hands back what it measured when stopped, and may not know that was short of its plan
        # (prefill stopped after its first length summarised one point as a whole sweep).
        result = dataclasses.replace(result, incomplete=True)
    finished = ExperimentFinished(experiment.exp_id, experiment.ms(), reason, result)
    emit(finished)
    return finished


def rounding_note(facts: object, result: LessonResult) -> str:
    """Why greedy tokens part in a 16-bit float, where they do: a forward pass over several tokens (prefill
    without the cache, a padded batch, verified guesses) sums in another order than one token at a time, and
    a near-tie between two tokens can flip. Said beside the check, so a lecture never shows a bare "different"."""
    dtype = getattr(facts, "dtype", "float32")
    checks = getattr(type(result), "token_checks", ())
    failed = any(getattr(result, name, None) is False for name in checks) and not result.incomplete
    if not failed or dtype == "float32":
        return ""
    return (f"in {dtype}, a pass over several tokens rounds differently from one token at a time, so greedy "
            "choices between near-tied tokens can part; run it in float32 to compare token for token")
