"""Remembered settings. ``KVSCOPE_SETTINGS`` names an ini file instead of the user's store, so tests never
touch a user's real settings."""

from __future__ import annotations

import os

from PySide6.QtCore import QSettings


def open_settings() -> QSettings:
    path = os.environ.get("KVSCOPE_SETTINGS")
    if path:
        return QSettings(path, QSettings.Format.IniFormat)
    return QSettings()
