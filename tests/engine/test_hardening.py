"""Bad input and faults at the engine level: each gives one clear, specific message."""

import json
import os
import shutil

import pytest
import torch

from engine.facts.errors import ModelSourceError, ParameterError
from engine.facts.events import RunFailed, RunFinished
from engine.facts.params import GenerationParams
from engine.model.models import load
from engine.run.faults import parse
from engine.run.session import Session


@pytest.fixture
def pickle_model(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    folder = tmp_path / "pickled"
    shutil.copytree(tiny_model_dir, folder)
    torch.save(load_file(str(folder / "model.safetensors")), folder / "pytorch_model.bin")
    (folder / "model.safetensors").unlink()
    return folder


def test_pickle_checkpoint_loads_tensors_only_and_warns(pickle_model):
    loaded = load(str(pickle_model), device="cpu")
    assert len(loaded.warnings) == 1 and "pickle" in loaded.warnings[0] and "weights_only=True" in loaded.warnings[0]
    assert loaded.loaded_event().warnings == loaded.warnings


def test_a_pickle_that_runs_code_is_refused(pickle_model, tmp_path):
    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    torch.save({"model.embed_tokens.weight": Payload()}, pickle_model / "pytorch_model.bin")
    with pytest.raises(ModelSourceError, match="pickle weights .* were refused: they hold something besides tensors, "
                                               "code that would run as they load") as info:
        load(str(pickle_model), device="cpu")
    assert not (tmp_path / "pwned").exists()
    assert "weights_only=False" not in str(info.value) and ".safetensors" in str(info.value)


def test_remote_code_is_refused_unless_allowed(tiny_model_dir, tmp_path):
    folder = tmp_path / "remote"
    folder.mkdir()
    config = json.loads((tiny_model_dir / "config.json").read_text())
    config.update(model_type="kvscope_custom", auto_map={"AutoConfig": "configuration_custom.CustomConfig",
                                                          "AutoModelForCausalLM": "modeling_custom.CustomModel"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_custom.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('x')\n")
    with pytest.raises(ModelSourceError, match="trust_remote_code.*unless you allow it"):
        load(str(folder), device="cpu")
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("phase, step", [("prefill", 0), ("decode", 2)])
def test_out_of_memory_at_prefill_or_decode(tiny, phase, step):
    session = Session(tiny, fault_hook=parse(f"{phase}:{step}:oom"))
    result = session.run("hello world", GenerationParams(max_new_tokens=8))
    assert isinstance(result, RunFailed) and result.error == "out_of_memory"
    assert result.summary.generated_tokens == (0 if phase == "prefill" else 2)
    session.fault_hook = None
    assert isinstance(session.run("hello world", GenerationParams(max_new_tokens=3)), RunFinished)


@pytest.mark.parametrize("kv_cache", [True, False])
def test_out_of_memory_advice_names_only_what_the_run_did_not_do(tiny, kv_cache):
    session = Session(tiny, fault_hook=parse("decode:2:oom"))
    result = session.run("hello world", GenerationParams(max_new_tokens=8, kv_cache=kv_cache))
    assert "Memory was released: try fewer tokens, a shorter prompt" in result.message
    assert ("the KV cache on" in result.message) is not kv_cache          # never "the cache on" while it was on
    assert ("kept as fp8 or quanto4" in result.message) is kv_cache
    assert "a smaller dtype (bfloat16)" in result.message                 # the tiny model runs in float32


def test_fault_specs_from_the_environment(monkeypatch, tiny):
    monkeypatch.setenv("KVSCOPE_FAULTS", "decode:1:error")
    result = Session(tiny).run("hello", GenerationParams(max_new_tokens=5))
    assert isinstance(result, RunFailed) and result.error == "RuntimeError" and "injected" in result.message
    assert parse("first:0:error") is not None                             # after the prefill's pass
    for bad in ("nonsense", "decode:x:oom", "middle:1:oom", "decode:1:explode"):
        with pytest.raises(ParameterError, match="KVSCOPE_FAULTS"):
            parse(bad)


def test_characters_outside_the_vocabulary_fall_back_to_bytes(tiny):
    """The tiny tokenizer never saw these characters: byte fallback keeps them, and the pieces still join
    into exactly the prompt, so the token view shows them as typed."""
    session = Session(tiny)
    events = []
    prompt = "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ☃ ∮ ᚠᛇᚻ"
    session.run(prompt, GenerationParams(max_new_tokens=2, chat_template=False), events.append)
    started = events[0]
    assert "".join(started.prompt_pieces) == prompt
    assert len(started.prompt_ids) > len(prompt)                # several byte tokens per character
    assert all("\ufffd" not in p for p in started.prompt_pieces)


def test_max_new_tokens_beyond_the_context_stops_at_the_context(tiny):
    result = Session(tiny).run("hello", GenerationParams(max_new_tokens=10_000))
    assert result.reason in ("context_full", "eos")
    assert result.summary.prompt_tokens + result.summary.generated_tokens <= tiny.facts.max_context


def test_long_prompt_error_says_by_how_much(tiny):
    from engine.facts.errors import PromptError

    with pytest.raises(PromptError) as info:
        Session(tiny).run("hello world " * 300, GenerationParams())
    message = str(info.value)
    assert "holds 256" in message and "shorten it by" in message


def test_a_conversion_cancelled_at_its_first_tensor_read_the_gguf_once_and_leaves_nothing_behind(tmp_path,
                                                                                                 monkeypatch):
    """By its first de-quantized tensor a conversion has read the tokenizer, the config and the weights' index,
    each of which transformers reads from the file's metadata; they share one read, and one tensor-name table."""
    import gguf as package

    from engine.model import embedded, gguf

    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    made: list[str] = []
    reader, name_map = package.GGUFReader, package.get_tensor_name_map

    def counted_reader(*args, **kwargs):
        made.append("reader")
        return reader(*args, **kwargs)

    def counted_name_map(*args, **kwargs):
        made.append("name map")
        return name_map(*args, **kwargs)

    monkeypatch.setattr(package, "GGUFReader", counted_reader)
    monkeypatch.setattr(package, "get_tensor_name_map", counted_name_map)
    said: list[str] = []

    def cancelled():                                          # the user presses Cancel at the first tensor
        return bool(said) and said[-1].startswith("De-quantizing tensor")

    with pytest.raises(ModelSourceError, match="Conversion cancelled"):
        gguf.ensure_converted(embedded.embedded_gguf(), progress=lambda p: said.append(p.message),
                              cancelled=cancelled)
    assert said[-1] == "De-quantizing tensor 0 of 272"
    assert made == ["reader", "name map"]
    assert package.GGUFReader is counted_reader and package.get_tensor_name_map is counted_name_map
    assert not gguf.is_converted(embedded.embedded_gguf())
    assert list((tmp_path / "converted").iterdir()) == []      # the staging folder went too


@pytest.fixture
def nan_model_dir(tiny_model_dir, tmp_path):
    """The tiny model with one NaN in its output projection: every next-token score is NaN."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "nan-model"
    shutil.copytree(tiny_model_dir, folder)
    weights = load_file(str(folder / "model.safetensors"))
    name = next(k for k in weights if k.endswith("embed_tokens.weight"))     # tied: the output projection too
    weights[name][:, 0] = float("nan")
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("params", [GenerationParams(max_new_tokens=4),
                                    GenerationParams(max_new_tokens=4, temperature=0.8, top_k=5, seed=1),
                                    GenerationParams(max_new_tokens=4, temperature=1.0, seed=1)],
                         ids=["greedy", "top-k", "plain sampling"])
def test_nan_logits_end_the_run_as_failed_with_what_was_measured_and_a_line_saying_why(nan_model_dir, params):
    events: list = []
    result = Session(load(str(nan_model_dir), device="cpu", dtype="float32")).run("hello", params, events.append)
    assert isinstance(result, RunFailed) and result.error == "non_finite_logits"
    assert "not numbers (NaN or infinity) at token 1" in result.message and "dtype (float32)" in result.message
    assert "try bfloat16" in result.message and "try float32" not in result.message   # never the dtype that failed
    assert result.summary.prompt_tokens > 0 and result.summary.prefill_ms > 0      # the prefill's numbers are kept


def test_the_cli_says_why_a_model_with_nan_logits_failed_and_exits_2(nan_model_dir, cache_root):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "engine", "--model", str(nan_model_dir), "--device", "cpu",
                        "--prompt", "hi", "--dtype", "float32"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root), "PYTHONWARNINGS": "ignore"})
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: The model's next-token scores were not numbers")
