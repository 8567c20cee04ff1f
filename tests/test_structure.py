"""The structure the code promises, checked: a lesson is named in its registry only (no ``kind ==`` switchboards
elsewhere), both registries list the same lessons, the main window is a layout (at most 25 methods), and no
engine function takes more than 8 parameters (the import-linter contracts in pyproject.toml check the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("engine", "app") for p in (ROOT / folder).rglob("*.py")]


def test_no_module_branches_on_a_lessons_kind():
    """Code that varies by lesson asks the lesson (its module, its view): no comparison of something called
    ``kind`` with a lesson's name outside the two registries. (``"chat"`` is also a kind of run, generate or
    chat: comparing a run's ``.kind`` with it is a run's business.)"""
    from engine import lessons

    names = {lesson.kind for lesson in lessons.LESSONS}
    found = []
    for path in SOURCES:
        if path.name == "__init__.py" and path.parent.name == "lessons":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            literals = {c.value for side in sides for c in ([side] + list(getattr(side, "elts", [])))
                        if isinstance(c, ast.Constant) and c.value in names}
            subjects = [ast.unparse(side) for side in sides if not isinstance(side, (ast.Constant, ast.Tuple))]
            if any(s == "kind" or s.endswith(".kind") for s in subjects) and literals - {"chat"} or \
                    "chat" in literals and "kind" in subjects:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_the_engine_and_the_window_list_the_same_lessons_once():
    from app import lessons as app_lessons
    from engine import lessons

    assert [lesson.kind for lesson in lessons.LESSONS] == list(app_lessons.BY_KIND)
    assert len(set(lessons.BY_KIND)) == len(lessons.LESSONS)


def test_the_main_window_is_a_layout_of_at_most_25_methods():
    tree = ast.parse((ROOT / "app" / "window.py").read_text())
    window = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "MainWindow")
    methods = [n.name for n in window.body if isinstance(n, ast.FunctionDef)]
    assert len(methods) <= 25, methods


def test_no_engine_function_takes_more_than_8_parameters():
    crowded = []
    for path in (ROOT / "engine").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)]
                count = len(names) - (1 if names and names[0] in ("self", "cls") else 0)
                if count > 8:
                    crowded.append(f"{path.relative_to(ROOT)}:{node.name} ({count})")
    assert not crowded, crowded
