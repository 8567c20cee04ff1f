"""Remembered settings: the window's geometry and dock layout, the view's choices, the run settings and each
lesson's form, the history's length, the model the controls loaded last. Written shortly after anything
changes (so a logout or ``kill`` loses nothing) and at exit; read once at start.

A settings file is data from anywhere (a hand edit, another version): every value read back is checked
against the bounds of its control, and one that does not fit falls back to its default with one note in the
window, never an abort.
"""

from __future__ import annotations

from PySide6.QtCore import QByteArray, QSettings

from app.panels.controls import ControlsPanel
from app.state.run_settings import RunSettings
from app.state.store import RunStore
from app.state.viewstate import KV_MODES, TOKEN_COLOURS, ViewState

MAX_HISTORY = 500


def restore(settings: QSettings, window, state: ViewState, run_settings: RunSettings, controls: ControlsPanel,
            store: RunStore) -> list[str]:
    """Apply what was remembered; the notes say which values were out of range and replaced."""
    geometry = settings.value("window/geometry")
    if isinstance(geometry, QByteArray):
        window.restoreGeometry(geometry)
    layout = settings.value("window/state")
    window.dock_layout.restore(layout if isinstance(layout, QByteArray) else None,
                               own=str(settings.value("window/own_layout", "false")).lower() in ("true", "1"))
    controls.restore(settings)
    stored = {key.removeprefix("run/"): settings.value(key) for key in settings.allKeys() if key.startswith("run/")}
    run_settings.restore(stored)
    notes = list(run_settings.notes)
    history = _whole(settings.value("history/max_runs", store.max_runs))
    if history is None or not 1 <= history <= MAX_HISTORY:
        notes.append(f"history/max_runs ({str(settings.value('history/max_runs'))[:20]})")
        history = 20
    store.max_runs = history
    colours, mode = settings.value("view/token_colours", "phase"), settings.value("view/kv_mode", "memory")
    state.set_token_colours(colours if colours in TOKEN_COLOURS else TOKEN_COLOURS[0])
    state.set_kv_mode(mode if mode in KV_MODES else KV_MODES[0])
    state.set_heatmap_fit(str(settings.value("view/heatmap_fit", "true")).lower() in ("true", "1"))
    return notes


def save(settings: QSettings, window, state: ViewState, run_settings: RunSettings, controls: ControlsPanel,
         store: RunStore, workbench_geometry: QByteArray | None) -> None:
    if workbench_geometry is None:                  # in a scene, the workbench's own geometry is kept
        settings.setValue("window/geometry", window.saveGeometry())
        settings.setValue("window/state", window.saveState())
        settings.setValue("window/own_layout", window.dock_layout.own)
    else:
        settings.setValue("window/geometry", workbench_geometry)
    settings.setValue("view/token_colours", state.token_colours)
    settings.setValue("view/kv_mode", state.kv_mode)
    settings.setValue("view/heatmap_fit", state.heatmap_fit)
    settings.setValue("history/max_runs", store.max_runs)
    for key, value in run_settings.as_dict().items():
        settings.setValue(f"run/{key}", value)
    controls.save(settings)
    settings.sync()


def _whole(value: object) -> int | None:
    try:
        return int(str(value).strip())
    except (TypeError, ValueError):
        return None
