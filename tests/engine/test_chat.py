"""Multi-turn chat: reusing the cache across turns prefills only the new tokens and changes nothing else."""

import pytest

from engine.facts.events import ExperimentPoint, PrefillDone
from engine.facts.params import GenerationParams
from engine.run.session import Session
from engine.run.workloads import CONVERSATION
from tests.lessons import collect


def converse(session, reuse, turns=CONVERSATION[:3], tokens=12):
    messages, replies, prefills = [], [], []
    for turn in turns:
        messages.append({"role": "user", "content": turn})
        events = []
        result = session.chat(messages, GenerationParams(max_new_tokens=tokens), events.append, reuse=reuse)
        replies.append(result.summary.token_ids)
        prefills.append(next(e for e in events if isinstance(e, PrefillDone)))
        messages.append({"role": "assistant", "content": result.summary.text})
    return replies, prefills


def test_reuse_gives_the_same_tokens_and_prefills_only_the_new_turn(tiny):
    with_reuse, pre_on = converse(Session(tiny), reuse=True)
    without, pre_off = converse(Session(tiny), reuse=False)
    assert with_reuse == without
    assert pre_on[0].reused_tokens == 0 and all(p.reused_tokens > 0 for p in pre_on[1:])
    assert all(p.reused_tokens == 0 for p in pre_off)
    for on, off in zip(pre_on[1:], pre_off[1:]):
        assert on.reused_tokens + on.n_tokens == off.n_tokens            # the same conversation ...
        assert on.n_tokens < off.n_tokens                                # ... mostly taken from the cache


def test_kv_bytes_cover_the_whole_conversation(tiny):
    session = Session(tiny)
    _, prefills = converse(session, reuse=True, tokens=6)
    from engine.facts import kvformula

    last = prefills[-1]
    held = last.reused_tokens + last.n_tokens
    assert sum(map(sum, last.kv_bytes_per_layer)) == kvformula.predicted_kv_bytes(tiny.facts, held)


def test_a_plain_run_or_a_new_conversation_forgets_the_kept_cache(tiny):
    session = Session(tiny)
    converse(session, reuse=True, turns=CONVERSATION[:1], tokens=4)
    assert session.kept_tokens > 0
    session.run("hello", GenerationParams(max_new_tokens=2))
    assert session.kept_tokens == 0


def test_chat_experiment_compares_reuse_on_and_off_repeated_and_interleaved(tiny):
    events, finished = collect("chat", tiny, turns=CONVERSATION[:3], new_tokens=8, repeats=3)
    points = [e.values for e in events if isinstance(e, ExperimentPoint)]
    r = finished.result
    assert r.tokens_match is True and len(points) == 2 * 3 * 3 and r.repeats == 3 and r.turns == 3
    order = [p["reuse"] for p in points if p["turn"] == 1]
    assert order == [1.0, 0.0, 0.0, 1.0, 1.0, 0.0]                         # the order alternates per repeat
    first = [p for p in points if p["repeat"] == 1]
    on = [p for p in first if p["reuse"]]
    off = [p for p in first if not p["reuse"]]
    assert [p["conversation_tokens"] for p in on] == [p["conversation_tokens"] for p in off]
    assert all(a["prefilled_tokens"] < b["prefilled_tokens"] for a, b in zip(on[1:], off[1:]))
    conv = [p["conversation_tokens"] for p in off]
    assert conv == sorted(conv) and len(set(conv)) == 3                     # the conversation grows
    for figures in r.per_turn:
        ttft = sorted(p["ttft_ms"] for p in points if p["turn"] == figures.turn and p["reuse"])
        assert figures.on_ms == ttft[1] and figures.on_range == (ttft[0], ttft[-1])
        off_range = figures.off_range
        assert figures.clear == (ttft[-1] < off_range[0] or off_range[1] < ttft[0])


def test_empty_chat_message_is_refused(tiny):
    from engine.facts.errors import PromptError

    with pytest.raises(PromptError, match="message is empty"):
        Session(tiny).chat([{"role": "user", "content": "  "}], GenerationParams())


@pytest.mark.real
def test_reuse_gives_the_same_tokens_on_the_real_model(smol):
    with_reuse, pre_on = converse(Session(smol), reuse=True, tokens=16)
    without, _ = converse(Session(smol), reuse=False, tokens=16)
    assert with_reuse == without and pre_on[-1].reused_tokens > 40
