"""The matrix-product kernel: every candidate gives ATen's greedy tokens, the per-machine choice is measured once
and cached per torch version and CPU, a faster kernel with other tokens is refused, a busy comparison is not
kept; where the CPU emulates the model's half float, a prefill's products run in float32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.facts.params import GenerationParams
from engine.model import hardware, kernels
from engine.run.session import Session
from engine.store import machine_cache


def fresh(tiny_model_dir, dtype: str):
    from engine.model.models import load

    return load(str(tiny_model_dir), device="cpu", dtype=dtype)


@pytest.fixture(autouse=True)
def cpu_with_half_float_units(monkeypatch):
    """The kernel choice alone: a CPU without bf16 units would also widen a bfloat16 model's prefill (the tests of
    that say which CPU they are on)."""
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16", "avx512_fp16"}))


KERNEL_FORMATS = [(k.name, d) for d in ("float32", "bfloat16") for k in kernels.candidates(getattr(torch, d))
                  if k.name != "aten"]              # what this CPU offers (oneDNN packs no bfloat16 without AVX-512)


@pytest.mark.parametrize(("kernel", "dtype"), KERNEL_FORMATS)
def test_each_packed_kernel_gives_atens_greedy_tokens(tiny_model_dir, monkeypatch, kernel, dtype):
    plain = fresh(tiny_model_dir, dtype)
    monkeypatch.setenv(kernels.ENV, kernel)
    packed = fresh(tiny_model_dir, dtype)
    layers = [m for m in packed.model.modules() if isinstance(m, kernels.PackedLinear)]
    assert layers and all(m.kernel.name == kernel for m in layers)
    assert not any(isinstance(m, kernels.PackedLinear) for m in plain.model.modules())
    params = GenerationParams(max_new_tokens=16)
    a = Session(plain).run("the cache keeps what attention read", params).summary.token_ids
    b = Session(packed).run("the cache keeps what attention read", params).summary.token_ids
    assert a == b and len(a) == 16
    assert f"eager products through {kernels.CANDIDATES[kernel].title}" in packed.dtype_reason   # not a compiled step's


def test_a_kernel_without_this_format_leaves_atens_and_says_so(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "mkl")
    loaded = fresh(tiny_model_dir, "bfloat16")
    assert not any(isinstance(m, kernels.PackedLinear) for m in loaded.model.modules())
    assert "eager products through ATen's linear (KVSCOPE_LINEAR=mkl: that kernel has nothing for this format here)" \
        in loaded.dtype_reason


@pytest.mark.parametrize("kernel", [k for k in kernels.KERNELS if k != "aten"])
def test_packed_layers_keep_their_weights_for_the_facts_and_multiply_a_step_through_the_packed_copy(
        tiny_model_dir, monkeypatch, kernel):
    monkeypatch.setenv(kernels.ENV, kernel)
    loaded = fresh(tiny_model_dir, "float32")
    packed = [m for m in loaded.model.modules() if isinstance(m, kernels.PackedLinear)]
    assert packed and all(isinstance(m.weight, torch.nn.Parameter) for m in packed)
    monkeypatch.setenv(kernels.ENV, "aten")
    assert loaded.facts.weight_bytes == fresh(tiny_model_dir, "float32").facts.weight_bytes
    layer = packed[0]
    x = torch.randn(2, 3, layer.in_features)                         # a prefill's shape: [batch, tokens, in]
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    torch.testing.assert_close(layer(x), expected)                    # the packed product, eagerly
    step = torch.randn(1, 1, layer.in_features)                      # a decode step's shape: one row
    step_expected = torch.nn.functional.linear(step, layer.weight, layer.bias)
    torch.testing.assert_close(layer(step), step_expected)
    layer.packed = layer.kernel.pack(torch.zeros_like(layer.weight))  # from here, only the weight gives it
    assert not torch.allclose(layer(step), step_expected)             # the step went through the packed copy


def test_a_packed_layer_beside_another_threads_export_multiplies_through_its_packed_copy(
        tiny_model_dir, monkeypatch, compile_skipped, tmp_path):
    """The window decodes eagerly while a package is exported beside it. Torch's export flag is one for the whole
    process, so a layer that read it sent the eager decode's products through the plain weight (ATen) for as
    long as the export traced; the layer now asks whether its own thread exports."""
    import threading

    from engine.model import compiled, kvcache, packaged

    monkeypatch.setenv(kernels.ENV, next(name for name, _dtype in KERNEL_FORMATS))
    loaded = fresh(tiny_model_dir, "float32")
    layer = next(m for m in loaded.model.modules() if isinstance(m, kernels.PackedLinear))
    zeros = torch.zeros_like(layer.weight)
    layer.packed = layer.kernel.pack(zeros)               # the packed copy and the weight now give different products
    tracing, traced = threading.Event(), threading.Event()

    def step(traced_model, token, position, cache):
        tracing.set()
        assert traced.wait(120)
        return compiled.decode_step(traced_model, token, position, cache)

    def export() -> None:
        with torch.inference_mode():
            cache = kvcache.new_cache(loaded.model, compiled.SHORTEST)
            token = torch.zeros((1, 1), dtype=torch.long)
            kvcache.forward(loaded.model, token, cache)
            packaged.build(step, (loaded.model, token, torch.ones((1, 1), dtype=torch.long), cache),
                           tmp_path / "step.so", tmp_path / "inductor")

    exporting = threading.Thread(target=export)
    exporting.start()
    try:
        assert tracing.wait(300)
        assert torch.compiler.is_exporting()                     # torch's flag is up in this thread as well
        x = torch.randn(1, 1, layer.in_features)
        beside = layer(x)
    finally:
        traced.set()
        exporting.join(300)
    torch.testing.assert_close(beside, torch.nn.functional.linear(x, zeros, layer.bias))   # the packed copy
    assert not torch.allclose(beside, torch.nn.functional.linear(x, layer.weight, layer.bias))
    assert (tmp_path / "step.so").exists()                        # the export itself went on and was packaged


@pytest.mark.parametrize("package", [True, False], ids=["package", "graph"])
@pytest.mark.parametrize("kernel", [k for k in kernels.KERNELS if k != "aten"])
def test_a_compiled_decode_multiplies_through_the_kernel_its_kind_packs_for_with_atens_float32_tokens(
        tiny_model_dir, monkeypatch, kernel, package):
    """A graph whose weights are inputs calls the kernel's own operator over the packed weights (not ATen's
    product it would trace otherwise); a package multiplies by the layers' weights, which inductor packs for
    kernels of its own, and never calls the eager kernel's operator. Both decode ATen's eager greedy tokens."""
    from torch.profiler import profile

    from engine.model import packaged

    if not package:
        monkeypatch.setattr(packaged, "MAX_BYTES", 0)
    params = GenerationParams(max_new_tokens=8, static_cache=True)
    plain = Session(fresh(tiny_model_dir, "float32")).run("hello world", params).summary.token_ids
    monkeypatch.setenv(kernels.ENV, kernel)
    session = Session(fresh(tiny_model_dir, "float32"))
    session.compiled_prefill = None           # the prefill package's products are not what is tested here
    result = session.run("hello world", params.with_(compiled=True)).summary
    assert result.token_ids == plain and result.compiled_from_step == 1
    [graph] = session.compiled.graphs()
    from engine.model import kvcache

    with torch.inference_mode():
        cache = kvcache.new_cache(session.model, graph.length)
        kvcache.forward(session.model, torch.tensor([[1, 2, 3]]), cache)
        with profile() as prof:
            session.compiled.run(graph, torch.tensor([[4]]), torch.tensor([[3]]), cache)
    calls = {e.key: e.count for e in prof.key_averages()}
    linears = sum(isinstance(m, kernels.PackedLinear) for m in session.model.modules())
    assert linears and calls.get(f"kvscope::{kernel}_linear", 0) == (0 if package else linears)


def test_the_choice_is_measured_once_and_again_under_another_torch(tiny_model_dir, monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "busy", lambda share: False)
    measured = []
    real = kernels._step_ms
    monkeypatch.setattr(kernels, "_step_ms", lambda linears, offered: measured.append(1) or real(linears, offered))
    first = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    second = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 1 and not first.cached and second.cached and second.kernel == first.kernel
    offered = {k.name for k in kernels.candidates(torch.float32)}
    assert set(first.step_ms) == offered and len(offered) > 1 and all(v > 0 for v in first.step_ms.values())
    assert first.reached_bytes_per_s()[first.kernel] == pytest.approx(
        first.weight_bytes / first.step_ms[first.kernel] * 1000.0)
    another = kernels.choose(fresh_model(tiny_model_dir), "another cpu")
    assert len(measured) == 2 and not another.cached
    monkeypatch.setattr(torch, "__version__", "9.9.9")
    third = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 3 and not third.cached


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
    monkeypatch.setattr(kernels, "_step_ms", lambda linears, offered: {"aten": 2.0, "onednn": 1.0, "mkl": 1.5})
    answers = iter([[1, 2, 3], [1, 2, 4], [1, 2, 3]])                 # ATen's, oneDNN's, MKL's
    monkeypatch.setattr(kernels, "_probe", lambda model: next(answers))
    model = fresh_model(tiny_model_dir)
    choice = kernels.choose(model, "this cpu")
    assert choice.kernel == "mkl"                                     # the fastest whose tokens are ATen's
    assert choice.reason == ("oneDNN with prepacked weights was faster but gave other greedy tokens than ATen's: "
                             "not used")
    assert {m.kernel.name for m in model.modules() if isinstance(m, kernels.PackedLinear)} == {"mkl"}
    answers = iter([[1, 2, 3], [1, 2, 4], [1, 2, 5]])
    machine_cache.forget(kernels.CACHE)
    model = fresh_model(tiny_model_dir)
    assert kernels.choose(model, "this cpu").kernel == "aten"
    assert not any(isinstance(m, kernels.PackedLinear) for m in model.modules())


def test_a_comparison_made_on_a_busy_machine_is_kept_marked_and_measured_again_only_when_quiet(tiny_model_dir,
                                                                                                  monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "busy", lambda share: True)
    measured = []
    real = kernels._step_ms
    monkeypatch.setattr(kernels, "_step_ms", lambda linears, offered: measured.append(1) or real(linears, offered))
    choice = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert choice.busy and choice.step_ms and "while it was busy" in choice.words()
    monkeypatch.setattr(kernels, "quiet", lambda weight: False)       # still busy: the kept one, no minutes lost
    again = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 1 and again.cached and again.busy and again.kernel == choice.kernel
    monkeypatch.setattr(kernels, "quiet", lambda weight: True)        # quiet now: measured again, kept unmarked
    monkeypatch.setattr(kernels, "busy", lambda share: False)
    quiet = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert len(measured) == 2 and not quiet.cached and not quiet.busy
    assert kernels.choose(fresh_model(tiny_model_dir), "this cpu").cached and len(measured) == 2


def test_a_kept_choice_that_is_not_one_is_measured_again_and_an_unknown_kernel_name_is_said(tiny_model_dir,
                                                                                             monkeypatch):
    monkeypatch.setenv(kernels.ENV, "auto")
    machine_cache.forget(kernels.CACHE)
    monkeypatch.setattr(kernels, "busy", lambda share: False)
    kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    table = machine_cache._table(kernels.CACHE)
    key = next(iter(table))
    table[key]["step_ms"] = {name: "fast" for name in table[key]["step_ms"]}     # sealed, but not numbers
    machine_cache.remember(kernels.CACHE, key, table[key])
    choice = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert not choice.cached and all(isinstance(v, float) for v in choice.step_ms.values())
    monkeypatch.setenv(kernels.ENV, "fastest")
    said = kernels.choose(fresh_model(tiny_model_dir), "this cpu")
    assert "KVSCOPE_LINEAR=fastest is not one of aten, onednn, mkl or auto: chosen as auto" in said.words()


def _counting(layer: kernels.PackedLinear) -> list[int]:
    """The rows of every call that went through the layer's own kernel."""
    rows: list[int] = []
    product = layer.kernel.product
    layer.kernel = dataclasses.replace(layer.kernel,
                                       product=lambda x, *rest: rows.append(x.shape[-2]) or product(x, *rest))
    return rows


@pytest.mark.parametrize(("dtype", "units"), [("bfloat16", "avx512_bf16"), ("float16", "avx512_fp16")])
def test_without_units_for_its_float_a_prefills_products_run_in_float32_and_a_steps_through_its_kernel(
        tiny_model_dir, monkeypatch, dtype, units):
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
    loaded = fresh(tiny_model_dir, dtype)
    assert not any(type(m) is torch.nn.Linear for m in loaded.model.modules())
    layers = [m for m in loaded.model.modules() if isinstance(m, kernels.PackedLinear)]
    assert layers and all(m.wide == torch.float32 and m.kernel.name == "aten" for m in layers)
    assert (f"a prefill's products ({kernels.WIDE_ROWS} rows or more) in float32 over the weights widened per call: "
            f"this CPU has no {dtype} units") in loaded.dtype_reason
    layer = layers[0]
    rows = _counting(layer)
    many = torch.randn(2, kernels.WIDE_ROWS // 2, layer.in_features, dtype=getattr(torch, dtype))
    out = layer(many)
    bias = None if layer.bias is None else layer.bias.float()
    assert out.dtype == many.dtype and rows == []
    assert torch.equal(out, torch.nn.functional.linear(many.float(), layer.weight.float(), bias).to(many.dtype))
    layer(many[:1, :1])                                               # a decode step: one row
    layer(many[:1, :-1])                                              # one row short of widening
    assert rows == [1, kernels.WIDE_ROWS // 2 - 1]
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2", units}))
    native = fresh(tiny_model_dir, dtype)
    assert not any(isinstance(m, kernels.PackedLinear) for m in native.model.modules())
    assert "widened" not in native.dtype_reason


def test_a_float32_model_and_an_int8_one_are_not_widened_on_a_cpu_without_bf16_units(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2"}))
    for dtype in ("float32", "int8"):
        loaded = fresh(tiny_model_dir, dtype)
        assert not any(isinstance(m, kernels.PackedLinear) for m in loaded.model.modules())
        assert "widened" not in loaded.dtype_reason


def test_a_widened_models_run_gives_its_tokens_and_its_export_multiplies_by_the_plain_weights(
        tiny_model_dir, monkeypatch):
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2"}))
    loaded = fresh(tiny_model_dir, "bfloat16")
    layer = next(m for m in loaded.model.modules() if isinstance(m, kernels.PackedLinear))
    rows = _counting(layer)
    prompt = " ".join(["the cache keeps what attention read"] * 8)       # more tokens than WIDE_ROWS
    result = Session(loaded).run(prompt, GenerationParams(max_new_tokens=6, chat_template=False)).summary
    assert len(result.token_ids) == 6 and result.prompt_tokens >= kernels.WIDE_ROWS
    assert rows == [1] * 5                                            # the prefill widened; every step did not
    x = torch.randn(1, kernels.WIDE_ROWS, layer.in_features, dtype=torch.bfloat16)
    with kernels.exporting():                                         # what a package traces: the layer's own float
        traced = layer(x)
    assert rows == [1] * 5
    assert torch.equal(traced, torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_unknown_kernel_name_is_said_in_the_models_reason_whatever_is_chosen(tiny_model_dir, monkeypatch, dtype):
    """``KVSCOPE_LINEAR=onednnn`` (a typo) was taken as auto, silently where no other kernel could be used."""
    monkeypatch.setenv(kernels.ENV, "onednnn")
    loaded = fresh(tiny_model_dir, dtype)
    assert "KVSCOPE_LINEAR=onednnn is not one of aten, onednn, mkl or auto: chosen as auto" in loaded.dtype_reason
