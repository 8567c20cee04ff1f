"""A window's run stops within a second even inside a long prefill: a prompt that one pass could not finish in
half a second (by the session's measured rate) goes through in passes sized to take at most that, into one
cache, with the same tokens as one pass; a stop takes effect between two passes. Counted in passes, not seconds,
so the verdict is the same on any machine."""

from __future__ import annotations

import threading

from engine.facts.events import PrefillDone, RunFinished, RunStarted
from engine.facts.params import GenerationParams
from engine.model import kvcache
from engine.run.passes import FIRST_PASS, STOPPABLE, UNCHUNKED
from engine.run.session import RunOptions, Session

LONG = " ".join(["the cache keeps keys and values"] * 18)     # about 200 positions with the tiny tokenizer


def run(session: Session, prompt: str, cancel: threading.Event | None = None, **params):
    events: list = []
    result = session.run(prompt, GenerationParams(max_new_tokens=6, chat_template=False, **params), events.append,
                         cancel)
    return events, result


def counting_passes(monkeypatch) -> list[int]:
    """The positions of every forward pass made from now on."""
    sizes: list[int] = []
    forward = kvcache.forward

    def counted(model, ids, *args, **kwargs):
        sizes.append(int(ids.shape[-1]))
        return forward(model, ids, *args, **kwargs)

    monkeypatch.setattr(kvcache, "forward", counted)
    return sizes


def test_a_prompt_slower_than_half_a_second_goes_in_passes_with_one_passs_tokens(tiny, monkeypatch):
    one_pass = run(Session(tiny), LONG)[1]
    stoppable = Session(tiny, RunOptions(prefill_chunk=STOPPABLE))
    stoppable.prefill_rate = 200.0                    # as measured on a slow machine: 100 positions in half a second
    sizes = counting_passes(monkeypatch)
    events, result = run(stoppable, LONG)
    prompt = len(next(e for e in events if isinstance(e, RunStarted)).prompt_ids)
    started = next(e for e in events if isinstance(e, RunStarted))
    done = next(e for e in events if isinstance(e, PrefillDone))
    assert prompt > 128 and started.prefill_chunk == 64                 # the largest power of two in 100
    prefill_passes = sizes[:done.passes]
    assert done.passes >= 2 and sum(prefill_passes) == prompt and prefill_passes[0] == 64
    assert isinstance(result, RunFinished) and result.summary.token_ids == one_pass.summary.token_ids
    assert stoppable.prefill_rate is not None and stoppable.prefill_rate != 200.0   # learned from its own passes


def test_a_stop_during_a_long_prefill_takes_effect_after_the_pass_under_way(tiny, monkeypatch):
    session = Session(tiny, RunOptions(prefill_chunk=STOPPABLE))
    session.prefill_rate = 100.0                      # 50 positions in half a second: passes of 32
    cancel = threading.Event()
    sizes: list[int] = []
    forward = kvcache.forward

    def stop_in_first_pass(model, ids, *args, **kwargs):
        sizes.append(int(ids.shape[-1]))
        cancel.set()                                  # the key, pressed while this pass runs
        return forward(model, ids, *args, **kwargs)

    monkeypatch.setattr(kvcache, "forward", stop_in_first_pass)
    events, result = run(session, LONG, cancel)
    assert sizes == [32]                              # no pass began after the stop
    assert isinstance(result, RunFinished) and result.reason == "stopped"
    assert not any(isinstance(e, PrefillDone) for e in events)


def test_a_short_prompt_or_one_the_rate_clears_goes_in_one_pass(tiny, monkeypatch):
    session = Session(tiny, RunOptions(prefill_chunk=STOPPABLE))
    sizes = counting_passes(monkeypatch)
    events, _ = run(session, "the cache keeps keys")  # nothing measured yet, and short: one pass
    assert next(e for e in events if isinstance(e, PrefillDone)).passes == 1 and sizes[0] < UNCHUNKED
    session.prefill_rate = None
    events, _ = run(session, LONG)                    # nothing measured, long: a first pass of FIRST_PASS
    assert next(e for e in events if isinstance(e, RunStarted)).prefill_chunk == FIRST_PASS
    session.prefill_rate = 1e6                        # a fast machine: the whole prompt in well under 0.5 s
    events, _ = run(session, LONG)
    assert next(e for e in events if isinstance(e, PrefillDone)).passes == 1


def test_attention_recording_and_eviction_keep_one_pass(tiny):
    session = Session(tiny, RunOptions(prefill_chunk=STOPPABLE))
    session.prefill_rate = 100.0
    for params in ({"capture_attention": True}, {"kv_method": "sinks:4+64"}, {"kv_cache": False}):
        events, _ = run(session, LONG, **params)
        assert next(e for e in events if isinstance(e, RunStarted)).prefill_chunk == 0, params
        assert next(e for e in events if isinstance(e, PrefillDone)).passes == 1, params
