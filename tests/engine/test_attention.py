"""Attention over the cache: recorded only when asked, the same weights with the cache on or off, its cost
reported per pass, saved and replayed through the schema, and hostile attention events refused with a line."""

from __future__ import annotations

import pytest

from engine.facts.errors import ParameterError, TraceError
from engine.facts.events import AttentionStep, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace, write_trace
from engine.run.session import Session
from tests.traces import first_row, rows_of, write_rows

PROMPT = "The KV cache holds keys and values"
PARAMS = GenerationParams(max_new_tokens=8, capture_attention=True)


@pytest.fixture(scope="module")
def recorded(tiny) -> list:
    events: list = []
    Session(tiny).run(PROMPT, PARAMS, events.append)
    return events


def steps_of(events: list, kind: type) -> list:
    return [e for e in events if isinstance(e, kind)]


def test_each_step_records_one_row_per_head_summing_to_one_and_a_capture_time(recorded, tiny):
    tokens, rows = steps_of(recorded, TokenStep), steps_of(recorded, AttentionStep)
    assert [r.step for r in rows] == [t.step for t in tokens]
    facts = tiny.facts
    for token, row in zip(tokens, rows):
        assert row.position == token.position - 1 and row.layers == list(range(facts.num_layers))
        for first, heads in zip(row.first_positions, row.weights):
            assert first == 0 and len(heads) == facts.num_heads
            assert all(len(h) == row.position + 1 and abs(sum(h) - 1.0) < 1e-3 for h in heads)
        # The capture's time includes copying the rows out after the step's clock stopped: compared with the
        # step's latency it says how busy the machine was, not whether the capture works.
        assert 0.0 < row.capture_ms < 60_000 and row.method == "sdpa hook"
    assert recorded.index(rows[0]) == recorded.index(tokens[0]) + 1       # each after its own TokenStep


def test_nothing_is_recorded_or_computed_when_not_asked(tiny):
    session = Session(tiny)
    session.run(PROMPT, PARAMS, lambda e: None)            # attaches the capture to the model
    events: list = []
    session.run(PROMPT, PARAMS.with_(capture_attention=False), events.append)
    assert steps_of(events, AttentionStep) == []
    capture = session.attention_capture()
    assert capture.rows == {} and capture.spent_s == 0.0 and not capture.active


def test_the_cache_off_path_records_the_same_weights(tiny, recorded):
    events: list = []
    Session(tiny).run(PROMPT, PARAMS.with_(kv_cache=False), events.append)
    on, off = steps_of(recorded, AttentionStep), steps_of(events, AttentionStep)
    assert len(on) == len(off)
    for a, b in zip(on, off):
        for heads_a, heads_b in zip(a.weights, b.weights):
            for row_a, row_b in zip(heads_a, heads_b):
                assert max(abs(x - y) for x, y in zip(row_a, row_b)) < 2e-4


def test_compiled_decode_and_recording_are_refused_together():
    with pytest.raises(ParameterError, match="attention cannot be captured from a compiled decode"):
        GenerationParams(static_cache=True, compiled=True, capture_attention=True)


def test_a_trace_with_attention_reads_back_equal(recorded, tmp_path):
    back = read_trace(write_trace(tmp_path / "a.jsonl", recorded))
    assert steps_of(back, AttentionStep) == steps_of(recorded, AttentionStep)


def _rows(recorded, tmp_path) -> list[dict]:
    return rows_of(recorded, tmp_path / "valid.jsonl")


def _refused(tmp_path, rows: list[dict], fragment: str) -> None:
    path = write_rows(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError, match=fragment) as info:
        read_trace(path)
    assert "bad.jsonl line" in str(info.value) and "\n" not in str(info.value)


def _first_attention(rows: list[dict]) -> int:
    return first_row(rows, "AttentionStep")


@pytest.mark.parametrize("change, fragment", [
    (lambda a: a["weights"][0][0].__setitem__(0, 1.5), r"weights\[0\]\[0\]\[0\] must be between 0 and 1"),
    (lambda a: a["weights"][0][0].pop(), "weights must be"),
    (lambda a: a.__setitem__("position", a["position"] + 1), "position must be between"),
    (lambda a: a["first_positions"].__setitem__(0, 10**6), "first_positions"),
    (lambda a: a.__setitem__("layers", [1, 0]), "layers must be distinct"),
    (lambda a: a.__setitem__("method", "guess"), "method"),
])
def test_a_hostile_attention_event_is_refused_with_one_line(recorded, tmp_path, change, fragment):
    rows = _rows(recorded, tmp_path)
    change(rows[_first_attention(rows)])
    _refused(tmp_path, rows, fragment)


def test_attention_before_its_token_or_twice_is_refused(recorded, tmp_path):
    rows = _rows(recorded, tmp_path)
    i = _first_attention(rows)
    swapped = rows[:i - 1] + [rows[i], rows[i - 1]] + rows[i + 1:]
    _refused(tmp_path, swapped, "TokenStep")
    _refused(tmp_path, rows[:i + 1] + [rows[i]] + rows[i + 1:], "once")


def test_a_cpu_model_reads_grouped_keys_as_they_are_and_computes_what_sdpa_does(tiny_model_dir, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.integrations import sdpa_attention

    from engine.model import attention
    from engine.model.models import load

    model = load(str(tiny_model_dir), device="cpu", dtype="float32").model
    assert model.config._attn_implementation == attention.NAME
    assert not attention.use_grouped_sdpa(AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), attn_implementation="eager"))                 # only a model on sdpa is moved
    module = model.model.layers[0].self_attn
    heads, groups, dim = model.config.num_attention_heads, module.num_key_value_groups, module.head_dim
    copies = []
    repeat = sdpa_attention.repeat_kv
    monkeypatch.setattr(sdpa_attention, "repeat_kv", lambda x, n: copies.append(n) or repeat(x, n))
    monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True)    # as in a compiled graph
    torch.manual_seed(0)
    keys, values = (torch.randn(1, heads // groups, 16, dim) for _ in range(2))
    for rows in (1, 6):                                    # a decode step and a prefill, each with its mask
        query = torch.randn(1, heads, rows, dim)
        mask = torch.ones(rows, 16, dtype=torch.bool).tril(diagonal=16 - rows)[None, None]
        mask[..., 12:] = False                             # a static cache's unwritten slots
        copies.clear()
        expected, _ = sdpa_attention.sdpa_attention_forward(module, query, keys, values, mask,
                                                            scaling=module.scaling)
        assert copies == [groups, groups]                  # transformers copies keys and values out per head
        copies.clear()
        got, _ = attention._sdpa(module, query, keys, values, mask, scaling=module.scaling)
        assert copies == []
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 1e-5), ("bfloat16", 2e-2)])
def test_a_compiled_steps_one_query_attention_computes_what_sdpa_does_without_its_kernel(
        tiny_model_dir, monkeypatch, dtype, tolerance):
    """In a compiled graph a one-row query goes through ``one_query`` (two batched products), not torch's
    attention kernel, and gives sdpa's numbers: grouped and one KV head per query head, a boolean mask with a
    static cache's unwritten slots, an additive mask, none; a mask per head and a prefill's rows still go to the
    kernel."""
    import torch
    from transformers.integrations import sdpa_attention

    from engine.model import attention
    from engine.model.models import load

    module = load(str(tiny_model_dir), device="cpu", dtype="float32").model.model.layers[0].self_attn
    heads, dim = module.config.num_attention_heads, module.head_dim
    kernel_calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: kernel_calls.append(a[0].shape[-2]) or sdpa(*a, **k))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(sdpa_attention, "is_torchdynamo_compiling", lambda: True)
    torch.manual_seed(0)
    as_dtype = getattr(torch, dtype)
    written = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    written[..., 12:] = False
    masks = {"boolean": written, "additive": torch.where(written, 0.0, -1e4).to(as_dtype), "none": None}
    for kv_heads in (module.config.num_key_value_heads, heads):
        monkeypatch.setattr(module, "num_key_value_groups", heads // kv_heads)
        keys, values = (torch.randn(1, kv_heads, 16, dim, dtype=as_dtype) for _ in range(2))
        query = torch.randn(1, heads, 1, dim, dtype=as_dtype)
        for name, mask in masks.items():
            kernel_calls.clear()
            got, _ = attention._sdpa(module, query, keys, values, mask, scaling=module.scaling)
            assert kernel_calls == [], name
            grouped_keys, grouped_values = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (keys, values))
            expected = sdpa(query.float(), grouped_keys.float(), grouped_values.float(),
                            attn_mask=None if mask is None else mask.float() if mask.dtype != torch.bool else mask,
                            scale=module.scaling).transpose(1, 2)
            assert got.shape == (1, 1, heads, dim) and got.dtype == as_dtype
            assert torch.allclose(got.float(), expected, atol=tolerance, rtol=tolerance), (kv_heads, name)
    per_head = written.expand(1, heads, 1, 16)               # a mask of each head's own: the kernel's to apply
    attention._sdpa(module, torch.randn(1, heads, 1, dim), *(torch.randn(1, heads, 16, dim) for _ in range(2)),
                    per_head, scaling=module.scaling)
    assert kernel_calls == [1]
    kernel_calls.clear()
    prefill = torch.randn(1, heads, 6, dim)
    mask = torch.ones(6, 16, dtype=torch.bool).tril(diagonal=10)[None, None]
    monkeypatch.setattr(module, "num_key_value_groups", 1)
    attention._sdpa(module, prefill, *(torch.randn(1, heads, 16, dim) for _ in range(2)), mask, scaling=module.scaling)
    assert kernel_calls == [6]
