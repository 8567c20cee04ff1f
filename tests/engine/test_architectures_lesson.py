"""The lesson on why new models hold less KV: layers built with published attention dimensions hold what their
formula says, at every step; sliding layers stop at their window, linear-attention layers keep a fixed state;
the whole-model figures follow from the measured ones; the CLI's JSON names each design with both figures."""

from __future__ import annotations

import json

import pytest

from engine import cli
from engine.lessons.architectures import BY_NAME, CONTEXTS, LayerFigures, whole_model_bytes
from engine.output.trace import read_trace, write_trace
from tests.lessons import collect

SOME = ("gpt-oss-20b", "Qwen3-Next-80B-A3B", "DeepSeek-V3")


@pytest.fixture(scope="module")
def measured(tiny, tmp_path_factory):
    events, finished = collect("architectures", tiny, designs=SOME, prompt_tokens=16, decode_steps=2)
    return events, finished


def test_each_design_holds_what_its_published_dimensions_say_at_every_step(measured):
    _events, finished = measured
    designs = {d.name: d for d in finished.result.designs}
    assert list(designs) == list(SOME) and finished.reason == "done"
    for d in designs.values():
        assert d.kv_bytes_per_token_measured == d.kv_bytes_per_token_formula > 0 and d.every_step_matches, d.name
    assert designs["DeepSeek-V3"].kv_bytes_per_token_measured == 61 * (512 + 64) * 2          # latent + rope key
    assert designs["DeepSeek-V3"].layers[0].kind == "latent"
    assert designs["gpt-oss-20b"].kv_bytes_per_token_measured == 24 * 2 * 8 * 64 * 2
    assert [layer.kind for layer in designs["gpt-oss-20b"].layers] == ["sliding", "full"]


def test_a_sliding_layer_stops_at_its_window_and_a_linear_layer_keeps_a_state(measured):
    _events, finished = measured
    designs = {d.name: d for d in finished.result.designs}
    sliding, full = designs["gpt-oss-20b"].layers
    assert sliding.capacity == 127 and full.capacity is None                   # window 128, the newest kept
    assert designs["gpt-oss-20b"].at_contexts[-1] == 12 * 2048 * 127 + 12 * 2048 * CONTEXTS[-1]
    linear, attention = designs["Qwen3-Next-80B-A3B"].layers
    assert linear.kind == "state" and linear.bytes_per_token == 0 and linear.state_bytes > 0
    assert designs["Qwen3-Next-80B-A3B"].state_bytes == 36 * linear.state_bytes
    assert attention.bytes_per_token == 2 * 2 * 256 * 2


def test_a_design_is_built_with_zero_weights_and_the_buffers_its_own_modelling_code_computes():
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from engine.lessons.architectures import VOCAB, build

    design = BY_NAME["gpt-oss-20b"]
    built = build(design, "float32")
    assert all(not p.any() for p in built.parameters())               # zeros, never uninitialised memory
    config = getattr(transformers, design.config)(
        vocab_size=VOCAB, num_hidden_layers=len(design.layers), **design.published, **design.shrunk,
        layer_types=[kind for kind, _count in design.layers])
    initialised = dict(AutoModelForCausalLM.from_config(config, dtype=torch.float32).named_buffers())
    buffers = dict(built.named_buffers())
    assert buffers.keys() == initialised.keys() and any("inv_freq" in name for name in buffers)
    assert all(torch.equal(buffers[name], initialised[name]) for name in buffers)


def test_whole_model_bytes_count_every_layer_up_to_its_capacity():
    layers = [LayerFigures("sliding_attention", 3, "sliding", 100, capacity=10),
              LayerFigures("full_attention", 2, "full", 50), LayerFigures("linear_attention", 4, "state", 0,
                                                                           state_bytes=1000)]
    assert whole_model_bytes(layers, 5) == 3 * 500 + 2 * 250 + 4 * 1000
    assert whole_model_bytes(layers, 1000) == 3 * 1000 + 2 * 50_000 + 4 * 1000


def test_the_trace_of_the_lesson_reads_back(measured, tmp_path):
    events, _finished = measured
    assert read_trace(write_trace(tmp_path / "arch.jsonl", events)) == events


def test_the_cli_json_names_each_design_with_its_measured_and_formula_bytes(tiny_model_dir, capsys):
    code = cli.main(["sweep", "architectures", "--model", str(tiny_model_dir), "--device", "cpu", "--designs",
                     "Falcon-7B", "--tokens", "8", "--steps", "1", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    (falcon,) = payload["result"]["designs"]
    assert falcon["name"] == "Falcon-7B" and falcon["source"] == BY_NAME["Falcon-7B"].source
    assert falcon["kv_bytes_per_token_measured"] == falcon["kv_bytes_per_token_formula"] == 32 * 2 * 1 * 64 * 2


def test_the_cli_table_marks_each_figure_past_the_models_own_context(tiny_model_dir, capsys):
    code = cli.main(["sweep", "architectures", "--model", str(tiny_model_dir), "--device", "cpu", "--designs",
                     "Falcon-7B", "--tokens", "8", "--steps", "1"])
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Falcon-7B "))
    assert code == 0
    assert row.split("|")[5:8] == [" 32.0 MiB* ", "  256 MiB* ", " 1.00 GiB* "]     # 2,048 positions its own
