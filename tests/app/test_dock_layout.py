"""The docks follow the window's size: compact at 1280x720, roomy on a desktop, and back, with no stray tab bar
and no panel the user closed opened again."""

from __future__ import annotations

from PySide6.QtWidgets import QTabBar

from tests.app.conftest import arrange_at, close_and_dispose, make_window


def stray_tab_bars(window) -> list[list[str]]:
    """The window's tab bars on show that sit under no dock shown (Qt's dock tab bars are the window's children,
    each under its group's current dock)."""
    docks = [d for d in window.docks.values() if d.isVisible() and not d.isFloating()]
    out = []
    for bar in window.findChildren(QTabBar):
        if bar.parentWidget() is not window or not bar.isVisible():
            continue
        under = [d for d in docks if abs(d.geometry().bottom() + 1 - bar.geometry().top()) <= 3
                 and d.geometry().left() <= bar.geometry().center().x() <= d.geometry().right()]
        if not under:
            out.append([bar.tabText(i) for i in range(bar.count())])
    return out


def test_a_window_grown_from_720p_to_1080p_splits_the_tab_group_and_leaves_no_stray_tab_bar(qtbot):
    window = make_window(qtbot)
    try:
        docks = window.docks
        arrange_at(qtbot, window, (1280, 720))
        assert docks["sampling"] in window.tabifiedDockWidgets(docks["timing"])
        qtbot.waitUntil(lambda: not stray_tab_bars(window), timeout=3000)     # (once Qt has laid the docks out)
        arrange_at(qtbot, window, (1920, 1080))
        assert docks["sampling"] not in window.tabifiedDockWidgets(docks["timing"])
        assert docks["attention"] in window.tabifiedDockWidgets(docks["sampling"])
        assert docks["sampling"].geometry().top() > docks["timing"].geometry().bottom()
        qtbot.waitUntil(lambda: not stray_tab_bars(window), timeout=3000)     # (once Qt has laid the docks out)
        arrange_at(qtbot, window, (1280, 720))
        qtbot.waitUntil(lambda: not stray_tab_bars(window), timeout=3000)     # (once Qt has laid the docks out)
    finally:
        close_and_dispose(window)


def test_a_panel_the_user_closed_stays_closed_when_the_arrangement_follows_the_size(qtbot):
    window = make_window(qtbot)
    try:
        arrange_at(qtbot, window, (1920, 1080))
        window.docks["attention"].close()
        arrange_at(qtbot, window, (1280, 720))
        assert window.docks["attention"].isHidden() and not window.docks["sampling"].isHidden()
        window.reset_layout()
        assert not window.docks["attention"].isHidden()
    finally:
        close_and_dispose(window)
