"""Ollama in its own words: a run on Ollama goes through its native API and keeps its own prefill/decode split.
No Ollama binary can be installed here: the answers are shaped from Ollama's API documentation and its official
Python client's output (the final chunk's figures below are the client's documented example for ``gemma2:2b``:
10 prompt tokens in 246,847,000 ns, 17 tokens in 4,032,296,000 ns)."""

from __future__ import annotations

import json

from engine.facts.events import RunFailed, RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.serve.remote import RemoteSession, probe, remote_report
from tests.replay_server import ReplayServer, Route

NDJSON = "application/x-ndjson"
DONE = {"model": "gemma2:2b", "created_at": "2024-08-07T03:57:37.0774624Z",
        "message": {"role": "assistant", "content": ""}, "done_reason": "stop", "done": True,
        "total_duration": 4353619900, "load_duration": 63915300, "prompt_eval_count": 10,
        "prompt_eval_duration": 246847000, "eval_count": 17, "eval_duration": 4032296000}


def lines(*chunks: dict) -> bytes:
    return b"".join(json.dumps(c).encode() + b"\n" for c in chunks)


def piece(text: str, field: str = "message") -> dict:
    body = {"message": {"role": "assistant", "content": text}} if field == "message" else {"response": text}
    return {"model": "gemma2:2b", "created_at": "2024-08-07T03:57:33.0365888Z", **body, "done": False}


def ollama(**routes: Route) -> ReplayServer:
    return ReplayServer({
        "GET /v1/models": Route(body=json.dumps({"object": "list", "data": [
            {"id": "gemma2:2b", "object": "model", "owned_by": "library"}]}).encode()),
        "GET /api/version": Route(body=b'{"version": "0.5.7"}'),
        "GET /api/ps": Route(body=json.dumps({"models": [{"name": "gemma2:2b", "size": 3_000_000_000,
                                                          "size_vram": 3_000_000_000,
                                                          "context_length": 4096}]}).encode()),
        **routes})


def test_a_chat_on_ollama_streams_through_its_own_api_and_keeps_its_prefill_and_decode_split():
    answer = lines(piece("Hello"), piece("!"), DONE)
    with ollama(**{"POST /api/chat": Route(body=answer, content_type=NDJSON)}) as server:
        facts = probe(server.url)
        assert (facts.engine, facts.context) == ("Ollama", 4096)
        assert any("prompt_eval_count" in line for line in facts.reveals)
        events: list = []
        result = RemoteSession(facts).run("hi", GenerationParams(max_new_tokens=32, temperature=0.0, seed=3),
                                          events.append)
        sent = json.loads(next(body for method, path, body, _ in server.requests if path == "/api/chat"))
    assert isinstance(result, RunFinished) and result.reason == "eos"
    assert [e.text for e in events if isinstance(e, TokenStep)] == ["Hello", "!"]
    assert sent["messages"] == [{"role": "user", "content": "hi"}] and sent["stream"] is True
    assert sent["options"] == {"num_predict": 32, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 3}
    s = result.summary
    assert s.server_timings["ollama.prompt_eval_count"] == 10 and s.server_timings["ollama.eval_count"] == 17
    assert s.prompt_tokens == 10                               # the prompt as the server counted it
    assert ("server: prompt 10 tokens in 246.8 ms (40.51 tok/s), 17 tokens generated in 4,032.3 ms (4.22 tok/s), "
            "model load 63.9 ms, total 4,353.6 ms (Ollama's own figures, as reported by the server)"
            ) in remote_report(s)


def test_a_raw_run_goes_to_generate_as_it_is_and_a_stream_without_done_is_said_dropped():
    answer = lines(piece("The", "response"), piece(" cache", "response"))       # cut before "done": true
    with ollama(**{"POST /api/generate": Route(body=answer, content_type=NDJSON)}) as server:
        result = RemoteSession(probe(server.url)).run("Once", GenerationParams(max_new_tokens=4, chat_template=False))
        sent = json.loads(next(body for method, path, body, _ in server.requests if path == "/api/generate"))
    assert sent["prompt"] == "Once" and sent["raw"] is True and "messages" not in sent
    assert isinstance(result, RunFailed) and "closed the stream before saying it was done" in result.message
    assert result.summary.generated_tokens == 2


def test_an_error_line_and_an_html_answer_are_one_line_each():
    error = lines(piece("Hi"), {"error": "model 'gemma2:2b' not found, try pulling it first"})
    with ollama(**{"POST /api/chat": Route(body=error, content_type=NDJSON)}) as server:
        failed = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=4))
    assert isinstance(failed, RunFailed) and "not found, try pulling it first" in failed.message
    with ollama(**{"POST /api/chat": Route(body=b"<html>proxy</html>", content_type="text/html")}) as server:
        failed = RemoteSession(probe(server.url)).run("hi", GenerationParams(max_new_tokens=4))
    assert isinstance(failed, RunFailed) and "text/html, not a token stream (application/x-ndjson)" in failed.message
