"""Where every figure comes from: a local run's figures are measured here, achieved over a measured time or
computed; a served run's own figures are the server's, and nothing of its prefill is called measured here."""

from __future__ import annotations

import json

from engine import cli
from engine.facts.events import RunFinished, ServerFacts
from engine.facts.params import GenerationParams
from engine.facts.provenance import ACHIEVED, COMPUTED, KINDS, MEASURED, REPORTED, run_sources
from engine.run.session import Session
from engine.serve.remote import RemoteSession
from tests.replay_server import ReplayServer, Route


def test_a_local_runs_figures_say_measured_achieved_or_computed_and_from_what(tiny):
    events: list = []
    Session(tiny).run("The cache holds", GenerationParams(max_new_tokens=6, temperature=0.0), events.append)
    s = next(e for e in events if isinstance(e, RunFinished)).summary
    rows = {r.figure: r for r in run_sources(tiny.facts, s)}
    assert rows["time to first token"].kind == MEASURED and rows["time to first token"].value == f"{s.ttft_ms:,.1f} ms"
    assert rows["prefill time"].kind == MEASURED and rows["prefill speed"].kind == ACHIEVED
    assert rows["decode time"].kind == MEASURED and rows["decode speed"].kind == ACHIEVED
    assert rows["KV cache held"].kind == MEASURED and rows["KV cache at full context"].kind == COMPUTED
    assert all(r.kind in KINDS and r.source for r in rows.values())
    assert not any(r.kind == REPORTED for r in rows.values())
    off = {r.figure for r in run_sources(tiny.facts, s, kv_on=False)}
    assert "KV cache held" not in off and "KV cache at full context" not in off


def test_a_served_runs_own_figures_are_the_servers_and_its_prefill_is_not_called_measured_here():
    stream = (b'data: {"choices": [{"delta": {"content": "Hi"}, "finish_reason": null}]}\n\n'
              b'data: {"choices": [{"delta": {"content": "!"}, "finish_reason": "stop"}], '
              b'"timings": {"prompt_n": 7, "prompt_ms": 12.5, "predicted_n": 2, "predicted_ms": 8.0, "cache_n": 3}}\n\n'
              b"data: [DONE]\n\n")
    with ReplayServer({"POST /v1/chat/completions": Route(body=stream, content_type="text/event-stream")}) as server:
        facts = ServerFacts(name="m", url=server.url, engine="llama.cpp", context=4096)
        result = RemoteSession(facts).run("hi", GenerationParams(max_new_tokens=4))
    rows = {r.figure: r for r in run_sources(facts, result.summary)}
    assert rows["time to first token"].kind == MEASURED and "this client's clock" in rows["time to first token"].source
    assert rows["timings.prompt_ms"].kind == REPORTED and rows["timings.prompt_ms"].value == "12.5"
    assert rows["prompt tokens"].kind == REPORTED and rows["prompt tokens"].value == "7"
    assert "prefill time" not in rows and "KV cache held" not in rows


def test_the_cli_json_carries_the_same_table(tiny_model_dir, capsys):
    assert cli.main(["--model", str(tiny_model_dir), "--device", "cpu", "--dtype", "float32", "--prompt", "hi",
                     "--max-new-tokens", "3", "--raw", "--json", "--no-history"]) == 0
    payload = json.loads(capsys.readouterr().out)
    kinds = {row["figure"]: row["kind"] for row in payload["sources"]}
    assert kinds["decode speed"] == ACHIEVED and kinds["KV cache at full context"] == COMPUTED
