"""A setting is declared once (``engine.facts.params``, the lessons' settings): the controls, the CLI, the settings file
and the lecture keys agree on its range and default; the loaded model narrows what depends on it; a choice made
since the model loaded is pending, and says so."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QSettings

from app.state.phase import plural
from app.state.run_settings import Choices, RunSettings, param_shape
from engine import lessons
from engine.cli import generate_parser
from engine.facts.events import HardwarePeaks
from engine.facts.params import DEFAULT_SEED, GenerationParams
from engine.terminal.command_line import settings_from
from tests.app.conftest import close_and_dispose, make_window, run_and_wait, wait_idle


def test_the_window_and_the_cli_share_every_run_default_the_seed_included():
    parser = generate_parser()
    from_cli = settings_from(GenerationParams, parser.parse_args(["--prompt", "hi"]), parser)
    from_window = RunSettings().params()
    assert from_cli == from_window == GenerationParams()
    assert from_cli.seed == Choices().seed == DEFAULT_SEED == 42
    random = settings_from(GenerationParams, parser.parse_args(["--prompt", "hi", "--seed", "random"]), parser)
    assert random.seed is None                          # the session draws one and reports it


def test_each_control_takes_its_range_step_and_unit_from_the_declaration(window):
    c = window.controls
    for name, box in (("temperature", c.temperature), ("top_p", c.top_p)):
        shape = param_shape(name)
        assert (box.minimum(), box.maximum(), box.singleStep()) == (shape.span.low, shape.span.high,
                                                                    shape.setting.step), name
    assert c.temperature.maximum() == 100.0               # what the engine accepts, not a narrower 2.0
    assert c.max_tokens.suffix() == " tokens" and c.top_k.specialValueText() == "off"


def test_a_dtype_chosen_after_loading_is_pending_and_the_run_says_what_it_used(qtbot, window):
    c = window.controls
    assert not c.pending.isVisibleTo(window) and window.controller.model_choice.pending() == []
    c.dtype_box.setCurrentText("bfloat16")
    assert window.controller.model_choice.pending() == ["dtype bfloat16"]
    assert c.pending.isVisibleTo(window) and "dtype bfloat16: press Load model" in c.pending.text()
    assert "dtype float32" in c.pending.text()                         # what runs use meanwhile
    c.max_tokens.setValue(2)
    window.controller.run()
    assert "not yet applied: dtype bfloat16" in window.status.currentMessage()
    wait_idle(qtbot, window)
    assert window.store.current.model.dtype == "float32" and c.pending.isVisibleTo(window)
    c.dtype_box.setCurrentText("float32")
    assert not c.pending.isVisibleTo(window)


def test_a_failed_load_keeps_its_source_as_pending_beside_the_model_still_loaded(qtbot, window, tiny_model_dir):
    c = window.controls
    c.model_box.setCurrentText("/nope")
    window.controller.load_model()                  # Ctrl+L: what the controls name now
    wait_idle(qtbot, window)
    assert window.banner.isVisible() and "/nope" in window.banner.label.text()
    assert c.pending.text().startswith("Pending: source /nope (its last load failed)")
    assert str(tiny_model_dir) in c.pending.text()             # runs still use the model that is loaded
    assert "Could not load /nope." in c.model_status.text()


def test_k_and_m_stay_within_the_loaded_models_vocabulary_and_context(qtbot, window):
    facts = window.client.model.model
    window.lecture.enter("sampling")
    for _ in range(12):
        window.lecture.parameter("top_k", 1)
        window.lecture.parameter("max_new_tokens", 1)
        window.controller.stop()
        wait_idle(qtbot, window)
    c = window.run_settings.choices
    assert c.top_k == facts.vocab_size and c.max_new_tokens == facts.max_context - 1
    assert window.controls.top_k.maximum() == facts.vocab_size
    assert window.controls.max_tokens.maximum() == facts.max_context - 1
    window.lecture.leave()


def test_m_in_an_experiment_scene_changes_what_r_runs_there_and_t_says_it_does_not_apply(qtbot, window):
    window.lecture.enter("cache")
    window.lecture.parameter("max_new_tokens", 1)
    settings = window.controller.choices.for_run("cache", lessons.lesson("cache").settings, "")
    assert settings.new_tokens == 96                               # the lesson's 48, doubled: what R runs now
    assert window.run_settings.choices.max_new_tokens == 128       # the prompt's setting is not what R runs here
    assert "<b>M</b> 96 tokens" in window.scene_view.footer_text()
    assert "new tokens (both runs) 96; R runs the scene with it" in window.scene_view.footer_text()
    window.lecture.parameter("temperature", 1)
    assert "T does not apply in this scene" in window.scene_view.footer_text()
    assert window.run_settings.choices.temperature == 0.0
    form = window.experiments.views["cache"].form
    window.lecture.parameter("max_new_tokens", -1)
    assert window.controller.choices.settings["cache"].new_tokens == 48
    assert form.readers["new_tokens"]() == 48                       # the tab's form shows what R will run
    window.lecture.leave()


def test_a_saved_temperature_out_of_its_range_is_refused_with_a_note_and_one_in_range_shows_as_it_runs(
        qtbot, tmp_path, monkeypatch):
    path = tmp_path / "saved.ini"
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(path))
    stored = QSettings(str(path), QSettings.Format.IniFormat)
    stored.setValue("run/temperature", 500.0)
    stored.setValue("run/top_p", 0.5)
    stored.sync()
    w = make_window(qtbot)
    try:
        assert w.banner.isVisible() and "temperature (500.0)" in w.banner.label.text()
        assert w.run_settings.choices.temperature == 0.0 and w.controls.temperature.value() == 0.0
        assert w.controls.top_p.value() == 0.5
    finally:
        close_and_dispose(w)
    stored.setValue("run/temperature", 50.0)
    stored.sync()
    w = make_window(qtbot)
    try:
        assert w.controls.temperature.value() == 50.0 == w.run_settings.params().temperature   # shown = run
    finally:
        close_and_dispose(w)


def test_an_error_banner_goes_when_a_later_run_starts(qtbot, window):
    window.run_settings.update(prompt="   ")
    window.controller.run()
    assert window.banner.isVisible() and "prompt is empty" in window.banner.label.text()
    window.run_settings.update(prompt="hello", max_new_tokens=2)
    run_and_wait(qtbot, window)
    assert not window.banner.isVisible()


def test_nothing_is_measured_by_itself_after_a_run_that_beats_the_peaks(qtbot, window):
    """A run above the cached peak says the peak is too low; it does not start a minute of measuring."""
    worker = window.client.worker
    worker.peaks = HardwarePeaks("this CPU", "float32", flops_per_s=1e3, bytes_per_s=1e6, cpu_share=0.95)
    busy: list = []
    window.client.events_ready.connect(lambda items: busy.extend(window.client.busy for _ in items))
    window.controls.max_tokens.setValue(2)
    run_and_wait(qtbot, window)
    assert "peaks" not in busy and worker.peaks.flops_per_s == 1e3
    assert "measured too low" in window.banner.label.text() and window.banner.isVisible()


def test_a_prefill_above_its_floats_emulated_peak_but_below_float32s_raises_no_alarm(qtbot, window):
    """Products widened to float32 are held to float32's peak: only a run above that says the peak is low."""
    from engine.facts.costmodel import ModelCost

    worker = window.client.worker
    window.controls.max_tokens.setValue(2)
    s = run_and_wait(qtbot, window).summary()
    achieved = ModelCost(window.store.current.model).prefill(s.prompt_tokens).flops / (s.prefill_ms / 1000.0)
    worker._said_peaks_low = False
    worker.peaks = HardwarePeaks("this CPU", "bfloat16", flops_per_s=achieved / 100, bytes_per_s=1e15,
                                 cpu_share=0.95, wide_rows=s.prompt_tokens, wide_flops_per_s=achieved * 100)
    window.banner.hide()
    run_and_wait(qtbot, window)
    assert not window.banner.isVisible()
    worker.peaks = HardwarePeaks("this CPU", "bfloat16", flops_per_s=achieved / 100, bytes_per_s=1e15,
                                 cpu_share=0.95, wide_rows=s.prompt_tokens + 1, wide_flops_per_s=achieved * 100)
    run_and_wait(qtbot, window)
    assert "measured too low" in window.banner.label.text() and window.banner.isVisible()


def test_plural_counts_say_one_token_and_two_tokens():
    assert plural(1, "token") == "1 token" and plural(2, "token") == "2 tokens" and plural(1_000, "step") == \
        "1,000 steps"


def test_a_remembered_value_the_run_would_refuse_is_reset_when_restored():
    """Temperature 0.005 is inside 0..100 but not a temperature (0 is greedy, sampling starts at 0.01): the
    restore check reads the whole declaration, so it is reset with a note instead of failing at Run."""
    settings = RunSettings()
    settings.restore({"temperature": 0.005, "top_p": 0.5})
    assert settings.choices.temperature == 0.0 and settings.choices.top_p == 0.5
    assert settings.notes == ["temperature (0.005)"]
    settings.params()                                    # what Run builds: accepted
    settings.restore({"temperature": 0.01})
    assert settings.choices.temperature == 0.01 and settings.notes == []


def test_the_load_settings_say_the_same_in_the_cli_and_controls_and_share_one_deadline_range(window, capsys):
    import argparse

    from engine.facts.params import LoadSettings
    from engine.facts.validation import shape_of
    from engine.terminal.command_line import add_model_arguments, add_server_arguments

    p = argparse.ArgumentParser()
    add_model_arguments(p)
    add_server_arguments(p)
    flags = {a.dest: a for a in p._actions}
    c = window.controls
    for name, widget in (("model", c.model_box), ("device", c.device_box), ("memory_budget", c.budget),
                         ("trust_remote_code", c.trust_box), ("deadline_s", c.deadline)):
        shape = shape_of(LoadSettings, name)
        assert widget.toolTip().lower().startswith(shape.setting.help[:60].lower()), name
        assert flags[name].help.startswith(shape.setting.help), name
    deadline = shape_of(LoadSettings, "deadline_s")
    assert (c.deadline.minimum(), c.deadline.maximum()) == (deadline.span.low, deadline.span.high)
    with pytest.raises(SystemExit):
        p.parse_args(["--deadline", str(deadline.span.high + 1)])
    assert "out of range" in capsys.readouterr().err
    assert [c.device_box.itemText(i) for i in range(c.device_box.count())] == list(flags["device"].choices)


@pytest.mark.parametrize("remembered, kept", [("deleted-model", False), ("here", True),
                                              ("HuggingFaceTB/SmolLM2-360M-Instruct", True)])
def test_a_remembered_model_folder_that_is_gone_gives_way_to_the_built_in_one_and_says_so(
        qtbot, monkeypatch, tmp_path, remembered, kept):
    from app.main import build, parse_args, start
    from tests.app.conftest import close_and_dispose

    (tmp_path / "here").mkdir()
    source = remembered if "/" in remembered else str(tmp_path / remembered)
    _app, window = build(parse_args(["--no-load"]))
    window.show()
    try:
        window.controls.set_model(source)                          # as the settings file restored it
        asked = []
        monkeypatch.setattr(window.controller, "load_model", lambda request=None: asked.append(request))
        start(window, parse_args([]))
        qtbot.waitUntil(lambda: bool(asked))
        if kept:
            assert asked[0].model == source and not window.banner.isVisible()
        else:
            assert asked[0].model == "embedded" and window.controls.model_box.currentText() == "embedded"
            assert window.banner.isVisible() and source in window.banner.label.text()
            assert "loading the built-in model instead" in window.banner.label.text()
    finally:
        close_and_dispose(window)
