"""File > Export > Scene as video: the scene's run (or experiment) saved as a trace and rendered by
``kvscope --render`` in a process of its own (offscreen, on its own screen of the video's size, so the window
stays responsive and unchanged), with a progress dialog reading its progress lines; Cancel stops it and no file
is left."""

from __future__ import annotations

import re
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject, QProcess, Qt
from PySide6.QtWidgets import QProgressDialog, QWidget

from engine.output.trace import write_checked

PROGRESS = re.compile(r"^\[(\d+)/(\d+)\]")


def render_command(out: Path, scene: str, size: str, fps: int, trace: Path) -> list[str]:
    """The render as a command line: this same program (frozen by PyInstaller, or the interpreter with
    ``-m app``)."""
    program = [sys.executable] if getattr(sys, "frozen", False) else [sys.executable, "-m", "app"]
    return [*program, "--render", str(out), "--scene", scene, "--size", size, "--fps", str(fps), "--force",
            str(trace)]     # the save dialog asked before replacing a file


class VideoExport(QObject):
    """One export in flight. ``done(message, ok)`` when it ends, however it ends."""

    def __init__(self, parent: QWidget, events: list, scene: str, out: str, size: str,
                 done: Callable[[str, bool], None]) -> None:
        super().__init__(parent)
        self.out, self.done = Path(out), done
        self._tmp = tempfile.TemporaryDirectory(prefix="kvscope-export-")
        trace = Path(self._tmp.name) / "scene.kvscope.jsonl"
        write_checked(trace, events)
        fps = 15 if self.out.suffix.lower() == ".gif" else 30
        self.dialog = QProgressDialog(f"Rendering the {scene} scene to {self.out.name}…", "Cancel", 0, 0, parent)
        self.dialog.setWindowTitle("Export scene as video")
        self.dialog.setWindowModality(Qt.WindowModality.WindowModal)
        self.dialog.setMinimumDuration(0)
        self.dialog.canceled.connect(self.cancel)
        self.process = QProcess(self)
        self.process.setProcessChannelMode(QProcess.ProcessChannelMode.SeparateChannels)
        self.process.readyReadStandardError.connect(self._progress)
        self.process.finished.connect(self._finished)
        self._cancelled = False
        self._last_error = ""
        command = render_command(self.out, scene, size, fps, trace)
        self.process.start(command[0], command[1:])
        self.dialog.show()

    def _progress(self) -> None:
        for line in bytes(self.process.readAllStandardError()).decode(errors="replace").splitlines():
            found = PROGRESS.match(line)
            if found:
                self.dialog.setMaximum(int(found.group(2)))
                self.dialog.setValue(int(found.group(1)))
            elif line.strip():
                self._last_error = line.strip().removeprefix("kvscope: ")

    def cancel(self) -> None:
        self._cancelled = True
        if self.process.state() != QProcess.ProcessState.NotRunning:
            self.process.terminate()                 # the renderer stops between frames and removes its file
            if not self.process.waitForFinished(10_000):
                self.process.kill()

    def _finished(self, code: int, _status) -> None:
        self.dialog.reset()
        partial = self.out.with_name(f".{self.out.name}.partial")
        partial.unlink(missing_ok=True)              # a killed renderer could not remove it itself
        self._tmp.cleanup()
        if self._cancelled:
            self.done("The export was cancelled; no file was written.", False)
        elif code == 0 and self.out.is_file():
            self.done(f"Exported the scene as video to {self.out}", True)
        else:
            self.done(f"The export failed: {self._last_error or f'the renderer ended with code {code}'}", False)
        self.deleteLater()
