"""The instrumented loop on the tiny model: parity with generate(), KV accounting, stop reasons, cancel."""

import threading

import pytest
import torch

from engine.facts import kvformula
from engine.facts.errors import ParameterError, PromptError
from engine.facts.events import KVNorms, PrefillDone, RunFailed, RunFinished, RunStarted, TokenStep
from engine.facts.params import GenerationParams
from engine.run.session import Session

PROMPT = "The KV cache holds keys"


def run_collect(session, prompt=PROMPT, **params):
    events = []
    result = session.run(prompt, GenerationParams(**params), events.append)
    return events, result


def generate_ids(loaded, ids, n):
    model = loaded.model
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             do_sample=False, max_new_tokens=n)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("kv_cache", [True, False])
def test_greedy_tokens_equal_generate(tiny, kv_cache):
    session = Session(tiny)
    events, result = run_collect(session, max_new_tokens=40, kv_cache=kv_cache)
    started = events[0]
    assert isinstance(result, RunFinished)
    expected = generate_ids(tiny, started.prompt_ids, 40)
    assert result.summary.token_ids == expected
    assert len(expected) == 40 or expected[-1] == tiny.tokenizer.eos_token_id


def test_event_sequence_and_step_fields(tiny):
    events, result = run_collect(Session(tiny), max_new_tokens=6)
    kinds = [type(e).__name__ for e in events]
    # the prefill's pass, then its token (whose time is the TTFT), then the prompt's KV norms
    assert kinds[:4] == ["RunStarted", "PrefillDone", "TokenStep", "KVNorms"]
    assert kinds[-1] == "RunFinished"
    started, prefill = events[0], events[1]
    steps = [e for e in events if isinstance(e, TokenStep)]
    n = len(started.prompt_ids)
    assert prefill.n_tokens == n and len(started.prompt_pieces) == n
    assert [s.step for s in steps] == list(range(len(steps)))
    assert [s.position for s in steps] == [n + i for i in range(len(steps))]
    assert steps[0].phase == "prefill" and all(s.phase == "decode" for s in steps[1:])
    assert all(len(s.candidates) >= 10 for s in steps)
    assert all(0 < s.prob <= 1 and 0 < s.raw_prob <= 1 for s in steps)
    assert all(s.latency_ms >= s.forward_ms > 0 for s in steps)
    ts = [e.t_ms for e in events]
    assert ts == sorted(ts)
    s = result.summary
    assert s.generated_tokens == len(steps) and s.decode_runs == len(steps) - 1
    assert s.decode_ms == pytest.approx(sum(x.latency_ms for x in steps[1:]))
    assert s.prefill_ms == pytest.approx(prefill.forward_ms)
    assert s.ttft_ms == steps[0].t_ms >= prefill.t_ms                 # TTFT: tokenize + prefill + first sample
    assert s.kv_tokens == n + len(steps) - 1


def test_kv_bytes_read_from_cache_equal_the_formula_after_every_step(tiny):
    events, result = run_collect(Session(tiny), max_new_tokens=12)
    facts = events[0].model
    n = len(events[0].prompt_ids)
    assert kvformula.kv_heads(facts) < facts.num_heads        # GQA is exercised
    prefill = events[1]
    per_layer = kvformula.bytes_per_position(facts.kv_layers[0])
    assert [k + v for k, v in prefill.kv_bytes_per_layer] == [per_layer * n] * facts.num_layers
    assert all(k == v for k, v in prefill.kv_bytes_per_layer)
    for step in (e for e in events if isinstance(e, TokenStep)):
        held = n + step.step                           # the newest token is not in the cache yet
        assert [k + v for k, v in step.kv_bytes_per_layer] == kvformula.predicted_kv_bytes_per_layer(facts, held)
    assert result.summary.kv_bytes == kvformula.predicted_kv_bytes(facts, result.summary.kv_tokens)


def test_kv_norms_cover_every_cached_position_once(tiny):
    events, result = run_collect(Session(tiny), max_new_tokens=20)
    norms = [e for e in events if isinstance(e, KVNorms)]
    layers = events[0].model.num_layers
    covered = []
    for e in norms:
        assert len(e.k_norms) == layers and len(e.v_norms) == layers
        covered += range(e.first_position, e.first_position + len(e.k_norms[0]))
    assert covered == list(range(result.summary.kv_tokens))        # contiguous, no gaps, no repeats
    assert norms[0].first_position == 0 and len(norms[0].k_norms[0]) == events[1].n_tokens
    assert all(v > 0 for e in norms for row in e.k_norms + e.v_norms for v in row)
    assert norms[0].k_norms[0] != norms[0].k_norms[1]               # content differs layer to layer
    assert len(norms) < result.summary.generated_tokens             # batched, not one per step


def test_a_static_caches_norms_are_its_positions_not_its_buffers_unwritten_end(tiny):
    """A static cache's buffer is as long as the cache may grow: position p sits at index p, zeros after the last
    written one. Its heatmap once read the buffer's end (shifted, zeros at the right)."""
    def grid(static: bool) -> list[list[float]]:
        events, _ = run_collect(Session(tiny), max_new_tokens=8, static_cache=static)
        rows: list[list[float]] = [[] for _ in range(events[0].model.num_layers)]
        for e in (e for e in events if isinstance(e, KVNorms)):
            for row, values in zip(rows, e.k_norms):
                row += values
        return rows

    dynamic, static = grid(False), grid(True)
    assert [len(r) for r in static] == [len(r) for r in dynamic]
    assert all(v > 0 for row in static for v in row)
    for a, b in zip(dynamic, static):
        assert b == pytest.approx(a, rel=1e-4)


def test_kv_norms_match_the_cache_tensors(tiny):
    from transformers import DynamicCache

    from engine.model.kvcache import norms as kv_norms

    session = Session(tiny)
    ids = torch.tensor([session.encode(PROMPT)])
    cache = DynamicCache(config=tiny.model.config)
    with torch.inference_mode():
        tiny.model(input_ids=ids, cache=cache, use_cache=True)
    k, v = kv_norms(cache, 2, ids.shape[1])
    expected = cache.layers[1].keys[0, :, 2:].norm(dim=-1).mean(dim=0)
    assert torch.allclose(torch.tensor(k[1]), expected)
    assert len(v[0]) == ids.shape[1] - 2


def test_cache_off_holds_no_bytes_and_recomputes(tiny):
    events, result = run_collect(Session(tiny), max_new_tokens=5, kv_cache=False)
    assert all(k == v == 0 for e in events if isinstance(e, TokenStep) for k, v in e.kv_bytes_per_layer)
    assert result.summary.kv_bytes == 0 and "KV off" in events[0].label


def test_same_seed_same_sampled_tokens_and_seed_is_reported(tiny):
    session = Session(tiny)
    a = run_collect(session, max_new_tokens=20, temperature=1.2, seed=11)[1].summary.token_ids
    b = run_collect(session, max_new_tokens=20, temperature=1.2, seed=11)[1].summary.token_ids
    c = run_collect(session, max_new_tokens=20, temperature=1.2, seed=12)[1].summary.token_ids
    assert a == b and a != c
    events, _ = run_collect(session, max_new_tokens=2, temperature=1.0)
    assert isinstance(events[0].params.seed, int)


def test_top_k_one_equals_greedy(tiny):
    session = Session(tiny)
    greedy = run_collect(session, max_new_tokens=15)[1].summary.token_ids
    topk1 = run_collect(session, max_new_tokens=15, temperature=3.0, top_k=1, seed=5)[1].summary.token_ids
    assert greedy == topk1


def test_stop_reasons_max_tokens_and_eos(tiny):
    session = Session(tiny)
    _, result = run_collect(session, max_new_tokens=3)
    assert result.reason == "max_tokens" and result.summary.generated_tokens == 3
    first = result.summary.token_ids[0]
    session.eos_ids = {first}                               # make the first greedy token the end of sequence
    _, result = run_collect(session, max_new_tokens=10)
    assert result.reason == "eos" and result.summary.token_ids == [first]


def test_context_full_stops_at_the_context(tiny):
    session = Session(tiny)
    n = len(session.encode(PROMPT))
    limit = tiny.facts.max_context
    _, result = run_collect(session, max_new_tokens=limit)
    assert result.reason == "context_full"
    assert n + result.summary.generated_tokens == limit


def test_prompt_too_long_is_refused_before_compute(tiny):
    events = []
    with pytest.raises(PromptError, match="shorten it by"):
        Session(tiny).run("hello world " * 400, GenerationParams(), events.append)
    assert events == []


@pytest.mark.parametrize("prompt", ["", "   \n\t "])
def test_empty_prompt_is_refused(tiny, prompt):
    with pytest.raises(PromptError, match="empty"):
        Session(tiny).run(prompt, GenerationParams())


def test_top_k_beyond_vocabulary_is_refused(tiny):
    with pytest.raises(ParameterError, match="vocabulary"):
        Session(tiny).run(PROMPT, GenerationParams(temperature=1.0, top_k=tiny.facts.vocab_size + 1))


def test_cancel_from_another_thread_stops_within_one_step(tiny):
    session = Session(tiny)
    cancel = threading.Event()
    reached, release = threading.Event(), threading.Event()
    events = []

    def sink(e):
        events.append(e)
        if isinstance(e, TokenStep) and e.step == 3:
            reached.set()
            release.wait(10)

    result = {}
    worker = threading.Thread(target=lambda: result.update(r=session.run(
        PROMPT, GenerationParams(max_new_tokens=100), sink, cancel)))
    worker.start()
    assert reached.wait(30)
    cancel.set()
    release.set()
    worker.join(10)
    assert not worker.is_alive()
    assert result["r"].reason == "stopped"
    assert [e.step for e in events if isinstance(e, TokenStep)] == [0, 1, 2, 3]


def test_before_step_hook_sees_every_decode_step(tiny):
    seen = []
    Session(tiny).run(PROMPT, GenerationParams(max_new_tokens=5), before_step=seen.append)
    assert seen == [1, 2, 3, 4]


def test_out_of_memory_fails_the_run_keeps_numbers_and_next_run_works(tiny):
    def fault(phase, step):
        if phase == "decode" and step == 3:
            raise MemoryError("injected")

    session = Session(tiny, fault_hook=fault)
    events, result = run_collect(session, max_new_tokens=10)
    assert isinstance(result, RunFailed) and result.error == "out_of_memory"
    assert "Out of memory after 3 tokens" in result.message
    assert result.summary.generated_tokens == 3 and result.summary.prefill_ms > 0
    assert isinstance(events[-1], RunFailed)
    session.fault_hook = None
    assert isinstance(run_collect(session, max_new_tokens=4)[1], RunFinished)


def test_raw_mode_skips_the_chat_template(tiny):
    session = Session(tiny)
    chat = session.encode(PROMPT, chat_template=True)
    raw = session.encode(PROMPT, chat_template=False)
    assert len(chat) > len(raw)
    assert tiny.tokenizer.decode(raw) == PROMPT


def test_events_carry_plain_values_only(tiny):
    events, _ = run_collect(Session(tiny), max_new_tokens=3)
    import dataclasses
    import json

    for e in events:
        json.dumps(dataclasses.asdict(e))                 # no tensors, nothing unserialisable
    assert isinstance(events[0], RunStarted) and isinstance(events[1], PrefillDone)


def test_a_static_cache_gives_the_dynamic_cache_tokens_and_holds_its_allocation(tiny):
    dynamic = run_collect(Session(tiny), max_new_tokens=12)[1].summary
    events, result = run_collect(Session(tiny), max_new_tokens=12, static_cache=True)
    assert result.summary.token_ids == dynamic.token_ids
    prefill = next(e for e in events if type(e).__name__ == "PrefillDone")
    facts = events[0].model
    allocated = len(events[0].prompt_ids) + 12
    assert prefill.kv_allocated == allocated
    for step in (e for e in events if isinstance(e, TokenStep)):
        # the tensors hold the whole allocation from the start (measured), of which `position` are in use
        assert [k + v for k, v in step.kv_bytes_per_layer] == kvformula.predicted_kv_bytes_per_layer(facts, allocated)
        assert step.kv_positions_per_layer == [step.position] * facts.num_layers


def test_compiled_decode_needs_the_static_cache():
    from engine.facts.errors import ParameterError

    with pytest.raises(ParameterError, match="needs the static KV cache"):
        GenerationParams(compiled=True)
    assert GenerationParams(static_cache=True, compiled=True).describe().endswith("KV static, compiled")


