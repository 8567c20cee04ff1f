"""``MainWindow``: the workbench layout (docks around the token stream), lecture mode (one scene at a time),
the status strip and the error banner, and remembered settings. It is the view: actions and event routing
live in ``app.controller``, the refresh timer in ``app.frames``, menus in ``app.menus``, file actions in
``app.file_actions``, what is shown in the models of ``app.viewstate``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from PySide6.QtCore import QByteArray, QRect, Qt, QTimer
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFrame,
    QHBoxLayout,
    QInputDialog,
    QLabel,
    QMainWindow,
    QMessageBox,
    QPushButton,
    QScrollArea,
    QStackedWidget,
    QVBoxLayout,
    QWidget,
)

from app import theme as th
from app.controller import Controller, describe_loaded
from app.dialogs import AboutDialog, FirstRunDialog
from app.file_actions import FileActions
from app.frames import FrameScheduler
from app.menus import SHORTCUTS, build_menus, set_lecture_keys
from app.panels.attention import AttentionPanel
from app.panels.chat import ChatPanel
from app.panels.controls import ControlsPanel
from app.panels.experiments import ExperimentsPanel
from app.panels.kv_heatmap import KVHeatmapPanel
from app.panels.sampling import SamplingPanel
from app.panels.timing import TimingPanel
from app.panels.tokens import TokensPanel
from app.scenes import SceneView
from app.settings import open_settings
from app.status import StatusStrip
from app.store import RunStore
from app.viewstate import SCENES, Conversation, ViewState
from app.worker import EngineClient
from engine.errors import EngineError
from engine.events import LoadProgress, ModelLoaded, ServerFacts
from engine.gguf import remove_all_conversions
from engine.kvcache import format_bytes

log = logging.getLogger(__name__)
ERROR_STYLE = "background:#FBE3D6; color:#7A2600;"
WARNING_STYLE = "background:#FFF4CC; color:#5A4500;"
SAVE_DELAY_MS = 800        # settings are written this long after the last change (and at exit)


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

    def show_message(self, message: str, warning: bool = False) -> None:
        self.setStyleSheet(WARNING_STYLE if warning else ERROR_STYLE)
        self.label.setText(message)
        self.show()


class MainWindow(QMainWindow):
    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation, client: EngineClient) -> None:
        super().__init__()
        self.store, self.state, self.conversation, self.client = store, state, conversation, client
        self.settings = open_settings()
        self._font_pt = QApplication.font().pointSizeF()
        self.worker_stopped = True
        self.first_run: FirstRunDialog | None = None
        self.lecture = False
        self.replay_speed = 1.0
        self._last_failure: tuple[str, str] | None = None
        self._workbench_geometry: QByteArray | None = None
        self.setWindowTitle("KVScope")
        self.setObjectName("KVScopeMain")
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowNestedDocks)

        self.controls = ControlsPanel()
        self.tokens = TokensPanel(store, state)
        self.kv = KVHeatmapPanel(store, state)
        self.timing = TimingPanel(store, state)
        self.sampling = SamplingPanel(store, state)
        self.attention = AttentionPanel(store, state)
        self.experiments = ExperimentsPanel(store)
        self.chat = ChatPanel(store, conversation)
        self.banner = ErrorBanner()
        self.workbench = QWidget()
        wv = QVBoxLayout(self.workbench)
        wv.setContentsMargins(0, 0, 0, 0)
        wv.addWidget(self.tokens, 1)
        self.scene_view = SceneView(store, state, conversation, self._scene_arrangements(), self._enter_scene,
                                    self._leave_scene)
        self.stack = QStackedWidget()
        self.stack.addWidget(self.workbench)
        self.stack.addWidget(self.scene_view)
        central = QWidget()
        cv = QVBoxLayout(central)
        cv.setContentsMargins(0, 0, 0, 0)
        cv.addWidget(self.banner)
        cv.addWidget(self.stack, 1)
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
            "attention": self._dock("Attention over the cache", self.attention, Qt.DockWidgetArea.RightDockWidgetArea),
        }
        self.splitDockWidget(self.docks["timing"], self.docks["sampling"], Qt.Orientation.Vertical)
        self.tabifyDockWidget(self.docks["timing"], self.docks["experiments"])
        self.tabifyDockWidget(self.docks["experiments"], self.docks["chat"])
        self.tabifyDockWidget(self.docks["sampling"], self.docks["attention"])
        self.docks["sampling"].raise_()
        self.docks["timing"].raise_()
        self.status = StatusStrip()
        self.setStatusBar(self.status)
        self.resize(1600, 1000)
        self._default_layout()
        self._default_state = self.saveState()
        self.state.subscribe(self._state_changed)
        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(SAVE_DELAY_MS)
        self._save_timer.timeout.connect(self.save_settings)

    def attach(self, controller: Controller) -> None:
        """Wire the controller in (the composition root makes it with this window as its surface)."""
        self.controller = controller
        self.files = FileActions(self, self.store, self.state, controller, self.settings, self.show_status,
                                 self.show_error, lambda: self.replay_speed)
        self.actions_by_name = build_menus(self)
        c = self.controls
        c.run_requested.connect(self.start_run)
        c.stop_requested.connect(controller.stop)
        c.step_requested.connect(self.step_run)
        c.pause_toggled.connect(self.set_paused)
        c.load_requested.connect(lambda *request: controller.load_model(*request))
        c.delay_changed.connect(lambda s: setattr(self.client.control, "delay_s", s))
        c.changed.connect(self.settings_changed)
        self.tokens.step_selected.connect(self.sampling.show_step)
        self.tokens.step_selected.connect(self.attention.show_step)
        self.experiments.run_requested.connect(self.start_experiment)
        self.experiments.views["speculative"].prompt_source = self.controls.prompt_text
        self.experiments.cancel_requested.connect(controller.stop)
        self.chat.send_requested.connect(self.send_chat)
        self.chat.compare_requested.connect(lambda turns: self.start_experiment(
            "chat", {"turns": turns} if turns else {}))
        self.frames = FrameScheduler(
            self.store, self.state,
            text=[("Drawing the token stream", self.tokens.refresh),
                  ("Updating the status strip", lambda: self.status.show_run(self.selected_run())),
                  ("Writing the scene caption", self.scene_view.refresh)],
            charts=[("Drawing the KV heatmap", self.kv), ("Drawing the timing charts", self.timing),
                    ("Drawing the sampling chart", self.sampling), ("Drawing the attention view", self.attention),
                    ("Drawing the experiment charts", self.experiments),
                    ("Drawing the chat view", self.chat)],
            guard=self.guarded, parent=self)
        self._restore()
        self._apply_mode()

    # --- construction -------------------------------------------------------------------------------------
    def _dock(self, title: str, widget: QWidget, area: Qt.DockWidgetArea) -> QDockWidget:
        """A panel in a dock, inside a scroll area: on a small screen the panel scrolls rather than pushing
        the window past the screen's edge (the workbench's panels add up to more than 1,100 px otherwise)."""
        dock = QDockWidget(title, self)
        dock.setObjectName(f"dock-{title}")
        scroll = QScrollArea()
        scroll.setWidgetResizable(True)
        scroll.setFrameShape(QFrame.Shape.NoFrame)
        scroll.setWidget(widget)
        scroll.setMinimumWidth(160)
        dock.setWidget(scroll)
        self.addDockWidget(area, dock)
        return dock

    def _scene_arrangements(self) -> dict[str, list[tuple[QWidget, int]]]:
        views = self.experiments.views
        return {"prefill": [(self.tokens, 4), (self.timing.timeline, 5)], "kv": [(self.kv, 1)],
                "cache": [(views["cache"], 1)], "prompt": [(views["prefill"], 1)],
                "batch": [(views["batch"], 1), (views["continuous"], 1)], "sampling": [(self.sampling, 1)],
                "chat": [(self.chat, 1)], "memory": [(self.kv, 1)],
                "attention": [(self.tokens, 1), (self.attention, 2)],
                "speculative": [(views["speculative"], 1)], "paged": [(views["paged"], 1)]}

    def _enter_scene(self, name: str) -> None:
        for view in self.experiments.views.values():
            view.set_compact(True)
        self.kv.whole_window_only = name == "memory"
        self.kv.set_controls_visible(False)
        self.tokens.set_controls_visible(False)
        self.attention.set_controls_visible(False)
        self.chat.set_wide(True)
        self.kv.refresh_range()

    def _leave_scene(self, _name: str) -> None:
        for view in self.experiments.views.values():
            view.set_compact(False)
        self.kv.whole_window_only = False
        self.kv.set_controls_visible(True)
        self.tokens.set_controls_visible(True)
        self.attention.set_controls_visible(True)
        self.chat.set_wide(False)
        self.kv.refresh_range()

    # --- actions that read the controls -------------------------------------------------------------------
    def selected_run(self):
        return self.store.find(self.state.selected) if self.state.selected else None

    def _params(self):
        try:
            return self.controls.params()
        except EngineError as exc:
            self.show_error(str(exc))
            return None

    def start_run(self, paused: bool = False, attention: bool = False) -> None:
        """Run the prompt with the controls' settings (``attention``: recording attention whatever they say)."""
        params = self._params()
        if params is not None and attention and not params.capture_attention:
            params = params.with_(capture_attention=True, compiled=False)
        if params is not None:
            self.controller.start_run(self.controls.prompt_text(), params, paused=bool(paused),
                                      delay_s=self.controls.slow.value() / 1000.0)
            self.controls.set_paused(bool(paused) and self.client.busy == "run")

    def step_run(self) -> None:
        self.controller.step(lambda: self.start_run(paused=True))
        if self.client.busy == "run":
            self.controls.set_paused(True)

    def toggle_pause(self) -> None:
        self.set_paused(not self.client.control.paused)

    def set_paused(self, paused: bool) -> None:
        self.controls.set_paused(paused if self.controller.set_paused(paused) else False)

    def load_from_controls(self) -> None:
        self.controller.load_model(*self.controls.model_request())

    def load_model(self, model: str, device: str = "auto", dtype: str = "auto", trust: bool = False) -> None:
        self.controller.load_model(model, device, dtype, trust)

    def send_chat(self, text: str, reuse: bool) -> None:
        params = self._params()
        if params is not None:
            self.controller.send_chat(text, params, reuse, delay_s=self.controls.slow.value() / 1000.0)

    def start_experiment(self, kind: str, settings: dict) -> None:
        if self.controller.start_experiment(kind, settings):
            self.show_experiment(kind)

    def show_experiment(self, kind: str) -> None:
        """Bring the experiment's view forward: the chat comparison in the Chat tab, the others in Experiments
        (a lecture scene shows its own charts instead)."""
        if self.lecture:
            return
        self.docks["chat" if kind == "chat" else "experiments"].raise_()
        if kind in self.experiments.views:
            self.experiments.setCurrentWidget(self.experiments.views[kind])

    def scene_action(self) -> None:
        """R in a lecture scene: run what the scene is about."""
        scene = self.state.scene
        if scene in ("cache", "prompt", "batch", "speculative", "paged"):
            kind = {"cache": "cache", "prompt": "prefill", "batch": "batch", "speculative": "speculative",
                    "paged": "paged"}[scene]
            try:
                settings = self.experiments.views[kind].settings()
            except ValueError as exc:
                self.show_error(str(exc))
                return
            self.start_experiment(kind, settings)
        elif scene == "chat":
            self.start_experiment("chat", {"turns": self.conversation.user_turns()} if self.conversation.user_turns()
                                  else {})
        else:
            self.start_run(attention=scene == "attention")

    def current_experiment(self):
        kind = "chat" if self.docks["chat"].isVisible() and not self.docks["experiments"].isVisible() \
            else self.experiments.current.kind
        return self.store.latest_experiment(kind) or (self.store.experiments[-1] if self.store.experiments else None)

    def set_replay_speed(self, speed: float) -> None:
        self.replay_speed = speed
        for name, action in self.actions_by_name.items():
            if name.startswith("speed "):
                action.setChecked(name == f"speed {speed}")

    def open_trace(self, *paths: str) -> None:
        self.files.open_trace(*paths)

    def save_trace(self, path: str, events: list | None = None) -> None:
        self.files.save_trace(path, events)

    def clear_runs(self) -> None:
        self.controller.clear_runs()
        self.frames.refresh(force=True)

    def ask_history(self) -> None:
        value, ok = QInputDialog.getInt(self, "Run history", "Keep this many runs (older ones are dropped, with "
                                        "their memory):", self.store.max_runs, 1, 500)
        if ok:
            self.set_history(value)

    def set_history(self, max_runs: int) -> None:
        self.store.max_runs = max_runs
        self.store.trim()
        self.state.forget_runs({r.run_id for r in self.store.runs})
        self.settings_changed()

    def run_when_loaded(self) -> None:
        self.controller.run_when_loaded(self.start_run)

    # --- Surface: what the controller shows -----------------------------------------------------------------
    def show_error(self, message: str) -> None:
        log.info("shown to the user: %s", message)
        self.banner.show_message(message)

    def show_warning(self, message: str) -> None:
        self.banner.show_message(message, warning=True)

    def show_status(self, message: str, ms: int = 5000) -> None:
        self.status.showMessage(message, ms)

    def show_progress(self, message: str, fraction: float | None) -> None:
        self.status.show_progress(message, fraction)

    def hide_progress(self) -> None:
        self.status.hide_progress()
        self._close_first_run()

    def show_model_status(self, text: str) -> None:
        self.controls.model_status.setText(text)

    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None:
        self.status.show_memory(rss, gpu)

    def loading(self, progress: LoadProgress) -> None:
        """The one-time conversion gets a dialog that explains it; everything else stays in the status bar."""
        if progress.stage == "convert" and self.first_run is None:
            self.first_run = FirstRunDialog(self)
            self.first_run.cancel_requested.connect(self.controller.stop)
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

    def model_loaded(self, loaded: ModelLoaded) -> None:
        m = loaded.model
        if isinstance(m, ServerFacts):                    # the server checks its own limits
            self.controls.set_model_limits(m.context or (1 << 20), 1 << 20)
        else:
            self.controls.set_model_limits(m.max_context, m.vocab_size)
        self.controls.model_status.setText(describe_loaded(loaded))
        self.status.showMessage(describe_loaded(loaded), 8000)
        self.setWindowTitle(f"KVScope — {m.name} on {m.device}")
        if loaded.warnings:
            self.show_warning(" ".join(loaded.warnings))
        self.settings_changed()

    def busy_changed(self, busy: str | None) -> None:
        self.controls.set_running(busy == "run", busy=bool(busy))
        if not busy:
            self.controls.set_paused(False)
        self.experiments.set_busy(busy)
        self.chat.set_busy(busy)

    def guarded(self, what: str, action: Callable[[], None]) -> bool:
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

    def refresh(self, force: bool = False) -> None:
        self.frames.refresh(force)

    # --- lecture mode: scenes -----------------------------------------------------------------------------
    def toggle_lecture(self) -> None:
        self.leave_lecture() if self.lecture else self.enter_lecture()

    def enter_lecture(self, scene: str | None = None) -> None:
        if not self.lecture:
            self.settings.setValue("window/state", self.saveState())
            self._workbench_geometry = self.saveGeometry()
            self.lecture = True
            self._apply_mode()
        wanted = scene or self.settings.value("view/scene", SCENES[0], str)
        self.state.show_scene(wanted if wanted in SCENES else SCENES[0])

    def leave_lecture(self) -> None:
        if not self.lecture:
            return
        self.state.show_scene(None)
        self.lecture = False
        self._apply_mode()

    def show_scene(self, name: str) -> None:
        if not self.lecture:
            self.enter_lecture(name)
        else:
            self.state.show_scene(name)

    def _state_changed(self, names: set[str]) -> None:
        if "scene" in names:
            self.scene_view.show_scene(self.state.scene)
            if self.lecture:
                self.cover_screen()                     # a scene's panels must not widen the window
            if self.state.scene is not None:
                self.settings.setValue("view/scene", self.state.scene)
        if "heatmap_fit" in names:
            self.settings_changed()

    def _apply_mode(self) -> None:
        """Workbench: docks around the token stream. Lecture: the scene fills the screen, large type."""
        set_lecture_keys(self.actions_by_name, self.lecture)
        self._apply_theme()
        self.menuBar().setVisible(not self.lecture)
        self.status.set_lecture(self.lecture)
        self.stack.setCurrentWidget(self.scene_view if self.lecture else self.workbench)
        if self.lecture:
            for dock in self.docks.values():
                dock.hide()
            self.cover_screen()
        else:
            if self.isFullScreen():
                self.showNormal()
            if isinstance(self._workbench_geometry, QByteArray):
                self.restoreGeometry(self._workbench_geometry)
            state = self.settings.value("window/state")
            if not (isinstance(state, QByteArray) and self.restoreState(state)):
                self.restoreState(self._default_state)
            self.fit_to_screen()
        self.frames.refresh(force=True)

    def cover_screen(self) -> None:
        """Lecture mode fills the screen the window is on: set here too, where no window manager obliges."""
        screen = self.screen()
        if screen is None:
            return
        self.setGeometry(screen.geometry())
        if QApplication.platformName() not in ("offscreen", "minimal"):
            self.showFullScreen()

    def fit_to_screen(self) -> None:
        """A window never extends past the screen it is on, whatever was remembered or a mode left behind."""
        screen = self.screen()
        if screen is None or self.isFullScreen():
            return
        area: QRect = screen.availableGeometry()
        frame = self.frameGeometry()
        width, height = min(frame.width(), area.width()), min(frame.height(), area.height())
        if (width, height) != (frame.width(), frame.height()):
            self.resize(width - (frame.width() - self.width()), height - (frame.height() - self.height()))
        frame = self.frameGeometry()
        x = min(max(frame.x(), area.x()), area.right() - frame.width() + 1)
        y = min(max(frame.y(), area.y()), area.bottom() - frame.height() + 1)
        if (x, y) != (frame.x(), frame.y()):
            self.move(x, y)

    def _default_layout(self) -> None:
        """Controls left, timing and sampling right, token stream over the KV heatmap in the middle."""
        height = max(self.height(), 600)
        self.resizeDocks([self.docks["controls"], self.docks["timing"]], [330, 560], Qt.Orientation.Horizontal)
        self.resizeDocks([self.docks["timing"], self.docks["sampling"]], [int(height * 0.58), int(height * 0.38)],
                         Qt.Orientation.Vertical)
        self.resizeDocks([self.docks["kv"]], [int(height * 0.55)], Qt.Orientation.Vertical)

    def _apply_theme(self) -> None:
        theme = th.current_theme(self.lecture)
        th.apply(QApplication.instance(), theme, self._font_pt)
        for panel in (self.tokens, self.kv, self.timing, self.sampling, self.attention, self.experiments,
                      self.chat, self.scene_view):
            panel.set_theme(theme)

    def reset_layout(self) -> None:
        """Every panel back in its dock, floating ones included, at the default sizes."""
        if self.lecture:
            self.leave_lecture()
        for dock in self.docks.values():
            dock.setFloating(False)
            dock.show()
        self.restoreState(self._default_state)
        self._default_layout()
        self.settings.remove("window/state")
        self.fit_to_screen()

    def show_about(self) -> None:
        dialog = AboutDialog(self, self.client.model, self.store.peaks, self.settings.fileName(),
                             busy=bool(self.client.busy))
        dialog.clear_cache.connect(self.clear_converted_models)
        dialog.exec()

    def clear_converted_models(self) -> None:
        if self.client.busy:
            self.show_status("Clearing the cache is not available while work is in progress.", 5000)
            return
        freed = remove_all_conversions()
        self.status.showMessage(f"Cleared converted models ({format_bytes(freed)}); the built-in model converts "
                                "again on its next load", 8000)

    def show_shortcuts(self) -> None:
        QMessageBox.information(self, "Keyboard shortcuts", SHORTCUTS)

    # --- settings and closing -----------------------------------------------------------------------------
    def settings_changed(self) -> None:
        """Settings are written shortly after they change, so a logout or ``kill`` loses nothing."""
        self._save_timer.start()

    def _restore(self) -> None:
        s = self.settings
        geometry = s.value("window/geometry")
        if isinstance(geometry, QByteArray):
            self.restoreGeometry(geometry)
        state = s.value("window/state")
        if isinstance(state, QByteArray):
            self.restoreState(state)
        self.fit_to_screen()
        self.controls.restore(s)
        self.store.max_runs = s.value("history/max_runs", self.store.max_runs, int)
        self.tokens.set_mode(s.value("view/token_colours", "phase", str))
        self.kv.set_mode(s.value("view/kv_mode", "memory", str))
        self.state.set_heatmap_fit(s.value("view/heatmap_fit", True, bool))

    def save_settings(self) -> None:
        s = self.settings
        if not self.lecture:
            s.setValue("window/geometry", self.saveGeometry())
            s.setValue("window/state", self.saveState())
        elif isinstance(self._workbench_geometry, QByteArray):
            s.setValue("window/geometry", self._workbench_geometry)
        s.setValue("view/token_colours", self.tokens.mode)
        s.setValue("view/kv_mode", self.kv.mode)
        s.setValue("view/heatmap_fit", self.state.heatmap_fit)
        s.setValue("history/max_runs", self.store.max_runs)
        self.controls.save(s)
        s.sync()

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.frames.stop()
        self._save_timer.stop()
        self.save_settings()
        self.worker_stopped = self.client.shutdown(1500)
        event.accept()
