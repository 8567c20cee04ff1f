"""KVScope against a real vLLM (its CPU build from PyPI) on the embedded model: found by its answers, a streamed run
that is the server's own greedy answer, every metric KVScope reads present on its live /metrics page, a
concurrent load the server sees, each request's cached prompt tokens as the server's answer said (with requests
overlapping) summing to its own counters, its KV events drawn as a prefix tree beside them as a prediction; the
window does the same through it."""

from __future__ import annotations

import html
import json
import time
import urllib.request

import pytest

from engine.facts.events import ExperimentPoint, ExperimentProgress, RunFinished, TokenStep
from engine.facts.params import GenerationParams
from engine.lessons import server_load
from engine.output.trace import read_trace, write_trace
from engine.serve import client, metrics
from engine.serve.block_events import KVBlocks, RequestBlocks
from engine.serve.prefix_tree import tree_of
from engine.serve.remote import RemoteSession, probe
from tests.integration.conftest import VLLM_CONTEXT, VLLM_TEST_S
from tests.lessons import collect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(VLLM_TEST_S)]   # its server starts inside the first
PROMPT = "What does a KV cache keep? Answer in one sentence."


def complete(url: str, tokens: int) -> dict:
    body = json.dumps({"model": "smollm2", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
                       "temperature": 0, "seed": 1}).encode()
    request = urllib.request.Request(url + "/v1/chat/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as answer:
        return json.loads(answer.read())


def test_probe_finds_vllm_its_context_and_metrics(vllm_server):
    url, _events = vllm_server
    facts = probe(url)
    assert facts.engine == "vLLM" and facts.metrics and facts.context == VLLM_CONTEXT and facts.name == "smollm2"


def test_a_streamed_run_is_the_servers_own_greedy_answer(vllm_server):
    url, _events = vllm_server
    events: list = []
    result = RemoteSession(probe(url)).chat([{"role": "user", "content": PROMPT}],
                                            GenerationParams(max_new_tokens=24, seed=1), events.append)
    assert isinstance(result, RunFinished)
    assert result.summary.text == complete(url, 24)["choices"][0]["message"]["content"]
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert len(steps) == result.summary.generated_tokens and steps[0].candidates       # its logprobs, per token
    assert result.summary.server_timings["usage.prompt_tokens"] == len(
        client.tokenize(client.address(url), "smollm2", [{"role": "user", "content": PROMPT}]))


def test_every_metric_kvscope_reads_is_on_the_live_page_of_the_pinned_vllm(vllm_server):
    url, _events = vllm_server
    reading = metrics.read(client.get_text(client.address(url), "/metrics"))
    assert reading.engine == "vLLM" and reading.notes == ()
    assert set(reading.values) == set(metrics.ENGINES["vLLM"]), sorted(set(metrics.ENGINES["vLLM"]) - set(
        reading.values))


def test_every_requests_cached_tokens_are_the_servers_own_answer_with_requests_overlapping(vllm_server, tmp_path):
    """Several requests in flight at once, each longer than the gap to the next: each request's prompt tokens
    from the prefix cache are what vLLM's answer said (usage.prompt_tokens_details.cached_tokens), their sum is
    what its own counters moved, and the CLI's table and the replayed trace say the same per request; the tree's
    walk at send is kept as a prediction beside them."""
    url, events_at = vllm_server
    events, end = collect("server load", RemoteSession(probe(url)), requests=8, every_s=0.3, new_tokens=48,
                          poll_s=0.25, limit_s=600, shared_prefix=150, kv_events=events_at)
    r = end.result
    assert r.completed == 8 and r.kv_events_error == "" and r.blocks_stored > 0
    rows = sorted((p.values for p in events if isinstance(p, ExperimentPoint) and p.series == "request"),
                  key=lambda v: v["index"])
    in_flight = max(sum(1 for b in rows if b["arrival_ms"] <= a["arrival_ms"] < b["arrival_ms"] + b["e2e_ms"])
                    for a in rows)
    assert in_flight >= 2, "the requests did not overlap"
    assert all("cached_tokens" in v and "prompt_tokens" in v for v in rows)
    assert r.server_cached_tokens == sum(v["cached_tokens"] for v in rows) > 0      # the shared system prompt
    assert r.server_cached_tokens == r.cached_prompt_tokens_during                 # = the server's own counters
    assert r.server_prompt_tokens == r.prefix_queries_during and r.other_prompt_tokens is None
    walked = {e.index: e for e in events if isinstance(e, RequestBlocks)}
    assert [walked[v["index"]].server_cached_tokens for v in rows] == [v["cached_tokens"] for v in rows]
    assert r.mispredicted_requests == len(tree_of(events).mispredicted())
    table = server_load.table([p for p in events if isinstance(p, ExperimentPoint)], r).splitlines()
    for v in rows:                                       # the CLI prints each request's answer as it came
        line = next(x for x in table if x.split("|")[0].strip() == str(int(v["index"])))
        assert int(line.split("|")[8]) == v["cached_tokens"]
    replayed = read_trace(write_trace(tmp_path / "load.kvscope.jsonl", events))
    assert [e.server_cached_tokens for e in replayed if isinstance(e, RequestBlocks)] == [
        e.server_cached_tokens for e in events if isinstance(e, RequestBlocks)]
    tree = tree_of(replayed)
    shared = [b for b in tree.blocks.values() if len(b.requests) > 1]
    assert shared and all(b.text for b in tree.blocks.values())          # blocks carry the server's own text
    assert any(isinstance(e, KVBlocks) and e.action == "stored" for e in events)
    print(f"\nserved from the cache (the server's answers): {r.server_cached_tokens:,} of "
          f"{r.server_prompt_tokens:,}; predicted at send: {r.tree_reused_tokens:,}; {r.mispredicted_requests} "
          f"of 8 requests differ; {in_flight} in flight at most")


def test_the_shipped_workload_replays_with_each_requests_cached_tokens_the_servers_and_the_tree_beside(vllm_server):
    """The user's workload (three assistants' system prompts, interleaved) over ipc:// KV events: every request's
    cached tokens are the server's answer, their sum its counters', and a request sent after its assistant's first
    finished reuses that system prompt, in the server's words and in the tree's walk once answered."""
    from pathlib import Path

    url, events_at = vllm_server
    shipped = Path(__file__).resolve().parents[2] / "resources" / "workloads" / "three-assistants.jsonl"
    events, end = collect("server load", RemoteSession(probe(url)), workload=str(shipped), poll_s=0.25,
                          limit_s=600, kv_events=events_at)
    r = end.result
    assert r.completed == r.requested == 14 and r.kv_events_error == "" and r.blocks_stored > 0
    rows = sorted((p.values for p in events if isinstance(p, ExperimentPoint) and p.series == "request"),
                  key=lambda v: v["index"])
    assert r.server_cached_tokens == sum(v["cached_tokens"] for v in rows) == r.cached_prompt_tokens_during
    later = [v for v in rows if 3 <= v["index"] < 12]            # each assistant's second to fourth question
    assert all(v["cached_tokens"] >= 32 for v in later), [v["cached_tokens"] for v in later]
    walked = {e.index: e for e in events if isinstance(e, RequestBlocks)}
    assert all(len(walked[int(v["index"])].keys) * walked[int(v["index"])].block_size >= v["cached_tokens"]
               for v in rows)                                    # the tree holds what the server reused
    print(f"\nworkload: served from the cache {r.server_cached_tokens:,} of {r.server_prompt_tokens:,} prompt "
          f"tokens (the server's answers); predicted at send {r.tree_reused_tokens:,}; per request "
          f"{[int(v['cached_tokens']) for v in rows]}")


def test_a_watch_draws_another_clients_requests_as_a_tree_with_their_shared_trunk(vllm_server):
    """KVScope sends nothing (--requests 0, what kvscope --server URL --kv-events ADDR starts at launch); another
    client sends three requests sharing a system prompt: their blocks arrive from vLLM's events, as other clients',
    and the tree branches where the requests part after the blocks they share."""
    import threading

    url, events_at = vllm_server
    system = "You answer as a ship's navigator. " + " ".join(["Stars, tides and the log guide every answer."] * 12)
    cancel, events = threading.Event(), []

    def other_client() -> None:
        deadline = time.monotonic() + 300
        while not any(isinstance(e, ExperimentProgress) for e in list(events)) and time.monotonic() < deadline:
            time.sleep(0.2)                              # the watch is listening
        for question in ("Where are we?", "When is high tide?", "Which star is that?"):
            body = json.dumps({"model": "smollm2", "max_tokens": 4, "temperature": 0, "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": " ".join([question] * 8)}]}).encode()    # fills a block of its own
            urllib.request.urlopen(urllib.request.Request(url + "/v1/chat/completions", data=body, headers={
                "Content-Type": "application/json"}), timeout=120).read()
        time.sleep(1.0)                                  # the engine publishes its blocks as it stores them
        cancel.set()

    client = threading.Thread(target=other_client)
    client.start()
    _, end = collect("server load", RemoteSession(probe(url)), cancel=cancel, events=events, requests=0,
                     kv_events=events_at, limit_s=600, poll_s=0.5)
    client.join()
    tree = tree_of(events)
    trunk = [b for b in tree.blocks.values() if len([c for c in tree.children.get(b.key, [])
                                                      if c in tree.blocks]) >= 2]
    assert end.result.requested == 0 and end.result.blocks_stored > 0 and end.result.kv_events_error == ""
    assert trunk and not any(b.requests for b in tree.blocks.values())     # shared, and none of KVScope's own
    print(f"\nwatched: {end.result.blocks_stored} blocks stored by another client; the tree branches after "
          f"{len(trunk)} block(s)")


def test_a_concurrent_load_is_seen_on_metrics(vllm_server):
    url, _events = vllm_server
    _, end = collect("server load", RemoteSession(probe(url)), requests=4, every_s=0.0, new_tokens=48, poll_s=0.1,
                     limit_s=300)
    r = end.result
    assert r.completed == 4 and r.failed == 0 and r.metrics_polls >= 2 and r.peak_running >= 2


def test_the_window_draws_the_tree_through_vllm(qtbot, vllm_server, tmp_path, monkeypatch):
    from tests.app.conftest import close_and_dispose, make_window, run_and_wait, wait_idle

    url, events_at = vllm_server
    monkeypatch.setenv("KVSCOPE_SETTINGS", str(tmp_path / "settings.ini"))
    window = make_window(qtbot, model_dir=url)
    try:
        window.controls.max_tokens.setValue(8)
        assert run_and_wait(qtbot, window).remote
        view = window.experiments.views["server load"]
        for name, value in (("requests", 4), ("new_tokens", 8), ("shared_prefix", 100), ("kv_events", events_at)):
            view.form.set_value(name, value)
        view.run_button.click()
        wait_idle(qtbot, window, timeout=300_000)
        window.refresh(force=True)
        record = window.store.latest_experiment("server load")
        assert record.result.completed == 4 and record.of(KVBlocks, RequestBlocks)
        assert view.tree_chart.isVisibleTo(window) and view.tree_chart.blocks
        assert "from the server's answers" in html.unescape(view.explain.text())
        cached = [view.table.item(row, [c[0] for c in view.columns].index("cached_tokens")).text()
                  for row in range(view.table.rowCount())]
        points = sorted((p.values for p in record.points if p.series == "request"), key=lambda v: v["arrival_ms"])
        assert sorted(cached) == sorted(f"{v['cached_tokens']:,.0f}" for v in points)
    finally:
        close_and_dispose(window)


def test_discovery_tells_vllm_by_its_own_endpoints(vllm_server):
    from engine.serve.discover import find_servers

    url, _events = vllm_server
    [found] = find_servers([int(url.rsplit(":", 1)[1])])
    assert (found.engine, found.url, found.attachable, found.models) == ("vLLM", url, True, ("smollm2",))
    assert found.version                                           # from its /version
