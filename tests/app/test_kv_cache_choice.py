"""The KV cache kept as fp8 or a window, chosen in Controls: the run gets it, the KV panel says what it holds
against the formula, and a remembered choice the engine cannot parse comes back as the default, said."""

from __future__ import annotations

from app.state.run_settings import RunSettings
from tests.app.conftest import run_and_wait


def test_a_cache_chosen_as_fp8_in_controls_is_the_runs_and_the_kv_panel_says_its_share(qtbot, window):
    window.controls.kv_method_box.setCurrentText("fp8")
    assert window.run_settings.params().kv_method == "fp8"
    window.controls.max_tokens.setValue(4)
    run = run_and_wait(qtbot, window)
    assert run.started.params.kv_method == "fp8"
    text = window.kv.info.text()
    assert "kept as fp8:" in text and "the formula gives these positions in full precision" in text
    assert "✗" not in text


def test_a_remembered_cache_method_the_engine_cannot_parse_is_replaced_by_full_and_said():
    settings = RunSettings()
    settings.restore({"kv_method": "zip:9", "max_new_tokens": 7})
    assert settings.choices.kv_method == "full" and settings.choices.max_new_tokens == 7
    assert any("kv_method" in note for note in settings.notes)
