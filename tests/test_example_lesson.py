"""Adding a lesson is its own modules and one line in each registry, proven: the tree is copied, the example lesson
(``tests/example_lesson``: settings, result, a point and an event of its own, a helper module with a worker
process and a fault phase, a tab and a scene) is added as ``engine/lessons/example.py``,
``engine/run/example_counter.py`` and ``app/lessons/example.py``, the two registries list it, and nothing else
changes. In that copy the lesson is in the CLI (its sweep, its table from its point's columns), in the trace schema
(its event and point written and read back, an undeclared figure refused), in the worker registry (its process
runs; its fault phase ends it mid-sweep and the lesson keeps what it measured and says why; an action its phase
does not take is refused), in the window (its tab with those columns, its scene on its own key), through the
screen audit's walk of a lesson, and in the lifecycle test that every registered lesson passes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tests" / "example_lesson"

CHECKS = r'''
import sys
from pathlib import Path

model, folder = sys.argv[1], Path(sys.argv[2])

# The CLI: its sweep, and its table from the point's declared columns.
import contextlib, io
from engine import cli
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = cli.main(["sweep", "example", "--model", model, "--repeats", "2", "--tokens", "2",
                     "--trace", str(folder / "example.kvscope.jsonl")])
text = out.getvalue()
assert code == 0, text
header = next(line for line in text.splitlines() if "TTFT ms (example)" in line)
assert header.split(" | ")[0].strip() == "repeat" and "tokens (example)" in header, header
assert "median TTFT over 2 runs" in text, text

# The trace schema: its own event and its point, written and read back; a figure it does not declare refused.
from engine.facts.events import ExperimentPoint
from engine.lessons.example import PROMPT, ExampleMark, ExamplePoint
from engine.output.trace import read_trace, write_checked
events = read_trace(folder / "example.kvscope.jsonl")
marks = [e for e in events if isinstance(e, ExampleMark)]
assert len(marks) == 2 and {m.words for m in marks} == {len(PROMPT.split())}      # counted by its own process
points = [e for e in events if isinstance(e, ExperimentPoint)]
assert [ExamplePoint.read(p).repeat for p in points] == [0, 1]
import dataclasses
bad = [dataclasses.replace(e, values={**e.values, "undeclared_ms": 1.0}) if isinstance(e, ExperimentPoint) else e
       for e in events]
written = write_checked(folder / "bad.kvscope.jsonl", bad)
assert "has no figure(s) undeclared_ms" in written.note, written.note

# Its worker and fault phase: the registry runs its process; its own phase ends that process at run 2, and the
# lesson keeps run 1 and says why it stopped, in one line; an action its phase does not take is refused by name.
import os
from engine import lessons
assert "example-counter" in {w for lesson in lessons.LESSONS for w in lesson.workers}
os.environ["KVSCOPE_FAULTS"] = "example:2:exit"
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = cli.main(["sweep", "example", "--model", model, "--repeats", "3", "--tokens", "2",
                     "--trace", str(folder / "failed.kvscope.jsonl")])
text = out.getvalue()
assert code == 1 and "stopped: the word counter ended without an answer at run 2 (exit 3)" in text, text
assert len([e for e in read_trace(folder / "failed.kvscope.jsonl") if isinstance(e, ExperimentPoint)]) == 1
from engine.facts.errors import ParameterError
from engine.run import faults
os.environ["KVSCOPE_FAULTS"] = "example:1:boom"
try:
    faults.actions(faults.FaultPhase("example", ("exit", "sleep")))
    raise AssertionError("an action the phase does not take was taken")
except ParameterError as exc:
    assert "example:N:exit or example:N:sleep=S" in str(exc), str(exc)
del os.environ["KVSCOPE_FAULTS"]

# The window: its tab, its columns, its scene on its own key, and the screen audit's walk of one lesson.
import pytest
sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", "-x", str(folder / "window_checks.py")]))
'''

WINDOW_CHECKS = r'''
from app.lecture.scene_list import BY_NAME
from tests.app.conftest import make_window, start_lesson, close_and_dispose, wait_idle
from tests.app.screen_audit import Walk, machine_as_told, walk_experiment


def test_the_example_has_its_tab_scene_and_keeps_the_screen_rules(qtbot, tiny_model_dir, monkeypatch):
    from app.lecture import mode as lecture

    assert BY_NAME["example"].key == "Y" and BY_NAME["example"].lesson == "example"
    window = make_window(qtbot, tiny_model_dir)
    try:
        view = window.experiments.views["example"]
        headers = [view.table.horizontalHeaderItem(i).text() for i in range(view.table.columnCount())]
        assert headers == ["repeat", "TTFT ms (example)", "tokens (example)"]
        walk = Walk(qtbot, window)
        monkeypatch.setattr(lecture, "screen_area", walk.screen_area)
        machine_as_told(walk, monkeypatch)
        walk_experiment(walk, "example")
        assert not walk.findings, walk.report()
        assert view.table.rowCount() == 3 and view.table.item(0, 0).text() == "1"
        window.lecture.enter("example")
        assert "median TTFT" in window.scene_view.claim()
        window.lecture.leave()
    finally:
        close_and_dispose(window)
'''


def add_example(tree: Path) -> list[str]:
    """The example's three modules (its lesson, its helper with a worker and a fault phase, its window) and a line
    in each registry: everything adding a lesson takes. Returns the files changed, relative to the tree."""
    shutil.copy(EXAMPLE / "engine_side.py", tree / "engine" / "lessons" / "example.py")
    shutil.copy(EXAMPLE / "helper_side.py", tree / "engine" / "run" / "example_counter.py")
    shutil.copy(EXAMPLE / "app_side.py", tree / "app" / "lessons" / "example.py")
    changed = ["engine/lessons/example.py", "engine/run/example_counter.py", "app/lessons/example.py"]
    for registry, anchor in (("engine/lessons/__init__.py", "LESSONS: tuple[Lesson, ...] = ("),
                             ("app/lessons/__init__.py", "LESSONS: tuple[WindowLesson, ...] = tuple(module.WINDOW for "
                                                         "module in (")):
        path = tree / registry
        text = path.read_text()
        module = "engine" if registry.startswith("engine") else "app"
        assert anchor in text and f"from {module}.lessons import (\n" in text, registry
        text = text.replace(f"from {module}.lessons import (\n", f"from {module}.lessons import (\n    example,\n", 1)
        text = text.replace(anchor, anchor + ("example.LESSON, " if module == "engine" else "example, "), 1)
        path.write_text(text)
        changed.append(registry)
    return changed


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    copy = tmp_path_factory.mktemp("with-example")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("engine", "app", "tests"):
        shutil.copytree(ROOT / folder, copy / folder, ignore=ignore)
    (copy / "resources").symlink_to(ROOT / "resources")          # read only: the copy's code finds it beside it
    shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
    return copy


def sources(tree: Path) -> dict[Path, bytes]:
    return {p.relative_to(tree): p.read_bytes() for folder in ("engine", "app") for p in (tree / folder).rglob("*.py")}


def test_adding_the_example_changes_only_its_three_modules_and_the_registries(tree):
    before = sources(tree)
    changed = add_example(tree)
    after = sources(tree)
    differ = sorted(str(p) for p in after if before.get(p) != after[p])
    assert differ == sorted(changed)


def _run(tree: Path, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree), "QT_QPA_PLATFORM": "offscreen"}
    return subprocess.run([sys.executable, *args], cwd=tree, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_the_example_lesson_is_in_the_cli_the_schema_the_window_and_the_audit(tree, tiny_model_dir, tmp_path):
    if not (tree / "engine" / "lessons" / "example.py").exists():
        add_example(tree)
    (tmp_path / "window_checks.py").write_text(WINDOW_CHECKS)
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    done = _run(tree, "-c", CHECKS, str(tiny_model_dir), str(tmp_path))
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]


def test_the_example_lesson_passes_the_lifecycle_every_lesson_passes(tree):
    if not (tree / "engine" / "lessons" / "example.py").exists():
        add_example(tree)
    done = _run(tree, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/app/test_lesson_lifecycle.py",
                "-k", "example")
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
