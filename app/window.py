"""``MainWindow``: dock layout, menus, shortcuts, status strip, the refresh timer and the error banner.

Events from the worker go straight into the ``RunStore`` (cheap appends); panels redraw from the store on a
~30 fps timer only when it changed, never once per event.
"""

from __future__ import annotations

import logging
import time
from functools import partial

from PySide6.QtCore import QByteArray, QElapsedTimer, Qt, QTimer
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.dialogs import AboutDialog, FirstRunDialog
from app.file_actions import FileActions
from app.paint import METER
from app.panels.chat import ChatPanel
from app.panels.controls import ControlsPanel
from app.panels.experiments import ExperimentsPanel
from app.panels.kv_heatmap import KVHeatmapPanel
from app.panels.sampling import SamplingPanel
from app.panels.timing import TimingPanel
from app.panels.tokens import TokensPanel
from app.settings import open_settings
from app.status import StatusStrip
from app.store import RunStore
from app.worker import EngineClient, Note
from engine.errors import EngineError
from engine.events import LoadProgress, ModelLoaded, RunFailed, RunFinished, RunStarted
from engine.gguf import remove_all_conversions
from engine.kvcache import format_bytes
from engine.trace import ReplayGap, ReplayIncomplete

log = logging.getLogger(__name__)
REFRESH_MS = 33            # token text and status strip: ~30 fps; charts as often as paint.METER allows
PANEL_NAMES = {"KVHeatmapPanel": "KV heatmap", "TimingPanel": "timing charts", "SamplingPanel": "sampling chart",
               "ExperimentsPanel": "experiment charts", "ChatPanel": "chat view"}
REPLAY_SPEEDS = (("0.5x", 0.5), ("1x (as recorded)", 1.0), ("2x", 2.0), ("4x", 4.0), ("instant", 0.0))


ERROR_STYLE = "background:#FBE3D6; color:#7A2600;"
WARNING_STYLE = "background:#FFF4CC; color:#5A4500;"


class ErrorBanner(QWidget):
    """A message inside the window (not a modal dialog: a lecture must not stop for a click)."""

    def __init__(self) -> None:
        super().__init__()
        self.label = QLabel()
        self.label.setTextFormat(Qt.TextFormat.PlainText)      # messages quote file names and model output
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        close = QPushButton("Dismiss")
        close.clicked.connect(self.hide)
        row = QHBoxLayout(self)
        row.setContentsMargins(8, 4, 8, 4)
        row.addWidget(self.label, 1)
        row.addWidget(close)
        self.setStyleSheet(ERROR_STYLE)
        self.hide()

    def show_error(self, message: str) -> None:
        self.show_message(message)

    def show_message(self, message: str, warning: bool = False) -> None:
        self.setStyleSheet(WARNING_STYLE if warning else ERROR_STYLE)
        self.label.setText(message)
        self.show()


class MainWindow(FileActions, QMainWindow):
    def __init__(self, store: RunStore, client: EngineClient) -> None:
        super().__init__()
        self.store, self.client = store, client
        self.settings = open_settings()
        self._font_pt = QApplication.font().pointSizeF()
        self.worker_stopped = True
        self._run_after_load = False
        self._replaying = False           # events arrive in batches; the notes in them say when a replay ends
        self.first_run: FirstRunDialog | None = None
        self._last_failure: tuple[str, str] | None = None
        self.lecture = False
        self.replay_speed = 1.0
        self.setWindowTitle("KVScope")
        self.setObjectName("KVScopeMain")
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowNestedDocks)

        self.controls = ControlsPanel()
        self.tokens = TokensPanel(store)
        self.kv = KVHeatmapPanel(store)
        self.timing = TimingPanel(store)
        self.sampling = SamplingPanel(store)
        self.experiments = ExperimentsPanel(store)
        self.chat = ChatPanel(store)
        self.banner = ErrorBanner()
        central = QWidget()
        cv = QVBoxLayout(central)
        cv.setContentsMargins(0, 0, 0, 0)
        cv.addWidget(self.banner)
        cv.addWidget(self.tokens, 1)
        self.setCentralWidget(central)
        # Left and right docks run the full height; the KV heatmap sits under the token stream.
        self.setCorner(Qt.Corner.BottomLeftCorner, Qt.DockWidgetArea.LeftDockWidgetArea)
        self.setCorner(Qt.Corner.BottomRightCorner, Qt.DockWidgetArea.RightDockWidgetArea)
        self.docks = {
            "controls": self._dock("Controls", self.controls, Qt.DockWidgetArea.LeftDockWidgetArea),
            "timing": self._dock("Prefill vs decode timing", self.timing, Qt.DockWidgetArea.RightDockWidgetArea),
            "sampling": self._dock("Sampling: next-token candidates", self.sampling,
                                   Qt.DockWidgetArea.RightDockWidgetArea),
            "kv": self._dock("KV cache per layer", self.kv, Qt.DockWidgetArea.BottomDockWidgetArea),
            "experiments": self._dock("Experiments", self.experiments, Qt.DockWidgetArea.RightDockWidgetArea),
            "chat": self._dock("Chat (KV cache across turns)", self.chat, Qt.DockWidgetArea.RightDockWidgetArea),
        }
        self.splitDockWidget(self.docks["timing"], self.docks["sampling"], Qt.Orientation.Vertical)
        self.tabifyDockWidget(self.docks["timing"], self.docks["experiments"])
        self.tabifyDockWidget(self.docks["experiments"], self.docks["chat"])
        self.docks["timing"].raise_()
        self.status = StatusStrip()
        self.setStatusBar(self.status)
        self._build_menus()
        self._wire()
        self.resize(1600, 1000)
        self._restore()
        self._text_version = self._chart_version = -1
        self._chart_queue: list = []
        self._chart_cost = 0.0
        self.frames = self.chart_frames = 0
        self._chart_clock = QElapsedTimer()
        self._chart_clock.start()
        self.timer = QTimer(self)
        self.timer.setInterval(REFRESH_MS)
        self.timer.timeout.connect(self.refresh)
        self.timer.start()
        self._enter_mode()

    # --- construction -------------------------------------------------------------------------------------
    def _dock(self, title: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock-{title}")
        dock.setWidget(widget)
        self.addDockWidget(area, dock)
        return dock

    def _action(self, menu, text: str, slot, shortcut: str | QKeySequence | None = None,
                checkable: bool = False) -> QAction:
        action = QAction(text, self)
        if shortcut:
            action.setShortcut(QKeySequence(shortcut))
            action.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        action.setCheckable(checkable)
        action.triggered.connect(lambda: slot())    # drop the "checked" argument: slots take their own
        menu.addAction(action)
        self.addAction(action)      # shortcuts keep working when the menu bar is hidden (lecture mode)
        return action

    def _build_menus(self) -> None:
        bar = self.menuBar()
        file = bar.addMenu("&File")
        self._action(file, "Open trace…", self.open_trace_dialog, QKeySequence.StandardKey.Open)
        self._action(file, "Save run as trace…", self.save_trace_dialog, QKeySequence.StandardKey.Save)
        self._action(file, "Save experiment as trace…", self.save_experiment_trace_dialog)
        speed = file.addMenu("Replay speed")
        for label, value in REPLAY_SPEEDS:
            act = self._action(speed, label, partial(setattr, self, "replay_speed", value), checkable=True)
            act.setChecked(value == 1.0)
        exports = file.addMenu("Export")
        for label, item in (("Timing charts", lambda: self.timing.graphics.ci),
                            ("KV heatmap", lambda: self.kv.graphics.ci),
                            ("Sampling chart", lambda: self.sampling.graphics.ci)):
            self._action(exports, f"{label} as PNG or SVG…", partial(self.export_chart_of, label, item))
        self._action(exports, "Experiment chart as PNG or SVG…",
                     partial(self.export_chart_of, "Experiment", lambda: self.experiments.current.graphics.ci))
        self._action(exports, "Experiment data as CSV…", self.export_experiment)
        self._action(exports, "Run data as CSV…", lambda: self.export_run("csv"))
        self._action(exports, "Run data as JSON…", lambda: self.export_run("json"))
        file.addSeparator()
        self._action(file, "Quit", self.close, QKeySequence.StandardKey.Quit)
        run = bar.addMenu("&Run")
        self._action(run, "Run", self.start_run, "Ctrl+Return")
        self._action(run, "Run (keypad Enter)", self.start_run, "Ctrl+Enter").setVisible(False)
        self._action(run, "Stop", self.stop_run, "Esc")
        self._action(run, "Step one token", self.step_run, "F10")
        self._action(run, "Pause / resume", self.toggle_pause, "F9")
        self._action(run, "Load model", self.load_from_controls, "Ctrl+L")
        self._action(run, "Measure this machine's peaks again", self.remeasure_peaks)
        self._action(run, "Send chat message", self.chat.send, "Ctrl+Shift+Return")
        run.addSeparator()
        self._action(run, "Clear runs", self.clear_runs)
        self._action(run, "Keep the last N runs…", self.ask_history)
        view = bar.addMenu("&View")
        self.lecture_action = self._action(view, "Lecture mode", self.toggle_lecture, "F11", checkable=True)
        colour = view.addMenu("Token colours")
        for i, mode in enumerate(("phase", "latency", "probability")):
            self._action(colour, mode.capitalize(), partial(self.tokens.set_mode, mode), f"Ctrl+{i + 1}")
        heat = view.addMenu("KV heatmap")
        for i, (mode, label) in enumerate((("memory", "Memory"), ("k", "Key norm"), ("v", "Value norm"))):
            self._action(heat, label, partial(self.kv.set_mode, mode), f"Ctrl+Shift+{i + 1}")
        view.addSeparator()
        for dock in self.docks.values():
            view.addAction(dock.toggleViewAction())
        self._action(view, "Reset layout", self.reset_layout)
        help_menu = bar.addMenu("&Help")
        self._action(help_menu, "Keyboard shortcuts", self.show_shortcuts, QKeySequence.StandardKey.HelpContents)
        self._action(help_menu, "About KVScope", self.show_about)

    def _wire(self) -> None:
        c = self.controls
        c.run_requested.connect(self.start_run)
        c.stop_requested.connect(self.stop_run)
        c.step_requested.connect(self.step_run)
        c.pause_toggled.connect(self.set_paused)
        c.load_requested.connect(self.load_model)
        c.delay_changed.connect(lambda s: setattr(self.client.control, "delay_s", s))
        self.tokens.step_selected.connect(self.sampling.show_step)
        self.experiments.run_requested.connect(self.start_experiment)
        self.chat.send_requested.connect(self.send_chat)
        self.chat.compare_requested.connect(
            lambda turns: self.start_experiment("chat", {"turns": turns} if turns else {}, dock="chat"))
        self.store.subscribe(self._run_changed)
        self.experiments.cancel_requested.connect(self.stop_run)
        self.client.events_ready.connect(self.on_events)

    # --- actions ------------------------------------------------------------------------------------------
    def load_from_controls(self) -> None:
        self.load_model(*self.controls.model_request())

    def load_model(self, model: str, device: str = "auto", dtype: str = "auto", trust: bool = False) -> None:
        if self.client.busy:
            self.show_error("Wait for the current run to finish (or Stop it) before loading another model.")
            return
        self.banner.hide()
        self.status.show_progress(f"Loading {model}…", None)
        self.controls.model_status.setText(f"Loading {model}…")
        self.client.load_model(model, device, dtype, trust)
        self._update_buttons()

    def start_run(self, paused: bool = False) -> None:
        if self.client.busy:
            return
        if self.client.model is None:
            self.show_error("No model is loaded yet: wait for loading to finish (status bar), or press Load model.")
            return
        prompt = self.controls.prompt_text()
        if not prompt.strip():
            self.show_error("The prompt is empty: type something for the model to read (or pick a sample prompt).")
            return
        try:
            params = self.controls.params()
        except EngineError as exc:
            self.show_error(str(exc))
            return
        self.banner.hide()
        self.sampling.show_step("", -1)
        self.client.control.delay_s = self.controls.slow.value() / 1000.0
        self.client.start_run(prompt, params, paused=bool(paused))
        self.controls.set_paused(bool(paused))
        self._update_buttons()

    def send_chat(self, messages: list, reuse: bool) -> None:
        if self.client.busy or self.client.model is None:
            self.chat.request_failed()
            self.show_error("Wait for the model to load and for the current work to finish before sending.")
            return
        try:
            params = self.controls.params()
        except EngineError as exc:
            self.chat.request_failed()
            self.show_error(str(exc))
            return
        self.banner.hide()
        self.client.control.delay_s = self.controls.slow.value() / 1000.0
        self.client.start_chat(messages, params, reuse)
        self._update_buttons()

    def _run_changed(self, kind: str, run) -> None:
        if kind == "started":
            self.chat.turn_started(run)
        else:
            self.chat.turn_ended(run)

    def start_experiment(self, kind: str, settings: dict, dock: str = "experiments") -> None:
        if self.client.busy:
            return
        if self.client.model is None:
            self.show_error("No model is loaded yet: wait for loading to finish (status bar), or press Load model.")
            return
        self.banner.hide()
        self.docks[dock].raise_()
        self.client.start_experiment(kind, settings)
        self._update_buttons()

    def stop_run(self) -> None:
        self.client.stop()

    def remeasure_peaks(self) -> None:
        """The roofline ceilings are cached; a lecturer who moved to a quieter machine (or suspects the cached
        figure) measures them again here."""
        if self.client.busy:
            self.show_error("Wait for the current work to finish before measuring the peaks again.")
            return
        if self.client.model is None:
            self.show_error("Load a model first: the peaks are measured for its device and dtype.")
            return
        self.client.remeasure_peaks()
        self._update_buttons()

    def step_run(self) -> None:
        """Idle: start a run that pauses after the prefill. Running: let exactly one more token through."""
        if self.client.busy == "run":
            self.client.control.step()
            self.controls.set_paused(True)
        elif not self.client.busy:
            self.start_run(paused=True)

    def toggle_pause(self) -> None:
        if self.client.busy == "run":
            self.set_paused(not self.client.control.paused)

    def set_paused(self, paused: bool) -> None:
        if paused:
            self.client.control.pause()
        else:
            self.client.control.resume()
        self.controls.set_paused(paused)

    def ask_history(self) -> None:
        value, ok = QInputDialog.getInt(self, "Run history", "Keep this many runs (older ones are dropped, with "
                                        "their memory):", self.store.max_runs, 1, 500)
        if ok:
            self.set_history(value)

    def set_history(self, max_runs: int) -> None:
        self.store.max_runs = max_runs
        self.store.trim()
        self.settings.setValue("history/max_runs", max_runs)

    def clear_runs(self) -> None:
        if not self.client.busy:
            self.store.clear()
            self.refresh(force=True)

    # --- events from the worker ---------------------------------------------------------------------------
    def on_events(self, items: list) -> None:
        for item in items:
            self.guarded("Showing what the engine reported", lambda item=item: self._on_event(item))

    def _on_event(self, item: object) -> None:
        if isinstance(item, Note):
            self._on_note(item)
        elif isinstance(item, LoadProgress):
            self.status.show_progress(item.message, item.fraction)
            self.controls.model_status.setText(item.message)
            self._first_run_progress(item)
        elif isinstance(item, ModelLoaded):
            self._on_loaded(item)
        elif isinstance(item, ReplayGap):
            self.status.showMessage(f"The recording paused for {_duration(item.recorded_ms)} here; the replay "
                                    f"shortened the pause to {_duration(item.shown_ms)}", 8000)
        elif isinstance(item, ReplayIncomplete):
            self.store.mark_incomplete(item.run_id)
            self.banner.show_message("The trace ends before its run finished: the run is shown as far as it "
                                     "goes, marked incomplete.", warning=True)
        else:
            self.store.add(item)
            if isinstance(item, RunFailed):
                self.show_error(f"The run failed: {item.message}")
            elif isinstance(item, RunStarted) and self._replaying:
                loaded = self.client.model.model.name if self.client.model else None
                other = f" (not the loaded model, {loaded})" if loaded and loaded != item.model.name else ""
                self.status.showMessage(f"Replaying a trace recorded with {item.model.name} on "
                                        f"{item.model.device}{other}", 8000)
            elif isinstance(item, (RunStarted, RunFinished)) and not self._replaying:
                self.status.showMessage(f"Run #{self.store.current.number}: {self.store.current.reason}", 5000)

    def _first_run_progress(self, progress: LoadProgress) -> None:
        """The one-time conversion gets a dialog that explains it; everything else stays in the status bar."""
        if progress.stage == "convert" and self.first_run is None:
            self.first_run = FirstRunDialog(self)
            self.first_run.cancel_requested.connect(self.stop_run)
            self.first_run.show()
        if self.first_run is not None:
            if progress.stage == "convert":
                self.first_run.update_progress(progress.message, progress.fraction)
            else:
                self._close_first_run()

    def _close_first_run(self) -> None:
        if self.first_run is not None:
            self.first_run.close()
            self.first_run.deleteLater()
            self.first_run = None

    def _on_note(self, note: Note) -> None:
        if note.kind in ("error", "idle"):
            self._close_first_run()
        if note.kind == "error":
            self.chat.request_failed()
            self.show_error(str(note.payload))
            self.status.hide_progress()
            if self.client.model is not None:
                self.controls.model_status.setText(_loaded_text(self.client.model))
        elif note.kind == "memory":
            self.status.show_memory(*note.payload)
        elif note.kind == "idle":
            self._replaying = False
            self.status.hide_progress()
            if self.client.model is not None:
                self.controls.model_status.setText(_loaded_text(self.client.model))
            self.controls.set_paused(False)
        self._update_buttons()
        if note.kind == "idle" and self._run_after_load and self.client.model is not None:
            self._run_after_load = False
            self.start_run()

    def run_when_loaded(self) -> None:
        """Start the prompt once the model is in (``kvscope --run``: a demo that needs no click)."""
        self._run_after_load = True

    def _on_loaded(self, loaded: ModelLoaded) -> None:
        m = loaded.model
        self.controls.set_model_limits(m.max_context, m.vocab_size)
        self.controls.model_status.setText(_loaded_text(loaded))
        self.status.showMessage(_loaded_text(loaded), 8000)
        self.setWindowTitle(f"KVScope — {m.name} on {m.device}")
        if loaded.warnings:
            self.banner.show_message(" ".join(loaded.warnings), warning=True)

    def guarded(self, what: str, action) -> bool:
        """Run ``action`` (drawing, taking in an event); if it raises, say so in the banner once and keep the
        window working: one broken panel or event must not take the others down."""
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001  (anything a panel or a hostile trace can raise)
            log.exception("%s failed", what)
            key = (what, type(exc).__name__)
            if key != self._last_failure:
                self._last_failure = key
                text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
                self.show_error(f"{what} failed ({type(exc).__name__}{': ' + text if text else ''}). The window "
                                "keeps working; what was recorded is kept.")
            return False

    def show_error(self, message: str) -> None:
        log.info("shown to the user: %s", message)
        self.banner.show_error(message)

    def _update_buttons(self) -> None:
        busy = self.client.busy
        self.controls.set_running(busy == "run", busy=bool(busy))
        self.experiments.set_busy(busy)
        self.chat.set_busy(busy)

    # --- refresh ------------------------------------------------------------------------------------------
    def refresh(self, force: bool = False) -> None:
        """Called every ``REFRESH_MS``: text and status follow the store at once. While a run streams, the
        charts refresh no more often than their measured painting cost allows (``app.paint``), one chart per
        tick so no single tick paints them all; forced or at the end of a run, all at once."""
        version, run = self.store.version, self.store.current
        if force or version != self._text_version:
            self._text_version = version
            self.frames += 1
            self.guarded("Drawing the token stream", self.tokens.refresh)
            self.guarded("Updating the status strip", lambda: self.status.show_run(run))
        charts = (self.kv, self.timing, self.sampling, self.experiments, self.chat)
        if force or (version != self._chart_version and (run is None or run.finished)):
            self._chart_version, self._chart_queue = version, []
            for panel in charts:
                self.guarded(f"Drawing the {PANEL_NAMES[type(panel).__name__]}", panel.refresh)
            self.chart_frames += 1
            return
        if not self._chart_queue and version != self._chart_version \
                and self._chart_clock.elapsed() >= METER.interval_ms():
            self._chart_version, self._chart_queue = version, list(charts)
            self._chart_clock.restart()
            self._chart_cost = 0.0
        if self._chart_queue:
            started = time.perf_counter()
            panel = self._chart_queue.pop(0)
            self.guarded(f"Drawing the {PANEL_NAMES[type(panel).__name__]}", panel.refresh)
            self._chart_cost += (time.perf_counter() - started) * 1000.0
            if not self._chart_queue:
                self.chart_frames += 1
                METER.close_frame(self._chart_cost)

    # --- view ---------------------------------------------------------------------------------------------
    def toggle_lecture(self) -> None:
        """Lecture mode has its own remembered layout: switching saves this one and restores the other."""
        self.settings.setValue(self._layout_key(), self.saveState())
        self.lecture = not self.lecture
        self._enter_mode()

    def _enter_mode(self) -> None:
        self.lecture_action.setChecked(self.lecture)
        self._apply_theme()
        self.controls.set_compact(self.lecture)
        self.menuBar().setVisible(not self.lecture)
        if self.lecture and QApplication.platformName() not in ("offscreen", "minimal"):
            self.setGeometry(self.screen().geometry())      # also right where no window manager makes it so
            self.showFullScreen()
        elif not self.lecture and self.isFullScreen():
            self.showNormal()
        self._apply_layout()

    def _layout_key(self) -> str:
        return "window/lecture_state" if self.lecture else "window/state"

    def _apply_layout(self) -> None:
        state = self.settings.value(self._layout_key())
        if not (isinstance(state, QByteArray) and self.restoreState(state)):
            self._default_layout()

    def _default_layout(self) -> None:
        """Controls left, timing and sampling right, token stream over the KV heatmap in the middle."""
        controls, right = (430, 720) if self.lecture else (330, 560)
        height = max(self.height(), 600)
        self.resizeDocks([self.docks["controls"], self.docks["timing"]], [controls, right], Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["timing"], self.docks["sampling"]], [int(height * 0.58), int(height * 0.38)],
                         Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["kv"]], [int(height * 0.55)], Qt.Orientation.Vertical)

    def _apply_theme(self) -> None:
        theme = th.current_theme(self.lecture)
        th.apply(QApplication.instance(), theme, self._font_pt)
        for panel in (self.tokens, self.kv, self.timing, self.sampling, self.experiments, self.chat):
            panel.set_theme(theme)
        self.refresh(force=True)

    def reset_layout(self) -> None:
        for dock in self.docks.values():
            dock.show()
        self.settings.remove(self._layout_key())
        self._default_layout()

    def show_about(self) -> None:
        dialog = AboutDialog(self, self.client.model, self.store.peaks, self.settings.fileName(),
                             busy=bool(self.client.busy))
        dialog.clear_cache.connect(self.clear_converted_models)
        dialog.exec()

    def clear_converted_models(self) -> None:
        if self.client.busy:
            self.show_error("Wait for the current work to finish before clearing the cache.")
            return
        freed = remove_all_conversions()
        self.status.showMessage(f"Cleared converted models ({format_bytes(freed)}); the built-in model converts "
                                "again on its next load", 8000)

    def show_shortcuts(self) -> None:
        QMessageBox.information(self, "Keyboard shortcuts", (
            "Ctrl+Enter  run the prompt\nEsc  stop\nF10  step one token (starts paused after the prefill)\n"
            "F9  pause / resume\nCtrl+L  load the model\nF11  lecture mode\nCtrl+1/2/3  token colours\n"
            "Ctrl+Shift+1/2/3  KV heatmap mode\nCtrl+O / Ctrl+S  open / save a trace"))

    # --- settings and closing -----------------------------------------------------------------------------
    def _restore(self) -> None:
        s = self.settings
        geometry = s.value("window/geometry")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        self.controls.restore(s)
        self.store.max_runs = s.value("history/max_runs", self.store.max_runs, int)
        self.tokens.set_mode(s.value("view/token_colours", "phase", str))
        self.kv.set_mode(s.value("view/kv_mode", "memory", str))
        self.lecture = s.value("view/lecture", False, bool)

    def save_settings(self) -> None:
        s = self.settings
        s.setValue("window/geometry", self.saveGeometry())
        s.setValue(self._layout_key(), self.saveState())
        s.setValue("view/token_colours", self.tokens.mode)
        s.setValue("view/kv_mode", self.kv.mode)
        s.setValue("view/lecture", self.lecture)
        self.controls.save(s)
        s.sync()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.timer.stop()
        self.save_settings()
        self.worker_stopped = self.client.shutdown(1500)
        event.accept()


def _duration(ms: float) -> str:
    for unit, size in (("days", 86_400_000), ("h", 3_600_000), ("min", 60_000), ("s", 1000)):
        if ms >= size:
            return f"{ms / size:,.1f} {unit}"
    return f"{ms:,.0f} ms"


def _loaded_text(loaded: ModelLoaded) -> str:
    m = loaded.model
    how = " (converted from GGUF this time)" if loaded.converted else ""
    return (f"{m.name}: {m.num_params / 1e6:,.0f}M parameters, {m.num_layers} layers, {m.dtype} on {m.device}; "
            f"loaded in {loaded.load_ms / 1000:.1f} s{how}")
