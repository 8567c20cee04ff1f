"""Any model folder, any cache state: it runs right, or it is refused in one line before it costs anything. Configs
with absurd or zero sizes, configs that do not belong to their weights, a folder with only a config, encoders,
model types this transformers cannot run, a conversion cache killed, truncated or damaged, a full or read-only
cache, and the KV arithmetic of designs whose cache holds more, or other, than their config says."""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.facts import config_facts, kvformula
from engine.facts.errors import ModelSourceError
from engine.facts.events import LoadProgress
from engine.facts.params import GenerationParams
from engine.model import gguf, kvcache, memory, models
from engine.model.models import load
from engine.run.session import Session
from tests.architectures import build

ROOT = Path(__file__).resolve().parents[2]


def edited(source: Path, folder: Path, **changes) -> Path:
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("changes, words", [
    ({"num_hidden_layers": 1_000_000}, "config.json's num_hidden_layers is 1,000,000: a model's num_hidden_layers "
                                       "must be between 1 and 4,096"),
    ({"hidden_size": 10_000_000}, "config.json's hidden_size is 10,000,000: a model's hidden_size must be between"),
    ({"num_attention_heads": 0}, "config.json's num_attention_heads is 0"),
    ({"vocab_size": "lots"}, "config.json's vocab_size is \"lots\", not a whole number"),
    ({"hidden_size": 40_000}, "config.json describes a model of about 82.8M parameters (2 layers of 40,000), but "
                              "its weights hold 0.1M: the config does not belong to these weights"),
])
def test_a_config_with_absurd_sizes_is_refused_naming_the_field_before_anything_is_built(
        tiny_model_dir, tmp_path, monkeypatch, changes, words):
    monkeypatch.setattr(models, "pick_dtype", lambda *a, **k: pytest.fail("got as far as choosing a dtype"))
    with pytest.raises(ModelSourceError, match=words.replace("(", r"\(").replace(")", r"\)")) as info:
        load(str(edited(tiny_model_dir, tmp_path / "m", **changes)), device="cpu", dtype="auto")
    assert "\n" not in str(info.value)


def test_weights_larger_than_the_free_memory_are_refused_before_any_is_allocated(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(memory, "available_bytes", lambda device="cpu": 10_000)
    with pytest.raises(ModelSourceError, match=r"needs about .* for its weights in bfloat16 .* and cpu has 9.77 KiB "
                                               r"free: pick a smaller format"):
        load(str(tiny_model_dir), device="cpu", dtype="auto")


def test_the_dtype_measurement_builds_a_bounded_sample_whatever_the_config_says(monkeypatch):
    from engine.model import calibrate

    seen = []
    monkeypatch.setattr(calibrate, "calibrate", lambda device, hidden, intermediate, *a, **k: seen.append(
        (hidden, intermediate)) or SimpleNamespace(best="float32", reason=lambda: "measured"))
    models.pick_dtype("auto", torch.device("cpu"), SimpleNamespace(hidden_size=40_000, intermediate_size=160_000))
    assert seen == [(models.CALIBRATE_HIDDEN, 4 * models.CALIBRATE_HIDDEN)]


def test_a_folder_with_only_a_config_gives_its_arithmetic_and_says_nothing_can_run(tiny_model_dir, tmp_path):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_model_dir / "config.json", folder / "config.json")
    with pytest.raises(ModelSourceError, match=r"has a config.json but no weights .* so nothing can run. From its "
                                               r"config alone \(computed, 16-bit\): 256 B of KV cache per position"):
        load(str(folder), device="cpu")


def test_phi_4_minis_published_config_gives_128_kib_a_token_and_512_mib_at_4096_positions(tmp_path):
    phi4 = {"architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
            "num_hidden_layers": 32, "num_attention_heads": 24, "num_key_value_heads": 8, "vocab_size": 200064,
            "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "sliding_window": 262144,
            "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    folder = tmp_path / "Phi-4-mini-instruct"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(phi4))
    m = config_facts.model_facts(folder, config_facts.read(folder))
    assert kvformula.bytes_per_token(m) == 128 * 1024
    assert kvformula.predicted_kv_bytes(m, 4096) == 512 * 1024 * 1024
    r = subprocess.run([sys.executable, "-m", "engine", "costmodel", "--model", str(folder), "--context", "4096",
                        "--memory-budget", "4GiB"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "= 131,072 B/token (128 KiB per position)" in r.stdout and "at 4,096 positions: 512 MiB" in r.stdout
    assert "computed from config.json alone (no weights)" in r.stdout
    assert "memory budget 4.00 GiB: bfloat16 weights + KV at 4,096 positions = 7.65 GiB: does not fit" in r.stdout
    assert "memory budget 4.00 GiB: int4 weights + KV at 4,096 positions = 2.51 GiB: fits" in r.stdout


def test_an_encoder_is_refused_as_one_rather_than_run_as_a_decoder(tmp_path):
    import transformers

    from tests.tiny_model import build_tokenizer

    tok = build_tokenizer()
    folder = tmp_path / "bert"
    config = transformers.BertConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64)
    transformers.BertForMaskedLM(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    with pytest.raises(ModelSourceError, match="BertForMaskedLM is an encoder .* it keeps no KV cache and generates "
                                               "no text token by token"):
        load(str(folder), device="cpu")


@pytest.mark.parametrize("config_class", ["LlavaConfig", "Mistral4Config"])
def test_a_model_type_this_transformers_cannot_run_is_not_called_a_broken_folder(tmp_path, config_class):
    import transformers

    folder = tmp_path / config_class
    folder.mkdir()
    config = getattr(transformers, config_class)()
    config.save_pretrained(folder)
    (folder / "model.safetensors").write_bytes(b"")     # weights there: the model type is what is refused
    with pytest.raises(ModelSourceError, match=f"is not supported by transformers {transformers.__version__} as a "
                                               "text generator") as info:
        models._read_config(str(folder), trust_remote_code=False)
    assert "Unrecognized" not in str(info.value)


def test_mpt_takes_its_context_from_max_seq_len(tmp_path):
    loaded = load(str(build("mpt", tmp_path / "mpt")), device="cpu", dtype="float32")
    assert loaded.facts.max_context == 64 and loaded.facts.context_declared


def test_a_model_that_declares_no_context_says_so_instead_of_a_silent_default(tmp_path):
    loaded = load(str(build("recurrentgemma", tmp_path / "rg")), device="cpu", dtype="float32")
    f = loaded.facts
    assert not f.context_declared and f.max_context == config_facts.UNDECLARED_CONTEXT
    assert kvformula.context_text(f) == "not declared by the model; runs here stop at 8,192 positions"
    from engine.facts.report import kv_line

    check = kvformula.check_kv(f, kvformula.predicted_kv_bytes(f, 10), 10)
    assert "full context: not declared by the model" in kv_line(f, check) and check.equal


def test_recurrent_state_kept_on_the_modules_is_counted(tmp_path):
    """RecurrentGemma's recurrent layers keep their state (convolution and LRU) on their own modules: 1,024 B a
    layer in float32 on this tiny model, read from the modules after a pass, not reported as nothing."""
    loaded = load(str(build("recurrentgemma", tmp_path / "rg")), device="cpu", dtype="float32")
    layers = loaded.facts.kv_layers
    assert [(layer.kind, layer.state_bytes) for layer in layers[:2]] == [("state", 1024), ("state", 1024)]
    assert layers[2].kind == "sliding" and kvformula.state_bytes(loaded.facts) == 2048
    block = next(m for n, m in loaded.model.named_modules() if n.endswith("layers.0.temporal_block"))
    held = sum(int(t.nbytes) for m in block.modules() for name, t in vars(m).items()
               if isinstance(t, torch.Tensor) and name in ("conv1d_state", "recurrent_states"))
    assert held == 1024                                    # read independently: what the module holds


def _repeating_heads_before_caching(model) -> None:
    """Widen each GQA layer's K and V projections to one head per query head, each shared head's rows repeated
    in the order ``repeat_kv`` repeats them: the same arithmetic, with the cache holding K and V for every
    query head (as Falcon's new decoder did up to transformers 5.24)."""
    for layer in model.model.layers:
        attn = layer.self_attn
        groups, width = attn.num_key_value_groups, attn.head_dim
        for name in ("k_proj", "v_proj"):
            narrow = getattr(attn, name)
            wide = torch.nn.Linear(narrow.in_features, narrow.out_features * groups, bias=False)
            rows = narrow.weight.detach().view(-1, width, narrow.in_features).repeat_interleave(groups, dim=0)
            wide.weight = torch.nn.Parameter(rows.reshape(-1, narrow.in_features))
            setattr(attn, name, wide)
        attn.num_key_value_groups = 1


def test_a_cache_holding_more_heads_than_the_config_declares_says_why(tmp_path):
    from transformers import AutoModelForCausalLM

    folder = build("llama-gqa", tmp_path / "llama")
    loaded = load(str(folder), device="cpu", dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()     # transformers' own layers
    ids = torch.arange(4, 20).view(1, -1)
    with torch.inference_mode():
        before = model(input_ids=ids).logits
        _repeating_heads_before_caching(model)
        torch.testing.assert_close(model(input_ids=ids).logits, before)        # the same model
    f = models.model_facts(model, name="llama", source=str(folder), device="cpu")
    loaded = dataclasses.replace(loaded, model=model, facts=f)
    assert kvformula.kv_heads(f) == 4 and f.config_kv_heads == 2
    assert "its config declares 2 KV heads, but the cache holds K and V for 4" in kvformula.heads_text(f)
    result = Session(loaded).run("hello world", GenerationParams(max_new_tokens=3))
    assert result.summary.kv_bytes == kvformula.predicted_kv_bytes(f, result.summary.kv_tokens)


def test_deepseek_v32s_indexer_keys_in_bfloat16_are_what_its_cache_tensors_hold(tmp_path):
    """Measured means read from the cache: in bfloat16 the bytes reported equal every tensor each cache layer holds
    (latent, rope key and the indexer's keys), counted here independently of KVScope's reader."""
    loaded = load(str(build("deepseek-v32-indexer", tmp_path / "v32")), device="cpu", dtype="bfloat16")
    cache = kvcache.new_cache(loaded.model)
    with torch.inference_mode():
        kvcache.forward(loaded.model, torch.arange(4, 70).view(1, -1), cache)
    every_tensor = sum(int(t.nbytes) for layer in cache.layers for t in vars(layer).values()
                       if isinstance(t, torch.Tensor) and t.dim() >= 2)
    reported = sum(k + v for k, v in kvcache.held_per_layer(cache, loaded.facts.num_layers)[0])
    assert reported == every_tensor == kvformula.predicted_kv_bytes(loaded.facts, 66)
    assert loaded.facts.kv_layers[0].extra_bytes == 32 * 2          # index_head_dim 32 at 2 B


# --- the conversion cache heals itself ------------------------------------------------------------------------
@pytest.fixture
def fake_gguf(tmp_path, tiny_model_dir, monkeypatch):
    """A GGUF whose "conversion" copies the tiny model (the cache logic under test; the real conversion is
    tested on the embedded model)."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "model.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))           # a valid header: version 3, nothing in it
    calls = []

    def convert(source, out, report, stop):
        calls.append(out)
        shutil.copytree(tiny_model_dir, out)

    monkeypatch.setattr(gguf, "_convert", convert)
    return SimpleNamespace(path=path, calls=calls)


def test_a_conversion_killed_part_way_is_removed_at_the_next_launch_and_a_live_one_is_left(fake_gguf):
    parent = gguf.converted_folder(fake_gguf.path).parent
    dead, live = parent / ".converting-dead", parent / ".converting-live"
    for folder in (dead, live):
        (folder / "model").mkdir(parents=True)
        (folder / "model" / "model.safetensors").write_bytes(b"x" * 1000)
        (folder / gguf.LOCK).write_text("")
    holder = (live / gguf.LOCK).open("a")
    fcntl.flock(holder, fcntl.LOCK_EX)                 # another process converting into it right now
    try:
        gguf.ensure_converted(fake_gguf.path)
        assert not dead.exists() and live.exists()
    finally:
        holder.close()
    gguf.ensure_converted(fake_gguf.path)
    assert not live.exists() and len(fake_gguf.calls) == 1


@pytest.mark.parametrize("damage, words", [
    (lambda f: f.write_bytes(f.read_bytes()[:1000]), "model.safetensors is 1,000 bytes"),
    (lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:]), "model.safetensors's header is damaged"),
    (lambda f: f.unlink(), "model.safetensors is missing"),
], ids=["truncated", "header", "missing"])
def test_a_damaged_copy_is_converted_again_with_a_line_that_says_so(fake_gguf, damage, words):
    target = gguf.ensure_converted(fake_gguf.path)
    damage(target / "model.safetensors")
    said: list[LoadProgress] = []
    assert gguf.ensure_converted(fake_gguf.path, said.append) == target
    assert len(fake_gguf.calls) == 2 and gguf.damage(target) is None
    assert any(words in p.message and "converting it again" in p.message for p in said), said


def test_flipped_bytes_pass_the_fast_check_and_are_found_by_the_thorough_one_which_removes_the_copy(fake_gguf):
    target = gguf.ensure_converted(fake_gguf.path)
    weights = target / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert gguf.damage(target) is None                           # same size, readable header: a load goes ahead
    assert "checksum differs" in gguf.check_thoroughly(fake_gguf.path)
    assert not target.exists()                                   # the next load converts it again


@pytest.mark.parametrize("error, words", [
    (OSError(errno.ENOSPC, "No space left on device"), "is full: the built-in model needs about 520 MiB"),
    (RuntimeError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on '
                  'device" })'), "is full: the built-in model needs about 520 MiB"),     # safetensors' own words
    (PermissionError(errno.EACCES, "Permission denied", "/cache/converted"), "permission denied for "
                                                                             "/cache/converted"),
])
def test_a_full_disk_or_a_cache_without_permission_is_named_as_such(fake_gguf, monkeypatch, error, words):
    def refuse(*args):
        raise error

    monkeypatch.setattr(gguf, "_convert_into", refuse)
    with pytest.raises(ModelSourceError, match=words):
        gguf.ensure_converted(fake_gguf.path)


def test_an_unreadable_weights_file_is_called_unreadable_not_missing(tiny_model_dir, tmp_path, monkeypatch):
    folder = tmp_path / "locked"
    shutil.copytree(tiny_model_dir, folder)
    real = models.os.access
    monkeypatch.setattr(models.os, "access", lambda p, mode: False if str(p).endswith(".safetensors") else
                        real(p, mode))
    with pytest.raises(ModelSourceError, match="model.safetensors cannot be read: permission denied"):
        load(str(folder), device="cpu")


# --- a serving engine's /metrics page, read as it is ----------------------------------------------------------
def test_two_data_parallel_engines_are_two_series_not_one_sum():
    from engine.serve import metrics

    page = "\n".join(f'vllm:{name}{{engine="{engine}",model_name="m"}} {value}' for name, engine, value in (
        ("num_requests_running", 0, 3), ("num_requests_running", 1, 2), ("kv_cache_usage_perc", 0, 0.9),
        ("kv_cache_usage_perc", 1, 0.9)))
    reading = metrics.read(page)
    assert reading.values == {"running": 5.0}                    # requests add up; a share of a cache does not
    assert reading.engines == {"0": {"running": 3.0, "kv_usage": 0.9}, "1": {"running": 2.0, "kv_usage": 0.9}}
    assert any("2 engines, each with its own cache" in note for note in reading.notes)


@pytest.mark.parametrize("page, words", [
    ("\n".join(["vllm:num_requests_running 2"] * 5000), "vllm:num_requests_running is given 5,000 times for the "
                                                         "same labels: not read"),
    ("vllm:num_requests_running -5\nvllm:num_requests_waiting 1", "vllm:num_requests_running is -5, which it "
                                                                   "cannot be (a count of 0 to 1e+07)"),
    ("vllm:kv_cache_usage_perc 7.5\nvllm:num_requests_waiting 1", "vllm:kv_cache_usage_perc is 7.5, which it cannot "
                                                                   "be (a share of 0 to 1)"),
])
def test_duplicates_and_impossible_values_are_refused_as_absent_with_a_note(page, words):
    from engine.serve import metrics

    reading = metrics.read(page)
    assert words in " ".join(reading.notes)
    assert "running" not in reading.values or "waiting" in words
    assert "kv_usage" not in reading.values


def test_an_oversized_metrics_page_is_said_to_be_one():
    from engine.serve import metrics

    with pytest.raises(metrics.MetricsError, match="the metrics page is 37.0 MiB, larger than the 8 MiB"):
        metrics.read("vllm:num_requests_running 1\n" * (37 * 2**20 // 28))


@pytest.mark.parametrize("text, words", [
    ("0.4", "'0.4' is less than one byte"), ("1PiB", "'1PiB' is more than this machine's"),
    ("lots", "'lots' is not a size")])
def test_a_memory_budget_below_a_byte_or_above_the_machine_is_refused_with_a_reason(text, words):
    import argparse

    from engine.terminal.command_line import byte_size

    with pytest.raises(argparse.ArgumentTypeError, match=words):
        byte_size(text)
    assert byte_size("300MiB") == 300 * 2**20 and byte_size("0") == 0
