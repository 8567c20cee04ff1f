"""LM Studio in its own words: a run goes through its REST API (/api/v0), the same stream with its own stats.
No LM Studio can be installed here: the answers are shaped from its REST API documentation's examples (the
model list's /api/v0/models, and the stats, model_info and usage of its chat completion response, put on the
stream's last chunk)."""

from __future__ import annotations

import json

from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.serve.remote import RemoteSession, probe, remote_report
from tests.replay_server import ReplayServer, Route

MODELS = {"object": "list", "data": [
    {"id": "qwen2-vl-7b-instruct", "object": "model", "type": "vlm", "state": "not-loaded",
     "max_context_length": 32768},
    {"id": "granite-3.0-2b-instruct", "object": "model", "type": "llm", "publisher": "ibm", "arch": "granite",
     "compatibility_type": "gguf", "quantization": "Q4_K_M", "state": "loaded", "max_context_length": 4096}]}
LAST = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 24, "completion_tokens": 53, "total_tokens": 77},
        "stats": {"tokens_per_second": 51.43709529007664, "time_to_first_token": 0.111, "generation_time": 0.954,
                  "stop_reason": "eosFound"},
        "model_info": {"arch": "granite", "quant": "Q4_K_M", "format": "gguf", "context_length": 4096},
        "runtime": {"name": "llama.cpp-mac-arm64-apple-metal-advsimd", "version": "1.3.0"}}


def sse(*chunks: dict) -> bytes:
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


def test_a_run_on_lm_studio_goes_through_its_rest_api_and_keeps_its_own_stats():
    stream = sse({"choices": [{"index": 0, "delta": {"content": "Greetings"}, "finish_reason": None}]}, LAST)
    with ReplayServer({
            "GET /v1/models": Route(body=json.dumps({"data": [{"id": "granite-3.0-2b-instruct",
                                                                "owned_by": "organization_owner"}]}).encode()),
            "GET /api/v0/models": Route(body=json.dumps(MODELS).encode()),
            "POST /api/v0/chat/completions": Route(body=stream, content_type="text/event-stream")}) as server:
        facts = probe(server.url)
        events: list = []
        result = RemoteSession(facts).run("Introduce yourself.", GenerationParams(max_new_tokens=64), events.append)
        paths = [path for method, path, _, _ in server.requests if method == "POST"]
    assert (facts.engine, facts.context) == ("LM Studio", 4096) and paths == ["/api/v0/chat/completions"]
    assert isinstance(result, RunFinished) and [e.text for e in events if isinstance(e, TokenStep)] == ["Greetings"]
    t = result.summary.server_timings
    assert t["lmstudio.stats.time_to_first_token"] == 0.111 and t["lmstudio.model_info.context_length"] == 4096
    assert "lmstudio.stats.stop_reason" not in t                       # words, not a figure
    assert ("server: prompt 24 tokens, first token after 111.0 ms, 53 tokens generated in 954.0 ms (55.56 tok/s) "
            "(LM Studio's stats, as reported by the server)") in remote_report(result.summary)
