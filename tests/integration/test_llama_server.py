"""KVScope against a real llama-server on the embedded model: a streamed run whose tokens are the server's own
answer and whose client timings bound the server's reported ones, a concurrent load the server's /metrics sees,
and the window running and load-testing through it."""

from __future__ import annotations

import json
import urllib.request

import pytest

from engine.facts.events import RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.serve.remote import RemoteSession, probe
from tests.integration.conftest import SLOTS
from tests.lessons import collect

pytestmark = pytest.mark.integration
PROMPT = "What does a KV cache keep? Answer in one sentence."


def complete(url: str, tokens: int) -> dict:
    """The same request, not streamed, straight to the server: its own answer to compare with."""
    body = json.dumps({"messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens, "temperature": 0,
                       "seed": 1, "cache_prompt": False}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def test_probe_finds_llama_cpp_its_context_and_metrics(llama_server):
    facts = probe(llama_server)
    assert facts.engine == "llama.cpp" and facts.metrics and facts.context == 4096 // SLOTS


def test_a_streamed_run_is_the_servers_answer_and_its_timings_agree(llama_server):
    facts = probe(llama_server)
    events: list = []
    result = RemoteSession(facts).chat([{"role": "user", "content": PROMPT}], GenerationParams(max_new_tokens=32,
                                                                                             seed=1),
                                       events.append, reuse=False)
    assert isinstance(result, RunFinished)
    direct = complete(llama_server, 32)
    assert result.summary.text == direct["choices"][0]["message"]["content"]
    steps = [e for e in events if isinstance(e, TokenStep)]
    s, t = result.summary, result.summary.server_timings
    unsent = 1 if result.reason == "eos" else 0          # the end-of-text token: predicted, never streamed
    assert t["timings.predicted_n"] == s.generated_tokens + unsent and s.generated_tokens == len(steps)
    assert all(x.token_id is not None for x in steps)
    assert t["timings.prompt_n"] == s.prompt_tokens > 0 and t["timings.cache_n"] == 0
    assert s.ttft_ms >= t["timings.prompt_ms"]          # the client cannot see a token before the prompt is read
    assert s.total_ms >= t["timings.prompt_ms"] + t["timings.predicted_ms"] * 0.9


def test_a_concurrent_load_is_timed_per_request_and_seen_on_metrics(llama_server):
    _, end = collect("server load", RemoteSession(probe(llama_server)), requests=SLOTS, every_s=0.0,
                     new_tokens=64, poll_s=0.1, limit_s=120)
    r = end.result
    assert r.completed == SLOTS and r.failed == 0 and r.metrics_polls >= 2
    assert r.peak_running >= 2                           # the server decoded them together
    assert r.mean_client_minus_server_ms >= 0


def test_its_slots_and_each_answers_cache_n_are_read_in_its_own_words(llama_server):
    """/slots, polled during a load test, against /slots asked directly after it, and each answer's cache_n: a
    request sent after another with the same system prompt finished gets its prompt from a slot's cache."""
    from engine.serve import slots
    from engine.serve.client import get_json

    events, end = collect("server load", RemoteSession(probe(llama_server)), requests=SLOTS, every_s=1.5,
                          new_tokens=8, poll_s=0.2, limit_s=120, shared_prefix=80)
    r = end.result
    after, _more = slots.read_slots(get_json(probe(llama_server).url, "/slots"))
    assert r.completed == SLOTS and r.slots == len(after) == SLOTS and r.slot_context == after[0].n_ctx == 1024
    assert r.slots_polls >= 2 and r.slots_error == "" and r.peak_slot_held >= max(s.held for s in after) > 0
    rows = sorted((p.values for p in events if getattr(p, "series", "") == "request"), key=lambda v: v["index"])
    assert all("server_cache_n" in v for v in rows)
    first = rows[0]["server_cache_n"]                   # the template's first tokens, left by earlier tests at most
    assert max(v["server_cache_n"] for v in rows[1:3]) > first + 16, rows   # the shared system prompt, from a slot
    print(f"\n/slots: {r.slots} slots of {r.slot_context:,}; at most {r.peak_busy_slots} working, "
          f"{r.peak_slot_held:,} positions held by one; cache_n per request {[int(v['server_cache_n']) for v in rows]}")


def test_the_window_runs_and_load_tests_through_the_server(qtbot, llama_server, tmp_path, monkeypatch):
    from tests.app.conftest import close_and_dispose, make_window, run_and_wait, wait_idle

    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    window = make_window(qtbot, model_dir=llama_server)
    try:
        window.controls.max_tokens.setValue(12)
        run = run_and_wait(qtbot, window)
        window.refresh(force=True)
        assert run.remote and run.n_steps == 12 and "client" in window.timing.summary.text()
        assert "no per-layer tensors" in window.kv.info.text()
        view = window.experiments.views["server load"]
        view.form.set_value("requests", 2)
        view.form.set_value("new_tokens", 8)
        view.run_button.click()
        wait_idle(qtbot, window, timeout=120_000)
        window.refresh(force=True)
        record = window.store.latest_experiment("server load")
        assert record.result.completed == 2 and "tok/s</b> in all" in view.explain.text()
    finally:
        close_and_dispose(window)


def test_discovery_tells_llama_server_by_its_own_endpoints(llama_server):
    from engine.serve.discover import find_servers

    [found] = find_servers([int(llama_server.rsplit(":", 1)[1])])
    assert (found.engine, found.url, found.attachable) == ("llama.cpp", llama_server, True)
    assert found.version and found.models                          # its build, and the model it serves
