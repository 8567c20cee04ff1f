"""What the engine reports, taken in: events go to the store, fix each run's style, move the selection (new main
runs and chat turns are shown; experiment runs stay in their own views) and advance the conversation; notes from
the worker (failed, idle, memory) reach the window through ``Surface``. The controller starts work; this finishes
what it started (a load, a replay, a queued run), through the ``Activity`` both hold."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from app.link.worker import EngineClient, Failed, HistoryProblem, Idle, Memory, Note, PeaksBelowRun, ReplayFile
from app.state import requests as rq
from app.state.phase import run_phase
from app.state.run_settings import ModelChoice, RunSettings
from app.state.store import RunStore
from app.state.viewstate import CHAT, EXPERIMENT, Conversation, ViewState
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
from engine.serve.client import without_credentials

log = logging.getLogger(__name__)


class Surface(Protocol):
    """What the controller asks of the window."""

    def show_error(self, message: str) -> None: ...
    def show_warning(self, message: str) -> None: ...
    def show_status(self, message: str, ms: int = 5000) -> None: ...
    def show_until_idle(self, message: str) -> None: ...
    def show_progress(self, message: str, fraction: float | None) -> None: ...
    def hide_progress(self) -> None: ...
    def show_model_status(self, text: str, details: str = "") -> None: ...
    def loading(self, progress: LoadProgress) -> None: ...
    def model_loaded(self, loaded: ModelLoaded) -> None: ...
    def busy_changed(self, busy: str | None) -> None: ...
    def show_steering(self, steering: str) -> None: ...
    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None: ...
    def show_experiment(self, kind: str) -> None: ...
    def clear_banner(self) -> None: ...
    def lecture(self) -> bool: ...



@dataclass
class Activity:
    """What the window has started and not yet seen end: the load in progress, a replay, how the next run
    starts (``steering_next``: "stepping" after Step with nothing running), the last load's failure in words,
    an action queued until the engine is idle, one to start once a model is in, and this machine's peaks put
    aside while a trace replays."""

    loading: rq.Load | None = None
    replaying: bool = False
    replay_quiet: bool = False          # a lecture's traces replayed behind its first slide: no run named there
    steering_next: str = ""
    load_failed: str = ""
    queued: Callable[[], None] | None = None
    after_load: Callable[[], None] | None = None
    live_peaks: Any = None


class EventRouter:
    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation, client: EngineClient,
                 run_settings: RunSettings, surface: Surface, model_choice: ModelChoice, activity: Activity,
                 end_replay: Callable[[], None], busy_changed: Callable[[], None]) -> None:
        self.store, self.state, self.conversation, self.client = store, state, conversation, client
        self.run_settings, self.surface, self.model_choice = run_settings, surface, model_choice
        self.activity = activity
        self.end_replay, self.busy_changed = end_replay, busy_changed

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
            if self.activity.loading is not None:
                self.model_choice.loaded_with(self.activity.loading)
            self.activity.loading = None
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
                if self.activity.replaying:
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
        if not self.activity.replaying:
            self.store.steer(event.run_id, self.activity.steering_next)
            self.surface.show_steering(self.activity.steering_next)
            self.activity.steering_next = ""
        if style.group == CHAT:
            self.conversation.started(event.run_id)
            if event.run_id in self.conversation.turn_runs:
                reason = f"chat turn {self.conversation.turn_runs.index(event.run_id) + 1}"
            else:
                reason = "a replayed chat turn"
        else:
            reason = "replay" if self.activity.replaying else "newest run"
        self.state.select(event.run_id, reason)
        if self.activity.replaying and not self.activity.replay_quiet:
            # One run among a lecture's traces is not what its first slide is about ("Replaying run #17" stood
            # under the course's title scene); a trace the user opened is named, another model's said so.
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
        elif not self.activity.replaying and not record.started.experiment:
            self.surface.show_status(f"Run #{record.number} {run_phase(record).words()}.", 5000)

    def _note(self, note: Note) -> None:
        if isinstance(note, Failed):
            self.conversation.refused()
            self.surface.show_error(note.message)
            self.surface.hide_progress()
            if self.activity.loading is not None:
                self.activity.load_failed = f"Could not load {without_credentials(self.activity.loading.model)}."
                self.model_choice.load_failed(self.activity.loading)
                self.activity.loading = None
        elif isinstance(note, Memory):
            self.surface.show_memory(note.rss, note.gpu)
        elif isinstance(note, HistoryProblem):
            self.surface.show_warning(note.message + ".")
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
            if self.activity.loading is None:
                model = self.client.model
                current = describe_loaded(model, brief=True) if model else "No model is loaded."
                self.surface.show_model_status(f"{self.activity.load_failed} {current}".strip(),
                                               loaded_reasons(model) if model else "")
        self.busy_changed()
        if isinstance(note, Idle):
            self._after_idle()

    def _after_idle(self) -> None:
        queued, self.activity.queued = self.activity.queued, None
        if queued is not None:
            queued()
        elif self.activity.after_load is not None and self.client.model is not None:
            start, self.activity.after_load = self.activity.after_load, None
            start()


def describe_loaded(loaded: ModelLoaded, brief: bool = False) -> str:
    """The loaded model in one line. ``brief`` leaves out why its format and kernel were chosen: the status
    bar shows one line, which that reason ran past (cut mid-word at 1280x720); the model's label wraps it."""
    m = loaded.model
    if isinstance(m, ServerFacts):
        context = f", {m.context:,} positions per request" if m.context else ""
        watched = "; /metrics answers" if m.metrics else "; no /metrics"
        return f"{m.name} served by {m.engine} at {m.url}{context}{watched} (answered in {loaded.load_ms:,.0f} ms)"
    how = " (converted from GGUF this time)" if loaded.converted else ""
    why = f" ({loaded.dtype_reason})" if loaded.dtype_reason and loaded.dtype_reason != "chosen" and not brief \
        else ""
    return (f"{m.name}: {m.num_params / 1e6:,.0f}M parameters, {m.num_layers} layers, {m.weights or m.dtype} on "
            f"{m.device}{why}; loaded in {loaded.load_ms / 1000:.1f} s{how}")


def loaded_reasons(loaded: ModelLoaded) -> str:
    """Why the model runs as it does (its dtype, its kernels): the details behind ``describe_loaded``'s line."""
    reason = loaded.dtype_reason
    return f"Why {loaded.model.weights or loaded.model.dtype}: {reason}" if reason and reason != "chosen" else ""


def duration(ms: float) -> str:
    for unit, size in (("days", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:,.1f} {unit}"
    return f"{ms:,.0f} ms"


