"""Weight formats: int8 and int4 weights through torch's own kernels, the bytes a decode step reads taken from
the weights as stored, ``auto`` picking the fastest float by measurement, and the format sweep."""

from __future__ import annotations

import json

import pytest
import torch

from engine.facts.costmodel import ModelCost
from engine.facts.events import HardwarePeaks
from engine.facts.params import GenerationParams
from engine.model import calibrate, kernels, quantize
from engine.model.models import load
from engine.run.session import Session
from tests.lessons import collect


@pytest.mark.parametrize("act", ["float32", "bfloat16"])
@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_load_and_generate_on_the_tiny_model(tiny_model_dir, monkeypatch, fmt, act):
    """The activations' float stated, not measured (the calibration's choice varies by machine), on a CPU without
    bf16 units: a layer kept in float is then widened for a prefill's rows when that float is bfloat16."""
    from engine.model import hardware

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2"}))
    monkeypatch.setattr(calibrate, "calibrate", lambda *_a, weights="", **_k: calibrate.Calibration(
        act, [calibrate.Timing(act, 1.0, 1.0)], False, weights=weights))
    fp32 = load(str(tiny_model_dir), "cpu", "float32")
    loaded = load(str(tiny_model_dir), "cpu", fmt)
    assert loaded.facts.dtype == act
    layers = [m for m in loaded.model.modules() if isinstance(m, (quantize.Int8Linear, quantize.Int4Linear))]
    kept = [m for m in loaded.model.modules() if isinstance(m, (torch.nn.Linear, kernels.PackedLinear))]
    linears = [m for m in fp32.model.modules() if isinstance(m, torch.nn.Linear)]
    assert len(layers) + len(kept) == len(linears) and len(layers) >= len(linears) - 1
    if fmt == "int4":       # the 457-token output projection: the int4 kernel takes multiples of 16 outputs
        assert [m.out_features for m in kept] == [loaded.facts.vocab_size]
        widened = [getattr(m, "wide", None) for m in kept]
        assert widened == [torch.float32 if act == "bfloat16" else None]
    assert loaded.facts.weights.startswith(f"{fmt} weights ({len(layers)} linear layers")
    assert loaded.facts.weight_format == fmt                     # named apart from the activations' dtype
    assert loaded.facts.num_params == fp32.facts.num_params
    result = Session(loaded).run("hello world", GenerationParams(max_new_tokens=6))
    assert result.summary.generated_tokens == 6


def test_bytes_per_token_come_from_the_weights_as_stored(tiny_model_dir):
    fp32 = load(str(tiny_model_dir), "cpu", "float32")
    int8 = load(str(tiny_model_dir), "cpu", "int8")
    linear = sum(m.weight.nbytes for m in fp32.model.modules() if isinstance(m, torch.nn.Linear))
    stored = sum(m.weight_int8.nbytes + m.scales.nbytes for m in int8.model.modules()
                 if isinstance(m, quantize.Int8Linear))
    assert stored < linear / 3                                     # int8 plus scales against float32
    assert fp32.facts.weight_bytes - int8.facts.weight_bytes == pytest.approx(
        linear - stored + _float_rest(fp32) - _float_rest(int8), abs=1)
    assert ModelCost(int8.facts).decode(10).bytes < ModelCost(fp32.facts).decode(10).bytes / 2


def _float_rest(loaded) -> int:
    """Bytes outside the linear layers (norms, and the embedding table when an untied head reads it)."""
    quantized = (quantize.Int8Linear, quantize.Int4Linear, torch.nn.Linear)
    linear = sum(sum(t.nbytes for t in m.buffers()) + sum(t.nbytes for t in m.parameters())
                 for m in loaded.model.modules() if isinstance(m, quantized))
    return loaded.facts.weight_bytes - linear


def test_int8_matches_float_within_quantization_error():
    layer = torch.nn.Linear(64, 48)
    x = torch.randn(3, 64)
    q = quantize.Int8Linear(layer, torch.float32)
    assert torch.allclose(q(x), layer(x), atol=0.05, rtol=0.05)
    q4 = quantize.Int4Linear(layer, torch.float32)
    assert (q4(x) - layer(x)).abs().max() < 0.25 * layer(x).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_int8_layer_computes_a_prefills_rows_as_its_int8_kernel_does_a_steps(dtype):
    """Many rows go through the float GEMM over the widened codes, a few through torch's int8 kernel: the same
    product either way, row for row."""
    layer = quantize.Int8Linear(torch.nn.Linear(64, 48), dtype)
    x = torch.randn(2, quantize.PREFILL_ROWS, 64, dtype=dtype)                  # a prefill: the float GEMM
    wide = layer(x)
    one_row = torch.cat([layer(x[b, t].reshape(1, 1, 64)) for b in range(2)        # a step: the int8 kernel
                         for t in range(quantize.PREFILL_ROWS)]).reshape(wide.shape)
    tolerance = {"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 0.05, "rtol": 0.02}
    torch.testing.assert_close(wide, one_row, **tolerance)
    layer.weight_int8.zero_()                                      # both paths read the same codes
    assert layer(x).abs().max() == layer.bias.abs().max() and layer(x[:1, :1]).abs().max() == layer.bias.abs().max()


def test_auto_never_picks_a_dtype_slower_than_float32_in_its_own_calibration():
    found = calibrate.measure(torch.device("cpu"), 128, 256)
    best, base = found.timing(found.best), found.timing("float32")
    assert base is not None and best.run_ms <= base.run_ms
    assert found.reason().startswith(found.best)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_quantized_weights_take_the_activations_their_own_kernel_ran_fastest_with(fmt, monkeypatch, tmp_path):
    """The float a quantized model computes in is timed through its own kernel, not through float matmuls: on one
    machine float matmuls favoured float32 while the int8 kernel ran 7x faster with bfloat16 activations."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "busy", lambda _share: False)     # quiet, as the test says: not the machine's
    found = calibrate.calibrate(torch.device("cpu"), 128, 256, weights=fmt)
    fastest = min(found.timings, key=lambda t: t.run_ms)
    assert found.best in ("float32", fastest.dtype) and found.timing("float32") is not None
    assert found.timing(found.best).run_ms <= found.timing("float32").run_ms or found.by_rule
    assert f"activations for {fmt} weights" in found.reason()
    floats = calibrate.calibrate(torch.device("cpu"), 128, 256)
    assert not floats.cached and "activations" not in floats.reason()      # kept apart from the float choice
    assert calibrate.calibrate(torch.device("cpu"), 128, 256, weights=fmt).cached


@pytest.mark.parametrize(("flags", "prefill_in"), [({"avx2"}, torch.float32),
                                                  ({"avx2", "avx512_bf16"}, torch.bfloat16)])
def test_the_calibration_times_bfloat16_as_a_model_computes_it_with_or_without_bf16_units(
        monkeypatch, flags, prefill_in):
    """Without bf16 units a bfloat16 model's prefill runs in float32 over widened weights: the calibration times
    that, not torch's emulated GEMM (which charged bfloat16 a prefill no model runs); its decode stays bfloat16."""
    from engine.model import hardware

    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset(flags))
    computed_in: dict[int, set[torch.dtype]] = {}
    linear = torch.nn.functional.linear

    def recording(x, w, b=None):
        computed_in.setdefault(x.shape[0], set()).add(w.dtype)
        assert x.dtype == w.dtype
        return linear(x, w, b)

    monkeypatch.setattr(torch.nn.functional, "linear", recording)
    layer = calibrate._layer(64, 128, torch.bfloat16, torch.device("cpu"), kernels.CANDIDATES["aten"])
    calibrate._time_ms([layer], calibrate.PREFILL_TOKENS, torch.device("cpu"), 1, torch.bfloat16)
    calibrate._time_ms([layer], 1, torch.device("cpu"), 1, torch.bfloat16)
    assert computed_in == {calibrate.PREFILL_TOKENS: {prefill_in}, 1: {torch.bfloat16}}


@pytest.mark.parametrize("layers", [None, 3])
def test_the_calibration_reads_distinct_weights_filling_its_sample_or_the_models_layers(monkeypatch, layers):
    """Decode reads each weight once a step: one layer timed again and again would time the CPU's cache. A model
    with fewer layers than the sample holds is timed over as many as it has (it decodes from the cache)."""
    monkeypatch.setattr(calibrate, "SAMPLE_BYTES", 1 << 20)
    timed = calibrate._time_ms
    read: dict[torch.dtype, set[int]] = {}

    def recording(layers, tokens, device, repeats, act):
        read.setdefault(act, set()).update(m.weight.data_ptr() for layer in layers for m in layer)
        return timed(layers, tokens, device, repeats, act)

    monkeypatch.setattr(calibrate, "_time_ms", recording)
    found = calibrate.measure(torch.device("cpu"), 64, 128, layers=layers)
    assert {t.dtype for t in found.timings} == {"float32", "bfloat16"} == {str(d)[6:] for d in read}
    per_layer_fp32 = 4 * (4 * 64 * 64 + 3 * 64 * 128)
    for weights in read.values():
        if layers is None:
            assert len(weights) == 7 * calibrate.copies(64, 128) and len(weights) * per_layer_fp32 / 7 >= 1 << 20
        else:
            assert len(weights) == 7 * layers


@pytest.mark.parametrize("linear", ["auto", "aten"])
def test_the_calibration_times_each_float_through_the_kernel_its_decode_would_take(monkeypatch, linear):
    """As ``kernels.choose`` does: the fastest decode among the kernels offered for the float (only the one
    ``KVSCOPE_LINEAR`` names, when it names one), its prefill timed through the same kernel."""
    monkeypatch.setenv("KVSCOPE_LINEAR", linear)
    here = kernels.offered(torch.float32)
    assert [k.name for k in here] == (["aten"] if linear == "aten" else [k.name for k in kernels.candidates(
        torch.float32)])
    said = {k.name: (10.0 + i, 3.0 - i) for i, k in enumerate(here)}     # the last offered decodes fastest
    timed: list[tuple[str, str]] = []

    def stated(layers, tokens, device, repeats, act):
        name = layers[0][0].kernel.name
        timed.append((str(act)[6:], name))
        return said[name][0] if tokens > 1 else said[name][1]

    monkeypatch.setattr(calibrate, "_time_ms", stated)
    # Two layers: oneDNN and MKL packing the sample's 820 copies of so small a layer kept 1.5 GB in the process
    found = calibrate.measure(torch.device("cpu"), 64, 128, layers=2)
    assert found.timing("float32") == calibrate.Timing("float32", *said[here[-1].name])
    assert sorted({name for dtype, name in timed if dtype == "float32"}) == sorted(said)


def test_the_measuring_line_appears_only_when_a_calibration_is_measured(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "busy", lambda _share: False)     # a quiet machine's: not this one's load
    said: list[str] = []
    first = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    again = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    assert said == ["measuring"] and not first.cached and again.cached and again.best == first.best


def test_a_busy_measurement_is_not_used_and_is_measured_again_only_at_a_quiet_launch(monkeypatch, tmp_path):
    """On a busy machine the timings say little: the stated rule (native bf16 units or not) chooses, the reason
    says so, and the decision is kept, marked: a launch that finds the machine still busy neither measures again
    nor chooses otherwise; the first that finds it quiet measures, and its measurement decides from then on."""
    monkeypatch.setenv("KVSCOPE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(calibrate, "busy", lambda _share: True)
    said: list[str] = []
    probes: list[tuple[int, ...]] = []

    def probe(answer: bool):
        return lambda weight: probes.append(tuple(weight.shape)) or answer

    first = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    monkeypatch.setattr(kernels, "quiet", probe(False))
    again = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    rule = calibrate.rule(torch.device("cpu"))
    assert first.best == again.best == rule and first.by_rule and again.by_rule and again.cached
    assert said == ["measuring"] and probes == [(128, 64)]
    assert first.reason().startswith(f"{rule} by rule") and "busy" in first.reason()
    assert "measured again at a launch when it is quiet" in first.reason()

    monkeypatch.setattr(kernels, "quiet", probe(True))
    monkeypatch.setattr(calibrate, "busy", lambda _share: False)
    quiet = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    assert said == ["measuring", "measuring"] and not quiet.by_rule and not quiet.cached
    kept = calibrate.calibrate(torch.device("cpu"), 64, 128, layers=2, measuring=lambda: said.append("measuring"))
    assert kept.cached and not kept.by_rule and kept.best == quiet.best
    assert said == ["measuring", "measuring"] and len(probes) == 2          # a quiet decision is not probed


def test_the_rule_follows_the_cpu_flags(monkeypatch):
    monkeypatch.setattr(calibrate, "native_bf16", lambda _device: True)
    assert calibrate.rule(torch.device("cpu")) == "bfloat16"
    monkeypatch.setattr(calibrate, "native_bf16", lambda _device: False)
    assert calibrate.rule(torch.device("cpu")) == "float32"


def test_a_many_row_product_widens_a_half_float_unless_the_cpus_flags_show_units_for_it(monkeypatch):
    from engine.model import hardware

    cpu = torch.device("cpu")
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2", "avx512_bf16"}))
    assert hardware.native_float(cpu, torch.bfloat16) and hardware.native_float(cpu, torch.float16) is False
    assert hardware.gemm_dtype(torch.bfloat16, "cpu") == torch.bfloat16
    assert hardware.gemm_dtype(torch.float16, "cpu") == torch.float32
    assert hardware.gemm_dtype(torch.float16, "cuda") == torch.float16          # a GPU's own
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: frozenset({"avx2", "amx_fp16"}))
    assert hardware.gemm_dtype(torch.float16, "cpu") == torch.float16
    assert hardware.gemm_dtype(torch.bfloat16, "cpu") == torch.float32 and not hardware.native_bf16(cpu)
    monkeypatch.setattr(hardware, "_cpu_flags", lambda: None)                   # flags nobody can read
    assert hardware.native_float(cpu, torch.bfloat16) is None
    assert hardware.gemm_dtype(torch.bfloat16, "cpu") == torch.float32          # float32's GEMM is never emulated
    assert hardware.gemm_dtype(torch.float32, "cpu") == torch.float32


def test_the_reason_names_the_measured_ratios():
    fast_bf16 = calibrate.Calibration("bfloat16", [calibrate.Timing("float32", 40.0, 1.2),
                                                   calibrate.Timing("bfloat16", 50.0, 0.6)], True)
    assert fast_bf16.reason() == ("bfloat16: a layer's products 2.0x as fast as float32's in decode and 0.8x in "
                                  "prefill (native bf16 on this CPU) (measured)")
    slow_bf16 = calibrate.Calibration("float32", [calibrate.Timing("float32", 40.0, 1.2),
                                                  calibrate.Timing("bfloat16", 200.0, 1.0)], False)
    assert slow_bf16.reason().startswith("float32: the others were slower here (bf16 emulated on this CPU)")


QUIET = HardwarePeaks("this cpu", "float32", 2e11, 2e10, cpu_share=0.98)


def _sweep(tiny):
    from engine.facts.events import ExperimentPoint

    events, finished = collect("dtype", tiny, formats=("float32", "int8"), new_tokens=6, repeats=1, prefill_tokens=32)
    points = [e.values for e in events if isinstance(e, ExperimentPoint) and e.series == "format"]
    return events, finished, points


def test_the_format_sweep_measures_each_format_beside_its_ceiling(tiny, monkeypatch):
    from engine.model import hardware

    monkeypatch.setattr(hardware, "quiet_peaks", lambda device, dtype, attempts=3: QUIET)
    _events, finished, points = _sweep(tiny)
    assert len(points) == 2 and [f.name for f in finished.result.measured] == ["float32", "int8"]
    fp32, int8 = points
    assert int8["bytes_per_token"] < fp32["bytes_per_token"] / 2
    assert all(p["decode_tok_s"] > 0 and p["perplexity"] > 1 for p in points)
    assert [p["decode_ceiling_tok_s"] for p in points] == pytest.approx(
        [QUIET.bytes_per_s / p["bytes_per_token"] for p in points])
    assert fp32["diverges_at"] == -1.0                          # float32 is the reference
    assert finished.result.measured[1].bytes_x == pytest.approx(int8["bytes_per_token"] / fp32["bytes_per_token"])


def test_a_machine_busy_at_every_bandwidth_measurement_gives_the_sweep_no_ceiling(tiny, monkeypatch):
    from engine import lessons
    from engine.model import hardware

    monkeypatch.setattr(hardware, "quiet_peaks", lambda device, dtype, attempts=3: None)
    events, finished, points = _sweep(tiny)
    assert len(points) == 2 and all(p["decode_tok_s"] > 0 for p in points)
    assert not any(key.endswith("ceiling_tok_s") or key == "bandwidth_gb_s" for p in points for key in p)
    from engine.facts.events import ExperimentPoint

    text = lessons.lesson("dtype").table([e for e in events if isinstance(e, ExperimentPoint)], finished.result)
    rows = [line for line in text.splitlines() if line.strip().startswith(("float32 |", "int8 |"))]
    assert len(rows) == 2 and all(row.split("|")[3].strip() == "-" for row in rows)


def test_quiet_peaks_measure_again_until_quiet_and_give_none_when_the_machine_stays_busy(monkeypatch):
    from engine.model import hardware

    busy = HardwarePeaks("this cpu", "float32", 2e11, 5e9, cpu_share=0.4)
    answers = iter([busy, busy, QUIET])
    calls = []
    monkeypatch.setattr(hardware, "peaks", lambda device, dtype, remeasure=False: calls.append(remeasure)
                        or next(answers))
    assert hardware.quiet_peaks(torch.device("cpu"), torch.float32) is QUIET and calls == [False, True, True]
    monkeypatch.setattr(hardware, "peaks", lambda device, dtype, remeasure=False: busy)
    assert hardware.quiet_peaks(torch.device("cpu"), torch.float32) is None
    assert hardware.share_of_ceiling(30.0, 40.0) == "75%"
    assert hardware.share_of_ceiling(41.0, 40.0) == "above the ceiling (ceiling wrong)"     # never over 100%
    assert hardware.share_of_ceiling(30.0, None) == "no quiet ceiling"


def test_the_sweep_names_each_kernels_bandwidth_over_the_weights_and_the_chosen_one():
    from engine.lessons import formats
    from engine.model.kernels import KernelChoice

    choice = KernelChoice("onednn", {"aten": 20.0, "onednn": 10.0}, weight_bytes=200_000_000)
    values = {**formats._kernel_values(choice), "bandwidth_gb_s": 25.0}
    assert values["products_gb_s_onednn"] == pytest.approx(20.0) and values["products_gb_s_aten"] == pytest.approx(10.0)
    assert formats.kernel_words(values) == ("a step's products through oneDNN 20.0 GB/s (chosen), ATen 10.0 GB/s "
                                            "(achieved) beside a 25.0 GB/s copy (measured)")
    assert formats._kernel_values(KernelChoice("aten", reason="KVSCOPE_LINEAR=aten")) == {}


@pytest.mark.real
def test_int8_weights_generate_on_the_embedded_model(smol):
    loaded = load("embedded", "cpu", "int8")
    result = Session(loaded).run("hey, what is continuous batching?", GenerationParams(max_new_tokens=12))
    assert result.summary.generated_tokens == 12 and result.summary.text.strip()
    assert loaded.facts.weight_bytes < smol.facts.weight_bytes / 3


def test_the_json_names_the_weight_format_beside_the_activation_dtype(tiny_model_dir, capsys):
    from engine import cli

    code = cli.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "int8", "--prompt", "hi",
                     "--max-new-tokens", "2", "--json"])
    payload = json.loads(capsys.readouterr().out)
    assert code == 0 and payload["weights"] == "int8" and payload["dtype"] in ("float32", "bfloat16")   # activations
    assert payload["weights_described"].startswith("int8 weights")
