"""The menu bar and every keyboard shortcut, in one place. Actions are also added to the window itself so
their shortcuts keep working when lecture mode hides the menu bar; the lecture keys (the number row, PageUp/PageDown, R,
C, B, Esc) are enabled only while a scene is shown, and Esc stops a run only outside a scene."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence

from app.scenes import SCENE_KEYS, SCENE_LIST

if TYPE_CHECKING:
    from app.window import MainWindow

REPLAY_SPEEDS = (("0.5x", 0.5), ("1x (as recorded)", 1.0), ("2x", 2.0), ("4x", 4.0), ("instant", 0.0))
STOP_KEYS = {False: ["Esc", "Ctrl+."], True: ["Ctrl+."]}      # lecture mode: Esc leaves the scene instead


def _action(window: MainWindow, menu, text: str, slot: Callable[[], object],
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


def build_menus(window: MainWindow) -> dict[str, QAction]:
    files, actions = window.files, {}
    bar = window.menuBar()
    file = bar.addMenu("&File")
    _action(window, file, "Open trace…", files.open_trace_dialog, QKeySequence.StandardKey.Open)
    _action(window, file, "Save run as trace…", files.save_trace_dialog, QKeySequence.StandardKey.Save)
    _action(window, file, "Save experiment as trace…",
            lambda: files.save_experiment_trace_dialog(window.current_experiment()))
    speed = file.addMenu("Replay speed")
    for label, value in REPLAY_SPEEDS:
        act = _action(window, speed, label, partial(window.set_replay_speed, value), checkable=True)
        act.setChecked(value == 1.0)
        actions[f"speed {value}"] = act
    exports = file.addMenu("Export")
    for label, widget in (("Timing panel", lambda: window.timing), ("KV heatmap panel", lambda: window.kv),
                          ("Sampling panel", lambda: window.sampling),
                          ("Experiment panel", lambda: window.experiments.current),
                          ("Chat panel", lambda: window.chat), ("Lecture scene", lambda: window.scene_view)):
        _action(window, exports, f"{label} as PNG or SVG…", lambda n=label, w=widget: files.export_panel(n, w()))
    _action(window, exports, "Experiment data as CSV…", lambda: files.export_experiment(window.current_experiment()))
    _action(window, exports, "Run as a Perfetto trace…", lambda: files.export_perfetto(None))
    _action(window, exports, "Experiment as a Perfetto trace…",
            lambda: files.export_perfetto(window.current_experiment()))
    _action(window, exports, "Run data as CSV…", lambda: files.export_run("csv"))
    _action(window, exports, "Run data as JSON…", lambda: files.export_run("json"))
    file.addSeparator()
    _action(window, file, "Quit", window.close, QKeySequence.StandardKey.Quit)

    run = bar.addMenu("&Run")
    _action(window, run, "Run", window.start_run, "Ctrl+Return")
    _action(window, run, "Run (keypad Enter)", window.start_run, "Ctrl+Enter").setVisible(False)
    actions["stop"] = _action(window, run, "Stop", window.controller.stop)
    actions["stop"].setShortcuts([QKeySequence(k) for k in STOP_KEYS[False]])
    _action(window, run, "Step one token", window.step_run, "F10")
    _action(window, run, "Pause / resume", window.toggle_pause, "F9")
    _action(window, run, "Load model", window.load_from_controls, "Ctrl+L")
    _action(window, run, "Send chat message", window.chat.send, "Ctrl+Shift+Return")
    _action(window, run, "Measure this machine's peaks again", window.controller.remeasure_peaks)
    run.addSeparator()
    _action(window, run, "Clear runs", window.controller.clear_runs)
    _action(window, run, "Keep the last N runs…", window.ask_history)

    view = bar.addMenu("&View")
    actions["lecture"] = _action(window, view, "Lecture mode (scenes)", window.toggle_lecture, "F11", checkable=True)
    scenes = view.addMenu("Lecture scene")
    for key, scene in zip(SCENE_KEYS, SCENE_LIST):
        actions[f"scene {scene.name}"] = _action(window, scenes, f"{key}  {scene.title}",
                                                 partial(window.show_scene, scene.name), key)
    actions["next scene"] = _action(window, scenes, "Next scene", lambda: window.state.step_scene(1), "PgDown")
    actions["previous scene"] = _action(window, scenes, "Previous scene", lambda: window.state.step_scene(-1), "PgUp")
    actions["blank"] = _action(window, scenes, "Blank the screen", window.state.toggle_blank, "B")
    actions["scene action"] = _action(window, scenes, "Run what the scene shows", window.scene_action, "R")
    actions["continuous"] = _action(window, scenes, "Continuous batching (batch scene)",
                                    lambda: window.start_experiment("continuous", {}), "C")
    actions["leave lecture"] = _action(window, scenes, "Back to the workbench", window.leave_lecture, "Esc")
    colour = view.addMenu("Token colours")
    for i, mode in enumerate(("phase", "latency", "probability")):
        _action(window, colour, mode.capitalize(), partial(window.tokens.set_mode, mode), f"Ctrl+{i + 1}")
    heat = view.addMenu("KV heatmap")
    for i, (mode, label) in enumerate((("memory", "Memory"), ("k", "Key norm"), ("v", "Value norm"))):
        _action(window, heat, label, partial(window.kv.set_mode, mode), f"Ctrl+Shift+{i + 1}")
    _action(window, heat, "Zoom to used positions / whole window",
            lambda: window.state.set_heatmap_fit(not window.state.heatmap_fit), "Ctrl+Shift+Z")
    view.addSeparator()
    for dock in window.docks.values():
        view.addAction(dock.toggleViewAction())
    _action(window, view, "Reset layout", window.reset_layout)

    help_menu = bar.addMenu("&Help")
    _action(window, help_menu, "Keyboard shortcuts", window.show_shortcuts, QKeySequence.StandardKey.HelpContents)
    _action(window, help_menu, "About KVScope", window.show_about)
    return actions


LECTURE_ONLY = ("next scene", "previous scene", "blank", "scene action", "continuous", "leave lecture",
                *(f"scene {scene.name}" for scene in SCENE_LIST))


def set_lecture_keys(actions: dict[str, QAction], lecture: bool) -> None:
    """The lecture keys work only in a scene; there Esc leaves the scene, and Ctrl+. stops a run."""
    for name in LECTURE_ONLY:
        actions[name].setEnabled(lecture)
    actions["stop"].setShortcuts([QKeySequence(k) for k in STOP_KEYS[lecture]])
    actions["lecture"].setChecked(lecture)


SHORTCUTS = """Ctrl+Enter  run the prompt
Esc (Ctrl+. in a lecture scene)  stop
F10  step one token (starts paused after the prefill)
F9  pause / resume
Ctrl+L  load the model
Ctrl+Shift+Enter  send the chat message
F11  lecture mode: scenes on the number row (1-9, 0, -), PageUp/PageDown, R run the scene, B blank, Esc back
Ctrl+1/2/3  token colours
Ctrl+Shift+1/2/3  KV heatmap mode; Ctrl+Shift+Z zoom to used positions / whole window
Ctrl+O / Ctrl+S  open / save a trace"""
