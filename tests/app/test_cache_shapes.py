"""The caches newer models build, said alike everywhere: a compressed latent (DeepSeek-V3), a latent plus a
sparse-attention indexer's keys (DeepSeek-V3.2), layers keeping attention KV and a state-space state at once
(Falcon-H1), and sliding layers whose storages hold more than their tensors expose (Gemma2). The CLI's report,
its JSON and the window describe the same run with the same bytes and the same words."""

from __future__ import annotations

import json
from html import escape

import pytest

from engine import cli
from engine.facts import kvformula
from engine.model.models import load as load_model
from tests.app.conftest import close_and_dispose, make_window, run_and_wait
from tests.architectures import build

PROMPT = "The KV cache holds keys and values for every position"
TOKENS = 20
WORDS = {"deepseek-v3-mla": ["multi-head latent attention", "latent solid, rope key hatched"],
         "deepseek-v32-indexer": ["sparse-attention indexer key", "latent solid, rope key hatched"],
         "falcon-h1-combined": ["convolution and SSM state per sequence", "state dotted"],
         "gemma2-alternating": ["layers slide and hold at most", "allocated dashed"]}


@pytest.mark.parametrize("name", list(WORDS))
def test_the_report_the_json_and_the_window_describe_the_cache_alike(qtbot, tmp_path, capsys, name):
    folder = str(build(name, tmp_path / name))
    args = ["--model", folder, "--device", "cpu", "--dtype", "float32", "--raw", "--prompt", PROMPT,
            "--max-new-tokens", str(TOKENS), "--temperature", "0"]
    assert cli.main(args) == 0
    report = capsys.readouterr().out
    assert cli.main([*args, "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    facts = load_model(folder, device="cpu", dtype="float32").facts
    formula = kvformula.formula_text(facts)
    window = make_window(qtbot, folder)
    try:
        window.controls.prompt.setPlainText(PROMPT)
        window.controls.chat_box.setChecked(False)
        window.controls.max_tokens.setValue(TOKENS)
        run = run_and_wait(qtbot, window)
        summary = run.summary()
        info = window.kv.info.text()
        bars = window.kv.bars_key                        # the bars per layer, said in the panel's text
    finally:
        close_and_dispose(window)
    assert payload["kv_bytes"] == payload["kv_bytes_formula"] == summary.kv_bytes > 0
    assert payload["kv_allocated_bytes"] == summary.kv_allocated_bytes
    assert formula in report and escape(formula) in info
    held = kvformula.format_bytes(summary.kv_bytes)
    assert f"the tensors hold {held} (measured, = the formula)" in report and f"{held} after" in info
    assert WORDS[name][0] in report + kvformula.heads_text(facts) and WORDS[name][0] in info
    assert WORDS[name][1] in bars and f"the bars per layer: {escape(bars)}" in info
    if name == "falcon-h1-combined":
        assert all(layer["state_bytes"] > 0 for layer in payload["kv_layers"]) and payload["state_bytes"] > 0
    if name == "gemma2-alternating":           # a sliding layer's view into a larger buffer: two figures
        allocated = kvformula.format_bytes(summary.kv_allocated_bytes)
        assert summary.kv_allocated_bytes > summary.kv_bytes
        assert f"their storages have {allocated} allocated" in report and f"{allocated} — more than they" in info
