"""The app never needs torch to show itself or to replay a trace; the Qt binding does not corrupt bools."""

import subprocess
import sys

from tests.engine.test_boundaries import BLOCK


def test_window_opens_without_importing_torch():
    code = BLOCK.format(names={"torch", "transformers"}) + """
from app.main import build, parse_args
app, w = build(parse_args(["--no-load"]))
w.show(); app.processEvents()
assert "torch" not in sys.modules
w.close()
from app.main import dispose
dispose(app, w)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr)


def test_trace_replays_in_the_window_without_torch(tiny, tmp_path):
    from engine.facts.params import GenerationParams
    from engine.output.trace import TraceWriter
    from engine.run.session import Session

    writer = TraceWriter(tmp_path / "t.jsonl")
    Session(tiny).run("hello", GenerationParams(max_new_tokens=5), writer)
    path = writer.close()
    code = BLOCK.format(names={"torch", "transformers", "accelerate"}) + f"""
import time
from PySide6.QtCore import QEventLoop, QTimer
from app.main import build, parse_args
app, w = build(parse_args(["--no-load"]))
w.controller.replay_speed = 0.0
w.files.open_trace({str(path)!r})
deadline = time.time() + 30
while (w.store.current is None or not w.store.current.finished) and time.time() < deadline:
    loop = QEventLoop(); QTimer.singleShot(20, loop.quit); loop.exec()
assert w.store.current.n_steps == 5, w.store.current
w.refresh(force=True)
assert w.tokens.rendered_tokens() == w.store.current.prompt_tokens + 5
w.close()
from app.main import dispose
dispose(app, w)
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "QT_QPA_PLATFORM": "offscreen"})
    assert r.returncode == 0, (r.returncode, r.stderr)


def test_signal_emission_keeps_bool_reference_counts(qtbot):
    """PySide6 6.12.0 dropped a reference to True on every emit(); on Python < 3.12 that crashes at exit."""
    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        fired = Signal(object)

    e = Emitter()
    e.fired.connect(lambda _v: None)
    before = sys.getrefcount(True), sys.getrefcount(False)
    for _ in range(200):
        e.fired.emit(False)
    assert (sys.getrefcount(True), sys.getrefcount(False)) == before
