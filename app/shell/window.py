"""``MainWindow``: the workbench's layout (docks around the token stream) and the window's own actions (layout,
about, quit). It is a view: actions and event routing live in ``app.link.controller``, what the window shows for
the controller in ``app.shell.surface``, lecture mode in ``app.lecture.mode``, menus in ``app.shell.menus``, file
actions in ``app.shell.file_actions``, remembered settings in ``app.shell.window_settings``, the refresh timer in
``app.views.frames``, and what is shown in the models of ``app.state.viewstate`` and ``app.state.run_settings``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from PySide6.QtCore import QByteArray, Qt, QTimer
from PySide6.QtWidgets import (
    QApplication,
    QDockWidget,
    QFrame,
    QInputDialog,
    QMainWindow,
    QMessageBox,
    QScrollArea,
    QSizePolicy,
    QStackedWidget,
    QTabBar,
    QVBoxLayout,
    QWidget,
)

from app import lessons as app_lessons
from app.lecture.mode import Lecture, fit_to_screen
from app.lecture.scene_list import BY_NAME, SCENES
from app.lecture.scenes import RUN_SCENES, Context, SceneView, scene_lesson
from app.link.controller import Controller
from app.link.worker import EngineClient
from app.panels.attention import AttentionPanel
from app.panels.controls import ControlsPanel
from app.panels.conversation import ChatPanel
from app.panels.experiments import ExperimentsPanel
from app.panels.kv_heatmap import KVHeatmapPanel
from app.panels.sampling import SamplingPanel
from app.panels.timing import TimingPanel
from app.panels.tokens import WORKBENCH_LINES, TokensPanel
from app.shell import window_settings
from app.shell.dialogs import AboutDialog
from app.shell.dock_layout import TITLES, DockLayout
from app.shell.file_actions import FileActions
from app.shell.lookups import Lookups
from app.shell.menus import SHORTCUTS, build_menus, set_lecture_keys
from app.shell.settings import open_settings
from app.shell.surface import ErrorBanner, WindowSurface
from app.state.phase import experiment_phase, figures, run_phase
from app.state.run_settings import LessonChoices, ModelChoice, RunSettings
from app.state.store import RunStore
from app.state.viewstate import Conversation, ViewState
from app.views import theme as th
from app.views.audit import EXPERIMENT, OTHER, RUN, SETTINGS, Known, ScreenAudit
from app.views.frames import FrameScheduler
from app.views.status import StatusStrip
from engine.facts.kvformula import format_bytes
from engine.model.gguf import remove_all_conversions
from engine.store.paths import offloaded_models_dir, remove_tree

log = logging.getLogger(__name__)
SAVE_DELAY_MS = 800        # settings are written this long after the last change (and at exit)


class MainWindow(QMainWindow):
    def __init__(self, store: RunStore, state: ViewState, conversation: Conversation, client: EngineClient,
                 run_settings: RunSettings, choices: LessonChoices, model_choice: ModelChoice) -> None:
        super().__init__()
        self.store, self.state, self.conversation, self.client = store, state, conversation, client
        self.run_settings = run_settings
        self.settings, self.settings_problem = open_settings()
        self.worker_stopped = True
        self.setWindowTitle("KVScope")
        self.setObjectName("KVScopeMain")
        self.setDockOptions(QMainWindow.DockOption.AnimatedDocks | QMainWindow.DockOption.AllowNestedDocks)
        self.controls = ControlsPanel(run_settings, model_choice)
        self.tokens = TokensPanel(store, state)
        self.kv = KVHeatmapPanel(store, state)
        self.timing = TimingPanel(store, state)
        self.sampling = SamplingPanel(store, state)
        self.attention = AttentionPanel(store, state)
        self.experiments = ExperimentsPanel(store, choices)
        self.chat = ChatPanel(store, conversation)
        self.banner = ErrorBanner()
        self.workbench = QWidget()
        wv = QVBoxLayout(self.workbench)
        wv.setContentsMargins(0, 0, 0, 0)
        wv.addWidget(self.tokens, 1)
        arrangements = self._scene_arrangements()
        lesson_views = list(self.experiments.views.values())
        self._scene_lesson_views = {scene: [panel for panel, _ in panels if panel in lesson_views]
                                    for scene, panels in arrangements.items()}
        self.scene_view = SceneView(Context(store, state, conversation, choices), run_settings,
                                    arrangements, self._enter_scene, self._leave_scene)
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
        left, right, bottom = (Qt.DockWidgetArea.LeftDockWidgetArea, Qt.DockWidgetArea.RightDockWidgetArea,
                               Qt.DockWidgetArea.BottomDockWidgetArea)
        self.docks = {name: self._dock(TITLES[name], widget, area) for name, widget, area in (
            ("controls", self.controls, left), ("timing", self.timing, right), ("sampling", self.sampling, right),
            ("kv", self.kv, bottom), ("experiments", self.experiments, right), ("chat", self.chat, right),
            ("attention", self.attention, right))}
        self.dock_layout = DockLayout(self, self.docks, lambda: hasattr(self, "lecture") and self.lecture.active)
        self.status = StatusStrip()
        self.setStatusBar(self.status)
        self.surface = WindowSurface(self, self.banner, self.status, self.controls, self.experiments, self.chat,
                                     self.docks)
        self.audit = ScreenAudit()
        self._register_views()
        self.resize(1600, 1000)
        # (The docks are arranged once the window is shown, for its size: arranged before, Qt left a stray tab
        # bar where the 1600x1000 arrangement had one, over the KV heatmap of a larger window.)
        self._save_timer = QTimer(self)
        self._save_timer.setSingleShot(True)
        self._save_timer.setInterval(SAVE_DELAY_MS)
        self._save_timer.timeout.connect(self.save_settings)

    def attach(self, controller: Controller) -> None:
        """Wire the controller in (the composition root makes it with this window's surface)."""
        self.controller = controller
        self.lecture = Lecture(self, self.state, self.store, self.scene_view, controller, self.run_settings,
                               self.settings)
        self.surface.lecture = lambda: self.lecture.active
        self.surface.work_ended = self.lecture.work_ended
        # A blanked screen is blank edge to edge: the status strip under the scene goes with it.
        self.state.subscribe(lambda names: self.status.setVisible(not self.state.blank) if "blank" in names
                             else None)
        self.surface.cancel_load = controller.stop
        self.files = FileActions(self, self.store, self.state, controller, self.settings, self.surface,
                                 lambda: self.experiments.current.lesson.kind)
        self.files.present_lecture = self.lecture.present
        exports: dict[str, Callable[[], QWidget]] = {
            "Timing panel": lambda: self.timing, "KV heatmap panel": lambda: self.kv,
            "Sampling panel": lambda: self.sampling, "Experiment panel": lambda: self.experiments.current,
            "Chat panel": lambda: self.chat, "Lecture scene": lambda: self.scene_view}
        self.lookups = Lookups(self, self.controls, controller, self.timing, self.settings)
        self.actions_by_name = build_menus(self, controller, self.lecture, self.files, self.state, exports,
                                           list(self.docks.values()), self.lookups,
                                           lambda: self.selected_run() or (self.store.runs[-1] if self.store.runs
                                                                           else None))
        c = self.controls
        c.run_requested.connect(controller.run)
        c.stop_requested.connect(controller.stop)
        c.step_requested.connect(controller.step)
        c.pause_toggled.connect(lambda paused: controller.set_paused(paused) or c.show_steering(""))
        c.load_requested.connect(controller.load_model)
        c.slow.valueChanged.connect(controller.set_slow_motion)
        c.changed.connect(self.settings_changed)
        self.run_settings.subscribe(lambda _names: self.settings_changed())
        self.tokens.step_selected.connect(self.state.pin)
        self.experiments.run_requested.connect(controller.start_lesson)
        self.experiments.cancel_requested.connect(controller.stop)
        self.chat.send_requested.connect(controller.send_chat)
        self.chat.compare_requested.connect(lambda: controller.start_lesson(app_lessons.drawn_in("chat")))
        self.frames = FrameScheduler(
            self.store, self.state,
            text=[("Drawing the token stream", self.tokens.refresh),
                  ("Updating the status strip", lambda: self.status.show_run(self.selected_run())),
                  ("Marking the next run's settings", self._show_next_run),
                  ("Writing the timing header", self.timing.refresh_summary),
                  ("Writing the scene caption", self.scene_view.refresh)],
            charts=[("Drawing the KV heatmap", self.kv), ("Drawing the timing charts", self.timing),
                    ("Drawing the sampling chart", self.sampling), ("Drawing the attention view", self.attention),
                    ("Drawing the experiment charts", self.experiments), ("Drawing the chat view", self.chat)],
            guard=self.guarded, parent=self, behind=lambda: self.tokens.behind, take_in=self.client.drain_backlog)
        notes = window_settings.restore(self.settings, self, self.state, self.run_settings, self.controls, self.store)
        if self.settings_problem:
            self.surface.show_warning(self.settings_problem + ".")
        elif notes:
            self.surface.show_warning("Some remembered settings were out of range and were reset to their defaults: "
                                      + ", ".join(notes) + ".")
        fit_to_screen(self)
        self.apply_mode(False)

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
        scroll.setMinimumSize(160, 80)
        dock.setWidget(scroll)
        self.addDockWidget(area, dock)
        return dock

    def _scene_arrangements(self) -> dict[str, list[tuple[QWidget, int]]]:
        """Which panels each scene borrows (a lesson's scene: its view, and the view of a lesson that joins it)."""
        views = self.experiments.views
        out = {"prefill": [(self.tokens, 3), (self.timing.timeline, 6)], "kv": [(self.kv, 1)],
               "sampling": [(self.sampling.chart, 1)], "chat": [(self.chat, 1)],
               "attention": [(self.tokens, 1), (self.attention, 2)]}
        panels = {"kv": self.kv}
        for scene in SCENES:
            if scene.lesson in views:
                beside = [(panels[name], 1) for name in app_lessons.beside(scene.lesson)]
                out[scene.name] = [(views[scene.lesson], 1), *beside]
        for scene, (kind, _joins) in app_lessons.joins().items():
            out[scene] = out.get(scene, []) + [(views[kind], 1)]
        return out

    def _enter_scene(self, name: str) -> None:
        self.tokens.set_legend_wrap(name != "prefill")          # the full width there, over the timeline
        lesson = BY_NAME[name].lesson if name in BY_NAME else None
        self._set_scene_mode(name, True, whole_window=lesson is not None and "kv" in app_lessons.beside(lesson))

    def _leave_scene(self, name: str) -> None:
        self.tokens.set_legend_wrap(True)
        self._set_scene_mode(name, False, whole_window=False)

    def _set_scene_mode(self, name: str, scene: bool, whole_window: bool) -> None:
        """Panels in a scene show their chart; the scene's caption carries the claim, so their controls step back.
        Only the lesson views this scene borrows change: the others are not on screen in a scene, and compacting
        and expanding every one at each scene change re-laid out all their charts' rich-text titles."""
        for view in self._scene_lesson_views.get(name, []):
            view.set_compact(scene)
        self.kv.whole_window_only = whole_window
        for panel in (self.kv, self.tokens, self.attention):
            panel.set_controls_visible(not scene)
        self.chat.set_wide(scene)
        self.kv.refresh_range()

    # --- modes and layout ---------------------------------------------------------------------------------
    def apply_mode(self, lecture: bool, height: int = th.LECTURE_HEIGHT) -> None:
        """Workbench: docks around the token stream. Lecture: the scene fills the screen (``height`` pixels
        high), its type sized from that height."""
        set_lecture_keys(self.actions_by_name, lecture)
        theme = th.current_theme(lecture, height)
        th.apply(QApplication.instance(), theme)
        for panel in (self.tokens, self.kv, self.timing, self.sampling, self.attention, self.experiments, self.chat,
                      self.scene_view):
            panel.set_theme(theme)
        self.menuBar().setVisible(not lecture)
        self.status.set_lecture(lecture)
        self.stack.setCurrentWidget(self.scene_view if lecture else self.workbench)
        # The page not shown asks for no room: a stack's least size is its largest page's, and the scene's footer,
        # once shown, held the workbench's centre 671 px wide, squeezing the controls dock to 190 px at 1280x720.
        for page in (self.workbench, self.scene_view):
            policy = QSizePolicy.Policy.Preferred if page is self.stack.currentWidget() else QSizePolicy.Policy.Ignored
            page.setSizePolicy(policy, policy)
        if lecture:
            for dock in self.docks.values():
                dock.hide()
            # Tabbed docks keep their tab bar (the main window's own child) on screen after the docks hide: at
            # some sizes it showed over the scene's footer ("Sampling…", "Attention…").
            for bar in self.findChildren(QTabBar):
                if bar.parentWidget() is self:
                    bar.hide()
        self.frames.refresh(force=True)

    def restore_layout(self, state: QByteArray | None) -> None:
        """The docks as they were (or the default layout), after a scene borrowed their panels."""
        self.dock_layout.restore_after_scene(state)

    def reset_layout(self) -> None:
        """Every panel back in its dock, floating ones included, arranged for the window's size."""
        self.lecture.leave()
        fit_to_screen(self)
        self.dock_layout.reset()
        self.settings.remove("window/state")

    # --- what the window itself does ----------------------------------------------------------------------
    def selected_run(self):
        return self.store.find(self.state.selected) if self.state.selected else None

    def _show_next_run(self) -> None:
        run = self.selected_run()
        shown = run.started.params if run is not None and not run.remote else None
        self.controls.show_next_run(run.number if run is not None else None, self.run_settings.differences(shown))

    def known(self) -> Known:
        """What is known now, as the screen audit judges it."""
        run = self.selected_run()
        shown = run.started.params if run is not None and not run.remote else None
        scene = self.state.scene if self.lecture.active else None
        return Known(run_phase(run), figures(run),
                     {r.kind: experiment_phase(r) for r in self.store.experiments},
                     self.client.busy, tuple(self.run_settings.differences(shown)), scene, scene_lesson(scene),
                     blank=self.lecture.active and self.state.blank)

    def _register_views(self) -> None:
        """Every view the screen audit reads: the panels, the status strip, the scene and each lesson's tab."""
        audit = self.audit
        c = self.controls
        essentials = {
            "controls": lambda: [("the prompt", c.prompt, 0), *((b.text().split()[0], b, 0) for b in (
                c.run_button, c.stop_button, c.step_button, c.pause_button))],
            "token stream": lambda: [("the token stream", self.tokens.text, WORKBENCH_LINES)]}
        for name, widget, about in (("status strip", self.status, RUN), ("token stream", self.tokens, RUN),
                                    ("timing", self.timing, RUN), ("KV heatmap", self.kv, RUN),
                                    ("sampling", self.sampling, RUN), ("attention", self.attention, RUN),
                                    ("chat", self.chat, OTHER), ("controls", self.controls, SETTINGS),
                                    ("banner", self.banner, OTHER)):
            audit.register(name, widget, about, essentials=essentials.get(name))
        for kind, view in self.experiments.views.items():
            audit.register(f"tab {kind}", view, EXPERIMENT, kind)
        audit.register("status message", self.status, OTHER, texts=lambda: [self.status.currentMessage()])
        audit.register("scene", self.scene_view, lambda: RUN if self.scene_view.shown in RUN_SCENES else EXPERIMENT)

    def send_chat(self) -> None:
        self.chat.send()

    def ask_history(self) -> None:
        value, ok = QInputDialog.getInt(self, "Run history", "Keep this many runs (older ones are dropped, with "
                                        "their memory):", self.store.max_runs, 1, window_settings.MAX_HISTORY)
        if ok:
            self.controller.set_history(value)
            self.settings_changed()

    def guarded(self, what: str, action: Callable[[], None]) -> bool:
        """Run ``action`` (drawing, taking in an event); if it raises, say so in the banner once and keep the
        window working: one broken panel or event must not take the others down."""
        try:
            action()
            return True
        except Exception as exc:  # noqa: BLE001  (anything a panel or a hostile trace can raise)
            log.exception("%s failed", what)
            text = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            self.surface.show_failure((what, type(exc).__name__),
                                      f"{what} failed ({type(exc).__name__}{': ' + text if text else ''}). The "
                                      "window keeps working; what was recorded is kept.")
            return False

    def refresh(self, force: bool = False) -> None:
        self.frames.refresh(force)

    def show_about(self) -> None:
        dialog = AboutDialog(self, self.client.model, self.store.peaks, self.settings.fileName(),
                             busy=bool(self.client.busy))
        dialog.clear_cache.connect(self.clear_converted_models)
        dialog.exec()

    def clear_converted_models(self) -> None:
        if self.client.busy:
            self.surface.show_status("Clearing the cache is not available while work is in progress.", 5000)
            return
        freed = remove_all_conversions()
        model = self.client.model
        kept = model is not None and "disk" in model.model.layer_devices
        if not kept:
            freed += remove_tree(offloaded_models_dir())
        self.surface.show_status(f"Cleared converted models ({format_bytes(freed)}); the built-in model converts "
                                 "again on its next load" + ("; offloaded layers kept: the loaded model reads them"
                                                             if kept else ""), 8000)

    def show_shortcuts(self) -> None:
        QMessageBox.information(self, "Keyboard shortcuts", SHORTCUTS)

    # --- settings and closing -----------------------------------------------------------------------------
    def settings_changed(self) -> None:
        """Settings are written shortly after they change, so a logout or ``kill`` loses nothing."""
        self._save_timer.start()

    def save_settings(self) -> None:
        workbench = self.lecture.workbench_geometry if self.lecture.active else None
        window_settings.save(self.settings, self, self.state, self.run_settings, self.controls, self.store,
                             workbench if isinstance(workbench, QByteArray) else None)

    def closeEvent(self, event) -> None:  # noqa: N802 (Qt override)
        self.frames.stop()
        self._save_timer.stop()
        self.save_settings()
        self.worker_stopped = self.client.shutdown(1500)
        event.accept()
