"""On a real X server (Xvfb, driven with xdotool): what offscreen tests cannot show. The window that a window
manager or ``xdotool windowclose`` destroys takes the process with it, and Ctrl+O opens the trace dialog at
the first press. Skipped, saying so, where Xvfb or xdotool is missing; CI installs both (.ci/run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not (shutil.which("Xvfb") and shutil.which("xdotool")),
                                reason="needs Xvfb and xdotool (apt-get install xvfb xdotool)")


@pytest.fixture(scope="module")
def display():
    for number in range(140, 180):
        if not Path(f"/tmp/.X{number}-lock").exists() and not Path(f"/tmp/.X11-unix/X{number}").exists():
            break
    server = subprocess.Popen(["Xvfb", f":{number}", "-screen", "0", "1600x1000x24", "-nolisten", "tcp"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 10
    while not Path(f"/tmp/.X11-unix/X{number}").exists() and time.time() < deadline:
        time.sleep(0.1)
    yield f":{number}"
    server.terminate()
    server.wait(timeout=10)


def start(display: str, tmp_path: Path) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "DISPLAY": display, "QT_QPA_PLATFORM": "xcb", "KVSCOPE_SETTINGS": str(tmp_path / "s.ini")}
    app = subprocess.Popen([sys.executable, "-m", "app", "--no-load"], env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    window = ""
    deadline = time.time() + 30
    while not window and time.time() < deadline:
        time.sleep(0.3)
        found = subprocess.run(["xdotool", "search", "--onlyvisible", "--name", "^KVScope"], capture_output=True,
                               text=True, env={**os.environ, "DISPLAY": display})
        window = found.stdout.split()[0] if found.stdout.split() else ""
    assert window, "the window did not appear"
    return app, window


def xdotool(display: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["xdotool", *args], capture_output=True, text=True, env={**os.environ, "DISPLAY": display})


def test_destroying_the_window_from_outside_ends_the_process(display, tmp_path):
    app, window = start(display, tmp_path)
    time.sleep(1)
    xdotool(display, "windowclose", window)
    try:
        app.wait(timeout=120)                             # checked every 2 s; settings saved on the way out
    finally:
        app.kill()
    assert app.returncode == 0
    assert (tmp_path / "s.ini").read_text().count("geometry") >= 1


def test_ctrl_o_opens_the_trace_dialog_at_the_first_press(display, tmp_path):
    app, window = start(display, tmp_path)
    try:
        xdotool(display, "windowfocus", "--sync", window)
        xdotool(display, "key", "ctrl+o")
        deadline, found = time.time() + 10, ""
        while not found and time.time() < deadline:
            time.sleep(0.3)
            found = xdotool(display, "search", "--name", "Open a KVScope trace").stdout.strip()
        assert found, "no dialog after the first Ctrl+O"
    finally:
        app.terminate()
        app.wait(timeout=30)
