"""The KV compression lab on the tiny model: every cache's bytes are its tensors' bytes, the reference against
itself and an eviction that never evicts agree exactly, fp8 keeps the greedy tokens, eviction keeps what it
says it keeps, a missing backend and a model with sliding layers are refused in words."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from engine.facts import kv_methods, kvformula
from engine.facts.errors import ParameterError
from engine.lessons import kv_compression
from engine.lessons.kv_compression import CompressionSettings
from engine.model import kv_compress
from engine.run.session import Session
from tests.lessons import collect

PROMPT = " ".join(["The cache keeps what attention has already read."] * 3)


@pytest.fixture(scope="module")
def lab(tiny):
    _, finished = collect("kv-compression", tiny, prompt=PROMPT, new_tokens=12,
                          methods=("full", "fp8", "sinks:4+20", "h2o:24", "sinks:4+1000"))
    return finished.result, Session(tiny).facts


def by_name(result, name):
    return next(m for m in result.methods if m.name == name)


def test_each_cache_holds_the_bytes_its_tensors_hold(lab):
    result, facts = lab
    positions = result.prompt_tokens + result.steps
    full = kvformula.predicted_kv_bytes(facts, positions)
    assert by_name(result, "full").bytes == full
    # fp8: one byte per element (the tiny model computes in float32: four) and a float32 scale per tensor
    assert by_name(result, "fp8").bytes == full // 4 + 2 * 4 * facts.num_layers
    assert by_name(result, "sinks:4+20").bytes == kvformula.predicted_kv_bytes(facts, 24)
    assert by_name(result, "h2o:24").bytes == kvformula.predicted_kv_bytes(facts, 24)
    assert by_name(result, "sinks:4+20").ratio == pytest.approx(full / kvformula.predicted_kv_bytes(facts, 24))


def test_the_reference_and_an_eviction_that_never_evicts_agree_with_it_exactly(lab):
    result, _ = lab
    for name in ("full", "sinks:4+1000"):
        m = by_name(result, name)
        assert m.kl_mean == 0.0 and m.kl_max == 0.0 and m.agreement == 1.0 and m.departure is None, m


def test_fp8_moves_the_next_token_distribution_by_a_small_but_real_amount(lab):
    """(A random tiny model's distribution is nearly flat, so its top token flips on a hair: the KL, not the
    top token, is what fp8 is checked by here; the real model's agreement is measured in README.)"""
    result, _ = lab
    fp8 = by_name(result, "fp8")
    assert 0 < fp8.kl_mean <= fp8.kl_max < 1e-3 and fp8.ratio == pytest.approx(4, rel=0.01)


def test_eviction_keeps_the_sinks_and_the_recent_window_and_drops_the_rest(lab):
    result, _ = lab
    streaming = by_name(result, "sinks:4+20")
    kept = [i for i, share in enumerate(streaming.full_share) if share == 1.0]
    end = result.prompt_tokens + result.steps
    assert kept == [0, 1, 2, 3, *range(end - 20, end)]
    assert streaming.kl_mean > 0


def test_h2o_keeps_the_positions_that_received_the_most_attention(tiny):
    facts = Session(tiny).facts
    method = kv_methods.parse_method("h2o:12")
    evictor = kv_compress.Evictor(method, facts.num_layers)
    cache = kv_compress.new_cache(tiny.model, method)
    ids = torch.arange(5, 25)[None]
    with torch.inference_mode():
        tiny.model(input_ids=ids, past_key_values=cache, use_cache=True)
    heads = tiny.model.config.num_attention_heads
    attention = torch.zeros(heads, 20)
    attention[:, [7, 9, 11]] = 1.0                     # three positions in the middle drew all the attention
    evictor.after_pass(cache, 20, {i: attention for i in range(facts.num_layers)})
    assert method.sinks + method.heavy + method.recent == 12
    for kept, layer in zip(evictor.kept, cache.layers):
        assert layer.keys.shape[2] == 12 and kept[:4] == [0, 1, 2, 3]
        assert {7, 9, 11} <= set(kept[4:4 + method.heavy])
        assert kept[-method.recent:] == list(range(20 - method.recent, 20))


def test_the_hadamard_rotation_is_built_where_the_keys_are():
    """Built on the CPU, it could not multiply a GPU's keys (the compression lesson crashed on every CUDA run). The
    meta device stands in for a GPU: a tensor on it is nowhere the CPU's are."""
    keys = torch.empty(3, 10, 64, device="meta")
    rotation = kv_compress.hadamard(64, keys.device)
    assert rotation.device == keys.device and (keys.float() @ rotation).shape == (3, 10, 64)
    on_cpu = kv_compress.hadamard(4)
    assert torch.allclose(on_cpu @ on_cpu.T, torch.eye(4))                # orthonormal, as before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="H2O's scores from a GPU's attention need a GPU")
def test_h2o_sums_a_gpus_attention_rows_into_its_scores(tiny):
    """A GPU's attention row was added into scores kept on the CPU: a device mismatch at the first pass."""
    method = kv_methods.parse_method("h2o:12")
    facts = Session(tiny).facts
    evictor = kv_compress.Evictor(method, facts.num_layers)
    cache = kv_compress.new_cache(tiny.model, method)
    with torch.inference_mode():
        tiny.model(input_ids=torch.arange(5, 25)[None], past_key_values=cache, use_cache=True)
    attention = torch.zeros(tiny.model.config.num_attention_heads, 20, device="cuda")
    attention[:, [7, 9, 11]] = 1.0
    evictor.after_pass(cache, 20, {i: attention for i in range(facts.num_layers)})
    assert all({7, 9, 11} <= set(kept) for kept in evictor.kept)


def test_methods_are_named_or_refused_in_words():
    assert kv_methods.parse_method("sinks:4+60").budget == 64
    assert kv_methods.parse_method("h2o:64").words == "H2O: 64 (4 sinks, 30 most attended, 30 recent)"
    for bad in ("sinks:4", "h2o:3", "int3", "sinks:4,0", "sinks:4+0"):
        with pytest.raises(ParameterError, match="Unknown KV cache method"):
            kv_methods.parse_method(bad)
    with pytest.raises(ParameterError, match="Unknown KV cache method 'zip'"):
        CompressionSettings(methods=("full", "zip"))


def test_a_backend_that_is_not_installed_is_skipped_and_said(tiny, monkeypatch):
    real = kv_methods.importlib.util.find_spec
    monkeypatch.setattr(kv_methods.importlib.util, "find_spec",
                        lambda name: None if name in ("optimum", "hqq") else real(name))
    _, finished = collect("kv-compression", tiny, prompt=PROMPT, new_tokens=3, methods=("full", "quanto4", "hqq4"))
    r = finished.result
    assert [m.name for m in r.methods] == ["full"] and not r.incomplete
    assert r.skipped == ("quanto4 needs the optimum package (pip install optimum-quanto hqq)",
                         "hqq4 needs the hqq package (pip install optimum-quanto hqq)")


@pytest.mark.parametrize("name", ["quanto4", "quanto2", "hqq4"])
def test_group_wise_backends_count_packed_bytes_and_scales_with_the_full_precision_residual(tiny, name):
    method = kv_methods.parse_method(name)
    if kv_methods.available(method):
        pytest.skip(kv_methods.available(method))
    facts = Session(tiny).facts
    cache = kv_compress.new_cache(tiny.model, method)
    with torch.inference_mode():
        tiny.model(input_ids=torch.arange(5, 69)[None], past_key_values=cache, use_cache=True)   # quantized
        for t in range(3):                                                                      # residual
            tiny.model(input_ids=torch.tensor([[7 + t]]), past_key_values=cache, use_cache=True)
    full, packed = zip(*(kv_compress.layer_bytes(layer) for layer in cache.layers))
    assert sum(full) == kvformula.predicted_kv_bytes(facts, 3)              # the residual, in float32
    bits = dict(method.options)["nbits"]
    data = kvformula.predicted_kv_bytes(facts, 64) * bits // 32             # the packed data alone
    assert data < sum(packed) < data * 2                                    # plus its scales and zeros
    assert kv_compress.held_bytes(cache) == sum(full) + sum(packed)


def test_a_model_with_sliding_layers_is_refused_in_one_line():
    config = SimpleNamespace(layer_types=["sliding_attention", "full_attention"])
    model = SimpleNamespace(config=SimpleNamespace(get_text_config=lambda decoder: config))
    facts = SimpleNamespace(name="Gemma-ish", kv_layers=[SimpleNamespace(kind="sliding"), SimpleNamespace(kind="full")],
                            num_layers=2, max_context=512)
    target = SimpleNamespace(facts=facts, model=model, encode=lambda text, **k: [1, 2])
    with pytest.raises(ParameterError) as refused:
        kv_compression.check(target, CompressionSettings(new_tokens=4))
    message = str(refused.value)
    assert "\n" not in message and "sliding_attention layers" in message and "full attention" in message


def test_sweep_kv_compression_prints_its_table(tiny_model_dir, cache_root):
    r = subprocess.run([sys.executable, "-m", "engine", "sweep", "kv-compression", "--model", str(tiny_model_dir),
                        "--methods", "full,fp8,sinks:4+8", "--tokens", "4", "--prompt", PROMPT], capture_output=True,
                       text=True, timeout=300, env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)})
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line.split("|")[0].strip() for line in r.stdout.splitlines() if "|" in line][1:]     # after the head
    assert rows == ["full precision (the reference)", "fp8 (per tensor)", "StreamingLLM: 4 sinks + 8 recent"]


# --- a run with its cache kept smaller (GenerationParams.kv_method, the CLI's --kv-cache) -------------------------

def test_a_run_with_its_cache_in_fp8_holds_the_packed_bytes_for_every_position_it_was_fed(tiny):
    from engine.facts.events import KVNorms, TokenStep
    from engine.facts.params import GenerationParams
    from engine.run.session import Session

    session = Session(tiny)
    events: list = []
    result = session.run("the cache keeps what attention read", GenerationParams(max_new_tokens=6, kv_method="fp8"),
                         events.append)
    plain = Session(tiny).run("the cache keeps what attention read", GenerationParams(max_new_tokens=6))
    steps = [e for e in events if isinstance(e, TokenStep)]
    per_token = kvformula.bytes_per_token(tiny.facts)
    last = steps[-1]
    fed = result.summary.kv_tokens
    assert all(p == fed for p in last.kv_positions_per_layer)            # every position held, quantized
    held = sum(map(sum, last.kv_bytes_per_layer))
    assert held == result.summary.kv_bytes and 0 < held < per_token * fed      # smaller than full precision
    assert not any(isinstance(e, KVNorms) for e in events)                # no norms read from packed keys
    assert len(result.summary.token_ids) == len(plain.summary.token_ids) == 6


def test_a_run_kept_to_sinks_and_a_window_never_holds_more_than_its_budget(tiny):
    from engine.facts.events import TokenStep
    from engine.facts.params import GenerationParams
    from engine.run.session import Session

    events: list = []
    result = Session(tiny).run("one two three four five six seven eight nine ten eleven twelve",
                               GenerationParams(max_new_tokens=8, kv_method="sinks:2+6", chat_template=False),
                               events.append)
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert max(max(s.kv_positions_per_layer) for s in steps) == 8
    assert result.summary.kv_bytes == 8 * kvformula.bytes_per_token(tiny.facts)
    assert result.summary.generated_tokens == 8 and result.summary.kv_tokens > 8


@pytest.mark.parametrize("changes, words", [
    ({"kv_method": "h2o:64"}, "a run does not record"),
    ({"kv_method": "fp8", "static_cache": True}, "a dynamic one"),
    ({"kv_method": "fp8", "kv_cache": False}, "a dynamic one"),
    ({"kv_method": "zip"}, "Unknown KV cache method"),
])
def test_a_run_refuses_a_cache_it_cannot_keep_in_one_line(changes, words):
    from engine.facts.errors import ParameterError
    from engine.facts.params import GenerationParams

    with pytest.raises(ParameterError, match=words):
        GenerationParams(**changes)


def test_the_cli_runs_with_its_cache_kept_as_fp8_and_says_its_share_of_the_formula(tiny_model_dir):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "engine", "--model", str(tiny_model_dir), "--device", "cpu",
                        "--prompt", "hello there", "--max-new-tokens", "4", "--kv-cache", "FP8"],
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr
    assert "kept as fp8:" in r.stdout and "of the formula's" in r.stdout and "but the formula says" not in r.stdout


def test_a_quanto_build_left_locked_or_no_compiler_is_said_in_one_line_and_the_other_caches_still_run(
        tiny, monkeypatch, tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").write_text("")                          # what a build killed part-way leaves behind
    monkeypatch.setattr(kv_methods, "quanto_build_folder", lambda: build)
    said = kv_methods.available(kv_methods.parse_method("quanto4"))
    assert str(build / "lock") in said and "delete that file" in said and "\n" not in said
    _events, finished = collect("kv-compression", tiny, prompt=" ".join(["The cache keeps what it read."] * 3),
                                new_tokens=4, methods=("full", "quanto4", "fp8"))
    r = finished.result
    assert [m.name for m in r.methods] == ["full", "fp8"] and r.skipped == (said,)
    (build / "lock").unlink()
    monkeypatch.setattr(kv_methods.shutil, "which", lambda _name: None)
    assert "has no C++ compiler" in kv_methods.available(kv_methods.parse_method("quanto2"))
    (build / "pytorch_version.txt").write_text(__import__("torch").__version__)
    (build / "quanto_cpp.so").write_bytes(b"")                # built already: no compiler needed
    assert kv_methods.available(kv_methods.parse_method("quanto2")) is None
