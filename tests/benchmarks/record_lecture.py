"""A lecture recorded from the scenes alone, on the real model, on a real display: the window opens in lecture
mode, every scene is entered by its own key, R (and C in the batching scene) is pressed live, and the scene is
saved as a PNG when what it started has finished; in the sampling scene T raises the temperature, which re-runs.
Each scene's caption, footer, window geometry and run time go to ``lecture.json`` beside the PNGs.

The lessons' tabs are set first to sizes that finish in a minute or two on two cores (what a lecturer would
prepare before the talk; the window remembers them). Run it under an X server of the projector's size, e.g.
``Xvfb :9 -screen 0 1280x720x24 & DISPLAY=:9 python -m tests.benchmarks.record_lecture --out shots-720``
(``make record-lecture`` does this at 1280x720 and 1920x1080).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from PySide6.QtCore import QCoreApplication
from PySide6.QtGui import QKeySequence
from PySide6.QtTest import QTest

from app import lessons as app_lessons
from app.lecture.scene_list import SCENES

TABS = {"cache": {"new_tokens": 24}, "prefill": {"max_length": 512, "repeats": 1},
        "batch": {"sizes": (1, 2, 4, 8), "new_tokens": 16}, "continuous": {"requests": 4},
        "chat": {"new_tokens": 16, "repeats": 1}, "speculative": {"new_tokens": 32, "repeats": 1},
        "paged": {"requests": 4, "new_tokens": 8}, "offload": {"new_tokens": 12},
        "architectures": {"designs": ("Llama-2-7B", "Falcon-7B", "DeepSeek-V3", "gpt-oss-20b")}}
PROMPT = "Explain in two sentences why decode reads the whole KV cache."
MAX_TOKENS = 48


def pump(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        QCoreApplication.processEvents()
        time.sleep(0.01)


def wait_until(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        QCoreApplication.processEvents()
        if condition():
            return True
        time.sleep(0.02)
    return False


def press(window, key: str) -> None:
    sequence = QKeySequence(key)[0]
    QTest.keyClick(window, sequence.key(), sequence.keyboardModifiers())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("lecture-shots"))
    p.add_argument("--timeout", type=float, default=600.0, help="longest wait for one scene's run, seconds")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    os.environ.setdefault("KVSCOPE_SETTINGS", str(args.out / "settings.ini"))     # the user's own stay untouched
    from app.main import build, parse_args, start

    options = parse_args(["--lecture"])
    app, window = build(options)
    window.show()
    start(window, options)
    if not wait_until(lambda: window.client.model is not None and window.client.busy is None, 900):
        raise SystemExit("the model did not load")
    window.controls.prompt.setPlainText(PROMPT)
    window.controls.max_tokens.setValue(MAX_TOKENS)
    for kind, values in TABS.items():
        view = window.experiments.views.get(kind)
        for name, value in values.items() if view is not None else ():
            view.form.set_value(name, value)
    joined = {scene: (kind, join.key) for scene, (kind, join) in app_lessons.joins().items()}
    log = []

    def shoot(scene: str, what: str, key: str) -> None:
        started = time.monotonic()
        window.activateWindow()
        press(window, key)
        pump(0.5)
        done = wait_until(lambda: window.client.busy is None, args.timeout)
        window.refresh(force=True)
        pump(1.0)
        name = f"scene-{scene}" + ("" if what == "R" else f"-{what}")
        window.grab().save(str(args.out / f"{name}.png"))
        screen, footer = window.screen().geometry(), window.scene_view.next_run
        log.append({"scene": scene, "key": key, "finished": done, "seconds": round(time.monotonic() - started, 1),
                    "caption": window.scene_view.claim(), "footer": window.scene_view.footer_text(),
                    "footer_visible": footer.isVisible() and footer.geometry().bottom() <= window.scene_view.height(),
                    "window": [window.x(), window.y(), window.width(), window.height()],
                    "screen": [screen.width(), screen.height()], "png": f"{name}.png"})
        print(json.dumps(log[-1]), flush=True)

    for scene in SCENES:
        press(window, scene.key)
        pump(0.5)
        shoot(scene.name, "R", "R")
        if scene.name in joined:
            kind, key = joined[scene.name]
            shoot(scene.name, kind, key)
        if scene.name == "sampling":
            shoot(scene.name, "temperature-up", "T")
    press(window, "Esc")
    pump(1.0)
    screen = window.screen().availableGeometry()
    log.append({"after": "Esc", "window": [window.x(), window.y(), window.width(), window.height()],
                "available": [screen.x(), screen.y(), screen.width(), screen.height()]})
    (args.out / "lecture.json").write_text(json.dumps(log, indent=1))
    window.close()
    pump(1.0)
    app.quit()
    return 0 if all(entry.get("finished", True) for entry in log) else 1


if __name__ == "__main__":
    raise SystemExit(main())

