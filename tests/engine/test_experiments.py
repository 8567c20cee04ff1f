"""Cost model and the lessons' experiments on the tiny model: complete, monotone where they must be, tokens
equal, and one lifecycle for all of them."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from engine import lessons
from engine.facts import costmodel
from engine.facts.errors import ParameterError
from engine.facts.events import ExperimentFinished, ExperimentPoint, ExperimentStarted, RunStarted
from engine.facts.params import GenerationParams
from engine.lessons.cache import CacheResult
from engine.lessons.prefill import doubling_lengths, fitted_exponent
from engine.run.batch_generate import generate_batch
from engine.run.experiment import rounding_note
from engine.run.session import Session
from tests.engine.test_kvcache import smol_facts
from tests.lessons import collect

SEED_EXPECTED = """PREFILL cost -- scales QUADRATICALLY:
  Prompt length   50 -> ~320,000 FLOPs
  Prompt length  100 -> ~1,280,000 FLOPs
  Prompt length  200 -> ~5,120,000 FLOPs
  Prompt length  400 -> ~20,480,000 FLOPs
  Prompt length  800 -> ~81,920,000 FLOPs

Doubling 400->800: FLOPs multiplier = 4.0x

Prompt length: 100, generating 50 new tokens
  WITHOUT KV cache: 102,134,400 total FLOPs
  WITH KV cache:    803,200 total FLOPs
  Reduction factor: 127.2x"""


def test_seed_example_is_reproduced_exactly():
    assert costmodel.seed_example() == SEED_EXPECTED


def test_seed_example_from_the_cli_line_for_line_then_its_note(cache_root):
    r = subprocess.run([sys.executable, "-m", "engine", "costmodel", "--seed-example"], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)})
    example, note = r.stdout.split("\n\nWhy a real model's prefill time grows slower than this:")   # then a note
    assert r.returncode == 0 and example == SEED_EXPECTED and "computed" in note


def test_whole_model_costs_behave():
    m = smol_facts(tied_embeddings=True)
    cost = costmodel.ModelCost(m)
    assert cost.body_params == 134515008 - 49152 * 576
    step = cost.decode(100)
    weights = 2 * (cost.body_params + 49152 * 576)                                    # 2 FLOPs per weight
    assert step.flops == weights + 4 * 30 * 9 * 64 * 101                              # + QK^T and AV over 101 keys
    assert step.flops == pytest.approx(weights, rel=0.05)                              # weights dominate decode
    assert step.bytes > 4 * cost.body_params                                          # all weights read
    assert cost.decode(1000).bytes - cost.decode(100).bytes == 900 * 46_080           # plus the KV read
    device = costmodel.Device("x", flops_per_s=300e9, bytes_per_s=25e9)
    assert step.bound(device) == "bandwidth" and cost.prefill(1024).bound(device) == "compute"
    assert cost.prefill(64).intensity < cost.prefill(1024).intensity
    long, short = cost.prefill(4096).flops, cost.prefill(2048).flops
    assert 2.0 < long / short < 4.0                                                    # between linear and n^2
    on = cost.decode_total(100, 50, cache=True).flops
    off = cost.decode_total(100, 50, cache=False).flops
    assert off / on > 50 and off / on > cost.decode_total(100, 10, cache=False).flops / \
        cost.decode_total(100, 10, cache=True).flops                                  # the gap grows with length


def test_fitted_exponent_and_lengths():
    assert doubling_lengths(16, 200) == [16, 32, 64, 128]
    assert fitted_exponent([1, 2, 4, 8], [3, 12, 48, 192]) == pytest.approx(2.0)


SHORT_PROMPTS = ("hello world", "The KV cache holds keys and values", "日本語 😀", "Temperature and top-p")


def test_prefill_sweep_on_the_tiny_model(tiny):
    events, finished = collect("prefill", tiny, max_length=128, repeats=2)
    assert isinstance(events[0], ExperimentStarted) and finished.reason == "done"
    points = [e.values for e in events if isinstance(e, ExperimentPoint)]
    assert [p["tokens"] for p in points] == [16, 32, 64, 128]
    assert all(p["prefill_ms"] > 0 and p["ttft_ms"] >= p["prefill_ms"] for p in points)
    flops = [p["flops"] for p in points]
    assert flops == sorted(flops) and len(set(flops)) == 4
    r = finished.result
    assert r.exponent is not None and (r.doubled_from, r.doubled_to) == (64, 128) and r.points == 4


@pytest.mark.parametrize("wide_rows, said", [(24, 24), (16, 0), (0, 0)])
def test_a_prefill_sweep_that_crosses_the_rows_where_products_widen_says_where(tiny, monkeypatch, wide_rows, said):
    """Where a CPU emulates the model's half float, products of ``wide_rows`` rows or more run widened to float32:
    the sweep says so where it crosses that length (16 -> 32 crosses 24), and not where it starts past it."""
    from types import SimpleNamespace

    from app.lessons.prefill import widened_words
    from engine.lessons.prefill import table

    monkeypatch.setattr(tiny, "kernel", SimpleNamespace(wide_rows=wide_rows))
    events, finished = collect("prefill", tiny, max_length=64, repeats=1)
    r = finished.result
    assert r.widened_from == said
    assert (f"From {said:,} tokens this CPU runs the products in float32" in widened_words(r)) == bool(said)
    points = [e for e in events if isinstance(e, ExperimentPoint)]
    assert ("note: from 24 tokens the products ran in float32" in table(points, r)) == bool(said)


def test_cache_comparison_tokens_match(tiny):
    events, finished = collect("cache", tiny, new_tokens=24, prompt="The KV cache holds keys")
    r = finished.result
    assert isinstance(r, CacheResult) and r.tokens_match is True and r.flops_ratio > 1 and r.attention_flops_ratio > 1
    runs = [e for e in events if isinstance(e, RunStarted)]
    assert [r.params.kv_cache for r in runs] == [True, False]       # the runs themselves are in the stream
    assert len([e for e in events if isinstance(e, ExperimentPoint)]) == 2


def test_batch_sweep_on_the_tiny_model(tiny):
    events, finished = collect("batch", tiny, sizes=(1, 2, 4), new_tokens=6, prompts=SHORT_PROMPTS)
    points = [e.values for e in events if isinstance(e, ExperimentPoint)]
    assert [p["batch"] for p in points] == [1, 2, 4]
    assert all(p["decode_tok_s"] > 0 and p["per_token_ms"] > 0 for p in points)
    assert finished.result.largest_batch == 4


def test_each_row_of_a_batch_equals_its_solo_run(tiny):
    """In float64, so left padding and masking must give the very same greedy tokens as running alone."""
    import copy

    model = copy.deepcopy(tiny.model).to(torch.float64)
    session = Session(tiny)
    prompts = [session.encode(t, chat_template=False) for t in (
        "hi", "hello world 日本語", "The KV cache holds keys and values", "Temperature, top-k and top-p change 😀")]
    assert len({len(p) for p in prompts}) == 4                     # different lengths: real padding
    pad = tiny.tokenizer.pad_token_id
    batched = generate_batch(model, prompts, 12, pad, torch.device("cpu")).tokens
    for row, prompt in enumerate(prompts):
        assert batched[row] == generate_batch(model, [prompt], 12, pad, torch.device("cpu")).tokens[0]


def test_batch_of_one_equals_the_session_greedy_run(tiny):
    session = Session(tiny)
    prompt = session.encode("The KV cache holds keys")
    expected = session.run("The KV cache holds keys", GenerationParams(max_new_tokens=10)).summary.token_ids
    got = generate_batch(tiny.model, [prompt], 10, tiny.tokenizer.pad_token_id, torch.device("cpu")).tokens[0]
    assert got[: len(expected)] == expected


def test_cancel_stops_an_experiment(tiny):
    cancel = threading.Event()
    cancel.set()
    _events, finished = collect("prefill", tiny, cancel, max_length=64)
    assert isinstance(finished, ExperimentFinished) and finished.reason == "stopped" and finished.result.incomplete


def test_an_experiment_stopped_after_its_first_point_is_marked_incomplete(tiny):
    """Stopped once a point is in (not before anything ran): what it measured is kept, and it says it is short."""
    cancel = threading.Event()

    class StopAtFirstPoint(list):
        def append(self, event) -> None:
            super().append(event)
            if isinstance(event, ExperimentPoint):
                cancel.set()

    events = StopAtFirstPoint()
    _events, finished = collect("prefill", tiny, cancel, events, max_length=64)
    assert sum(isinstance(e, ExperimentPoint) for e in events) == 1
    assert finished.reason == "stopped" and finished.result.points == 1 and finished.result.incomplete


def test_prompts_that_do_not_fit_the_context_are_refused(tiny):
    with pytest.raises(ParameterError, match="No prompt fits the context of 256"):
        collect("batch", tiny, sizes=(1,), new_tokens=4, prompts=["hello world " * 200])


def test_bad_experiment_settings(tiny):
    from engine import lessons

    with pytest.raises(KeyError, match="Unknown lesson 'nope'"):
        lessons.lesson("nope")
    with pytest.raises(ParameterError, match=r"max_length \(8\) must be at least start \(16\)"):
        collect("prefill", tiny, max_length=8)
    with pytest.raises(ParameterError, match="repeats must be between 1 and 100"):
        collect("prefill", tiny, repeats=0)
    with pytest.raises(ParameterError, match="The sweep needs 1 <= shortest prompt"):
        collect("prefill", tiny, start=300, max_length=400)           # past the tiny model's context of 256


def test_sweep_cli_prints_json(tiny_model_dir, cache_root):
    r = subprocess.run([sys.executable, "-m", "engine", "sweep", "batch", "--model", str(tiny_model_dir),
                        "--sizes", "1,2", "--tokens", "4", "--json"], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "KVSCOPE_CACHE_DIR": str(cache_root)})
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert [p["batch"] for p in data["points"]] == [1, 2] and data["result"]["largest_batch"] == 2


def test_hardware_peaks_are_measured_once_then_cached(tiny, monkeypatch):
    from engine.model.hardware import peaks_event

    first = peaks_event(tiny)
    second = peaks_event(tiny)
    assert first.flops_per_s > 1e8 and first.bytes_per_s > 1e8
    assert second.cached and second.flops_per_s == first.flops_per_s


def test_an_experiment_that_breaks_closes_its_record_and_later_runs_are_not_filed_under_it(tiny):
    from engine.facts.events import ExperimentFailed, ExperimentStarted, RunStarted

    session = Session(tiny)
    calls = []
    real_prefill = session.prefill

    def failing_prefill(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("injected failure in the third prefill")
        return real_prefill(*args, **kwargs)

    session.prefill = failing_prefill
    events: list = []
    with pytest.raises(RuntimeError, match="injected"):
        collect("prefill", session, max_length=64, repeats=1, events=events)
    started = next(e for e in events if isinstance(e, ExperimentStarted))
    failed = events[-1]
    assert isinstance(failed, ExperimentFailed) and failed.exp_id == started.exp_id
    assert failed.message == "injected failure in the third prefill"
    session.prefill = real_prefill
    session.run("hello", GenerationParams(max_new_tokens=2), events.append)
    assert next(e for e in events if isinstance(e, RunStarted)).experiment == ""


def test_runs_an_experiment_makes_name_it(tiny):
    events, _finished = collect("cache", tiny, new_tokens=3)
    exp_id = next(e for e in events if isinstance(e, ExperimentStarted)).exp_id
    runs = [e for e in events if isinstance(e, RunStarted)]
    assert len(runs) == 2 and all(r.experiment == exp_id for r in runs)


def test_tokens_that_part_in_a_16_bit_float_are_explained_and_in_float32_are_not():
    from types import SimpleNamespace

    from engine.lessons.continuous import ContinuousResult

    bf16, fp32 = SimpleNamespace(dtype="bfloat16"), SimpleNamespace(dtype="float32")
    assert "in bfloat16, a pass over several tokens rounds differently" in rounding_note(
        bf16, CacheResult(tokens_match=False))
    assert "bfloat16" in rounding_note(bf16, ContinuousResult(tokens_match_solo=False))
    assert rounding_note(bf16, CacheResult(tokens_match=True)) == ""
    assert rounding_note(bf16, CacheResult(tokens_match=False, incomplete=True)) == ""
    assert rounding_note(fp32, CacheResult(tokens_match=False)) == ""      # float32: a difference is a bug, not noise


def test_a_finished_experiment_whose_tokens_match_carries_no_note(tiny):
    _events, finished = collect("cache", tiny, new_tokens=4)
    assert finished.result.tokens_match and finished.result.tokens_note == ""


@pytest.mark.parametrize("kind", [lesson.kind for lesson in lessons.LESSONS])
def test_a_lessons_report_ends_with_the_busy_note_once_where_it_times_anything(kind):
    """Every lesson's CLI report ends with the same busy-machine and thread notes, said by the framework once
    (each of twelve tables appended them itself); a lesson that measures bytes (``timed=False``) has no busy
    note, a quiet result none."""
    lesson = lessons.lesson(kind)
    busy = lesson.result(lowest_cpu_share=0.3, incomplete=True, threads_note="4 threads of 8: the others were busy")
    report = lesson.report([], busy)
    said = report.count("measured while the machine was busy")
    assert said == (1 if lesson.timed else 0)
    assert report.rstrip().endswith("note: 4 threads of 8: the others were busy")
    quiet = lesson.report([], lesson.result(lowest_cpu_share=0.95, incomplete=True))
    assert "machine was busy" not in quiet and "note: 4 threads" not in quiet
