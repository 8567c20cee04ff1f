"""The engine's thread. ``EngineWorker`` lives in a ``QThread`` and carries out one request at a time (the typed
requests of ``app.state.requests``: load a model, run a prompt, a chat turn, a lesson, replay traces, measure the
machine); ``EngineClient`` is its face in the GUI thread.

Events leave the worker through an outbox (a deque: appends and pops are thread-safe) plus one coalesced
queued signal, so a model streaming thousands of tokens a second costs the GUI one wake-up per batch, not one
per token, and the order of events and notes is the order they happened in. The GUI never waits on the worker;
steering goes through ``RunControl`` and closing stops the work and joins the thread. The engine is imported
here, in the worker's thread, on first use: the window shows before torch loads.
"""

from __future__ import annotations

import collections
import gc
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.state import requests as rq
from app.state.run_control import RunControl
from engine.facts.errors import EngineError
from engine.facts.events import LoadProgress, ModelLoaded
from engine.model.memory import device_memory_bytes, process_rss_bytes, release_freed_heap

log = logging.getLogger(__name__)
MEMORY_EVERY_S = 0.5
DRAIN_BATCH = 2000           # events the GUI takes in per refresh tick at most (about 50 ms of work here)


@dataclass(frozen=True)
class Busy:
    """The worker took a request: ``what`` it is busy with (``app.state.requests.BUSY``)."""

    what: str


@dataclass(frozen=True)
class Idle:
    """The request ended, whatever happened (always the last message of a request)."""


@dataclass(frozen=True)
class Failed:
    """The request could not be carried out; ``message`` says why, in words for the user."""

    message: str


@dataclass(frozen=True)
class HistoryProblem:
    """The run history could not be used as it was (damaged, in use, not writable): one line, said once."""

    message: str


@dataclass(frozen=True)
class Memory:
    """The process's resident memory and, on a GPU, (allocated, reserved) bytes."""

    rss: int
    gpu: tuple[int, int] | None


@dataclass(frozen=True)
class PeaksBelowRun:
    """A run achieved more than this machine's measured peak allows: the peak is too low (measured while the
    machine was busy, or the machine changed). Nothing is measured again until the user asks."""

    achieved_flops_per_s: float
    peak_flops_per_s: float


@dataclass(frozen=True)
class ReplayFile:
    """The events that follow, until the next one, come from the trace at ``path`` (a lecture shows each scene
    the runs of its own traces)."""

    path: str
    recorded: str = ""          # where and when it was recorded (``engine.output.trace.recorded``)


Note = Busy | Idle | Failed | HistoryProblem | Memory | PeaksBelowRun | ReplayFile


class EngineWorker(QObject):
    pending = Signal()

    def __init__(self, control: RunControl) -> None:
        super().__init__()
        self.control = control
        self.outbox: collections.deque[object] = collections.deque()
        self.session = None
        self.peaks = None
        self._signalled = threading.Event()
        self._last_memory = 0.0
        self._said_peaks_low = False
        self._history = None                 # the run history's recorder, opened in this thread at the first run
        self._history_said = ""
        self._actions: dict[type, tuple[str, Callable]] = {
            rq.Load: ("Loading failed", self._load), rq.Run: ("The run failed", self._run),
            rq.Chat: ("The turn failed", self._chat), rq.Lesson: ("The experiment failed", self._lesson),
            rq.Replay: ("The replay failed", self._replay), rq.Remeasure: ("Measuring failed", self._remeasure)}

    # --- outbox -------------------------------------------------------------------------------------------
    def push(self, item: object) -> None:
        self.outbox.append(item)
        if not self._signalled.is_set():
            self._signalled.set()
            self.pending.emit()
        now = time.monotonic()
        if now - self._last_memory >= MEMORY_EVERY_S:
            self._last_memory = now
            device = self.session.facts.device if self.session is not None else "cpu"
            self.outbox.append(Memory(process_rss_bytes(), device_memory_bytes(device)))

    def take(self, limit: int = 1 << 62) -> list[object]:
        """GUI thread: up to ``limit`` of the items queued so far, oldest first. While items remain, no new
        ``pending`` is signalled: the GUI takes the rest at its own pace (``EngineClient.drain_backlog``)."""
        items = []
        while self.outbox and len(items) < limit:
            items.append(self.outbox.popleft())
        if not self.outbox:
            self._signalled.clear()
        return items

    # --- requests (worker thread) -------------------------------------------------------------------------
    @Slot(object)
    def handle(self, request: rq.Request) -> None:
        """Every request: ``busy`` first, ``idle`` last whatever happens, and an error as a note, never a
        dead thread (the app must survive anything a model throws)."""
        failure, action = self._actions[type(request)]
        self.push(Busy(rq.BUSY[type(request)]))
        try:
            action(request)
        except EngineError as exc:
            self.push(Failed(str(exc)))
        except RecursionError:
            self.push(Failed(f"{failure}: what was read was nested too deeply to be what it claimed"))
        except Exception as exc:  # noqa: BLE001
            log.exception("%s", failure)
            self.push(Failed(f"{failure}: {type(exc).__name__}: {exc}"))
        finally:
            self.push(Idle())

    def _session(self):
        if self.session is None:
            raise EngineError("No model is loaded yet: wait for loading to finish, or load one")
        return self.session

    def _load(self, request: rq.Load) -> None:
        from engine.serve.client import is_server

        if is_server(request.model):
            self._attach_server(request)
            return
        from engine.model.models import Offload, load
        from engine.run.passes import STOPPABLE
        from engine.run.session import RunOptions, Session

        loaded = load(request.model, request.device, request.dtype, trust_remote_code=request.trust_remote_code,
                      progress=self.push, cancelled=self.control.cancel.is_set,
                      offload=Offload(memory_budget=request.memory_budget))
        # The previous model stays until this one has loaded; a run never waits for a graph: it switches to it.
        self.session = Session(loaded, RunOptions(compile_in_background=True, prefill_chunk=STOPPABLE))
        self.push(loaded.loaded_event())             # the window then settles the heap (EngineClient._drain)
        self._said_peaks_low = False
        self._measure_peaks(may_measure=request.measure_peaks)

    def _attach_server(self, request: rq.Load) -> None:
        """A server "loads" when it answers: no weights here, no peaks to measure (they are the server's)."""
        from engine.serve.client import without_credentials
        from engine.serve.remote import RemoteSession, probe

        self.push(LoadProgress("connect", f"Connecting to {without_credentials(request.model)}", None))
        started = time.perf_counter()
        facts = probe(request.model, deadline_s=request.deadline_s)
        self.session, self.peaks = RemoteSession(facts, deadline_s=request.deadline_s), None
        self.push(ModelLoaded(model=facts, load_ms=(time.perf_counter() - started) * 1000.0))

    def _remembered(self, event: object) -> None:
        """A run's, a turn's or an experiment's events: shown, and added to the run history when it ends (in
        this thread: the window never waits for the database)."""
        self.push(event)
        if self._history is None:
            from engine.output.history import History, HistoryRecorder

            self._history = HistoryRecorder(History())
        self._history(event)
        if self._history.problem and self._history.problem != self._history_said:
            self._history_said = self._history.problem
            self.push(HistoryProblem(self._history.problem))

    def _run(self, request: rq.Run) -> None:
        result = self._session().run(request.prompt, request.params, self._remembered, self.control.cancel,
                                     self.control.before_step)
        self._check_peaks(result)

    def _chat(self, request: rq.Chat) -> None:
        messages = [{"role": role, "content": content} for role, content in request.messages]
        self._session().chat(messages, request.params, self._remembered, self.control.cancel,
                             self.control.before_step,
                             reuse=request.reuse)

    def _lesson(self, request: rq.Lesson) -> None:
        from engine import lessons
        from engine.run.experiment import run_lesson

        run_lesson(lessons.lesson(request.kind), self._session(), request.settings, self._remembered,
                   self.control.cancel, self.peaks)

    def _replay(self, request: rq.Replay) -> None:
        """Replay traces, one after the other (a lecture prepared as several files): no model, no torch; paced
        by the recorded timestamps. Every file is read and checked before the first event is shown."""
        from engine.output.trace import read_traces, recorded, replay

        for path, events in zip(request.paths, read_traces(request.paths)):
            self.push(ReplayFile(str(path), recorded(events)))
            for event in replay(events, request.speed, cancelled=self.control.cancel.is_set, sleep=self._sleep):
                self.push(event)

    def _remeasure(self, _request: rq.Remeasure) -> None:
        self._measure_peaks(remeasure=True)

    def _measure_peaks(self, remeasure: bool = False, may_measure: bool = True) -> None:
        """This machine's peaks: cached, or measured now (once per machine, before the first run, said in the
        status bar); with ``may_measure`` False only a cached figure (none: the ceilings say they are not measured)."""
        from engine.model.hardware import peaks_event

        session = self._session()
        try:
            self.peaks = peaks_event(session.loaded, remeasure=remeasure, may_measure=may_measure,
                                     measuring=lambda: self.push(LoadProgress(
                                         "peaks", "Measuring this machine's peak FLOP/s and memory bandwidth (once "
                                         "per machine; a run waits for it)", None)))
            if self.peaks is not None:
                self.push(self.peaks)
        except Exception as exc:  # noqa: BLE001  (bounds are a bonus; a failed measurement must not block runs)
            log.warning("could not measure the hardware peaks: %s", exc)
            self.peaks = None

    def _check_peaks(self, result) -> None:
        """A run that achieved more than the cached peak shows the peak is wrong: say so (once per model). It is
        not measured again here: a measurement keeps the CPU busy for a while, and must never start by itself
        after a run or a stop, in front of a room."""
        from engine.facts.costmodel import Device, ModelCost
        from engine.facts.events import RunFinished
        from engine.model.hardware import implausible

        s = getattr(result, "summary", None)
        if self.peaks is None or not isinstance(result, RunFinished) or not s.prefill_ms or self._said_peaks_low:
            return
        prefill = ModelCost(self._session().facts).prefill_after(s.reused_tokens, s.prompt_tokens)
        achieved = prefill.flops / (s.prefill_ms / 1000.0)
        if implausible(self.peaks, achieved, cost=prefill):
            self._said_peaks_low = True
            self.push(PeaksBelowRun(achieved, prefill.peak_flops_per_s(Device.of(self.peaks))))

    def _sleep(self, seconds: float) -> None:
        self.control.cancel.wait(seconds)


def settle_heap() -> None:
    """Free what a load left for the garbage collector, then move everything alive (torch, transformers, the
    model) out of its sight. A full collection over those objects took ~220 ms with the GIL held, freezing the
    window mid-run; frozen, they are never scanned. Loading leaves cycles that reach the model (torch's pytree
    and tracing closures; a replaced session did too): frozen as they were, every model ever loaded stayed
    resident (four loads of SmolLM2, 3.6 GB). So the collector sees everything again and collects, freezes what
    is left, and the freed heap goes back to the OS: 390-450 ms once a load, with SmolLM2. Called on the GUI
    thread: a collection off it can finalise Qt wrappers and deadlock with painting."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    release_freed_heap()


class EngineClient(QObject):
    """GUI-thread facade: requests go to the worker as queued signals, results come back as
    ``events_ready(list)`` (engine events and notes, in order)."""

    events_ready = Signal(list)
    _request = Signal(object)

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.control = RunControl()
        self.thread = QThread()
        self.thread.setObjectName("kvscope-engine")
        self.worker = EngineWorker(self.control)
        self.worker.moveToThread(self.thread)
        self._request.connect(self.worker.handle)
        self.worker.pending.connect(self._drain)
        self.thread.finished.connect(self.worker.deleteLater)
        self.busy: str | None = None
        self.model: ModelLoaded | None = None
        self.thread.start()

    def submit(self, request: rq.Request, paused: bool = False) -> None:
        """Hand ``request`` to the worker (``paused``: a run starts paused after its prefill)."""
        self.control.reset(paused=paused)
        self.busy = rq.BUSY[type(request)]
        self._request.emit(request)

    def stop(self) -> None:
        self.control.stop()

    def thread_policy(self) -> str:
        """How the engine's compute threads run in this process (``engine.model.threads``), in a line: read once a
        model is loaded (the engine is imported lazily, with torch)."""
        from engine.model.threads import policy_words

        return policy_words()

    def drain_backlog(self) -> None:
        """Take the next batch if the worker sent more than one (the refresh timer calls this every tick)."""
        if self.worker.outbox:
            self._drain()

    @Slot()
    def _drain(self) -> None:
        """A batch of what the worker sent; the rest waits for the next refresh tick, so a server that sends
        20,000 tokens a second never holds the window still while it is taken in."""
        items = self.worker.take(DRAIN_BATCH)
        for item in items:
            if isinstance(item, Busy):
                self.busy = item.what
            elif isinstance(item, Idle):
                self.busy = None
            elif isinstance(item, ModelLoaded):
                self.model = item
                settle_heap()
        if items:
            self.events_ready.emit(items)

    def shutdown(self, timeout_ms: int = 1500) -> bool:
        """Stop whatever runs and join the thread. False if a forward pass outlived ``timeout_ms``."""
        self.control.stop()
        self.thread.quit()
        done = self.thread.wait(timeout_ms)
        while done and self.worker.outbox:
            self._drain()
        return done
