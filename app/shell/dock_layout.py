"""The workbench's docks arranged for the window's room: roomy on a desktop monitor, compact on a projector's
1280x720, following the window's size while the arrangement is the window's own; a dock the user moves or floats
makes the layout theirs, kept as they left it, until View > Reset layout.

Roomy: controls left; timing over sampling on the right, experiments and chat tabbed with timing, attention with
sampling; the token stream over the KV heatmap in the middle. Compact: every right-hand panel in one tab group
(short names, none cut), so the one chart shown is readable, and the token stream keeps its lines over a shorter
heatmap.
"""

from __future__ import annotations

from collections.abc import Callable

from PySide6.QtCore import QByteArray, QEvent, QObject, Qt, QTimer
from PySide6.QtWidgets import QDockWidget, QMainWindow

COMPACT_BELOW = (1500, 900)  # a window narrower or lower than this gets the compact arrangement
COMPACT_KV_SHARE = 0.42      # of the height, the KV heatmap's in it: the token stream keeps five lines above
CONTROLS_PX = 350            # the controls dock: its widest row (seed and "random") with room for a scroll bar
TITLES = {"controls": "Controls", "timing": "Prefill vs decode timing", "sampling": "Sampling: next-token candidates",
          "kv": "KV cache per layer", "experiments": "Experiments", "chat": "Chat (KV cache across turns)",
          "attention": "Attention over the cache"}
AREAS = {"controls": Qt.DockWidgetArea.LeftDockWidgetArea, "kv": Qt.DockWidgetArea.BottomDockWidgetArea}  # else right
RAISE_ORDER = ("timing", "experiments", "chat", "sampling", "attention")     # the upper tab group's first
SHORT_TITLES = {"timing": "Timing", "sampling": "Sampling", "chat": "Chat", "attention": "Attention"}


def is_compact(width: int, height: int) -> bool:
    return width < COMPACT_BELOW[0] or height < COMPACT_BELOW[1]


class DockLayout(QObject):
    """Arranges ``docks`` in ``window``; ``compact`` is the arrangement they are in, None once the user made it."""

    def __init__(self, window: QMainWindow, docks: dict[str, QDockWidget], paused: Callable[[], bool]) -> None:
        super().__init__(window)
        self.window, self.docks, self.paused = window, docks, paused      # paused: a lecture scene has the window
        self.compact: bool | None = None
        self._arranging = False
        self._timer = QTimer(self)
        self._timer.setSingleShot(True)
        self._timer.setInterval(0)
        self._timer.timeout.connect(self._arrange_for_size)
        for dock in docks.values():
            dock.dockLocationChanged.connect(self._user_moved)
            dock.topLevelChanged.connect(self._user_moved)
        window.installEventFilter(self)

    @property
    def settled(self) -> bool:
        """Whether the arrangement for the window's size is made (one follows a resize once it is laid out)."""
        return not self._timer.isActive()

    @property
    def own(self) -> bool:
        """Whether the user arranged the docks (remembered with the window's state)."""
        return self.compact is None

    def arrange(self, compact: bool) -> None:
        d, vertical = self.docks, Qt.Orientation.Vertical
        w = self.window
        self._arranging = True
        try:
            # The right-hand panels start from no arrangement: re-split from the compact one, Qt kept every
            # panel in one tab group and left a stray tab bar over the KV heatmap.
            closed = {name for name, dock in d.items() if dock.isHidden()}       # by the user: they stay closed
            # The panels on top of their tab groups stay on top (the experiment a user was reading, not timing).
            shown = [name for name, dock in d.items() if dock.isVisible() and not dock.visibleRegion().isEmpty()]
            for name, dock in d.items():
                w.removeDockWidget(dock)
                w.addDockWidget(AREAS.get(name, Qt.DockWidgetArea.RightDockWidgetArea), dock)
                dock.setVisible(name not in closed)
            if compact:
                for name in ("sampling", "attention", "experiments", "chat"):
                    w.tabifyDockWidget(d["timing"], d[name])
            else:
                w.splitDockWidget(d["timing"], d["sampling"], vertical)
                w.tabifyDockWidget(d["timing"], d["experiments"])
                w.tabifyDockWidget(d["experiments"], d["chat"])
                w.tabifyDockWidget(d["sampling"], d["attention"])
                d["sampling"].raise_()
            d["timing"].raise_()
            for name in reversed([name for name in RAISE_ORDER if name in shown]):    # (compact: the first wins)
                d[name].raise_()
            for name, dock in d.items():
                dock.setWindowTitle(SHORT_TITLES.get(name, TITLES[name]) if compact else TITLES[name])
            height = max(w.height(), 600)
            w.resizeDocks([d["controls"], d["timing"]], [CONTROLS_PX, 500 if compact else 560],
                          Qt.Orientation.Horizontal)
            if not compact:
                w.resizeDocks([d["timing"], d["sampling"]], [int(height * 0.58), int(height * 0.38)], vertical)
            w.resizeDocks([d["kv"]], [int(height * (COMPACT_KV_SHARE if compact else 0.55))], vertical)
        finally:
            self._arranging = False
        self.compact = compact

    def follow_size(self) -> None:
        """Arranged for the window's size, once a resize is laid out: sizes given to the docks inside the resize
        were shared out again by the window's layout (the controls dock ended 150 px wide at 1280x720)."""
        if self.compact is None or self.paused():
            return
        self.compact = self._wanted()
        self._timer.start()

    def restore(self, state: QByteArray | None, own: bool) -> None:
        """The user's own layout as they left it; otherwise arranged for the window's size."""
        if own and isinstance(state, QByteArray) and self._restore_state(state):
            self.compact = None
            return
        self.compact = self._wanted()
        self.follow_size()

    def restore_after_scene(self, state: QByteArray | None) -> None:
        """The docks as they were after a scene borrowed their panels; an arrangement of the window's own is made
        for the size the window is back at."""
        restored = state is not None and self._restore_state(state)
        if not restored:
            for dock in self.docks.values():        # (the scene hid them)
                dock.show()
        if not (self.own and restored):
            self.arrange(self._wanted())

    def reset(self) -> None:
        """Every panel back in its dock, floating ones included, arranged for the window's size."""
        for dock in self.docks.values():
            dock.setFloating(False)
            dock.show()
        self.arrange(self._wanted())

    def eventFilter(self, watched: QObject, event: QEvent) -> bool:  # noqa: N802 (Qt override)
        if watched is self.window and event.type() in (QEvent.Type.Resize, QEvent.Type.Show):
            self.follow_size()          # a show too: dock sizes given before the window is on screen do not hold
        return False

    def _wanted(self) -> bool:
        return is_compact(self.window.width(), self.window.height())

    def _restore_state(self, state: QByteArray) -> bool:
        self._arranging = True
        try:
            return self.window.restoreState(state)
        finally:
            self._arranging = False

    def _arrange_for_size(self) -> None:
        if self.compact is not None and not self.paused():
            self.arrange(self._wanted())

    def _user_moved(self, *_args) -> None:
        if not self._arranging and not self.paused():
            self.compact = None
