"""The engine's thread. ``EngineWorker`` lives in a ``QThread`` and runs one request at a time (load a model,
run a prompt, replay a trace); ``EngineClient`` is its face in the GUI thread.

Events leave the worker through an outbox (a deque: appends and pops are thread-safe) plus one coalesced
queued signal, so a model streaming thousands of tokens a second costs the GUI one wake-up per batch, not one
per token, and the order of events and notes is the order they happened in. The GUI never waits on the worker;
steering goes through ``RunControl`` and closing stops the run and joins the thread.
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

from app.control import RunControl
from engine.errors import EngineError
from engine.events import LoadProgress, ModelLoaded
from engine.memory import device_memory_bytes, process_rss_bytes
from engine.params import GenerationParams

log = logging.getLogger(__name__)
MEMORY_EVERY_S = 0.5


@dataclass(frozen=True)
class Note:
    """A worker message that is not an engine event: ``busy`` (what), ``idle``, ``error`` (message),
    ``memory`` ((rss, gpu or None))."""

    kind: str
    payload: object = None


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
        self._remeasured = False

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
            self.outbox.append(Note("memory", (process_rss_bytes(), device_memory_bytes(device))))

    def take_all(self) -> list[object]:
        """GUI thread: everything queued so far, oldest first."""
        self._signalled.clear()
        items = []
        while self.outbox:
            items.append(self.outbox.popleft())
        return items

    # --- requests (worker thread) -------------------------------------------------------------------------
    def _handle(self, busy: str, failure: str, action: Callable[[], None]) -> None:
        """Every request: ``busy`` first, ``idle`` last whatever happens, and an error as a note, never a
        dead thread (the app must survive anything a model throws)."""
        self.push(Note("busy", busy))
        try:
            action()
        except EngineError as exc:
            self.push(Note("error", str(exc)))
        except Exception as exc:  # noqa: BLE001
            log.exception("%s", failure)
            self.push(Note("error", f"{failure}: {type(exc).__name__}: {exc}"))
        finally:
            self.push(Note("idle"))

    def _session(self):
        if self.session is None:
            raise EngineError("No model is loaded yet: wait for loading to finish, or load one")
        return self.session

    @Slot(dict)
    def load(self, request: dict) -> None:
        def action() -> None:
            from engine.models import load
            from engine.remote import is_server

            if is_server(request["model"]):
                self._attach_server(request["model"])
                return
            from engine.session import Session

            loaded = load(request["model"], request.get("device", "auto"), request.get("dtype", "auto"),
                          trust_remote_code=request.get("trust_remote_code", False), progress=self.push,
                          cancelled=self.control.cancel.is_set)
            self.session = Session(loaded)  # the previous model stays until this one has loaded
            _freeze_heap()
            self.push(loaded.loaded_event())
            self._measure_peaks()

        self._handle("load", "Loading failed", action)

    def _attach_server(self, url: str) -> None:
        """A server "loads" when it answers: no weights here, no peaks to measure (they are the server's)."""
        import time

        from engine.remote import RemoteSession, probe

        self.push(LoadProgress("connect", f"Connecting to {url}", None))
        started = time.perf_counter()
        facts = probe(url)
        self.session, self.peaks = RemoteSession(facts), None
        self.push(ModelLoaded(model=facts, load_ms=(time.perf_counter() - started) * 1000.0))

    @Slot(dict)
    def run(self, request: dict) -> None:
        def action() -> None:
            result = self._session().run(request["prompt"], request["params"], self.push, self.control.cancel,
                                         self.control.before_step)
            self._check_peaks(result)

        self._handle("run", "The run failed", action)

    @Slot()
    def remeasure_peaks(self) -> None:
        self._handle("peaks", "Measuring the peaks failed", lambda: self._measure_peaks(remeasure=True))

    @Slot(dict)
    def chat(self, request: dict) -> None:
        self._handle("run", "The turn failed", lambda: self._session().chat(
            request["messages"], request["params"], self.push, self.control.cancel, self.control.before_step,
            reuse=request.get("reuse", True)))

    @Slot(dict)
    def experiment(self, request: dict) -> None:
        def action() -> None:
            from engine.experiments import run_experiment

            run_experiment(request["kind"], self._session(), self.push, self.control.cancel, peaks=self.peaks,
                           **request.get("settings", {}))

        self._handle("experiment", "The experiment failed", action)

    @Slot(dict)
    def replay(self, request: dict) -> None:
        """Replay traces, one after the other (a lecture prepared as several files): no model, no torch; paced
        by the recorded timestamps. Every file is read and checked before the first event is shown."""
        def action() -> None:
            from engine.trace import read_trace, replay

            traces = [read_trace(path) for path in request["paths"]]
            for events in traces:
                for event in replay(events, request.get("speed", 1.0), cancelled=self.control.cancel.is_set,
                                    sleep=self._sleep):
                    self.push(event)

        self._handle("replay", "The replay failed", action)

    def _measure_peaks(self, remeasure: bool = False) -> None:
        from engine.hardware import peaks_event

        session = self._session()
        self.push(LoadProgress("peaks", "Measuring this machine's peak FLOP/s and memory bandwidth", None))
        try:
            self.peaks = peaks_event(session.loaded, remeasure=remeasure)
            self.push(self.peaks)
        except Exception as exc:  # noqa: BLE001  (bounds are a bonus; a failed measurement must not block runs)
            log.warning("could not measure the hardware peaks: %s", exc)
            self.peaks = None

    def _check_peaks(self, result) -> None:
        """A run that achieved more than the cached ceilings shows they are wrong: measure them again (once)."""
        from engine.costmodel import ModelCost
        from engine.events import RunFinished
        from engine.hardware import implausible

        s = getattr(result, "summary", None)
        if self.peaks is None or not isinstance(result, RunFinished) or not s.prefill_ms or self._remeasured:
            return
        cost = ModelCost(self._session().facts)
        achieved = (cost.prefill(s.reused_tokens + s.prompt_tokens).flops
                    - (cost.prefill(s.reused_tokens).flops if s.reused_tokens else 0.0)) / (s.prefill_ms / 1000.0)
        if implausible(self.peaks, achieved):
            self._remeasured = True
            log.info("a run achieved %.0f GFLOP/s, above the cached peak: measuring again", achieved / 1e9)
            self._measure_peaks(remeasure=True)

    def _sleep(self, seconds: float) -> None:
        self.control.cancel.wait(seconds)


def _freeze_heap() -> None:
    """Move everything alive now (torch, transformers, the model) out of the garbage collector's sight.
    A full collection over those objects took ~220 ms with the GIL held, freezing the window mid-run;
    frozen objects are still freed by reference counting when a model is replaced. No ``gc.collect()``
    first: collecting here, off the GUI thread, can finalise Qt wrappers and deadlock with painting."""
    gc.freeze()


class EngineClient(QObject):
    """GUI-thread facade: requests go to the worker as queued signals, results come back as
    ``events_ready(list)`` (engine events and notes, in order)."""

    events_ready = Signal(list)
    _load = Signal(dict)
    _run = Signal(dict)
    _replay = Signal(dict)
    _experiment = Signal(dict)
    _chat = Signal(dict)
    _remeasure = Signal()

    def __init__(self, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.control = RunControl()
        self.thread = QThread()
        self.thread.setObjectName("kvscope-engine")
        self.worker = EngineWorker(self.control)
        self.worker.moveToThread(self.thread)
        self._load.connect(self.worker.load)
        self._run.connect(self.worker.run)
        self._replay.connect(self.worker.replay)
        self._experiment.connect(self.worker.experiment)
        self._chat.connect(self.worker.chat)
        self._remeasure.connect(self.worker.remeasure_peaks)
        self.worker.pending.connect(self._drain)
        self.thread.finished.connect(self.worker.deleteLater)
        self.busy: str | None = None
        self.model: ModelLoaded | None = None
        self.thread.start()

    def load_model(self, model: str, device: str = "auto", dtype: str = "auto",
                   trust_remote_code: bool = False) -> None:
        self.control.reset()
        self.busy = "load"
        self._load.emit({"model": model, "device": device, "dtype": dtype, "trust_remote_code": trust_remote_code})

    def start_run(self, prompt: str, params: GenerationParams, paused: bool = False) -> None:
        self.control.reset(paused=paused)
        self.busy = "run"
        self._run.emit({"prompt": prompt, "params": params})

    def start_chat(self, messages: list[dict], params: GenerationParams, reuse: bool) -> None:
        self.control.reset()
        self.busy = "run"
        self._chat.emit({"messages": messages, "params": params, "reuse": reuse})

    def start_experiment(self, kind: str, settings: dict) -> None:
        self.control.reset()
        self.busy = "experiment"
        self._experiment.emit({"kind": kind, "settings": settings})

    def open_traces(self, paths: list[str], speed: float = 1.0) -> None:
        self.control.reset()
        self.busy = "replay"
        self._replay.emit({"paths": list(paths), "speed": speed})

    def remeasure_peaks(self) -> None:
        self.control.reset()
        self.busy = "peaks"
        self._remeasure.emit()

    def stop(self) -> None:
        self.control.stop()

    @Slot()
    def _drain(self) -> None:
        items = self.worker.take_all()
        for item in items:
            if isinstance(item, Note) and item.kind in ("busy", "idle"):
                self.busy = item.payload if item.kind == "busy" else None
            elif isinstance(item, ModelLoaded):
                self.model = item
        if items:
            self.events_ready.emit(items)

    def shutdown(self, timeout_ms: int = 1500) -> bool:
        """Stop whatever runs and join the thread. False if a forward pass outlived ``timeout_ms``."""
        self.control.stop()
        self.thread.quit()
        done = self.thread.wait(timeout_ms)
        if done:
            self._drain()
        return done

