"""README cannot drift from the code: every command in its code blocks parses (make targets exist, the CLI and the
window accept the options shown), and every file it names as part of the repository exists."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def code_lines() -> list[str]:
    """Lines inside ``` blocks (without a leading ``$ `` prompt or a trailing ``# comment``) and inline code spans."""
    lines, inside = [], False
    for raw in README.splitlines():
        line = raw.strip()                               # fences and commands may be indented in a list
        if line.startswith("```"):
            inside = not inside
            continue
        if inside:
            text = line[2:] if line.startswith("$ ") else line
            lines.append(re.sub(r"\s+#.*$", "", text).strip())
        else:
            lines += [span.strip() for span in re.findall(r"`([^`]+)`", line)]
    return lines


def commands(prefixes: tuple[str, ...]) -> list[list[str]]:
    """The arguments of every command line that starts with one of ``prefixes`` and has arguments."""
    found = []
    for line in code_lines():
        for prefix in prefixes:
            if line.startswith(prefix + " "):
                found.append(shlex.split(line[len(prefix):]))
                break
    return found


def make_targets() -> set[str]:
    makefile = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-z][a-z-]*):", makefile, flags=re.MULTILINE))


def test_every_make_command_in_readme_names_a_real_target():
    used = commands(("make",))
    assert len(used) >= 6                                # run, test and the others README explains
    targets = make_targets()
    for argv in used:
        names = [a for a in argv if "=" not in a]
        assert names and set(names) <= targets, argv


ENGINE = ("python -m engine", ".venv/bin/python -m engine", "kvscope-cli")
APP = ("python -m app", ".venv/bin/python -m app", "kvscope", ".venv/bin/kvscope")


def test_every_engine_command_in_readme_parses():
    from engine.cli import SUBCOMMANDS, parse_only

    used = commands(ENGINE)
    assert len(used) >= 8
    seen, refused = set(), []
    for argv in used:
        if argv and argv[0] in SUBCOMMANDS:
            seen.add(argv[0])
        try:
            parse_only(argv)
        except SystemExit as exc:                        # argparse refused it (or printed --help: code 0)
            if exc.code != 0:
                refused.append(shlex.join(argv))
    assert not refused, f"README's python -m engine commands that do not parse: {refused}"
    assert seen == set(SUBCOMMANDS), f"README shows no example of {set(SUBCOMMANDS) - seen}"


def test_every_window_command_in_readme_parses():
    from app.main import parse_args

    used = commands(APP)
    assert len(used) >= 4
    refused = []
    for argv in used:
        try:
            parse_args(argv)
        except SystemExit as exc:
            if exc.code != 0:
                refused.append(shlex.join(argv))
    assert not refused, f"README's kvscope commands that do not parse: {refused}"


def test_every_screenshot_readme_shows_exists():
    names = re.findall(r"\((resources/screenshots/[^)]+\.png)\)", README)
    assert len(names) >= 11                              # a workbench view and every lecture scene at least
    missing = [n for n in names if not (ROOT / n).exists()]
    assert not missing, missing


def test_every_module_readme_names_exists():
    listed = set(re.findall(r"`([a-z0-9_]+\.py)`", README))
    existing = {p.name for p in ROOT.glob("**/*.py") if ".venv" not in p.parts and "build" not in p.parts}
    assert len(listed) >= 50 and not listed - existing, sorted(listed - existing)


def test_readme_lists_every_engine_and_app_module():
    listed = set(re.findall(r"`([a-z0-9_]+\.py)`", README))
    modules = {p.name for folder in ("engine", "app", "app/panels") for p in (ROOT / folder).glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert not modules - listed, f"README's 'How it is built' does not mention {sorted(modules - listed)}"
