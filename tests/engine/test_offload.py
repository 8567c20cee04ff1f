"""Offloading: layers on disk (by count or by a memory budget) decode the same greedy tokens as the model all in
memory, each step records every layer's time and where it was read from, a budget too small to run anything is
refused, the lesson's figures follow from the layers it put on disk, and the KV cache offload runs on a GPU."""

from __future__ import annotations

import json

import pytest
import torch

from engine import cli
from engine.facts.errors import ModelSourceError
from engine.facts.events import LayerTimes, RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.model.models import Offload, load, offload_dir
from engine.output.trace import read_trace, write_trace
from engine.run.session import Session
from engine.store.paths import offloaded_models_dir
from engine.terminal.command_line import byte_size
from tests.lessons import collect

GREEDY = GenerationParams(max_new_tokens=6, temperature=0.0)


def greedy_ids(loaded, events: list | None = None) -> list[int]:
    result = Session(loaded).run("hello world", GREEDY, (events if events is not None else []).append)
    assert isinstance(result, RunFinished)
    return result.summary.token_ids


@pytest.fixture(scope="module")
def all_in_memory(tiny_model_dir):
    return greedy_ids(load(str(tiny_model_dir), "cpu", "float32"))


def test_the_last_layers_on_disk_decode_the_same_tokens_and_time_every_layer_at_every_step(tiny_model_dir,
                                                                                            all_in_memory):
    split = load(str(tiny_model_dir), "cpu", "float32", offload=Offload(disk_layers=1))
    assert split.facts.layer_devices == ["cpu", "disk"]
    first, second = split.model.model.layers
    assert {p.device.type for p in first.parameters()} == {"cpu"}
    assert {p.device.type for p in second.parameters()} == {"meta"}          # not held: read back at each use
    events: list = []
    assert greedy_ids(split, events) == all_in_memory
    times = [e for e in events if isinstance(e, LayerTimes)]
    steps = [e.step for e in events if isinstance(e, TokenStep)]
    assert [t.step for t in times] == steps and len(steps) == GREEDY.max_new_tokens
    assert all(t.devices == ["cpu", "disk"] and len(t.ms) == 2 and min(t.ms) > 0 for t in times)


def test_a_memory_budget_puts_what_does_not_fit_on_disk_and_keeps_the_tokens(tiny_model_dir, all_in_memory):
    split = load(str(tiny_model_dir), "cpu", "float32", offload=Offload(memory_budget=300_000))   # of 413,248 B
    assert "disk" in split.facts.layer_devices
    assert greedy_ids(split) == all_in_memory


def test_a_budget_smaller_than_the_embeddings_is_refused_with_the_size_it_needs(tiny_model_dir):
    with pytest.raises(ModelSourceError, match=r"A memory budget of 97.7 KiB is smaller than the model's embeddings "
                                               r"\(.* KiB\) and one layer beside them: nothing could run"):
        load(str(tiny_model_dir), "cpu", "float32", offload=Offload(memory_budget=100_000))


def test_a_model_in_one_place_records_no_layer_times(tiny):
    events: list = []
    Session(tiny).run("hello", GenerationParams(max_new_tokens=2), events.append)
    assert not any(isinstance(e, LayerTimes) for e in events)


def test_a_user_offload_folder_gets_a_folder_of_kvscopes_own_and_keeps_the_users_files(tiny_model_dir, tmp_path):
    mine = tmp_path / "notes.txt"
    mine.write_text("keep me")
    split = load(str(tiny_model_dir), "cpu", "float32", offload=Offload(disk_layers=1, folder=str(tmp_path)))
    assert split.offload_folder == offload_dir(str(tiny_model_dir), str(tmp_path))
    assert split.offload_folder.parent == tmp_path and split.offload_folder.name.startswith("kvscope-offload-")
    load(str(tiny_model_dir), "cpu", "float32", offload=Offload(disk_layers=2, folder=str(tmp_path)))  # emptied
    assert mine.read_text() == "keep me"


@pytest.mark.parametrize(("text", "size"), [("300MiB", 300 * 2**20), ("1.5GiB", int(1.5 * 2**30)), ("2GB", 2 * 10**9),
                                            ("4096", 4096), ("0", 0)])
def test_memory_budget_sizes_read_with_their_units(text, size):
    assert byte_size(text) == size


@pytest.mark.parametrize("argv", [["--memory-budget", "lots"], ["--memory-budget", "3 parsecs"],
                                  ["--memory-budget", "9e99"]])
def test_a_memory_budget_that_is_not_a_size_is_refused_by_the_cli(argv, capsys):
    with pytest.raises(SystemExit) as caught:
        cli.main(["--prompt", "hi", *argv])
    assert caught.value.code == 2 and "--memory-budget" in capsys.readouterr().err


@pytest.fixture(scope="module")
def lesson(tiny):
    return collect("offload", tiny, disk_shares=(0.0, 0.5, 1.0), new_tokens=4)


def test_the_lesson_splits_as_asked_and_each_split_keeps_the_tokens(lesson, tiny):
    _events, finished = lesson
    splits = finished.result.splits
    assert finished.reason == "done" and [s.disk_layers for s in splits] == [0, 1, 2]
    assert [s.layer_devices for s in splits] == [("cpu", "cpu"), ("cpu", "disk"), ("disk", "disk")]
    assert all(s.tokens_match and s.decode_tok_s > 0 for s in splits)
    layer_bytes = sum(p.numel() * p.element_size() for p in tiny.model.model.layers[1].parameters())
    assert splits[1].disk_bytes_per_token == layer_bytes and splits[2].disk_bytes_per_token == 2 * layer_bytes
    assert splits[0].budget == tiny.facts.weight_bytes and splits[1].budget == tiny.facts.weight_bytes - layer_bytes


def test_the_prediction_is_the_all_in_memory_step_plus_the_bytes_over_the_read_rate(lesson):
    _events, finished = lesson
    base, half = finished.result.splits[:2]
    assert base.predicted_decode_tok_s is None and half.read_bytes_per_s > 0
    base_step_s = 1 / base.decode_tok_s
    expected = 1 / (base_step_s + half.disk_bytes_per_token / half.read_bytes_per_s)
    assert half.predicted_decode_tok_s == pytest.approx(expected, rel=0.05)   # base tok/s is rounded from its ms
    assert half.disk_layer_ms is not None and base.disk_layer_ms is None and base.memory_layer_ms is not None


def test_the_lesson_removes_the_offload_folders_it_made(lesson, tiny):
    assert not offload_dir(tiny.facts.source).exists()


def test_the_kv_offload_figure_is_computed_at_positions_the_model_can_hold(lesson, tiny):
    from engine.facts import kvformula

    result = lesson[1].result
    full = kvformula.full_context_positions(tiny.facts)
    assert result.kv_positions == (full,) and not result.kv_offload_measured          # the tiny model holds 256
    assert result.kv_moved_per_token == (2 * kvformula.predicted_kv_bytes(tiny.facts, full),)


def test_the_lessons_trace_reads_back(lesson, tmp_path):
    events, _finished = lesson
    assert read_trace(write_trace(tmp_path / "offload.jsonl", events)) == events


def test_sweep_offload_json_gives_budget_devices_and_both_speeds_per_split(tiny_model_dir, capsys):
    code = cli.main(["sweep", "offload", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32",
                     "--disk-shares", "0,0.5", "--tokens", "3", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0
    splits = payload["result"]["splits"]
    assert [s["layer_devices"] for s in splits] == [["cpu", "cpu"], ["cpu", "disk"]]
    assert splits[0]["budget"] > splits[1]["budget"] > 0
    assert splits[1]["decode_tok_s"] > 0 and splits[1]["predicted_decode_tok_s"] > 0


def test_the_sweep_refuses_a_model_loaded_as_int8_weights(tiny_model_dir, capsys):
    code = cli.main(["sweep", "offload", "--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "int8",
                     "--tokens", "2"])
    assert code != 0 and "Offloading reads float weights from disk" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the KV cache offloads from a GPU to the CPU")
def test_on_a_gpu_the_offloaded_kv_cache_decodes_the_same_tokens(tiny_model_dir):
    _events, finished = collect("offload", load(str(tiny_model_dir), "cuda", "float32"), disk_shares=(0.0,),
                                new_tokens=4)
    result = finished.result
    assert result.kv_offload_measured and result.kv_offload_tokens_match and result.kv_offload_decode_tok_s > 0


def test_a_split_models_offload_folder_is_in_kvscopes_cache(tiny_model_dir):
    split = load(str(tiny_model_dir), "cpu", "float32", offload=Offload(disk_layers=1))
    assert split.offload_folder == offload_dir(str(tiny_model_dir))
    assert split.offload_folder.parent == offloaded_models_dir()


def test_an_offload_folder_that_cannot_be_made_is_refused_in_one_line(tiny_model_dir, tmp_path):
    afile = tmp_path / "notes.txt"
    afile.write_text("a file, not a folder")
    with pytest.raises(ModelSourceError, match=r"Cannot use .*notes.txt/kvscope-offload-\w+ for offloaded weights: "
                                               r"Not a directory"):
        load(str(tiny_model_dir), "cpu", "float32", offload=Offload(disk_layers=1, folder=str(afile)))
    assert afile.read_text() == "a file, not a folder"
