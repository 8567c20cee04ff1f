"""Remembered settings. ``KVSCOPE_SETTINGS`` names an ini file instead of the user's store, so tests never
touch a user's real settings.

Qt reads a settings file whole and blocks on what is not a file: a FIFO there hangs the window before it opens,
and a sparse file of gigabytes ends it in ``std::bad_alloc``. So the file is looked at first; one that is not a
regular file of at most ``MAX_BYTES`` is left as it is (nothing of the user's is removed) and this session
remembers its settings in a file of its own, and says so.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from pathlib import Path

from PySide6.QtCore import QCoreApplication, QSettings, QStandardPaths

MAX_BYTES = 1 << 20          # a settings file is kilobytes; the window's geometry and dock state included


def open_settings() -> tuple[QSettings, str]:
    """The settings store, and '' or the sentence that says why this session's settings are not remembered."""
    path = os.environ.get("KVSCOPE_SETTINGS")
    where = path or _default_file()
    problem = unusable(where) if where else ""
    if not problem:
        return (QSettings(path, QSettings.Format.IniFormat) if path else QSettings()), ""
    spare = Path(tempfile.mkdtemp(prefix="kvscope-settings-")) / "settings.ini"
    return (QSettings(str(spare), QSettings.Format.IniFormat),
            f"The settings file {where} {problem}: it was left as it is, and this session's settings will not be "
            "remembered")


def unusable(path: str) -> str:
    """Why Qt must not read ``path`` ('' when it may, or when it does not exist yet)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ""
    except (OSError, ValueError) as exc:
        return f"cannot be read ({getattr(exc, 'strerror', None) or exc})"
    if not stat.S_ISREG(st.st_mode):
        return "is not a regular file"
    if st.st_size > MAX_BYTES:
        return f"is {st.st_size / 2**20:,.0f} MiB, larger than a settings file ({MAX_BYTES >> 20} MiB at most)"
    if not os.access(path, os.R_OK):
        return "cannot be read (permission denied)"
    return ""


def _default_file() -> str:
    """Where ``QSettings()`` keeps this user's settings on Linux, found without Qt reading it (its constructor
    does); elsewhere the store is the system's own (a plist, the registry), not a file KVScope need look at."""
    if not sys.platform.startswith("linux"):
        return ""
    folder = QStandardPaths.writableLocation(QStandardPaths.StandardLocation.GenericConfigLocation)
    org, app = QCoreApplication.organizationName(), QCoreApplication.applicationName()
    return os.path.join(folder, org or app, f"{app}.conf")
