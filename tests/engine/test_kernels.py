"""The matrix-product kernel: oneDNN's packed linear gives ATen's greedy tokens, the per-machine choice is measured
once and cached per torch version, a faster kernel with other tokens is refused, a busy comparison is not kept."""

from __future__ import annotations

import pytest
import torch

from engine import kernels, machine_cache
from engine.params import GenerationParams
from engine.session import Session


def fresh(tiny_model_dir, dtype: str):
    from engine.models import load

    return load(str(tiny_model_dir), device="cpu", dtype=dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_packed_onednn_products_give_atens_greedy_tokens(tiny_model_dir, monkeypatch, dtype):
    plain = fresh(tiny_model_dir, dtype)
    monkeypatch.setenv(kernels.ENV, "onednn")
    packed = fresh(tiny_model_dir, dtype)
    assert any(isinstance(m, kernels.PackedLinear) for m in packed.model.modules())
    assert not any(isinstance(m, kernels.PackedLinear) for m in plain.model.modules())
    params = GenerationParams(max_new_tokens=16)
    a = Session(plain).run("the cache keeps what attention read", params).summary.token_ids
    b = Session(packed).run("the cache keeps what attention read", params).summary.token_ids
    assert a == b and len(a) == 16
    assert "oneDNN" in packed.dtype_reason


def test_packed_layers_keep_their_weights_for_the_facts_and_a_compiled_graph(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "onednn")
    loaded = fresh(tiny_model_dir, "float32")
    packed = [m for m in loaded.model.modules() if isinstance(m, kernels.PackedLinear)]
    assert packed and all(isinstance(m.weight, torch.nn.Parameter) for m in packed)
    monkeypatch.setenv(kernels.ENV, "aten")
    assert loaded.facts.weight_bytes == fresh(tiny_model_dir, "float32").facts.weight_bytes
    layer = packed[0]
    x = torch.randn(2, 3, layer.in_features)                         # a prefill's shape: [batch, tokens, in]
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected)                    # the packed product, eagerly
    layer.packed.zero_()                                              # from here, only the weight gives it
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert torch.equal(layer(x), expected)                            # what a compiled graph traces
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    assert not torch.allclose(layer(x), expected)


def test_the_choice_is_measured_once_and_again_under_another_torch(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "busy", lambda share: False)
    measured = []
    real = kernels._step_ms
    monkeypatch.setattr(kernels, "_step_ms", lambda linears: measured.append(1) or real(linears))
    first = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    second = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 1 and not first.cached and second.cached and second.kernel == first.kernel
    assert set(first.step_ms) == set(kernels.KERNELS) and all(v > 0 for v in first.step_ms.values())
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    third = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 2 and not third.cached


def fresh_model(tiny_model_dir):
    import os

    saved = os.environ[kernels.ENV]
    os.environ[kernels.ENV] = "aten"                 # load plain; the test chooses
    try:
        return fresh(tiny_model_dir, "float32").model
    finally:
        os.environ[kernels.ENV] = saved


def test_a_faster_kernel_whose_tokens_differ_is_refused_and_the_layers_put_back(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "_step_ms", lambda linears: {"aten": 2.0, "onednn": 1.0})
    answers = iter([[1, 2, 3], [1, 2, 4]])
    monkeypatch.setattr(kernels, "_probe", lambda model: next(answers))
    model = fresh_model(tiny_model_dir)
    choice = kernels.choose(model, "this cpu")
    assert choice.kernel == "aten" and "differed" in choice.reason
    assert not any(isinstance(m, kernels.PackedLinear) for m in model.modules())


def test_a_comparison_made_on_a_busy_machine_is_used_but_not_kept(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "busy", lambda share: True)
    choice = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert choice.kernel in kernels.KERNELS and choice.step_ms               # used for this load
    assert machine_cache._table(kernels.CACHE) == {}                         # and not kept for the next
