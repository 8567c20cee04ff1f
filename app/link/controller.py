"""The window's actions, without a widget in sight (what the engine reports back is ``app.link.routing``'s).

Every action either starts work in the engine or says why it did not (busy with what, nothing loaded yet); a
Run pressed while the previous run winds down after Stop, or while the machine is being measured after a
load, is queued, not dropped. Actions read the plain models (``RunSettings`` for a run, ``LessonChoices`` for a
lesson), so the Run button, Ctrl+Enter, a scene's R and its parameter keys all start the same thing. The window
is told what to show through the small ``Surface`` interface, so this module is testable as is.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace

from app.link.routing import Activity, EventRouter, Surface
from app.link.worker import EngineClient
from app.state import requests as rq
from app.state.run_settings import LessonChoices, ModelChoice, RunSettings
from app.state.store import RunStore
from app.state.viewstate import Conversation, ViewState
from engine import lessons as engine_lessons
from engine.facts.errors import EngineError
from engine.serve.client import without_credentials

log = logging.getLogger(__name__)
BUSY = {"load": "a model is loading", "run": "a run is in progress", "experiment": "an experiment is running",
        "replay": "a trace is replaying", "peaks": "this machine's peaks are being measured"}
STOPPING = {"load": "the loading", "run": "the run", "experiment": "the experiment", "replay": "the replay",
            "peaks": "measuring this machine's peaks"}


COMPILED_STATUS = ("Compiled decode: a new cache length's graph is built beside the run (a minute or more the "
                   "first time on a machine; the run decodes eagerly, and slowly, meanwhile) and decode switches "
                   "to it at the next step; the timing charts mark where")


class Controller:
    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation, client: EngineClient,
                 run_settings: RunSettings, choices: LessonChoices, surface: Surface,
                 model_choice: ModelChoice | None = None) -> None:
        self.store, self.state, self.conversation, self.client = store, state, conversation, client
        self.run_settings, self.choices, self.surface = run_settings, choices, surface
        self.model_choice = model_choice or ModelChoice()     # what the controls name; what loaded
        self.replay_speed = 1.0
        self.activity = Activity()
        self.router = EventRouter(store, state, conversation, client, run_settings, surface, self.model_choice,
                                  self.activity, self.end_replay, self._busy_changed)
        self.on_events = self.router.on_events              # what the engine reports goes there
        client.events_ready.connect(self.on_events)

    # --- refusals ---
    def refusal(self, action: str, needs_model: bool = True, in_scene: bool = False) -> str | None:
        """Why ``action`` cannot start now, or None if it can; the stop key named as it is where it is pressed
        (in a lecture scene Esc leaves the scene, Ctrl+. stops)."""
        busy = self.client.busy
        if busy:
            key = "Ctrl+." if in_scene else "Esc"
            stop = f" ({key} stops it)" if busy in ("run", "experiment", "replay") else ""
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
        if self.client.busy == "load" and self.client.model is not None and self.activity.loading is None:
            self.activity.queued = action
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
        request = self.activity.loading = replace(request, measure_peaks=not self.surface.lecture())
        self.activity.load_failed = ""
        self.surface.show_progress(f"Loading {shown}…", None)
        self.surface.show_model_status(f"Loading {shown}…")
        self.client.submit(request)
        self._busy_changed()

    def run(self, paused: bool = False, attention: bool = False) -> None:
        """Run the prompt with the run settings (``attention``: record attention whatever they say)."""
        start = lambda: self.run(paused, attention)  # noqa: E731  (the same call, later)
        if self.client.busy == "run" and self.client.control.cancel.is_set():
            self.activity.queued = start
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
        self.activity.steering_next = "stepping" if paused else ""
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
        self.activity.queued = None
        self.client.stop()
        self.surface.show_until_idle(f"Stopping: {STOPPING.get(self.client.busy, self.client.busy)} ends at its "
                                     "next step.")

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

    def open_traces(self, paths: list[str], quiet: bool = False) -> bool:
        """``quiet``: a lecture's traces, replayed behind its first slide: no run of them is named there."""
        if self._refused("Opening a trace", needs_model=False):
            return False
        self.begin_replay()
        self.activity.replay_quiet = quiet
        self.client.submit(rq.Replay(tuple(paths), self.replay_speed))
        self._busy_changed()
        return True

    def begin_replay(self) -> None:
        """Events from a trace follow (the worker's replay, or a render's). This machine's peaks say nothing of
        the machine a trace was recorded on: a replayed run's ceilings come from the trace's own peaks, if it has
        any, and this machine's return when the replay ends."""
        if not self.activity.replaying:
            self.activity.live_peaks, self.store.peaks = self.store.peaks, None
        self.activity.replaying = True

    def end_replay(self) -> None:
        if self.activity.replaying:
            self.store.peaks = self.activity.live_peaks
        self.activity.replaying = False
        self.store.source = self.store.recorded = ""

    def remeasure_peaks(self) -> None:
        if self._refused("Measuring the peaks"):
            return
        self.client.submit(rq.Remeasure())
        self._busy_changed()

    def start_when_loaded(self, kind: str) -> None:
        """Start lesson ``kind`` once the model (or server) is in (``--kv-events``: the watch from launch)."""
        self.activity.after_load = lambda: self.start_lesson(kind)

    def run_when_loaded(self) -> None:
        """Run the prompt once the model is in (``kvscope --run``: a demo that needs no click)."""
        self.activity.after_load = self.run

    def clear_runs(self) -> None:
        if self._refused("Clearing the runs", needs_model=False):
            return
        self.store.clear()
        self.state.forget_runs(set())

    def set_history(self, max_runs: int) -> None:
        self.store.max_runs = max(1, max_runs)
        self.store.trim()
        self.state.forget_runs({r.run_id for r in self.store.runs})
