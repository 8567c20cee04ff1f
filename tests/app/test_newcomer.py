"""What a newcomer trips over in the window and the desktop install: settings that survive a logout, a layout
that resets, actions that say why they did nothing, a failed load that is not retried, a trace dialog that
cannot hang, a desktop entry that opens traces, and a window that is still there when expected."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from PySide6.QtCore import QSettings
from PySide6.QtWidgets import QFileSystemModel

from app.shell.file_actions import PlainIcons, RegularFilesOnly
from tests.app.conftest import close_and_dispose, load, make_window, run_and_wait, wait_idle

ROOT = Path(__file__).resolve().parents[2]


def test_settings_are_written_soon_after_they_change_without_closing(qtbot, window):
    window.controls.temperature.setValue(0.65)
    path = window.settings.fileName()
    qtbot.waitUntil(lambda: QSettings(path, QSettings.Format.IniFormat).value("run/temperature", 0.0, float)
                    == 0.65, timeout=3000)


SHOWN = """
import sys
import app.main as m
from PySide6.QtCore import QTimer
build = m.build
def patched(args):
    app, w = build(args)
    QTimer.singleShot(0, lambda: print("shown", flush=True))     # the event loop runs: the handler is in place
    return app, w
m.build = patched
sys.exit(m.main(sys.argv[1:]))
"""


def test_sigterm_closes_the_window_and_keeps_the_settings(tmp_path):
    settings = tmp_path / "s.ini"
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "KVSCOPE_SETTINGS": str(settings)}
    process = subprocess.Popen([sys.executable, "-c", SHOWN, "--no-load"], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "shown"
    process.send_signal(signal.SIGTERM)
    _out, err = process.communicate(timeout=120)
    assert process.returncode == 0 and "Traceback" not in err
    assert QSettings(str(settings), QSettings.Format.IniFormat).value("window/geometry") is not None


def test_reset_layout_docks_floating_and_hidden_panels_again(qtbot, window):
    window.docks["sampling"].setFloating(True)
    window.docks["kv"].hide()
    window.reset_layout()
    assert not any(d.isFloating() for d in window.docks.values())
    assert all(d.isVisible() for d in window.docks.values())


def test_refused_actions_say_why(qtbot, window):
    load(window, "/no/such/model")                  # busy loading until the worker's answer is drained
    assert window.client.busy == "load"
    window.controller.run()
    assert "Run is not available while a model is loading" in window.status.currentMessage()
    wait_idle(qtbot, window)
    window.controls.max_tokens.setValue(200)
    window.controls.slow.setValue(50)
    window.controller.run()
    qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.n_steps >= 1)
    window.chat.input.setPlainText("hi")
    window.chat.send()                                    # Ctrl+Shift+Enter: the button itself is disabled
    assert "Sending a message is not available while a run is in progress" in window.status.currentMessage()
    assert "Wait for the model to load" not in window.status.currentMessage()
    window.controller.stop()
    wait_idle(qtbot, window)
    window.controller.toggle_pause()
    assert "Pause works during a run" in window.status.currentMessage()


def test_run_pressed_while_a_stopped_run_winds_down_is_queued_not_dropped(qtbot, window):
    window.controls.max_tokens.setValue(100)
    window.controls.slow.setValue(30)
    window.controller.run()
    qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.n_steps >= 2)
    first = window.store.current
    window.controller.stop()
    window.controller.run()                                    # the first run has not wound down yet
    qtbot.waitUntil(lambda: len(window.store.runs) == 2, timeout=30_000)
    assert first.reason == "stopped" and window.store.current is not first
    window.controller.stop()
    wait_idle(qtbot, window)


def test_a_failed_load_says_so_and_is_not_retried_at_the_next_launch(qtbot, tiny_model_dir, tmp_path):
    w = make_window(qtbot, tiny_model_dir)
    try:
        load(w, str(tmp_path / "fake.gguf"), "cpu", "float32")
        wait_idle(qtbot, w)
        assert w.controls.model_status.text().startswith(f"Could not load {tmp_path / 'fake.gguf'}.")
        assert "tiny" in w.controls.model_status.text()            # the model that is still loaded
        assert run_and_wait(qtbot, w).n_steps >= 1
        w.save_settings()
        saved = QSettings(w.settings.fileName(), QSettings.Format.IniFormat).value("controls/model")
        assert saved == str(tiny_model_dir)
    finally:
        close_and_dispose(w)


def test_a_model_loaded_from_the_command_line_shows_in_the_model_box(qtbot, tiny_model_dir):
    w = make_window(qtbot)
    try:
        w.controls.model_box.setCurrentText("embedded")            # what the last launch remembered
        load(w, str(tiny_model_dir), "cpu", "float32")          # as --model does
        qtbot.waitUntil(lambda: w.client.model is not None and w.client.busy is None, timeout=60_000)
        assert w.controls.model_box.currentText() == str(tiny_model_dir)
    finally:
        close_and_dispose(w)


def test_the_trace_dialog_lists_only_files_it_can_read_without_blocking(qtbot, tmp_path):
    trace = tmp_path / "run.kvscope.jsonl"
    trace.write_text("{}\n")
    os.mkfifo(tmp_path / "pipe")                          # reading a FIFO blocks, as /proc/kmsg does
    model = QFileSystemModel()
    model.setIconProvider(PlainIcons())                  # as the dialog does: the default one reads files
    proxy = RegularFilesOnly()
    proxy.setSourceModel(model)
    for folder in (tmp_path, Path("/proc")):
        root = model.setRootPath(str(folder))
        qtbot.waitUntil(lambda r=root: model.rowCount(r) > 0, timeout=5000)
    names = {model.fileName(model.index(r, 0, model.index(str(tmp_path)))): proxy.filterAcceptsRow(
        r, model.index(str(tmp_path))) for r in range(model.rowCount(model.index(str(tmp_path))))}
    assert names["run.kvscope.jsonl"] is True and names.get("pipe", False) is False
    proc = model.index("/proc")
    assert not any(proxy.filterAcceptsRow(r, proc) for r in range(model.rowCount(proc)))


def test_a_trace_named_on_the_command_line_opens(tiny, tmp_path):
    from engine.facts.params import GenerationParams
    from engine.output.trace import TraceWriter
    from engine.run.session import Session

    writer = TraceWriter(tmp_path / "run.kvscope.jsonl")
    Session(tiny).run("hello", GenerationParams(max_new_tokens=4), writer)
    path = writer.close()
    code = f"""
import sys, app.main as m
from PySide6.QtCore import QTimer
build = m.build
def patched(args):
    app, w = build(args)
    def check():
        if w.client.busy is None and w.store.current is not None and w.store.current.finished:
            print("runs", len(w.store.runs), w.store.current.n_steps, flush=True)
            w.close()
        else:
            QTimer.singleShot(100, check)
    QTimer.singleShot(200, check)
    return app, w
m.build = patched
sys.exit(m.main([{str(path)!r}, "--speed", "0"]))
"""
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "KVSCOPE_SETTINGS": str(tmp_path / "s.ini")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0, r.stderr
    assert "runs 1 4" in r.stdout


def tree(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*")}


@pytest.mark.parametrize("before", ["nothing", "another app's entry"])
def test_the_desktop_install_writes_what_it_says_and_removal_leaves_what_was_there(tmp_path, before):
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path)}
    if before != "nothing":
        (tmp_path / "applications").mkdir()
        (tmp_path / "applications" / "other.desktop").write_text("[Desktop Entry]\nName=Other\n")
    was = tree(tmp_path)
    script = ROOT / "packaging" / "install-desktop.sh"
    r = subprocess.run([str(script), "/opt/kvscope/bin/kvscope"], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0, r.stderr
    entry = tmp_path / "applications" / "kvscope.desktop"
    assert "Exec=/opt/kvscope/bin/kvscope %F" in entry.read_text()
    assert "MimeType=application/x-kvscope-trace;" in entry.read_text()
    mime = tmp_path / "mime" / "packages" / "kvscope.xml"
    assert '<glob pattern="*.kvscope.jsonl"' in mime.read_text()
    installed = [line.split(" ", 1)[1] for line in r.stdout.splitlines() if line.startswith("installed ")]
    assert len(installed) == 11 and all(Path(p).is_file() for p in installed)
    assert "make uninstall-desktop" in r.stdout
    r = subprocess.run([str(script), "--remove"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and not any(Path(p).exists() for p in installed)
    assert r.stdout.count("removed ") >= 11
    assert tree(tmp_path) == was, sorted(tree(tmp_path) - was)          # no empty folder, no database left


def test_make_install_desktop_points_the_entry_at_the_environment_make_used():
    r = subprocess.run(["make", "-n", "install-desktop", "VENV=/opt/elsewhere"], cwd=ROOT, capture_output=True,
                       text=True, timeout=60)
    assert "packaging/install-desktop.sh \"/opt/elsewhere/bin/kvscope\"" in r.stdout


def test_run_pressed_during_the_first_launch_measurement_starts_after_it(qtbot, tiny_model_dir, tmp_path, monkeypatch):
    """A first launch measures the machine once after the model loads; a run asked for meanwhile waits for it
    (queued, said in the status bar) instead of competing with it for the cores."""
    from engine.facts.costmodel import Device
    from engine.model import hardware

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))            # nothing measured yet
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    measuring, may_end = threading.Event(), threading.Event()

    def measure(device, dtype):             # ends when the test says, not after a time a busy machine can outlast
        measuring.set()
        may_end.wait(60)
        return Device("cpu", 1e11, 1e10), 0.9

    monkeypatch.setattr(hardware, "measure", measure)
    window = make_window(qtbot)
    order: list[str] = []
    add = window.store.add
    window.store.add = lambda event: (order.append(type(event).__name__), add(event))[1]
    try:
        load(window, str(tiny_model_dir), "cpu", "float32")
        qtbot.waitUntil(lambda: window.client.model is not None and measuring.is_set())
        assert window.client.busy == "load"                                  # measuring, the model loaded
        window.controls.max_tokens.setValue(3)
        window.controller.run()
        assert "Run queued: it starts as soon as this machine's one-time measurement ends" in \
            window.status.currentMessage()
        assert "RunStarted" not in order
        may_end.set()
        qtbot.waitUntil(lambda: window.store.current is not None and window.store.current.finished)
        assert order.index("HardwarePeaks") < order.index("RunStarted")
    finally:
        may_end.set()
        close_and_dispose(window)


def test_the_peaks_message_shows_only_while_measuring_and_goes_when_it_ends(qtbot, tiny_model_dir, tmp_path,
                                                                             monkeypatch):
    """A first launch says it is measuring the machine and the words go when it ends; a later launch reads the
    cached peaks and says nothing about measuring (it did not measure)."""
    from engine.facts.costmodel import Device
    from engine.model import hardware

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    monkeypatch.setattr(hardware, "measure", lambda device, dtype: (Device("cpu", 1e11, 1e10), 0.9))
    said: list[list[str]] = []
    for _launch in range(2):
        window = make_window(qtbot)
        messages: list[str] = []
        show = window.status.show_progress
        window.status.show_progress = lambda message, fraction: (messages.append(message), show(message, fraction))
        try:
            load(window, str(tiny_model_dir), "cpu", "float32")
            qtbot.waitUntil(lambda: window.store.peaks is not None and window.client.busy is None)
            assert "peak FLOP/s" not in window.status.currentMessage()
        finally:
            close_and_dispose(window)
        said.append([m for m in messages if "peak FLOP/s" in m])
    assert len(said[0]) == 1 and said[1] == []
