"""Adding a run setting is one declaration, proven: a copy of the tree gets one more field on ``GenerationParams``
(its range, flag, label, help, step and lecture key) and nothing else, and there the setting has its CLI flag, its
control in Controls, its place in the settings file (kept, and refused out of range), its value in a run's trace,
and its key and value in a run scene's footer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DECLARATION = '''    repetition_penalty: Annotated[float, Range(1.0, 2.0), Setting(
        "--repetition-penalty", "Repetition penalty", "an example setting no run uses", step=0.05),
        Key("Y", short="rep")] = 1.0
'''
ANCHOR = "    kv_cache: Annotated[bool, Setting("

CHECKS = r'''
from PySide6.QtCore import QSettings

from app.state.run_settings import RunSettings
from engine.cli import generate_parser
from engine.facts.events import RunStarted
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace
from engine.terminal.command_line import settings_from
from tests.app.conftest import close_and_dispose, make_window, wait_idle


def test_the_new_setting_is_in_the_cli_controls_settings_file_trace_and_footer(qtbot, tiny_model_dir, tmp_path,
                                                                               monkeypatch):
    parser = generate_parser()
    assert "--repetition-penalty" in parser.format_help()
    args = parser.parse_args(["--prompt", "hi", "--repetition-penalty", "1.5"])
    assert settings_from(GenerationParams, args, parser).repetition_penalty == 1.5

    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    window = make_window(qtbot, tiny_model_dir)
    try:
        box = window.controls.setting_widgets["repetition_penalty"]
        assert (box.minimum(), box.maximum(), box.singleStep()) == (1.0, 2.0, 0.05)
        box.setValue(1.5)
        assert window.run_settings.choices.repetition_penalty == 1.5
        window.controls.max_tokens.setValue(2)
        window.controller.run()
        wait_idle(qtbot, window)
        assert window.store.current.started.params.repetition_penalty == 1.5
        window.files.save_trace(str(tmp_path / "run.kvscope.jsonl"))
        started = next(e for e in read_trace(tmp_path / "run.kvscope.jsonl") if isinstance(e, RunStarted))
        assert started.params.repetition_penalty == 1.5
        window.lecture.enter("prefill")
        assert "<b>Y</b> rep 1.5" in window.scene_view.footer_text()
        window.lecture.parameter("repetition_penalty", 1)
        window.controller.stop()
        wait_idle(qtbot, window)
        assert window.run_settings.choices.repetition_penalty == 1.55
        window.lecture.leave()
        window.save_settings()
    finally:
        close_and_dispose(window)
    stored = QSettings(str(tmp_path / "settings.ini"), QSettings.Format.IniFormat)
    assert float(stored.value("run/repetition_penalty")) == 1.55
    again = RunSettings()
    again.restore({"repetition_penalty": "1.55"})
    assert again.choices.repetition_penalty == 1.55 and not again.notes
    again.restore({"repetition_penalty": "7"})
    assert again.choices.repetition_penalty == 1.0 and again.notes == ["repetition_penalty (7)"]
'''


def test_a_setting_declared_once_on_the_run_parameters_is_everywhere_a_setting_is(tmp_path, tiny_model_dir):
    tree = tmp_path / "tree"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("engine", "app", "tests"):
        shutil.copytree(ROOT / folder, tree / folder, ignore=ignore)
    (tree / "resources").symlink_to(ROOT / "resources")
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    params = tree / "engine" / "facts" / "params.py"
    text = params.read_text()
    assert text.count(ANCHOR) == 1
    params.write_text(text.replace(ANCHOR, DECLARATION + ANCHOR))          # the one declaration
    checks = tmp_path / "checks"
    checks.mkdir()
    (checks / "test_setting.py").write_text(CHECKS)
    shutil.copy(ROOT / "tests" / "conftest.py", checks / "conftest.py")
    env = {**os.environ, "PYTHONPATH": str(tree), "QT_QPA_PLATFORM": "offscreen"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(checks)], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-4000:] + done.stderr[-4000:]
