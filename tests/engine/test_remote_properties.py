"""Property tests of the server client (hypothesis): whatever a server streams (chunks of any length, any number
of candidates, usage figures no counter can hold, odd characters), every event it emits passes the trace
schema, the run reads back from its trace, nothing it received is lost without a word, and it stops at the run's
max_new_tokens whatever the server does."""

from __future__ import annotations

import io
import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.facts.events import RunFailed, RunFinished, RunStarted, ServerFacts, TokenStep
from engine.facts.fields import MAX_CANDIDATES, MAX_TEXT
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace, write_checked
from engine.serve.client import RemoteError
from engine.serve.remote import RemoteSession, _Stream

FACTS = ServerFacts(name="m", url="http://127.0.0.1:1", engine="llama.cpp")
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\r"), max_size=3000)
NUMBER = st.one_of(st.integers(-10**20, 10**20), st.floats(allow_nan=False), st.just(1e308), st.text(max_size=5),
                   st.none())


class FakeResponse(io.BytesIO):
    """What ``http.client`` hands the stream reader: the body, line by line, and a content type."""

    def getheader(self, name: str, default=None):
        return "text/event-stream" if name.lower() == "content-type" else default


@st.composite
def chunks(draw) -> dict:
    """One streamed chunk: text (with or without logprobs and their candidates), maybe usage and timings."""
    text = draw(TEXT)
    choice: dict = {"delta": {"content": text}}
    if draw(st.booleans()):
        top = [{"token": draw(st.text(max_size=8)), "logprob": -draw(st.floats(0, 30)),
                "id": draw(st.integers(0, 2**40))} for _ in range(draw(st.integers(0, 220)))]
        choice["logprobs"] = {"content": [{"token": text, "logprob": -draw(st.floats(0, 30)), "top_logprobs": top}]}
    chunk: dict = {"choices": [choice]}
    if draw(st.booleans()):
        chunk["usage"] = {"prompt_tokens": draw(NUMBER), "completion_tokens": draw(NUMBER),
                          "prompt_tokens_details": {"cached_tokens": draw(NUMBER)}}
    if draw(st.booleans()):
        chunk["timings"] = {"prompt_n": draw(NUMBER), "prompt_ms": draw(NUMBER), "cache_n": draw(NUMBER)}
    return chunk


def stream(body: list[dict], done: bool) -> bytes:
    lines = [f"data: {json.dumps(c)}\n\n" for c in body]
    if done:
        lines.append('data: {"choices": [{"delta": {}, "finish_reason": "stop"}]}\n\ndata: [DONE]\n\n')
    return "".join(lines).encode()


def run_stream(raw: bytes, max_new_tokens: int) -> list[object]:
    """The events of one streamed run whose response body is ``raw`` (no socket: the reader is what is tested)."""
    events: list[object] = []
    s = _Stream(RemoteSession(FACTS), [{"role": "user", "content": "hi"}], "hi", "chat",
                GenerationParams(max_new_tokens=max_new_tokens), events.append, None, None)
    s.emit(RunStarted(s.run_id, "x", FACTS, s.params, "hi", [], [], "now"))
    try:
        s._finished(s._read(FakeResponse(raw)))
    except RemoteError as exc:                        # a stream the client refuses ends the run failed, kept
        s._failed("stream", str(exc))
    return events


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(chunks(), min_size=1, max_size=6), st.booleans(), st.integers(1, 12))
def test_whatever_a_server_streams_the_run_reads_back_and_nothing_is_lost_silently(tmp_path_factory, body, done,
                                                                                  max_new_tokens):
    events = run_stream(stream(body, done), max_new_tokens)
    end = events[-1]
    assert isinstance(end, (RunFinished, RunFailed))
    path = tmp_path_factory.mktemp("remote") / "run.kvscope.jsonl"
    written = write_checked(path, events)
    assert written.note == "" and read_trace(path) == events
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert len(steps) <= max_new_tokens                                   # the client's own limit holds
    assert all(len(s.text) <= MAX_TEXT and len(s.candidates) <= MAX_CANDIDATES for s in steps)
    sent = sum(len(c["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) for c in body
               if "logprobs" in c["choices"][0])
    shown = sum(len(s.candidates) + s.candidates_cut for s in steps)      # every candidate kept or counted as cut
    assert shown <= sent
    figures = end.summary.server_timings
    assert all(isinstance(v, (int, float)) and math.isfinite(v) and abs(v) <= 1e30 for v in figures.values())
    sent_text = "".join(c["choices"][0]["delta"]["content"] for c in body)
    received = "".join(s.text for s in steps)
    assert sent_text.startswith(received)                                  # pieces in order, split not changed
    limited = any("max_new_tokens" in n for n in end.summary.notes)     # the client ended it, and said so
    if len(received) < len(sent_text) and isinstance(end, RunFinished):
        assert end.reason == "max_tokens" and limited
    if isinstance(end, RunFinished) and not limited:
        assert shown == sent and received == sent_text


def test_a_long_chunk_is_split_into_pieces_a_token_may_hold():
    events = run_stream(stream([{"choices": [{"delta": {"content": "x" * 5000}}]}], True), 64)
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert [len(s.text) for s in steps] == [1024, 1024, 1024, 1024, 904]


def test_extra_candidates_are_cut_to_the_likeliest_with_a_count():
    top = [{"token": f"t{i}", "logprob": -i / 10} for i in range(200)]
    chunk = {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [
        {"token": "a", "logprob": -0.1, "top_logprobs": top}]}}]}
    step = next(e for e in run_stream(stream([chunk], True), 64) if isinstance(e, TokenStep))
    assert len(step.candidates) == 100 and step.candidates_cut == 100
    assert [c.text for c in step.candidates[:3]] == ["t0", "t1", "t2"]


def test_impossible_usage_figures_are_dropped_and_said():
    chunk = {"choices": [{"delta": {"content": "a"}}], "usage": {"prompt_tokens": 1e308, "completion_tokens": -3}}
    end = run_stream(stream([chunk], True), 64)[-1]
    assert end.summary.prompt_tokens is None and end.summary.server_timings["usage.completion_tokens"] == -3
    assert "usage.prompt_tokens (1e+308)" in end.summary.notes[0]
