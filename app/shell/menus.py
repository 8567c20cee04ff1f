"""The menu bar and every keyboard shortcut, in one place. Actions call the controller (runs, lessons, stop),
the lecture (scenes and the speaker's keys), the file actions, and the view state (colours, heatmap mode and
zoom); only window things (quit, layout, about) call the window. Actions are also added to the window itself
so their shortcuts keep working when lecture mode hides the menu bar; the lecture keys are enabled only while a
scene is shown. The stop key Ctrl+. works everywhere; Esc stops too, outside a scene (in one it leaves)."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Protocol

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QMenuBar, QWidget

from app import lessons
from app.lecture.mode import Lecture
from app.lecture.scene_list import SCENES
from app.link.controller import Controller
from app.shell.file_actions import FileActions
from app.shell.lookups import Lookups
from app.state.run_settings import PARAMETER_LETTERS as PARAMETER_KEYS
from app.state.viewstate import KV_MODES, TOKEN_COLOURS, ViewState

REPLAY_SPEEDS = (("0.5x", 0.5), ("1x (as recorded)", 1.0), ("2x", 2.0), ("4x", 4.0), ("instant", 0.0))
STOP_KEYS = {False: ["Esc", "Ctrl+."], True: ["Ctrl+."]}      # lecture mode: Esc leaves the scene instead


class WindowActions(Protocol):
    """What the menus ask of the window itself: its menu bar and actions (Qt's), and the window's own commands.
    Everything else goes to the controller, the lecture, the file actions or the view state."""

    def menuBar(self) -> QMenuBar: ...  # noqa: N802 (Qt's name)
    def addAction(self, action: QAction) -> None: ...  # noqa: N802 (Qt's name)
    def close(self) -> bool: ...
    def reset_layout(self) -> None: ...
    def show_about(self) -> None: ...
    def show_shortcuts(self) -> None: ...
    def ask_history(self) -> None: ...
    def send_chat(self) -> None: ...


def _action(window: WindowActions, menu, text: str, slot: Callable[[], object],
            shortcut: str | QKeySequence | None = None, checkable: bool = False) -> QAction:
    action = QAction(text, window)
    if shortcut:
        action.setShortcut(QKeySequence(shortcut))
        action.setShortcutContext(Qt.ShortcutContext.WindowShortcut)
    action.setCheckable(checkable)
    action.triggered.connect(lambda: slot())    # drop the "checked" argument: slots take their own
    if menu is not None:
        menu.addAction(action)
    window.addAction(action)
    return action


def build_menus(window: WindowActions, controller: Controller, lecture: Lecture, files: FileActions,
                state: ViewState, exports: dict[str, Callable[[], QWidget]], docks: list, lookups: Lookups,
                shown_run: Callable[[], object]) -> dict[str, QAction]:
    actions: dict[str, QAction] = {}
    bar = window.menuBar()
    file = bar.addMenu("&File")
    _action(window, file, "Open trace…", files.open_trace_dialog, QKeySequence.StandardKey.Open)
    _action(window, file, "Save run as trace…", files.save_trace_dialog, QKeySequence.StandardKey.Save)
    _action(window, file, "Save experiment as trace…", lambda: files.save_experiment_trace_dialog(files.experiment()))
    _action(window, file, "Attach to a server running here…", partial(lookups.show_found, "servers"),
            "Ctrl+Shift+A")
    speed = file.addMenu("Replay speed")
    for label, value in REPLAY_SPEEDS:
        act = _action(window, speed, label, partial(set_replay_speed, controller, actions, value), checkable=True)
        act.setChecked(value == 1.0)
        actions[f"speed {value}"] = act
    out = file.addMenu("Export")
    for label, widget in exports.items():
        _action(window, out, f"{label} as PNG or SVG…", lambda n=label, w=widget: files.export_panel(n, w()))
    _action(window, out, "Experiment data as CSV…", lambda: files.export_experiment(files.experiment()))
    _action(window, out, "Run as a Perfetto trace…", lambda: files.export_perfetto(None))
    _action(window, out, "Experiment as a Perfetto trace…", lambda: files.export_perfetto(files.experiment()))
    _action(window, out, "Run as OpenTelemetry spans…", lambda: files.export_otlp(None))
    _action(window, out, "Experiment's runs as OpenTelemetry spans…", lambda: files.export_otlp(files.experiment()))
    _action(window, out, "Run data as CSV…", lambda: files.export_run("csv"))
    _action(window, out, "Run data as JSON…", lambda: files.export_run("json"))
    _action(window, out, "Scene as video (MP4 or GIF)…", lambda: files.export_video(state.scene), "Ctrl+Shift+E")
    file.addSeparator()
    _action(window, file, "Quit", window.close, QKeySequence.StandardKey.Quit)

    run = bar.addMenu("&Run")
    _action(window, run, "Run", controller.run, "Ctrl+Return")
    _action(window, run, "Run (keypad Enter)", controller.run, "Ctrl+Enter").setVisible(False)
    actions["stop"] = _action(window, run, "Stop (a run, an experiment, a replay)", lecture.stop)
    actions["stop"].setShortcuts([QKeySequence(k) for k in STOP_KEYS[False]])
    _action(window, run, "Step one token", controller.step, "F10")
    _action(window, run, "Pause / resume", controller.toggle_pause, "F9")
    _action(window, run, "Load model", controller.load_model, "Ctrl+L")
    _action(window, run, "Models and servers on this computer…", partial(lookups.show_found, "models"),
            "Ctrl+Shift+O")
    _action(window, run, "Send chat message", window.send_chat, "Ctrl+Shift+Return")
    experiments = run.addMenu("Run experiment")
    for kind, lesson in lessons.BY_KIND.items():
        _action(window, experiments, lesson.lesson.title, partial(controller.start_lesson, kind))
    _action(window, run, "Measure this machine again (peaks, fastest float)", controller.remeasure_peaks)
    run.addSeparator()
    _action(window, run, "Clear runs", controller.clear_runs)
    _action(window, run, "Keep the last N runs…", window.ask_history)
    _action(window, run, "Run history (every run remembered)…", lookups.show_run_history, "Ctrl+H")

    view = bar.addMenu("&View")
    actions["lecture"] = _action(window, view, "Lecture mode (scenes)", lecture.toggle, "F11", checkable=True)
    scenes = view.addMenu("Lecture scene")
    for scene in SCENES:
        actions[f"scene {scene.name}"] = _action(window, scenes, f"{scene.key}  {scene.title}",
                                                 partial(lecture.show, scene.name), scene.key)
    actions["next scene"] = _action(window, scenes, "Next scene (of the lecture file, if one is open)",
                                    partial(lecture.step, 1), "PgDown")
    actions["previous scene"] = _action(window, scenes, "Previous scene", partial(lecture.step, -1), "PgUp")
    actions["blank"] = _action(window, scenes, "Blank / unblank the screen", lecture.blank, "B")
    actions["what if"] = _action(window, scenes, "What if: other filters on the shown step (T, K, P; no rerun)",
                                 lecture.what_if, "W")
    actions["scene action"] = _action(window, scenes, "Run what the scene shows", lecture.action, "R")
    actions["joined action"] = _action(window, scenes, "The scene's second experiment (C: continuous batching)",
                                       lecture.joined_action, "C")
    actions["previous token"] = _action(window, scenes, "Previous token", partial(lecture.step_tokens, -1), "Left")
    actions["next token"] = _action(window, scenes, "Next token", partial(lecture.step_tokens, 1), "Right")
    for key, name in PARAMETER_KEYS:
        words = name.replace("_", " ")
        actions[f"raise {name}"] = _action(window, scenes, f"Raise {words} and run",
                                           partial(lecture.parameter, name, 1), key)
        actions[f"lower {name}"] = _action(window, scenes, f"Lower {words} and run",
                                           partial(lecture.parameter, name, -1), f"Shift+{key}")
    actions["leave lecture"] = _action(window, scenes, "Back to the workbench", lecture.leave, "Esc")
    colour = view.addMenu("Token colours")
    for i, mode in enumerate(TOKEN_COLOURS):
        _action(window, colour, mode.capitalize(), partial(state.set_token_colours, mode), f"Ctrl+{i + 1}")
    heat = view.addMenu("KV heatmap")
    for i, (mode, label) in enumerate(zip(KV_MODES, ("Memory", "Key norm", "Value norm"))):
        _action(window, heat, label, partial(state.set_kv_mode, mode), f"Ctrl+Shift+{i + 1}")
    _action(window, heat, "Zoom to used positions / whole window",
            lambda: state.set_heatmap_fit(not state.heatmap_fit), "Ctrl+Shift+Z")
    view.addSeparator()
    for dock in docks:
        view.addAction(dock.toggleViewAction())
    _action(window, view, "Reset layout", window.reset_layout)

    help_menu = bar.addMenu("&Help")
    _action(window, help_menu, "Keyboard shortcuts", window.show_shortcuts, QKeySequence.StandardKey.HelpContents)
    _action(window, help_menu, "Where these figures come from (the shown run)…",
            lambda: lookups.show_sources(shown_run()), "Ctrl+I")
    _action(window, help_menu, "About KVScope", window.show_about)
    return actions


def set_replay_speed(controller: Controller, actions: dict[str, QAction], speed: float) -> None:
    controller.replay_speed = speed
    for name, action in actions.items():
        if name.startswith("speed "):
            action.setChecked(name == f"speed {speed}")


LECTURE_ONLY = ("next scene", "previous scene", "blank", "what if", "scene action", "joined action", "leave lecture",
                "previous token", "next token", *(f"scene {scene.name}" for scene in SCENES),
                *(f"{way} {name}" for _key, name in PARAMETER_KEYS for way in ("raise", "lower")))


def set_lecture_keys(actions: dict[str, QAction], lecture: bool) -> None:
    """The lecture keys work only in a scene; there Esc leaves the scene, and Ctrl+. stops."""
    for name in LECTURE_ONLY:
        actions[name].setEnabled(lecture)
    actions["stop"].setShortcuts([QKeySequence(k) for k in STOP_KEYS[lecture]])
    actions["lecture"].setChecked(lecture)


SHORTCUTS = """Ctrl+Enter  run the prompt
Esc, Ctrl+.  stop a run, an experiment or a replay (in a lecture scene Ctrl+.; Esc goes back)
F10  step one token (starts paused after the prefill)
F9  pause / resume
Ctrl+L  load the model
Ctrl+I  where the shown run's figures come from: measured, reported by a server, computed or achieved
Ctrl+H  the run history: every run remembered across launches, up to four side by side
Ctrl+Shift+O  the models and servers already on this computer; Ctrl+Shift+A  attach to a server running here
Ctrl+Shift+Enter  send the chat message
F11  lecture mode: scenes on the number row, PageUp/PageDown, R run the scene, C continuous batching (scene 5),
     B blank / unblank, T P K M raise temperature, top-p, top-k, max tokens and run (Shift lowers),
     W what if: T P K re-filter the shown step instead, with no rerun (W again: back),
     Left/Right step through the tokens, Esc back
Ctrl+1/2/3  token colours
Ctrl+Shift+1/2/3  KV heatmap mode; Ctrl+Shift+Z zoom to used positions / whole window
Ctrl+O / Ctrl+S  open / save a trace (or open a lecture file)
Ctrl+Shift+E  export the scene as video (MP4 or GIF), rendered on the trace's own clock"""
