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

from PySide6.QtCore import QByteArray, QRect, QSettings
from PySide6.QtWidgets import QApplication, QMainWindow

from app import lessons
from app.controller import Controller
from app.run_settings import RunSettings
from app.scene_list import NAMES
from app.scenes import SceneView, cutting_step, scene_lesson, scene_run
from app.store import RunStore
from app.viewstate import ViewState

TOP_K_STEPS = (0, 1, 5, 10, 20, 40, 100, 1000)


class Lecture:
    def __init__(self, window: QMainWindow, state: ViewState, store: RunStore, view: SceneView,
                 controller: Controller, run_settings: RunSettings, settings: QSettings) -> None:
        self.window, self.state, self.store, self.view = window, state, store, view
        self.controller, self.run_settings, self.settings = controller, run_settings, settings
        self.active = False
        self.workbench_geometry: QByteArray | None = None
        state.subscribe(self._state_changed)

    # --- entering and leaving ---
    def toggle(self) -> None:
        self.leave() if self.active else self.enter()

    def enter(self, scene: str | None = None) -> None:
        if not self.active:
            self.settings.setValue("window/state", self.window.saveState())
            self.workbench_geometry = self.window.saveGeometry()
            self.active = True
            self.window.apply_mode(True)
            cover_screen(self.window)
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

    def _state_changed(self, names: set[str]) -> None:
        if "scene" not in names:
            return
        scene = self.state.scene
        self.view.show_scene(scene)
        if scene is None:
            return
        self.settings.setValue("view/scene", scene)
        run_id = scene_run(scene, self.store)
        if run_id is not None and run_id != self.state.selected:
            self.state.select(run_id, "the scene's run")
        run = self.store.find(self.state.selected) if self.state.selected else None
        if scene == "sampling" and run is not None:
            step = cutting_step(run)
            if step is not None:
                self.state.pin(run.run_id, step)
        if self.active:
            cover_screen(self.window)                # a scene's panels must not widen the window

    # --- keys ---
    def action(self) -> None:
        """R: run what the scene is about: its lesson, or the prompt (recording attention in that scene)."""
        kind = scene_lesson(self.state.scene)
        if kind is not None:
            started = self.controller.start_lesson(kind)
        else:
            started = self._run(attention=self.state.scene == "attention")
        if not started:
            self.view.say(self.controller.refusal("R") or "")

    def joined_action(self) -> None:
        """The key of a lesson that shares this scene (C: continuous batching in the batch scene)."""
        joined = lessons.joins().get(self.state.scene)
        if joined is None:
            self.view.say("That key does nothing in this scene.")
            return
        if not self.controller.start_lesson(joined[0]):
            self.view.say(self.controller.refusal(joined[1].words.capitalize()) or "")

    def stop(self) -> None:
        """The stop key, everywhere: stops whatever runs; in a scene, says so in the footer."""
        if self.active:
            busy = self.controller.client.busy
            self.view.say("Stopping…" if busy else "Nothing to stop: no run, experiment or replay is in progress.")
        self.controller.stop()

    def blank(self) -> None:
        self.state.toggle_blank()

    def parameter(self, name: str, direction: int) -> None:
        """Change one run setting a notch and run the scene again with it (a running run is stopped first)."""
        c = self.run_settings.choices
        if name == "temperature":
            self.run_settings.update(temperature=round(min(max(c.temperature + 0.1 * direction, 0.0), 2.0), 2))
        elif name == "top_p":
            self.run_settings.update(top_p=round(min(max(c.top_p + 0.05 * direction, 0.05), 1.0), 2))
        elif name == "top_k":
            index = max((i for i, k in enumerate(TOP_K_STEPS) if k <= c.top_k), default=0)
            self.run_settings.update(top_k=TOP_K_STEPS[min(max(index + direction, 0), len(TOP_K_STEPS) - 1)])
        elif name == "max_new_tokens":
            self.run_settings.update(max_new_tokens=int(min(max(c.max_new_tokens * (2 if direction > 0 else 0.5),
                                                                8), 4096)))
        if self.controller.client.busy == "run":
            self.controller.stop()                    # the new run waits for this one to wind down
        if scene_lesson(self.state.scene) is None:
            self._run(attention=self.state.scene == "attention")
        else:
            self.view.say("Changed; R runs the scene with it.")

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


def screen_area(window: QMainWindow, available: bool = False) -> QRect | None:
    """The screen the window is on (``available``: less the panels and docks of the desktop), or None."""
    screen = window.screen()
    if screen is None:
        return None
    return screen.availableGeometry() if available else screen.geometry()


def cover_screen(window: QMainWindow) -> None:
    """Lecture mode fills the screen the window is on: set here too, where no window manager obliges."""
    area = screen_area(window)
    if area is None:
        return
    window.setGeometry(area)
    if QApplication.platformName() not in ("offscreen", "minimal"):
        window.showFullScreen()


def fit_to_screen(window: QMainWindow) -> None:
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
