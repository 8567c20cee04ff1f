"""The structure the code promises, checked: a lesson is named in its registry only (no lesson or scene name
written as a string elsewhere), both registries list the same lessons, the main window is a layout (at most 25
methods), no engine function takes more than 8 parameters, and every engine and app module sits in a layer (the
import-linter contracts in pyproject.toml check the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [p for folder in ("engine", "app") for p in (ROOT / folder).rglob("*.py")]


LESSON_TAKERS = {"lesson", "start_lesson", "latest_experiment", "dock_of", "beside", "show", "enter", "BY_KIND",
                 "BY_NAME"}      # the functions and tables that take a lesson's or a scene's name


def _subject(node: ast.AST) -> str:
    """What a compared or assigned expression is called: its last name (``record.kind`` -> ``kind``)."""
    text = ast.unparse(node)
    return text.rsplit(".", 1)[-1].split("[")[0]


def lesson_names_outside_registries(paths) -> list[str]:
    """Every place outside the two lesson folders and the scene list where a lesson's kind or a lesson scene's
    name is written as a string and used as one: compared with (or assigned to) something called a kind, a lesson,
    a scene, a name or the scene shown, or passed to a function or table that takes one. The run kind ``"chat"``
    (a run is generated or chatted) compared with a run's ``kind`` is a run's business, not the lesson's."""
    from app import lessons as app_lessons
    from engine import lessons

    kinds = {lesson.kind for lesson in lessons.LESSONS}
    scenes = {scene.name for scene in app_lessons.scenes()}
    found = []
    for path in paths:
        if "lessons" in path.parts or path.name == "scene_list.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                sides, targets = [node.left, *node.comparators], [node.left, *node.comparators]
            elif isinstance(node, ast.Assign):
                sides, targets = [node.value], node.targets
            elif isinstance(node, ast.Call) and _subject(node.func) in LESSON_TAKERS:
                sides, targets = [*node.args, *(k.value for k in node.keywords)], [node.func]
            elif isinstance(node, ast.Subscript) and _subject(node.value) in LESSON_TAKERS:
                sides, targets = [node.slice], [node.value]
            else:
                continue
            literals = {c.value for side in sides for c in ([side] + list(getattr(side, "elts", [])))
                        if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            whole = [ast.unparse(t) for t in targets if not isinstance(t, (ast.Constant, ast.Tuple))]
            names = {_subject(t) for t in targets if not isinstance(t, (ast.Constant, ast.Tuple))}
            lesson_like = any(n in LESSON_TAKERS or n in ("kind", "lesson") for n in names)
            scene_like = any(n in LESSON_TAKERS for n in names) or any(
                w in ("name", "scene", "shown", "self.shown") or w.endswith(".scene") for w in whole)
            hits = (literals & kinds if lesson_like else set()) | (literals & scenes if scene_like else set())
            if isinstance(node, ast.Compare) and names & {"kind"} and not names & {"lesson"}:
                hits -= {"chat"}
            if hits:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_no_lesson_or_scene_is_named_as_a_string_outside_the_registries():
    """Code that varies by lesson asks the lesson (its declarations, its ``WindowLesson``), never its name."""
    paths = SOURCES + [ROOT / "packaging" / "launcher.py"]
    assert lesson_names_outside_registries(paths) == []


def test_the_lesson_name_check_finds_each_way_of_naming_one(tmp_path):
    """The check above, shown to catch what it is for: a comparison, an assignment, a call and a table lookup."""
    planted = tmp_path / "planted.py"
    planted.write_text('''
if record.kind == "depth": pass
kind = "server load"
controller.start_lesson("chat")
inner = box if name in ("batch", "attention", "memory") else other
lessons.BY_KIND["cache"]
if e.kind != "chat": pass
''')
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        found = lesson_names_outside_registries([planted])
    finally:
        ROOT = saved
    assert sorted(line.split(":")[1] for line in found) == ["2", "3", "4", "5", "6"]


def test_the_engine_and_the_window_list_the_same_lessons_once():
    from app import lessons as app_lessons
    from engine import lessons

    assert [lesson.kind for lesson in lessons.LESSONS] == list(app_lessons.BY_KIND)
    assert len(set(lessons.BY_KIND)) == len(lessons.LESSONS)


def test_the_main_window_is_a_layout_of_at_most_25_methods():
    tree = ast.parse((ROOT / "app" / "shell" / "window.py").read_text())
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


def layers_of(contract_name: str) -> set[str]:
    try:
        import tomllib
    except ImportError:                      # Python 3.10: pytest brings tomli
        import tomli as tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contract = next(c for c in config["tool"]["importlinter"]["contracts"] if c["name"].startswith(contract_name))
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


@pytest.mark.parametrize("package, contract, top_modules", [
    ("engine", "Engine layers", ["__init__.py", "__main__.py", "cli.py"]),
    ("app", "Window layers", ["__init__.py", "__main__.py", "main.py"]),
])
def test_every_module_sits_in_a_layer_of_the_contract(package, contract, top_modules):
    """Each side's folders are its layers: apart from its entry points, every module is inside a package the
    layers contract names, so a new module cannot sit outside the rules by sitting at the top."""
    layers = layers_of(contract)
    outside = []
    for path in (ROOT / package).rglob("*.py"):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if module in (f"{package}.__init__", f"{package}.__main__"):
            continue
        if not any(module == layer or module.startswith(layer + ".") for layer in layers):
            outside.append(module)
    assert not outside, outside
    top = sorted(p.name for p in (ROOT / package).glob("*.py"))
    assert top == top_modules, top


def test_folders_found_from_a_modules_place_are_those_of_the_tree_it_runs_from():
    """Modules moved into layer packages: what they find by their own place (the resources beside the source, the
    folder a prefill worker imports the engine from) is still this tree's, not a folder one level short."""
    import os

    from engine.run.kv_handover import _package_root
    from engine.store.resources import resources_dir

    assert resources_dir() == ROOT / "resources"
    assert Path(_package_root().split(os.pathsep)[0]) == ROOT


def test_no_window_lesson_reads_a_point_by_a_figures_name():
    """The window reads a lesson's points typed (``record.typed(ThePoint)``), so a figure's name is written once,
    on the point's field: no ``point.values["name"]`` in a window lesson."""
    import re

    untyped = re.compile(r"\.values\[\s*[\"']|\.values\.get\(")
    found = [f"{path.relative_to(ROOT)}:{number}" for path in (ROOT / "app" / "lessons").glob("*.py")
             for number, line in enumerate(path.read_text().splitlines(), 1) if untyped.search(line)]
    assert not found, found


def test_no_two_classes_in_one_engine_or_app_folder_share_a_name():
    """A name says which class it is: three classes called ``Request`` in engine/run (a run as asked, a
    scheduler's arrival, a hand-over's) made every reader open the file to know which."""
    from collections import defaultdict

    seen: dict[tuple[Path, str], list[str]] = defaultdict(list)
    for path in SOURCES:
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                seen[(path.parent, node.name)].append(path.name)
    shared = {f"{folder.relative_to(ROOT)}: {name}": files for (folder, name), files in seen.items()
              if len(files) > 1}
    assert not shared, shared


def test_no_module_name_is_used_more_than_twice():
    """A lesson's name is its engine module's and its window module's; any other module is named for what it is
    (three ``disaggregation.py`` and three ``chat.py`` had readers opening each to know which)."""
    from collections import Counter

    names = Counter(p.name for p in SOURCES if p.name not in ("__init__.py", "__main__.py"))
    assert not [name for name, count in names.items() if count > 2], names.most_common(3)
