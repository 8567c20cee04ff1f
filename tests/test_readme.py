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
    listed = set(re.findall(r"\b([a-z0-9_]+\.py)\b", README))
    modules = {p.name for folder in ("engine", "app") for p in (ROOT / folder).rglob("*.py")
               if p.name not in ("__init__.py", "__main__.py")}
    assert not modules - listed, f"README's 'How it is built' does not mention {sorted(modules - listed)}"


def test_the_glossary_is_the_windows_tooltips_word_for_word():
    from app.state.glossary import TERMS

    for term, definition in TERMS.items():
        assert f"- **{term}**: {definition}." in README, term


def test_readme_names_the_torch_make_installs_by_default_and_the_cpu_build_of_the_same_version():
    default = re.search(r"^TORCH \?= (\S+)$", (ROOT / "Makefile").read_text(), flags=re.MULTILINE).group(1)
    assert f"installs `{default}` from\n  the Python package index" in README
    assert f'make run TORCH="{default} --index-url https://download.pytorch.org/whl/cpu"' in README


def apt_packages() -> set[str]:
    line = next(line for line in code_lines() if line.startswith("sudo apt install python3-venv"))
    return set(line.split()[3:])


def test_the_apt_line_names_every_package_the_qt_libraries_need_on_a_minimal_debian():
    """``ldd`` over PySide6's Qt libraries and window-system plugin, each library's Debian package by ``dpkg -S``:
    every package outside a minimal install (C and C++ runtimes, compression, the libraries apt pulls in as
    dependencies of the ones named) is on README's apt line."""
    import shutil
    import subprocess

    import pytest

    if not shutil.which("dpkg") or not shutil.which("ldd"):
        pytest.skip("needs Debian's dpkg and ldd")
    import PySide6

    qt = Path(PySide6.__file__).parent / "Qt"
    binaries = [qt / "lib" / f"libQt6{name}.so.6" for name in ("Core", "Gui", "Widgets", "DBus", "XcbQpa", "Svg")]
    binaries += [qt / "plugins" / "platforms" / "libqxcb.so"]
    libraries = set()
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True).stdout
        libraries |= {line.split("=>")[1].split()[0] for line in out.splitlines()
                      if "=>" in line and "/" in line.split("=>")[1] and "PySide6" not in line}
    packages = set()
    for library in libraries:
        found = subprocess.run(["dpkg", "-S", str(Path(library).resolve())], capture_output=True, text=True).stdout \
            or subprocess.run(["dpkg", "-S", library], capture_output=True, text=True).stdout
        packages |= {entry.split(":")[0] for entry in found.splitlines()[:1]}
    minimal = {"libc6", "libgcc-s1", "libstdc++6", "zlib1g", "libzstd1", "liblzma5", "liblz4-1", "libbsd0",
               "libmd0", "libcap2", "libgcrypt20", "libgpg-error0", "libsystemd0", "libpcre2-8-0", "libexpat1",
               "libpng16-16", "libfreetype6", "libbrotli1", "libxkbcommon0", "libx11-6", "libxau6", "libxdmcp6",
               "libxcb1", "libglvnd0", "libglx0", "libxcb-glx0", "libxcb-render0", "libxcb-shm0", "libxcb-sync1",
               "libxcb-xfixes0", "libxcb-util1"}
    assert packages, "no library resolved to a package"
    assert not packages - minimal - apt_packages(), sorted(packages - minimal - apt_packages())
