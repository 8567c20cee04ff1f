"""What a double-click user depends on: the self-test, the About dialog, the first-run dialog, the icon,
the desktop entry and the installed launchers."""

import configparser
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.real
def test_self_test_on_the_source_tree_with_threads_that_follow_the_load(smol, cache_root):
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)}
    env.pop("QT_QPA_PLATFORM", None)                 # the self-test must go offscreen by itself
    env.pop("KVSCOPE_THREADS", None)                 # the tests' own setting (fixed) is not a user's
    r = subprocess.run([sys.executable, "-m", "app", "--self-test"], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr
    assert "self-test passed: SmolLM2-135M-Instruct" in r.stdout and "prompt eval time =" in r.stdout
    assert "/     7 runs" in r.stdout and "window shown" in r.stdout
    assert "Traceback" not in r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("compute threads:"))
    assert line.endswith("follow the load; waiting: spin (OpenMP's default)"), line   # as a user starts it


def test_self_test_fails_cleanly_on_a_bad_model(cache_root, tmp_path):
    env = {**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)}
    r = subprocess.run([sys.executable, "-m", "app", "--self-test", "--model", str(tmp_path / "missing")],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 1 and "self-test failed: No such file or folder" in r.stderr
    assert "Traceback" not in r.stderr


def test_about_lists_versions_device_and_files(qtbot, window):
    from app.shell.dialogs import AboutDialog

    qtbot.waitUntil(lambda: window.store.peaks is not None, timeout=30_000)
    dialog = AboutDialog(window, window.client.model, window.store.peaks, window.settings.fileName(), busy=False)
    text = dialog.label.text()
    for fragment in ("torch", "transformers", "PySide6", "tiny", "GFLOP/s", "converted models", "settings.ini"):
        assert fragment in text, fragment
    dialog.close()
    from app.shell.dialogs import peaks_words

    widened = dataclasses.replace(window.store.peaks, dtype="bfloat16", flops_per_s=26e9, wide_rows=24,
                                  wide_flops_per_s=132e9)
    assert "26 GFLOP/s in bfloat16, 132 in float32 (its products of 24+ rows run widened)" in peaks_words(widened)


def test_clearing_the_cache_removes_conversions(qtbot, window, monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "converted" / "model-x"
    folder.mkdir(parents=True)
    (folder / "model.safetensors").write_bytes(b"0" * 4096)
    window.clear_converted_models()
    assert not folder.exists() and "Cleared converted models (4.00 KiB)" in window.status.currentMessage()


def test_first_run_dialog_follows_conversion_progress(qtbot, window):
    from engine.facts.events import LoadProgress

    window.controller.on_events([LoadProgress("convert", "De-quantizing tensor 10 of 272", 0.3)])
    assert window.surface.first_run is not None and window.surface.first_run.isVisible()
    assert window.surface.first_run.bar.value() == 300 and "tensor 10" in window.surface.first_run.step.text()
    window.controller.on_events([LoadProgress("load", "Loading weights", None)])
    assert window.surface.first_run is None


def test_window_icon_and_desktop_entry(window):
    from PySide6.QtWidgets import QApplication

    from app.views.resources import icon_path

    assert icon_path().is_file() and (icon_path().parent / "kvscope-256.png").is_file()
    assert not QApplication.instance().windowIcon().isNull()
    entry = configparser.ConfigParser(interpolation=None)
    entry.optionxform = str
    entry.read(ROOT / "packaging" / "kvscope.desktop")
    desktop = entry["Desktop Entry"]
    assert desktop["Type"] == "Application" and desktop["Icon"] == "kvscope"
    assert desktop["Categories"].rstrip(";").split(";") == ["Education", "Science", "Development"]
    assert desktop["Exec"].startswith("kvscope")


def test_installed_entry_points_are_declared():
    tomllib = pytest.importorskip("tomllib")

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["gui-scripts"]["kvscope"] == "app.main:main"
    assert project["scripts"]["kvscope-cli"] == "engine.cli:main"


def test_wheel_carries_resources_and_launchers(tmp_path):
    import zipfile

    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("kvscope-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "kvscope_resources/prompts/01-short-question.txt" in names
    assert "kvscope_resources/icons/kvscope.svg" in names and "app/panels/kv_heatmap.py" in names
    course = sorted(p.relative_to(ROOT / "resources").as_posix() for p in (ROOT / "resources" / "course").iterdir())
    assert course and all(f"kvscope_resources/{name}" in names for name in course)     # the course ships whole
    entry_points = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "kvscope = app.main:main" in entry_points and "kvscope-cli = engine.cli:main" in entry_points
    assert not any("screenshots" in n for n in names)
