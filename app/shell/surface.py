"""What the controller shows, in the window's widgets: the error banner (never a dialog: a lecture must not stop
for a click), the status strip and its progress, the model line in Controls, the one-time conversion dialog,
the window's title, and the Experiments tab an experiment is drawn in. It implements ``app.link.controller.Surface``;
the window composes it, so ``MainWindow`` stays a layout."""

from __future__ import annotations

import logging

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QDockWidget, QHBoxLayout, QLabel, QMainWindow, QPushButton, QWidget

from app import lessons as app_lessons
from app.link.routing import describe_loaded, loaded_reasons
from app.panels.controls import ControlsPanel
from app.panels.conversation import ChatPanel
from app.panels.experiments import ExperimentsPanel
from app.shell.dialogs import FirstRunDialog
from app.views.status import StatusStrip
from engine.facts.events import LoadProgress, ModelLoaded

log = logging.getLogger(__name__)
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

    def show_message(self, message: str, warning: bool = False) -> None:
        self.setStyleSheet(WARNING_STYLE if warning else ERROR_STYLE)
        self.label.setText(message)
        self.show()


class WindowSurface:
    def __init__(self, window: QMainWindow, banner: ErrorBanner, status: StatusStrip, controls: ControlsPanel,
                 experiments: ExperimentsPanel, chat: ChatPanel, docks: dict[str, QDockWidget]) -> None:
        self.window, self.banner, self.status, self.controls = window, banner, status, controls
        self.experiments, self.chat, self.docks = experiments, chat, docks
        self.first_run: FirstRunDialog | None = None
        self.lecture = lambda: False                  # the window says whether a scene is shown
        self.work_ended = lambda: None                # the scene's footer forgets "Stopping…"
        self.cancel_load = lambda: None
        self._failure_shown: tuple[str, str] | None = None    # the failure the banner says (``show_failure``)
        self._until_idle: str | None = None           # a status line true only while work winds down

    def show_error(self, message: str) -> None:
        log.info("shown to the user: %s", message)
        self.banner.show_message(message)

    def show_warning(self, message: str) -> None:
        self.banner.show_message(message, warning=True)

    def show_failure(self, key: tuple[str, str], message: str) -> None:
        """A failure that repeats at every frame is said once, not at every frame; said again once the banner
        was cleared (a new run), since it still happens."""
        if key != self._failure_shown:
            self._failure_shown = key
            self.show_error(message)

    def clear_banner(self) -> None:
        self._failure_shown = None
        self.banner.hide()

    def show_status(self, message: str, ms: int = 5000) -> None:
        self.status.showMessage(message, ms)

    def show_until_idle(self, message: str) -> None:
        """A status line that is true only until the work in progress ends ("Stopping: …"): it goes when the
        stop has taken effect, as the scene footer's does, not after a time it could outlast or fall short of."""
        self._until_idle = message
        self.status.showMessage(message)

    def show_progress(self, message: str, fraction: float | None) -> None:
        self.status.show_progress(message, fraction)

    def hide_progress(self) -> None:
        self.status.hide_progress()
        self._close_first_run()

    def show_model_status(self, text: str, details: str = "") -> None:
        self.controls.show_model(text, details)

    def show_memory(self, rss: int, gpu: tuple[int, int] | None) -> None:
        self.status.show_memory(rss, gpu)

    def loading(self, progress: LoadProgress) -> None:
        """The one-time conversion gets a dialog that explains it; everything else stays in the status bar."""
        if progress.stage == "convert" and self.first_run is None:
            self.first_run = FirstRunDialog(self.window)
            self.first_run.cancel_requested.connect(self.cancel_load)
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
        self.controls.show_model(describe_loaded(loaded, brief=True), loaded_reasons(loaded))
        self.status.showMessage(describe_loaded(loaded, brief=True), 8000)
        self.window.setWindowTitle(f"KVScope — {m.name} on {m.device}")
        if loaded.warnings:
            self.show_warning(" ".join(loaded.warnings))

    def busy_changed(self, busy: str | None) -> None:
        self.controls.set_running(busy == "run", busy=bool(busy))
        if not busy:
            self.controls.show_steering("")
        self.experiments.set_busy(busy)
        self.chat.set_busy(busy)
        if not busy:
            if self._until_idle is not None and self.status.currentMessage() == self._until_idle:
                self.status.clearMessage()
            self._until_idle = None
            self.work_ended()

    def show_steering(self, steering: str) -> None:
        self.controls.show_steering(steering)

    def show_experiment(self, kind: str) -> None:
        """Bring the experiment's view forward: the chat comparison in the Chat tab, the others in Experiments
        (a lecture scene shows its own charts instead)."""
        if self.lecture():
            return
        self.docks[app_lessons.dock_of(kind)].raise_()
        self.experiments.show_lesson(kind)
