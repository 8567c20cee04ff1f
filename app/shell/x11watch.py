"""On X11, end the application when its window is destroyed from outside.

A window manager that crashes, a compositor restart or ``xdotool windowclose`` destroys the X window without
asking it to close; Qt receives no close event, and the process went on running with no window at all. A
second, private xcb connection asks the X server every two seconds whether the window still exists (one
round trip, no events, nothing global touched); when it does not, the window is closed as a click would
close it (settings saved, the worker stopped) and the application quits.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from collections.abc import Callable

from PySide6.QtCore import QObject, QTimer
from PySide6.QtGui import QGuiApplication

log = logging.getLogger(__name__)
INTERVAL_MS = 2000


class WindowWatch(QObject):
    def __init__(self, window_id: Callable[[], int], gone: Callable[[], None], parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.window_id, self.gone = window_id, gone
        self._xcb = self._conn = None
        self._free: Callable | None = None
        if QGuiApplication.platformName() != "xcb":
            return
        try:
            self._open()
        except (OSError, AttributeError) as exc:         # no libxcb: nothing to watch with
            log.info("not watching the X window: %s", exc)
            return
        self.timer = QTimer(self)
        self.timer.setInterval(INTERVAL_MS)
        self.timer.timeout.connect(self.check)
        self.timer.start()

    def _open(self) -> None:
        xcb = ctypes.CDLL(ctypes.util.find_library("xcb") or "libxcb.so.1")
        xcb.xcb_connect.restype = ctypes.c_void_p
        xcb.xcb_connect.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_int)]
        xcb.xcb_connection_has_error.argtypes = [ctypes.c_void_p]
        xcb.xcb_get_geometry.restype = ctypes.c_uint                 # a cookie: a struct of one unsigned int
        xcb.xcb_get_geometry.argtypes = [ctypes.c_void_p, ctypes.c_uint32]
        xcb.xcb_get_geometry_reply.restype = ctypes.c_void_p
        xcb.xcb_get_geometry_reply.argtypes = [ctypes.c_void_p, ctypes.c_uint, ctypes.POINTER(ctypes.c_void_p)]
        xcb.xcb_disconnect.argtypes = [ctypes.c_void_p]
        conn = xcb.xcb_connect(None, None)
        if not conn or xcb.xcb_connection_has_error(conn):
            raise OSError("cannot open a second connection to the X server")
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.free.argtypes = [ctypes.c_void_p]
        self._xcb, self._conn, self._free = xcb, conn, libc.free

    def exists(self) -> bool:
        """Whether the X server still has the window (a geometry request that fails means it is gone)."""
        if self._xcb is None:
            return True
        error = ctypes.c_void_p()
        reply = self._xcb.xcb_get_geometry_reply(self._conn, self._xcb.xcb_get_geometry(self._conn,
                                                                                          self.window_id()),
                                                 ctypes.byref(error))
        for pointer in (reply, error.value):
            if pointer:
                self._free(pointer)
        return bool(reply)

    def check(self) -> None:
        if not self.exists():
            log.warning("the window was destroyed from outside; closing the application")
            self.timer.stop()
            self.gone()

    def close(self) -> None:
        if self._xcb is not None:
            self._xcb.xcb_disconnect(self._conn)
            self._xcb = None
