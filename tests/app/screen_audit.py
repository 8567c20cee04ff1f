"""The screen audit's walk: the real window on the tiny model driven through every phase of a run, a chat turn, an
experiment, a replay and a settings change, and at each phase every registered view read at 1280x720, 1600x1000
and 1920x1080, in the workbench and in the lecture scenes the phase shows (and blanked), and judged by
``app.views.audit``'s rules.

The engine is held in a phase by a gate, not by a sleep: the run waits inside the engine (at the prefill, after
the prefill's pass, or at a decode step) until the walk has read the screen, however busy the machine is.

``python -m tests.app.screen_audit`` walks once and prints the table (view x phase) a person reads; the suite
runs the same walk (``tests/app/test_screen_audit.py``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from PySide6.QtCore import QRect
from PySide6.QtWidgets import QApplication

from app.lecture.scene_list import SCENES
from app.lecture.scenes import RUN_SCENES
from app.views.audit import RULES, Finding, judge

SIZES = ((1280, 720), (1600, 1000), (1920, 1080))


PROMPT = "The cache keeps what attention has already read."


class Gate:
    """A fault hook that holds the engine at the given (phase, step) points until released: the walk reads the
    screen while the run is, for certain, in that phase."""

    def __init__(self, *points: tuple[str, int]) -> None:
        self.points = set(points)
        self.reached = threading.Event()
        self.released = threading.Event()

    def __call__(self, phase: str, step: int) -> None:
        if (phase, step) in self.points:
            self.reached.set()
            self.released.wait(120)

    def release(self) -> None:
        self.released.set()


@dataclass
class Cell:
    phase: str
    where: str
    views: set[str]
    findings: list[Finding] = field(default_factory=list)


SETTLE_ROUNDS = 50


def _shape(window) -> tuple:
    """What a reading depends on: every visible widget's geometry, every label's words, every chart's title."""
    from PySide6.QtWidgets import QLabel, QWidget

    out = []
    for widget in window.findChildren(QWidget):
        if widget.isVisible():
            out.append((widget.geometry().getRect(), widget.text() if isinstance(widget, QLabel) else None,
                        getattr(widget, "_title_fitted", None)))
    return tuple(out)


class Walk:
    """Reads and judges the window at every phase it is brought to; ``cells`` keeps every reading's verdict."""

    def __init__(self, qtbot, window, sizes: Iterable[tuple[int, int]] = SIZES) -> None:
        self.qtbot, self.window, self.sizes = qtbot, window, tuple(sizes)
        self.cells: list[Cell] = []
        self.size = self.sizes[0]             # the screen the window is on now (lecture.screen_area answers it)
        self.cpu_share = 1.0                  # how busy every measurement says the machine was (machine_as_told)

    def screen_area(self, _window=None, available: bool = False) -> QRect:
        return QRect(0, 0, *self.size)

    def settle(self) -> None:
        """Until the window stops changing: every posted layout request, zero-delay timer, chart redraw and title
        fit has run. A fixed three rounds were enough on a quiet machine and not beside another test process (a
        wrapped label read before its layout grew it, a chart title before it was fitted): the rounds now follow
        the window, so the verdict does not follow the machine's load."""
        last = None
        for _ in range(SETTLE_ROUNDS):
            for _ in range(3):
                QApplication.processEvents()
            self.window.refresh(force=True)
            QApplication.processEvents()
            shape = _shape(self.window)
            if shape == last:
                return
            last = shape
            self.qtbot.wait(10)                 # let a timer that is due fire (a dock arrangement, a chart's fit)

    def look(self, phase: str, scenes: Iterable[str] = RUN_SCENES, dock: str | None = None,
             tabs: bool = False) -> None:
        """Read every view at every size: the workbench with the timing charts raised, then with ``dock`` raised
        (with ``tabs``, every lesson's tab in turn), then each of ``scenes``."""
        w = self.window
        scenes = tuple(scenes)
        for width, height in self.sizes:
            self.size = (width, height)
            w.lecture.leave()
            w.resize(width, height)
            for raised in dict.fromkeys(("timing", dock or "timing")):     # the timing charts, then ``dock``
                w.docks[raised].raise_()
                self.settle()
                self._judge(phase, f"workbench {width}x{height}, {raised} raised")
            for kind in w.experiments.views if tabs else ():
                w.docks["experiments"].raise_()
                w.experiments.show_lesson(kind)
                self.settle()
                self._judge(phase, f"workbench {width}x{height}, tab {kind}")
            if not scenes:
                continue
            for scene in scenes:
                w.lecture.show(scene)
                self.settle()
                self._judge(phase, f"scene {scene} {width}x{height}")
            w.lecture.leave()

    def look_blanked(self, phase: str, scene: str = "kv") -> None:
        """A lecture scene blanked (B) at every size: nothing shows through."""
        w = self.window
        for width, height in self.sizes:
            self.size = (width, height)
            w.lecture.leave()
            w.resize(width, height)
            w.lecture.show(scene)
            w.state.set_blank(True)
            self.settle()
            self._judge(phase, f"scene {scene} blanked {width}x{height}")
            w.state.set_blank(False)
            w.lecture.leave()

    def _judge(self, phase: str, where: str) -> None:
        readings = self.window.audit.read()
        findings = judge(readings, self.window.known())
        self.cells.append(Cell(phase, where, {r.view for r in readings}, findings))

    @property
    def findings(self) -> list[tuple[str, str, Finding]]:
        """What breaks a rule."""
        return [(c.phase, c.where, f) for c in self.cells for f in c.findings]

    # --- the table --------------------------------------------------------------------------------------------
    def table(self) -> str:
        """Phase x view, the lessons' tabs in one column: ✓ every reading of the view in that phase kept every
        rule, the rules broken otherwise, · the view was not on screen in that phase."""
        def column(view: str) -> str:
            return "lesson tabs" if view.startswith("tab ") else view

        phases = list(dict.fromkeys(c.phase for c in self.cells))
        views = list(dict.fromkeys(column(v) for v in self.window.audit.views))
        broken: dict[tuple[str, str], set[str]] = {}
        shown: set[tuple[str, str]] = set()
        for cell in self.cells:
            for view in cell.views:
                shown.add((column(view), cell.phase))
            for finding in cell.findings:
                for view in finding.view.split(" / "):
                    broken.setdefault((column(view), cell.phase), set()).add(finding.rule)
        lines = ["| phase | " + " | ".join(views) + " |", "|---|" + "---|" * len(views)]
        for phase in phases:
            cells = []
            for view in views:
                rules = broken.get((view, phase))
                cells.append(", ".join(sorted(rules)) if rules else "✓" if (view, phase) in shown else "·")
            lines.append(f"| {phase} | " + " | ".join(cells) + " |")
        readings = sum(len(c.views) for c in self.cells)
        lines.append("")
        lines.append(f"{len(self.window.audit.views)} views x {len(phases)} phases: {len(self.cells)} screens read "
                     f"({readings:,} view readings) at {', '.join(f'{a}x{b}' for a, b in self.sizes)}; rules: "
                     + ", ".join(RULES))
        return "\n".join(lines)

    def report(self) -> str:
        return "\n".join(f"{phase} · {where} · {f.view} · {f.rule}: {f.detail}" for phase, where, f in self.findings)


# --- driving the window ----------------------------------------------------------------------------------------
def wait_idle(qtbot, window) -> None:
    qtbot.waitUntil(lambda: window.client.busy is None, timeout=120_000)


def held(qtbot, window, gate: Gate, start: Callable[[], object], arrived: Callable[[], bool]) -> None:
    """Start something that the gate will hold, and wait until the window has taken in what came before it."""
    window.client.worker.session.fault_hook = gate
    start()
    qtbot.waitUntil(gate.reached.is_set, timeout=120_000)
    qtbot.waitUntil(arrived, timeout=120_000)


def let_go(qtbot, window, gate: Gate, stop: bool = False) -> None:
    if stop:
        window.controller.stop()
    gate.release()
    wait_idle(qtbot, window)
    window.client.worker.session.fault_hook = None


def walk_loading(walk: Walk, model_dir: Path, monkeypatch) -> None:
    """No model, then a model loading (held), then a model and no run."""
    from engine.model import models
    from tests.app.conftest import load

    w, qtbot = walk.window, walk.qtbot
    walk.look("no model", scenes=("prefill",))
    gate = Gate(("load", 0))
    real = models.load

    def held_load(*args, **kwargs):
        gate("load", 0)
        return real(*args, **kwargs)

    monkeypatch.setattr(models, "load", held_load)
    load(w, str(model_dir), "cpu", "float32")
    qtbot.waitUntil(gate.reached.is_set, timeout=120_000)
    walk.look("loading", scenes=("prefill", "cache"))
    gate.release()
    qtbot.waitUntil(lambda: w.client.model is not None and w.client.busy is None, timeout=120_000)
    monkeypatch.setattr(models, "load", real)
    walk.look("loaded, no run", scenes=("prefill", "kv", "sampling", "attention", "chat"))


def walk_run(walk: Walk) -> None:
    """A plain run through every phase, each held by the engine at that point."""
    w, qtbot = walk.window, walk.qtbot
    w.controls.prompt.setPlainText(PROMPT)
    w.controls.max_tokens.setValue(12)
    newest = lambda: w.store.current   # noqa: E731

    # prefill running, then stopped there (the pass ends; its token is the only one)
    count = len(w.store.runs)
    gate = Gate(("prefill", 0))
    held(qtbot, w, gate, w.controller.run, lambda: len(w.store.runs) > count)
    walk.look("prefill running")
    let_go(qtbot, w, gate, stop=True)
    walk.look("stopped in the prefill")

    # the prefill's pass has ended, its token not chosen yet
    gate = Gate(("first", 0))
    held(qtbot, w, gate, w.controller.run, lambda: newest().prefill is not None and not newest().finished)
    walk.look("prefill done, first token pending")
    let_go(qtbot, w, gate)

    # decoding, held before decode step 3; stopped there
    gate = Gate(("decode", 3))
    held(qtbot, w, gate, w.controller.run, lambda: newest().n_steps == 3 and not newest().finished)
    walk.look("decoding")
    let_go(qtbot, w, gate, stop=True)
    walk.look("stopped while decoding")

    # step by step, then paused, then let through
    w.controller.step()
    qtbot.waitUntil(lambda: newest().n_steps == 1 and w.client.control.held and not newest().finished)
    walk.look("step by step")
    w.controller.set_paused(True)
    walk.look("paused")
    w.controller.step()
    qtbot.waitUntil(lambda: newest().n_steps == 2 and w.client.control.held)
    w.controller.set_paused(False)
    wait_idle(qtbot, w)
    walk.look("finished")

    walk.look_blanked("finished, screen blanked")

    # the same run on a busy machine: every measured figure says so
    walk.cpu_share = 0.3
    w.controller.run()
    qtbot.waitUntil(lambda: newest().finished and w.client.busy is None, timeout=120_000)
    walk.look("finished on a busy machine")
    walk.cpu_share = 1.0

    # what if: the shown step filtered again with other settings, no rerun
    from app.state.viewstate import WhatIfSettings

    w.state.set_what_if(WhatIfSettings(1.5, 3, 0.9))
    walk.look("what if on the shown step", scenes=("sampling",))
    w.state.set_what_if(None)

    # a setting changed after the run: it is the next run's
    w.run_settings.update(temperature=0.9, top_k=20)
    walk.look("settings changed after the run", scenes=("prefill", "sampling"))
    w.run_settings.update(temperature=0.0, top_k=0)

    # failed at decode step 2, then out of memory there (memory released)
    for phase, fault in (("failed", "error"), ("out of memory, released", "oom")):
        from engine.run.faults import parse

        w.client.worker.session.fault_hook = parse(f"decode:2:{fault}")
        w.controller.run()
        qtbot.waitUntil(lambda: newest().finished and w.client.busy is None, timeout=120_000)
        w.client.worker.session.fault_hook = None
        walk.look(phase)


def walk_chat(walk: Walk) -> None:
    w, qtbot = walk.window, walk.qtbot
    gate = Gate(("prefill", 0))
    count = len(w.store.runs)
    held(qtbot, w, gate, lambda: w.controller.send_chat("What does the cache keep?", True),
         lambda: len(w.store.runs) > count)
    walk.look("chat turn, prefill running", scenes=("chat",), dock="chat")
    let_go(qtbot, w, gate)
    walk.look("chat turn finished", scenes=("chat", "prefill"), dock="chat")


def walk_experiment(walk: Walk, kind: str = "cache") -> None:
    """One lesson live: before it runs, its first point running (held in its first pass), stopped, finished."""
    from tests.app.conftest import start_lesson

    w, qtbot = walk.window, walk.qtbot
    scene = next(s.name for s in SCENES if s.lesson == kind)
    walk.look("experiment before it runs", scenes=(scene,), dock="experiments")
    gate = Gate(("prefill", 0))
    held(qtbot, w, gate, lambda: start_lesson(w, kind, new_tokens=4),
         lambda: w.store.latest_experiment(kind) is not None)
    walk.look("experiment, first point running", scenes=(scene,), dock="experiments")
    let_go(qtbot, w, gate, stop=True)
    walk.look("experiment stopped", scenes=(scene,), dock="experiments")
    assert start_lesson(w, kind, new_tokens=4)
    wait_idle(qtbot, w)
    walk.look("experiment finished", scenes=(scene,), dock="experiments")


def walk_lessons_before(walk: Walk) -> None:
    """Every registered lesson's scene and tab before it has run."""
    walk.look("lessons before they run", scenes=tuple(s.name for s in SCENES if s.lesson), dock="experiments",
              tabs=True)


def walk_replays(walk: Walk, folder: Path, lecture_trace: Path | None) -> None:
    """The last run saved from the window and opened again (with the peaks it was judged with, and without any),
    and every lesson's finished experiment replayed from the lecture trace."""
    from engine.facts.events import HardwarePeaks
    from engine.output.trace import read_trace, write_trace

    w, qtbot = walk.window, walk.qtbot
    saved = folder / "saved.kvscope.jsonl"
    w.files.save_trace(str(saved))
    bare = write_trace(folder / "bare.kvscope.jsonl", [e for e in read_trace(saved)
                                                       if not isinstance(e, HardwarePeaks)])
    for phase, trace in (("replayed, with its peaks", saved), ("replayed, no peaks measured", bare)):
        w.controller.replay_speed = 0.0
        w.files.open_trace(str(trace))
        wait_idle(qtbot, w)
        walk.look(phase)
    if lecture_trace is not None:
        w.controller.replay_speed = 0.0
        w.files.open_trace(str(lecture_trace))
        wait_idle(qtbot, w)
        walk.look("lessons replayed, finished", scenes=tuple(s.name for s in SCENES), dock="experiments", tabs=True)


def machine_as_told(walk: Walk, monkeypatch) -> None:
    """How busy the machine looks is the walk's to say, not the machine's: every CPU share a run or a peaks
    measurement reads is ``walk.cpu_share`` (quiet unless a phase says busy), so the screens, and the verdict, are
    the same however loaded the machine running the walk is."""
    import dataclasses

    from engine.facts import contention
    from engine.model import hardware

    monkeypatch.setattr(contention.LoadMeter, "share", lambda self, idle_ms=0.0: walk.cpu_share)
    monkeypatch.setattr(contention.LoadMeter, "share_so_far", lambda self, idle_ms=0.0: walk.cpu_share)
    real = hardware.peaks_event

    def peaks(*args, **kwargs):
        found = real(*args, **kwargs)
        return dataclasses.replace(found, cpu_share=walk.cpu_share) if found is not None else None

    monkeypatch.setattr(hardware, "peaks_event", peaks)


def walk_everything(qtbot, model_dir: Path, folder: Path, monkeypatch, lecture_trace: Path | None = None,
                    sizes: Iterable[tuple[int, int]] = SIZES) -> Walk:
    from app.lecture import mode as lecture
    from tests.app.conftest import make_window

    window = make_window(qtbot)
    walk = Walk(qtbot, window, sizes)
    monkeypatch.setattr(lecture, "screen_area", walk.screen_area)
    machine_as_told(walk, monkeypatch)
    try:
        walk_loading(walk, model_dir, monkeypatch)
        walk_lessons_before(walk)
        walk_run(walk)
        walk_chat(walk)
        walk_experiment(walk)
        walk_replays(walk, folder, lecture_trace)
    finally:
        from tests.app.conftest import close_and_dispose

        for gate_hook in (window.client.worker.session,):
            if gate_hook is not None and isinstance(gate_hook.fault_hook, Gate):
                gate_hook.fault_hook.release()
        close_and_dispose(window)
    return walk


def main() -> int:
    """The walk as the suite runs it, its table and findings printed (``make audit``)."""
    import pytest

    return int(pytest.main(["-q", "-s", "-p", "no:cacheprovider", str(Path(__file__).with_name(
        "test_screen_audit.py"))]))


if __name__ == "__main__":
    sys.exit(main())
