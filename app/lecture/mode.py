"""Lecture mode: the window as a presentation, one scene at a time, and the keys a speaker presses.

Entering it saves the workbench's layout and geometry, hides the docks and menus, switches to the lecture
theme and fills the screen; leaving it restores them and fits the window inside the screen (a workbench laid
out on a larger screen must not come back taller than a 720p projector). In a scene: the number row and
PageUp/PageDown change scene, R runs what the scene is about (a joined lesson has its own key, C), B blanks and
unblanks the screen whatever happened meanwhile, Ctrl+. stops whatever runs, T/P/K/M change temperature, top-p,
top-k and max tokens (Shift lowers) and run again, and the arrow keys step through a run's tokens. A key that
cannot act says why in the scene's footer.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

from PySide6.QtCore import QByteArray, QRect, QSettings
from PySide6.QtGui import QScreen
from PySide6.QtWidgets import QApplication

from app import lessons
from app.lecture.lecture_file import LectureFileError, LectureScene, read_lecture
from app.lecture.scene_list import NAMES
from app.lecture.scenes import SceneView, cutting_step, scene_lesson, scene_run
from app.link.controller import STOPPING, Controller
from app.state.run_settings import RunSettings, notch, param_shape
from app.state.store import RunStore
from app.state.viewstate import ViewState, WhatIfSettings
from app.views import theme as th
from app.views.setting_widgets import setting_text
from engine import lessons as engine_lessons


class LectureWindow(Protocol):
    """What the lecture asks of the window: switch its mode and put its layout back (its own), and Qt's geometry
    calls for filling the screen and fitting inside it again."""

    def apply_mode(self, lecture: bool, height: int = 720) -> None: ...
    def restore_layout(self, state: QByteArray | None) -> None: ...
    def saveState(self) -> QByteArray: ...  # noqa: N802 (Qt's names, here and below)
    def saveGeometry(self) -> QByteArray: ...  # noqa: N802
    def restoreGeometry(self, geometry: QByteArray) -> bool: ...  # noqa: N802
    def isFullScreen(self) -> bool: ...  # noqa: N802
    def showNormal(self) -> None: ...  # noqa: N802
    def showFullScreen(self) -> None: ...  # noqa: N802
    def screen(self) -> QScreen | None: ...
    def setGeometry(self, rect: QRect) -> None: ...  # noqa: N802
    def frameGeometry(self) -> QRect: ...  # noqa: N802
    def resize(self, width: int, height: int) -> None: ...
    def move(self, x: int, y: int) -> None: ...
    def width(self) -> int: ...
    def height(self) -> int: ...


class Lecture:
    def __init__(self, window: LectureWindow, state: ViewState, store: RunStore, view: SceneView,
                 controller: Controller, run_settings: RunSettings, settings: QSettings) -> None:
        self.window, self.state, self.store, self.view = window, state, store, view
        self.controller, self.run_settings, self.settings = controller, run_settings, settings
        self.active = False
        self.area: QRect | None = None       # the area lecture mode covers instead of the screen (a render's frame)
        self.plan: list[LectureScene] = []   # a lecture file's scenes in the speaker's order (PgDn / PgUp)
        self.position = 0                    # the plan's scene shown
        self.workbench_geometry: QByteArray | None = None
        self.started_in: str | None = None   # the scene whose R started the work in progress (None: elsewhere)
        state.subscribe(self._state_changed)
        store.subscribe(self._run_changed)

    # --- entering and leaving ---
    def toggle(self) -> None:
        self.leave() if self.active else self.enter()

    def enter(self, scene: str | None = None) -> None:
        if not self.active:
            self.settings.setValue("window/state", self.window.saveState())
            self.workbench_geometry = self.window.saveGeometry()
            self.active = True
            area = self.area or screen_area(self.window)
            self.window.apply_mode(True, area.height() if area is not None else th.LECTURE_HEIGHT)
            cover_screen(self.window, self.area)
        wanted = scene or self.settings.value("view/scene", NAMES[0], str)
        self.state.show_scene(wanted if wanted in NAMES else NAMES[0])

    def leave(self) -> None:
        if not self.active:
            return
        self.state.show_scene(None)
        self.state.set_blank(False)
        self.active = False
        self.window.apply_mode(False)
        if self.window.isFullScreen():
            self.window.showNormal()
        if isinstance(self.workbench_geometry, QByteArray):
            self.window.restoreGeometry(self.workbench_geometry)
        state = self.settings.value("window/state")
        self.window.restore_layout(state if isinstance(state, QByteArray) else None)
        fit_to_screen(self.window)

    def show(self, name: str) -> None:
        if not self.active:
            self.enter(name)
        else:
            self.state.show_scene(name)

    # --- a lecture file ---
    def present(self, path: str, scene: str | None = None) -> bool:
        """Open a lecture file: its traces replayed at once, then its first scene (or its first ``scene``: ``kvscope
        --course --scene memory`` opened on scene 1); PgDn / PgUp follow its order and each scene shows the runs
        of its own traces. A file that cannot be presented changes nothing."""
        try:
            plan = read_lecture(path)
        except LectureFileError as exc:
            self.controller.surface.show_error(str(exc))
            return False
        traces = list(dict.fromkeys(str(t) for entry in plan for t in entry.traces))
        previous, self.controller.replay_speed = self.controller.replay_speed, 0.0
        try:
            if not self.controller.open_traces(traces, quiet=True):
                return False
        finally:
            self.controller.replay_speed = previous
        start = next((i for i, entry in enumerate(plan) if entry.scene == scene), 0)
        self.plan, self.position = plan, start
        self.show(plan[start].scene)
        return True

    def step(self, delta: int) -> None:
        """PgDn / PgUp: the next or previous scene of the lecture file, or of the number row without one."""
        if not self.plan:
            self.state.step_scene(delta)
            return
        self.position = min(max(self.position + delta, 0), len(self.plan) - 1)
        scene = self.plan[self.position].scene
        if scene == self.state.scene:
            self._select_scene_run(scene)            # the same scene again, for another trace's run
        else:
            self.show(scene)

    def _sources(self, scene: str) -> tuple[str, ...]:
        if self.plan and self.plan[self.position].scene == scene:
            return tuple(str(t) for t in self.plan[self.position].traces)
        return ()

    def _select_scene_run(self, scene: str) -> None:
        run_id = scene_run(scene, self.store, self._sources(scene))
        kind = scene_lesson(scene)
        if kind in self.state.followed_lessons:          # its runs fill the panels beside it: its newest one
            record = self.store.latest_experiment(kind)
            run_id = record.run_ids[-1] if record is not None and record.run_ids else None
        if run_id is not None and run_id != self.state.selected:
            self.state.select(run_id, "the scene's run")

    def _run_changed(self, kind: str, run) -> None:
        """A replay's run that ended hands the scene back to the scene's own run: traces replayed one after the
        other must not leave scene 1 on the attention run that came last. A run that the scene's own lesson
        makes, and shows as it runs (the depth sweep beside its heatmap), is selected when it starts."""
        if not self.active or self.state.scene is None:
            return
        lesson = scene_lesson(self.state.scene)
        if kind == "started" and lesson in self.state.followed_lessons:
            record = self.store.latest_experiment(lesson)
            if record is not None and run.run_id in record.run_ids:
                self.state.select(run.run_id, f"{lesson} sweep")
        elif kind == "ended" and self.controller.activity.replaying:
            self._select_scene_run(self.state.scene)
            self._open_at_the_cut(self.state.scene)

    def _state_changed(self, names: set[str]) -> None:
        if "scene" not in names:
            return
        scene = self.state.scene
        self.view.show_scene(scene)
        if scene is None:
            return
        self.settings.setValue("view/scene", scene)
        if self.plan and self.plan[self.position].scene != scene:
            known = [i for i, entry in enumerate(self.plan) if entry.scene == scene]
            if known:
                self.position = known[0]             # a number key into the lecture: its place there
        self._select_scene_run(scene)
        self._open_at_the_cut(scene)
        if self.active:
            cover_screen(self.window, self.area)                # a scene's panels must not widen the window

    def _open_at_the_cut(self, scene: str) -> None:
        """The sampling scene shows the step where the filters cut the most while leaving a choice (its lesson),
        when it opens and when a replayed run ends in it (a render's final frame), not the last step drawn."""
        run = self.store.find(self.state.selected) if self.state.selected else None
        if scene == "sampling" and run is not None and run.finished:
            step = cutting_step(run)
            if step is not None:
                self.state.pin(run.run_id, step)

    # --- keys ---
    def action(self) -> None:
        """R: run what the scene is about: its lesson, or the prompt (recording attention in that scene)."""
        scene = self.state.scene
        if self._take_over(scene):
            return
        kind = scene_lesson(scene)
        if kind is not None:
            started = self.controller.start_lesson(kind)
        else:
            started = self._run(attention=scene == "attention")
        if started:
            self.started_in = scene
        else:
            self._refused("R")

    def work_ended(self) -> None:
        self.started_in = None
        self.view.work_ended()

    def _take_over(self, scene: str | None) -> bool:
        """R while a run or an experiment started elsewhere (another scene, the workbench) is in progress: the
        speaker has moved on, so that work stops and this scene's starts once it has wound down. R pressed again in
        the scene that started the work is refused, as before."""
        busy = self.controller.client.busy
        if busy not in ("run", "experiment") or self.started_in == scene:
            return False
        self.controller.stop()
        self.controller.activity.queued = self.action
        self.started_in = scene
        self.view.say(f"Stopping {STOPPING[busy]} started elsewhere; this scene's starts when it has stopped",
                      until_idle=True)
        return True

    def joined_action(self) -> None:
        """The key of a lesson that shares this scene (C: continuous batching in the batch scene)."""
        joined = lessons.joins().get(self.state.scene)
        if joined is None:
            self.view.say("That key does nothing in this scene.")
            return
        if not self.controller.start_lesson(joined[0]):
            self._refused(joined[1].words.capitalize())

    def _refused(self, action: str) -> None:
        """Why ``action`` did not start, in the footer, for as long as it is true: a refusal because work is in
        progress (or a model loading) goes when that work ends, never kept after it ("R is not available while a
        run is in progress" stood under a finished run)."""
        self.view.say(self.controller.refusal(action, in_scene=True) or "",
                      until_idle=bool(self.controller.client.busy))

    def stop(self) -> None:
        """The stop key, everywhere: stops whatever runs; in a scene, says so in the footer."""
        if self.active:
            busy = self.controller.client.busy
            if busy:
                self.view.say("Stopping…", until_idle=True)
            else:
                self.view.say("Nothing to stop: no run, experiment or replay is in progress.")
        self.controller.stop()

    def blank(self) -> None:
        self.state.toggle_blank()

    def what_if(self) -> None:
        """W: in a run scene, try other filters on the step shown (T, K and P then change them, with no rerun);
        W again shows only what ran."""
        if scene_lesson(self.state.scene) is not None:
            self.view.say("W works in the run scenes (sampling): it filters the shown step again")
            return
        if self.state.what_if is not None:
            self.state.set_what_if(None)
            self.view.say("What if: off; T, K and P change the run again")
            return
        run = self.store.find(self.state.selected) if self.state.selected else None
        if run is None or not run.steps or run.started.params is None:
            self.view.say("There is no step to try other filters on yet: press R.")
            return
        p = run.started.params
        self.state.set_what_if(WhatIfSettings(p.temperature, p.top_k, p.top_p))
        self.view.say("What if: T, K and P now filter the shown step again, with no rerun (W: back)")

    def parameter(self, name: str, direction: int) -> None:
        """A parameter key (T, P, K, M; Shift lowers): in a run scene, the run setting a notch and run the scene
        again with it (a running run is stopped first); in an experiment scene, the lesson's own setting that
        key is declared on (M: its new tokens), or the footer says the key does not apply there."""
        letter = param_shape(name).key.letter
        kind = scene_lesson(self.state.scene)
        tried = self.state.what_if
        if kind is None and tried is not None and hasattr(tried, name):     # what if: the filter, no rerun
            shape = param_shape(name)
            value = notch(shape, getattr(tried, name), direction, self.run_settings.bounds(name))
            if name == "temperature" and 0 < value < (shape.span.least or 0):
                value = shape.span.low if direction < 0 else shape.span.least
            self.state.set_what_if(replace(tried, **{name: value}))
            self.view.say(f"What if {self.state.what_if.text()}: no rerun (W: back to what ran)")
            return
        if kind is not None:
            lesson = engine_lessons.lesson(kind)
            choices = self.controller.choices
            settings = choices.step(kind, lesson.settings, letter, direction)
            if settings is None:
                self.view.say(f"{letter} does not apply in this scene: {lesson.title.lower()} takes its settings "
                              "from its tab")
                return
            shape = choices.keyed(kind, lesson.settings, letter)
            self.view.say(f"{setting_text(shape, getattr(settings, shape.name))}; R runs the scene with it")
            return
        self.run_settings.update(**{name: self.run_settings.notch(name, direction)})
        if self.controller.client.busy == "run":
            self.controller.stop()                    # the new run waits for this one to wind down
        self._run(attention=self.state.scene == "attention")

    def step_tokens(self, delta: int) -> None:
        """←/→: the previous or next token of the run shown (the sampling and attention views follow)."""
        run = self.store.find(self.state.selected) if self.state.selected else None
        if run is None or not run.steps:
            self.view.say("There is no run to step through yet: press R.")
            return
        current = self.state.pinned_step(run.run_id)
        current = run.n_steps - 1 if current is None else current
        self.state.pin(run.run_id, min(max(current + delta, 0), run.n_steps - 1))

    def _run(self, attention: bool) -> bool:
        if self.controller.refusal("R") is not None and not (self.controller.client.busy == "run"
                                                               and self.controller.client.control.cancel.is_set()):
            return False
        self.controller.run(attention=attention)
        return True


def screen_area(window: LectureWindow, available: bool = False) -> QRect | None:
    """The screen the window is on (``available``: less the panels and docks of the desktop), or None."""
    screen = window.screen()
    if screen is None:
        return None
    return screen.availableGeometry() if available else screen.geometry()


def cover_screen(window: LectureWindow, area: QRect | None = None) -> None:
    """Lecture mode fills the screen the window is on (or ``area``): set here too, where no window manager
    obliges."""
    area = area or screen_area(window)
    if area is None:
        return
    window.setGeometry(area)
    if QApplication.platformName() not in ("offscreen", "minimal"):
        window.showFullScreen()


def fit_to_screen(window: LectureWindow) -> None:
    """A window never extends past the screen it is on, whatever was remembered or a mode left behind."""
    area = screen_area(window, available=True)
    if area is None or window.isFullScreen():
        return
    frame = window.frameGeometry()
    width, height = min(frame.width(), area.width()), min(frame.height(), area.height())
    if (width, height) != (frame.width(), frame.height()):
        window.resize(width - (frame.width() - window.width()), height - (frame.height() - window.height()))
    frame = window.frameGeometry()
    x = min(max(frame.x(), area.x()), area.right() - frame.width() + 1)
    y = min(max(frame.y(), area.y()), area.bottom() - frame.height() + 1)
    if (x, y) != (frame.x(), frame.y()):
        window.move(max(x, area.x()), max(y, area.y()))
