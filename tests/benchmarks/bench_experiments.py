"""The experiments on the real model, run through the window (offscreen) exactly as a user would, printing
their tables and saving each panel as a PNG and each experiment as a trace, in the results folder."""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from PySide6.QtCore import Qt

from tests.benchmarks.bench_gui import _pause, _wait, open_window
from tests.benchmarks.common import RESULTS, machine, save

os.environ.setdefault("QT_QPA_PLATFORM", "offscreen")
SETTINGS = {"prefill": {"max_length": 2048, "repeats": 3}, "cache": {"new_tokens": 48},
            "batch": {"sizes": (1, 2, 4, 8, 16), "new_tokens": 32}, "chat": {"new_tokens": 32},
            "continuous": {"requests": 8, "arrive_every": 4}}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", default="embedded")
    p.add_argument("--charts", default=str(RESULTS), help="folder for the panel PNGs (default: the results folder)")
    p.add_argument("--max-length", type=int, default=SETTINGS["prefill"]["max_length"])
    args = p.parse_args(argv)
    os.environ.setdefault("KVSCOPE_SETTINGS", str(Path(tempfile.mkdtemp()) / "bench.ini"))
    import dataclasses

    from app import lessons as app_lessons
    from app.views.export import export_widget
    from engine import lessons
    from engine.output.trace import write_trace

    window = open_window(args.model)
    window.resize(1800, 1100)
    window.resizeDocks([window.docks["experiments"]], [900], Qt.Orientation.Horizontal)
    _wait(lambda: window.store.peaks is not None)
    results = {"machine": machine(), "model": window.client.model.model.name}
    SETTINGS["prefill"]["max_length"] = args.max_length
    for kind, settings in SETTINGS.items():
        lesson = lessons.lesson(kind)
        view = window.experiments.views.get(kind)
        if view is None:                                   # drawn in another panel (chat): no form of its own
            window.controller.choices.set(lesson.settings(**settings))
        for name, value in settings.items() if view is not None else ():
            view.form.set_value(name, value)               # chosen in the lesson's tab, as a user would
        window.controller.start_lesson(kind)
        _wait(lambda: window.client.busy is None, timeout_s=3600)
        record = window.store.latest_experiment(kind)
        if record is None:                                 # refused before it started (said in the window)
            print(f"\n== {kind}: not run: {window.banner.label.text() or window.status.currentMessage()}", flush=True)
            continue
        window.refresh(force=True)
        shown = window.chat if view is None else view
        if view is not None:
            window.experiments.setCurrentWidget(view)
        window.docks[app_lessons.dock_of(kind)].raise_()
        _pause(300)
        print(f"\n== {kind} ({machine()}) ==\n{lesson.table(record.points, record.result)}", flush=True)
        Path(args.charts).mkdir(parents=True, exist_ok=True)
        export_widget(shown, Path(args.charts) / f"experiment-{kind}.png")
        write_trace(RESULTS / f"experiment-{kind}.jsonl", record.events)
        results[kind] = {"points": [p.values for p in record.points], "result": dataclasses.asdict(record.result)}
    window.close()
    save("experiments", results)
    return results


if __name__ == "__main__":
    main()
