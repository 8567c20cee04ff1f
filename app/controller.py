"""The window's actions and the routing of what the engine reports, without a widget in sight.

Every action either starts work in the engine or says why it did not (busy with what, nothing loaded yet); a
Run pressed while the previous run winds down after Stop, or while the machine is being measured after a
load, is queued, not dropped. Actions read the plain models (``RunSettings`` for a run, ``LessonChoices`` for a
lesson), so the Run button, Ctrl+Enter, a scene's R and its parameter keys all start the same thing. Events
from the worker go to the store, fix each run's style, move the selection (new main runs and chat turns are
shown; experiment runs stay in their own views) and advance the conversation. The window is told what to
show through the small ``Surface`` interface, so this module is testable as is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from app import requests as rq
from app.phase import run_phase
from app.run_settings import LessonChoices, ModelChoice, RunSettings
from app.store import RunStore
from app.viewstate import CHAT, EXPERIMENT, Conversation, ViewState
from app.worker import EngineClient, Failed, Idle, Memory, Note, PeaksBelowRun, ReplayFile
from engine import lessons as engine_lessons
from engine.facts.errors import EngineError
from engine.facts.events import (
    ExperimentStarted,
    LoadProgress,
    ModelLoaded,
    RunFailed,
    RunFinished,
    RunStarted,
    ServerFacts,
)
from engine.output.trace import ReplayGap, ReplayIncomplete
from engine.serve.remote import without_credentials

log = logging.getLogger(__name__)
BUSY = {"load": "a model is loading", "run": "a run is in progress", "experiment": "an experiment is running",
        "replay": "a trace is replaying", "peaks": "this machine's peaks are being measured"}
STOPPING = {"load": "the loading", "run": "the run", "experiment": "the experiment", "replay": "the replay",
            "peaks": "measuring this machine's peaks"}


class Surface(Protocol):
    """What the controller asks of the window."""

    def show_error(self, message: str) -> None: ...
    def show_warning(self, message: str) -> None: ...
    def show_status(self, message: str, ms: int = 5000) -> None: ...
    def show_progress(self, message: str, fraction: float | None) -> None: ...
    def hide_progress(self) -> None: ...
    def show_model_status(self, text: str) -> None: ...
    def loading(self, progress: LoadProgress) -> None: ...
    def model_loaded(self, loaded: ModelLoaded) -> None: ...
    def busy_changed(self, busy: str | None) -> None: ...
    def show_steering(self, steering: str) -> None: ...
    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None: ...
    def show_experiment(self, kind: str) -> None: ...
    def clear_banner(self) -> None: ...
    def lecture(self) -> bool: ...


COMPILED_STATUS = ("Compiled decode: a new cache length's graph is built beside the run (a minute or more the "
                   "first time on a machine; the run decodes eagerly, and slowly, meanwhile) and decode switches "
                   "to it at the next step; the timing charts mark where")


def describe_loaded(loaded: ModelLoaded) -> str:
    m = loaded.model
    if isinstance(m, ServerFacts):
        context = f", {m.context:,} positions per request" if m.context else ""
        watched = "; /metrics answers" if m.metrics else "; no /metrics"
        return f"{m.name} served by {m.engine} at {m.url}{context}{watched} (answered in {loaded.load_ms:,.0f} ms)"
    how = " (converted from GGUF this time)" if loaded.converted else ""
    why = f" ({loaded.dtype_reason})" if loaded.dtype_reason and loaded.dtype_reason != "chosen" else ""
    return (f"{m.name}: {m.num_params / 1e6:,.0f}M parameters, {m.num_layers} layers, {m.weights or m.dtype} on "
            f"{m.device}{why}; loaded in {loaded.load_ms / 1000:.1f} s{how}")


class Controller:
    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation, client: EngineClient,
                 run_settings: RunSettings, choices: LessonChoices, surface: Surface,
                 model_choice: ModelChoice | None = None) -> None:
        self.store, self.state, self.conversation, self.client = store, state, conversation, client
        self.run_settings, self.choices, self.surface = run_settings, choices, surface
        self.model_choice = model_choice or ModelChoice()     # what the controls name; what loaded
        self.replaying = False
        self.loading: rq.Load | None = None
        self.replay_speed = 1.0
        self._load_failed = ""                  # "Could not load X." until the next load starts
        self._live_peaks = None                 # this machine's peaks, put aside while a trace replays
        self._queued: Callable[[], None] | None = None
        self._steering_next = ""                # how the next run starts: "stepping" after Step with nothing running
        self._run_after_load: Callable[[], None] | None = None
        client.events_ready.connect(self.on_events)

    # --- refusals ---
    def refusal(self, action: str, needs_model: bool = True) -> str | None:
        """Why ``action`` cannot start now, or None if it can."""
        busy = self.client.busy
        if busy:
            stop = " (the stop key, Ctrl+., stops it)" if busy in ("run", "experiment", "replay") else ""
            return f"{action} is not available while {BUSY.get(busy, busy)}{stop}."
        if needs_model and self.client.model is None:
            return (f"{action} needs a model: wait for loading to finish (status bar) or press Load model "
                    "(Ctrl+L).")
        return None

    def _refused(self, action: str, needs_model: bool = True) -> bool:
        reason = self.refusal(action, needs_model)
        if reason is not None:
            self.surface.show_status(reason, 6000)
            return True
        return False

    def _queue_after_load(self, action: Callable[[], None], what: str) -> bool:
        """A model has loaded and the machine is being measured once: start ``action`` right after."""
        if self.client.busy == "load" and self.client.model is not None and self.loading is None:
            self._queued = action
            self.surface.show_status(f"{what} queued: it starts as soon as this machine's one-time measurement "
                                     "ends.", 6000)
            return True
        return False

    # --- actions ---
    def load_model(self, request: rq.Load | None = None) -> None:
        """Load ``request``, or the model the controls name now (Ctrl+L, the button)."""
        request = request or self.model_choice.asked
        if self._refused("Loading a model", needs_model=False):
            return
        shown = without_credentials(request.model)
        request = self.loading = replace(request, measure_peaks=not self.surface.lecture())
        self._load_failed = ""
        self.surface.show_progress(f"Loading {shown}…", None)
        self.surface.show_model_status(f"Loading {shown}…")
        self.client.submit(request)
        self._busy_changed()

    def run(self, paused: bool = False, attention: bool = False) -> None:
        """Run the prompt with the run settings (``attention``: record attention whatever they say)."""
        start = lambda: self.run(paused, attention)  # noqa: E731  (the same call, later)
        if self.client.busy == "run" and self.client.control.cancel.is_set():
            self._queued = start
            self.surface.show_status("Run queued: it starts as soon as the stopped run has wound down.", 4000)
            return
        if self._queue_after_load(start, "Run") or self._refused("Run"):
            return
        prompt = self.run_settings.choices.prompt
        if not prompt.strip():
            self.surface.show_error("The prompt is empty: type something for the model to read (or pick a sample "
                                    "prompt).")
            return
        try:
            params = self.run_settings.params(attention=attention)
        except EngineError as exc:
            self.surface.show_error(str(exc))
            return
        self.client.control.delay_s = self.run_settings.choices.slow_ms / 1000.0
        self._steering_next = "stepping" if paused else ""
        self.client.submit(rq.Run(prompt, params), paused=paused)
        self._busy_changed()
        pending = self.model_choice.pending_text()
        if pending:
            self.surface.show_status(f"Running the loaded model; not yet applied: {pending}", 8000)
        elif params.compiled:
            self.surface.show_status(COMPILED_STATUS, 15000)

    def stop(self) -> None:
        """Stop whatever runs: a run, a chat turn, any lesson's experiment, a replay."""
        if not self.client.busy:
            self.surface.show_status("Nothing to stop: no run, experiment or replay is in progress.", 4000)
            return
        self._queued = None
        self.client.stop()
        self.surface.show_status(f"Stopping: {STOPPING.get(self.client.busy, self.client.busy)} ends at its next "
                                 "step.", 4000)

    def step(self) -> None:
        """Running: let exactly one more token through. Idle: start a run that pauses after the prefill."""
        if self.client.busy == "run":
            self.client.control.step()
            self._steer("stepping")
        elif self.client.busy:
            self._refused("Step")
        else:
            self.run(paused=True)

    def set_paused(self, paused: bool) -> bool:
        """Pause or resume the run; False (and a reason in the status bar) if no run is in progress."""
        if self.client.busy != "run":
            self.surface.show_status("Pause works during a run: start one with Ctrl+Enter or step with F10.", 4000)
            return False
        if paused:
            self.client.control.pause()
        else:
            self.client.control.resume()
        self._steer("paused" if paused else "")
        return True

    def _steer(self, steering: str) -> None:
        """The run in progress is held (paused, single steps) or let go: the store says so to every view, and the
        Pause control follows what the run is doing, not which button was pressed."""
        live = self.store.current
        if live is not None and not live.finished and not live.started.experiment:
            self.store.steer(live.run_id, steering)
        self.surface.show_steering(steering)

    def _busy_changed(self) -> None:
        self.store.set_activity(self.client.busy)
        self.surface.busy_changed(self.client.busy)

    def toggle_pause(self) -> bool:
        """F9: pause a running run, resume a paused or single-stepped one."""
        return self.set_paused(not self.client.control.paused)

    def set_slow_motion(self, ms: int) -> None:
        self.run_settings.update(slow_ms=ms)
        self.client.control.delay_s = ms / 1000.0

    def send_chat(self, text: str, reuse: bool) -> bool:
        if self._refused("Sending a message"):
            return False
        try:
            params = self.run_settings.params()
        except EngineError as exc:
            self.surface.show_error(str(exc))
            return False
        messages = self.conversation.send(text)
        if messages is None:
            self.surface.show_status("Type a message first (the last one is still being answered).", 4000)
            return False
        self.client.control.delay_s = self.run_settings.choices.slow_ms / 1000.0
        self.client.submit(rq.Chat(tuple((m["role"], m["content"]) for m in messages), params, reuse))
        self._busy_changed()
        return True

    def start_lesson(self, kind: str) -> bool:
        """Start ``kind`` with the settings its form holds (the same from the tab, a scene key or the menu)."""
        lesson = engine_lessons.lesson(kind)
        if self._queue_after_load(lambda: self.start_lesson(kind), lesson.title) or self._refused(lesson.title):
            return False
        try:
            settings = self.choices.for_run(kind, lesson.settings, self.run_settings.choices.prompt,
                                            tuple(self.conversation.user_turns()))
        except EngineError as exc:
            self.surface.show_error(str(exc))
            return False
        self.client.submit(rq.Lesson(kind, settings))
        self._busy_changed()
        self.surface.show_experiment(kind)
        return True

    def open_traces(self, paths: list[str]) -> bool:
        if self._refused("Opening a trace", needs_model=False):
            return False
        self.begin_replay()
        self.client.submit(rq.Replay(tuple(paths), self.replay_speed))
        self._busy_changed()
        return True

    def begin_replay(self) -> None:
        """Events from a trace follow (the worker's replay, or a render's). This machine's peaks say nothing of
        the machine a trace was recorded on: a replayed run's ceilings come from the trace's own peaks, if it has
        any, and this machine's return when the replay ends."""
        if not self.replaying:
            self._live_peaks, self.store.peaks = self.store.peaks, None
        self.replaying = True

    def end_replay(self) -> None:
        if self.replaying:
            self.store.peaks = self._live_peaks
        self.replaying = False
        self.store.source = self.store.recorded = ""

    def remeasure_peaks(self) -> None:
        if self._refused("Measuring the peaks"):
            return
        self.client.submit(rq.Remeasure())
        self._busy_changed()

    def start_when_loaded(self, kind: str) -> None:
        """Start lesson ``kind`` once the model (or server) is in (``--kv-events``: the watch from launch)."""
        self._run_after_load = lambda: self.start_lesson(kind)

    def run_when_loaded(self) -> None:
        """Run the prompt once the model is in (``kvscope --run``: a demo that needs no click)."""
        self._run_after_load = self.run

    def clear_runs(self) -> None:
        if self._refused("Clearing the runs", needs_model=False):
            return
        self.store.clear()
        self.state.forget_runs(set())

    def set_history(self, max_runs: int) -> None:
        self.store.max_runs = max(1, max_runs)
        self.store.trim()
        self.state.forget_runs({r.run_id for r in self.store.runs})

    # --- what the engine reports ---
    def on_events(self, items: list) -> None:
        for item in items:
            try:
                self._route(item)
            except Exception as exc:  # noqa: BLE001  (one bad event must not stop the ones after it)
                log.exception("taking in %r failed", type(item).__name__)
                self.surface.show_error(f"Showing what the engine reported failed ({type(exc).__name__}: "
                                        f"{str(exc).strip()[:200]}). The window keeps working.")

    def _route(self, item: object) -> None:
        if isinstance(item, Note):
            self._note(item)
        elif isinstance(item, LoadProgress):
            self.surface.show_progress(item.message, item.fraction)
            self.surface.show_model_status(item.message)
            self.surface.loading(item)
        elif isinstance(item, ModelLoaded):
            if self.loading is not None:
                self.model_choice.loaded_with(self.loading)
            self.loading = None
            m = self.store.loaded = item.model     # a server checks its own limits: its context if it states one
            notes = self.run_settings.set_model_limits(
                m.context if isinstance(m, ServerFacts) else m.max_context,
                None if isinstance(m, ServerFacts) else m.vocab_size)
            self.surface.model_loaded(item)
            if notes:
                self.surface.show_warning("Changed to fit the loaded model: " + "; ".join(notes) + ".")
        elif isinstance(item, ReplayGap):
            self.surface.show_status(f"The recording paused for {duration(item.recorded_ms)} here; the replay "
                                     f"shortened the pause to {duration(item.shown_ms)}.", 8000)
        elif isinstance(item, ReplayIncomplete):
            self.store.mark_incomplete(item.run_id)
            self.surface.show_warning("The trace ends before its run finished: the run is shown as far as it "
                                      "goes, marked incomplete.")
        else:
            self.store.add(item)
            if isinstance(item, RunStarted):
                self._started(item)
            elif isinstance(item, ExperimentStarted):
                self.surface.clear_banner()                  # an earlier failure's words would outlive it
                if self.replaying:
                    self.surface.show_experiment(item.kind)  # a replayed experiment is seen, not hidden in a tab
            elif isinstance(item, (RunFinished, RunFailed)):
                self._ended(item)

    def _started(self, event: RunStarted) -> None:
        style = self.state.style_run(event.run_id, event.kind, event.experiment, event.params.kv_cache)
        self.state.forget_runs({r.run_id for r in self.store.runs})
        record = self.store.find(event.run_id)
        if record is None:
            return
        if style.group == EXPERIMENT:
            owner = self.store.experiment(event.experiment)
            if owner is not None and owner.kind in self.state.followed_lessons and self.state.scene is None:
                self.state.select(event.run_id, f"{owner.kind} sweep")     # the heatmap fills as it runs
            return
        self.surface.clear_banner()                  # a new run started: an earlier failure's words are stale
        if not self.replaying:
            self.store.steer(event.run_id, self._steering_next)
            self.surface.show_steering(self._steering_next)
            self._steering_next = ""
        if style.group == CHAT:
            self.conversation.started(event.run_id)
            if event.run_id in self.conversation.turn_runs:
                reason = f"chat turn {self.conversation.turn_runs.index(event.run_id) + 1}"
            else:
                reason = "a replayed chat turn"
        else:
            reason = "replay" if self.replaying else "newest run"
        self.state.select(event.run_id, reason)
        if self.replaying:
            loaded = self.client.model.model.name if self.client.model else None
            other = f" (not the loaded model, {loaded})" if loaded and loaded != event.model.name else ""
            self.surface.show_status(f"Replaying run #{record.number}, recorded with {event.model.name} on "
                                     f"{event.model.device}{other}", 8000)

    def _ended(self, event: RunFinished | RunFailed) -> None:
        record = self.store.find(event.run_id)
        if record is None:
            return
        if record.started.kind == "chat":
            self.conversation.ended(event.run_id, isinstance(event, RunFailed), record.summary().text)
        if isinstance(event, RunFailed):
            self.surface.show_error(f"The run failed: {event.message}")
        elif event.summary.notes and not record.started.experiment:
            self.surface.show_warning(f"Run #{record.number}: " + "; ".join(event.summary.notes))
        elif not self.replaying and not record.started.experiment:
            self.surface.show_status(f"Run #{record.number} {run_phase(record).words()}.", 5000)

    def _note(self, note: Note) -> None:
        if isinstance(note, Failed):
            self.conversation.refused()
            self.surface.show_error(note.message)
            self.surface.hide_progress()
            if self.loading is not None:
                self._load_failed = f"Could not load {without_credentials(self.loading.model)}."
                self.model_choice.load_failed(self.loading)
                self.loading = None
        elif isinstance(note, Memory):
            self.surface.show_memory(note.rss, note.gpu)
        elif isinstance(note, PeaksBelowRun):
            self.surface.show_warning(
                f"A run achieved {note.achieved_flops_per_s / 1e9:,.0f} GFLOP/s, more than this machine's measured "
                f"peak of {note.peak_flops_per_s / 1e9:,.0f} GFLOP/s: the peak was measured too low (on a busy "
                "machine?), so its ceilings are not shown. Run > Measure this machine again, when nothing else "
                "runs, measures it anew.")
        elif isinstance(note, ReplayFile):
            self.store.source, self.store.recorded = note.path, note.recorded
        elif isinstance(note, Idle):
            self.end_replay()
            self.conversation.refused()
            self.surface.hide_progress()
            if self.loading is None:
                current = describe_loaded(self.client.model) if self.client.model else "No model is loaded."
                self.surface.show_model_status(f"{self._load_failed} {current}".strip())
        self._busy_changed()
        if isinstance(note, Idle):
            self._after_idle()

    def _after_idle(self) -> None:
        queued, self._queued = self._queued, None
        if queued is not None:
            queued()
        elif self._run_after_load is not None and self.client.model is not None:
            start, self._run_after_load = self._run_after_load, None
            start()


def duration(ms: float) -> str:
    for unit, size in (("days", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:,.1f} {unit}"
    return f"{ms:,.0f} ms"


