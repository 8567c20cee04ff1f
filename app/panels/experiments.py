"""The Experiments dock: one tab per lesson that has a view of its own (``app.lessons``), in the registry's
order. The tabs are the lessons' own widgets; this panel only holds them."""

from __future__ import annotations

from PySide6.QtCore import Signal
from PySide6.QtWidgets import QSizePolicy, QTabWidget

from app import lessons
from app.state.run_settings import LessonChoices
from app.state.store import RunStore
from app.views import theme as th
from app.views.lesson_view import LessonView


class ExperimentsPanel(QTabWidget):
    run_requested = Signal(str)
    cancel_requested = Signal()

    def __init__(self, store: RunStore, choices: LessonChoices) -> None:
        super().__init__()
        self.views: dict[str, LessonView] = {kind: view(store, choices) for kind, view in lessons.views().items()}
        for view in self.views.values():
            self.addTab(view, view.lesson.title)
            view.run_requested.connect(self.run_requested)
            view.cancel_requested.connect(self.cancel_requested)
        self.currentChanged.connect(lambda _index: self._size_by_current())
        self._size_by_current()

    def _size_by_current(self) -> None:
        """Only the lesson shown asks for room: the tabs' least size is their largest page's, and one lesson's
        charts side by side (each with its legend) held every tab wider than the dock, its chart scrolled off."""
        for view in self.views.values():
            policy = QSizePolicy.Policy.Preferred if view is self.currentWidget() else QSizePolicy.Policy.Ignored
            view.setSizePolicy(policy, policy)

    @property
    def current(self) -> LessonView:
        return self.currentWidget()

    def show_lesson(self, kind: str) -> None:
        if kind in self.views and self.indexOf(self.views[kind]) >= 0:
            self.setCurrentWidget(self.views[kind])

    def set_theme(self, theme: th.Theme) -> None:
        for view in self.views.values():
            view.set_theme(theme)

    def refresh(self) -> None:
        for view in self.views.values():
            view.refresh()

    def set_busy(self, busy: str | None) -> None:
        for view in self.views.values():
            view.set_busy(bool(busy), mine=busy == "experiment")
