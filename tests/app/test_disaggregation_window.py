"""The disaggregation lesson's prefill worker never outlives the window: closed mid-run, the app exits and its
worker is gone with it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from tests.engine.test_disaggregation import prefill_workers

SCRIPT = """
import os, sys, time
from pathlib import Path
from PySide6.QtCore import QEventLoop, QTimer
from app.main import build, dispose, parse_args
from tests.app.conftest import load

def pump(seconds):
    end = time.time() + seconds
    while time.time() < end:
        loop = QEventLoop(); QTimer.singleShot(20, loop.quit); loop.exec()

def worker_running():
    # a prefill worker for this model: not this process, whose own command line (this script) names both too
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\\0", b" ")
            if proc.name.isdigit() and int(proc.name) != os.getpid() and sys.argv[1].encode() in cmdline \\
                    and b"worker prefill-worker" in cmdline:
                return True
        except OSError:
            pass
    return False

app, w = build(parse_args(["--no-load"]))
w.show()
load(w, sys.argv[1], "cpu", "float32")
end = time.time() + 120
while (w.client.model is None or w.client.busy is not None) and time.time() < end:
    pump(0.05)
view = w.experiments.views["disaggregation"]
for name, value in {"long_prompt": 96, "short_prompt": 8, "requests": 4, "new_tokens": 5}.items():
    view.form.set_value(name, value)
assert w.controller.start_lesson("disaggregation")
end = time.time() + 120
while not worker_running() and time.time() < end:
    pump(0.05)
assert worker_running(), "the prefill worker never started"
pump(0.5)
print("closing", flush=True)
w.close()
dispose(app, w)
"""


def test_closing_the_window_mid_run_ends_the_prefill_worker(tiny_model_dir, tmp_path):
    env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "KVSCOPE_SETTINGS": str(tmp_path / "s.ini"),
           "KVSCOPE_FAULTS": "handover:1:sleep=600"}                    # the worker is mid-run when the window goes
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model_dir)], capture_output=True, text=True,
                       timeout=400, env=env, cwd=str(Path(__file__).resolve().parents[2]))
    assert "closing" in r.stdout, (r.stdout, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-2000:]
    deadline = time.monotonic() + 60                  # a killed process is reaped by init: give it the moment
    while prefill_workers(str(tiny_model_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert prefill_workers(str(tiny_model_dir)) == []
