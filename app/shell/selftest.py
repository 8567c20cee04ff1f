"""``kvscope --self-test``: the whole stack, offscreen, in one command. Opens the window, loads the model in the
worker, generates a few tokens, prints the timing report and exits 0 (1 with one line on stderr if anything
failed). It is how a bundled build is checked, and ``make test`` runs it on the source tree."""

from __future__ import annotations

import os
import sys
import time

from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication

from app.link.worker import Failed, Idle
from app.shell.window import MainWindow
from app.state.requests import Load
from engine.facts.events import RunFailed, RunFinished
from engine.facts.report import report

PROMPT = "hey, what is continuous batching?"
TOKENS = 8
TIMEOUT_MS = 15 * 60 * 1000


def process_age_s() -> float | None:
    """Seconds since this process started (Linux), so "time to window" includes interpreter start-up and,
    in a bundle, unpacking; None where /proc is missing."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_self_test(app: QApplication, window: MainWindow, started: float, model: str, device: str,
                  dtype: str) -> int:
    shown_s = time.perf_counter() - started
    age = process_age_s()
    shown = f"window shown {shown_s:.2f} s after main() started" + (
        f", {age:.2f} s after the process started" if age is not None else "")
    outcome: dict = {}

    def finish(code: int, message: str) -> None:
        if "code" not in outcome:
            outcome["code"] = code
            print(message, file=sys.stdout if code == 0 else sys.stderr, flush=True)
            app.exit(code)

    def on_events(items: list) -> None:
        for item in items:
            if isinstance(item, Failed):
                finish(1, f"self-test failed: {item.message}")
            elif isinstance(item, Idle) and "loaded_s" not in outcome \
                    and window.client.model is not None:
                outcome["loaded_s"] = time.perf_counter() - started
                window.run_settings.update(prompt=PROMPT, max_new_tokens=TOKENS, temperature=0.0)
                window.controller.run()
            elif isinstance(item, RunFailed):
                finish(1, f"self-test failed: {item.message}")
            elif isinstance(item, RunFinished):
                facts = window.client.model.model
                finish(0, "\n".join([
                    f"self-test passed: {facts.name} on {facts.device} ({facts.dtype}), "
                    f"{item.summary.generated_tokens} tokens: {item.summary.text!r}",
                    report(facts, item.summary),
                    f"{shown}; model loaded {outcome['loaded_s']:.1f} s after main() started",
                    window.client.thread_policy()]))

    window.client.events_ready.connect(on_events)
    QTimer.singleShot(TIMEOUT_MS, lambda: finish(1, "self-test failed: timed out"))
    window.controller.load_model(Load(model, device, dtype))
    app.exec()
    return outcome.get("code", 1)
