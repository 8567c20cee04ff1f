"""Runs as OpenTelemetry spans: a recorded vLLM load test's twelve requests and a local run, written as OTLP/JSON
and read back with OpenTelemetry's own protobuf classes, sent to a collector's OTLP/HTTP endpoint, and the CLI."""

from __future__ import annotations

from pathlib import Path

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from engine.facts.events import RunFinished, RunStarted
from engine.facts.params import GenerationParams
from engine.output.otlp import write_otlp
from engine.output.trace import read_trace
from engine.run.session import Session
from tests.otlp_spans import attributes, read_back
from tests.replay_server import ReplayServer, Route

LOAD = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_load.kvscope.jsonl"


def test_a_load_tests_requests_are_genai_spans_with_kvscopes_figures_read_back_by_otel(tmp_path):
    events = read_trace(LOAD)
    path, count = write_otlp(tmp_path / "load.otlp.json", events)
    spans = read_back(path)
    requests = sorted((s for s in spans if s.name == "chat smollm2"), key=lambda s: s.start_time_unix_nano)
    finished = {e.run_id: e for e in events if isinstance(e, RunFinished)}
    assert len(requests) == len(finished) == 12 and count == len(spans)
    for span in requests:
        a = attributes(span)
        run = finished[a["kvscope.run_id"]]
        assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.provider.name"] == "vLLM"
        assert a["gen_ai.request.model"] == "smollm2"
        assert a["gen_ai.usage.output_tokens"] == run.summary.generated_tokens
        assert a["gen_ai.latency.time_to_first_token"] == pytest.approx(run.summary.ttft_ms / 1000)
        assert a["gen_ai.response.time_to_first_chunk"] == a["gen_ai.latency.time_to_first_token"]   # the conventions'
        assert a.get("gen_ai.usage.cache_read.input_tokens") == run.summary.reused_tokens     # absent: unsaid
        assert a["gen_ai.response.finish_reasons"] == [run.reason]
        assert a["kvscope.measured_by"] == "client of the server"
        children = [s for s in spans if s.parent_span_id == span.span_id]
        assert {c.name for c in children} <= {"waiting for the first token (client)", "decode"} and children
        first = next(c for c in children if c.name.startswith("waiting"))
        assert (first.end_time_unix_nano - first.start_time_unix_nano) / 1e6 == pytest.approx(run.summary.ttft_ms,
                                                                                               abs=0.01)
    offsets = [(s.start_time_unix_nano - requests[0].start_time_unix_nano) / 1e9 for s in requests]
    assert offsets[-1] > 3.0 and all(b > a for a, b in zip(offsets, offsets[1:]))    # sent apart, in order


def test_a_local_run_is_an_internal_span_with_its_prefill_measured_by_the_engine(tiny, tmp_path):
    events: list = []
    Session(tiny).run("hello there", GenerationParams(max_new_tokens=4), events.append)
    spans = read_back(write_otlp(tmp_path / "run.otlp.json", events)[0])
    (root,) = [s for s in spans if s.name.startswith("chat ")]
    a = attributes(root)
    summary = next(e for e in events if isinstance(e, RunFinished)).summary
    assert a["kvscope.measured_by"] == "KVScope's engine" and a["gen_ai.provider.name"] == "kvscope"
    assert a["gen_ai.latency.time_in_model_prefill"] == pytest.approx(summary.prefill_ms / 1000)
    assert a["gen_ai.usage.input_tokens"] == summary.prompt_tokens and {s.name for s in spans} >= {"prefill", "decode"}
    assert next(e for e in events if isinstance(e, RunStarted)).run_id == a["kvscope.run_id"]


def test_the_cli_writes_a_file_and_sends_to_a_collector(tmp_path, capsys):
    from engine.cli import main

    with ReplayServer({"POST /v1/traces": Route(body=b"", content_type="application/x-protobuf")}) as collector:
        code = main(["otlp", str(LOAD), "--out", str(tmp_path / "spans.json"), "--endpoint",
                     f"{collector.url}/v1/traces"])
        bodies = [body for method, path, body, _ in collector.requests if path == "/v1/traces"]
    assert code == 0 and len(read_back(tmp_path / "spans.json")) == 36
    received = ExportTraceServiceRequest.FromString(bodies[0])
    assert sum(len(s.spans) for r in received.resource_spans for s in r.scope_spans) == 36
    out = capsys.readouterr().out
    assert "36 spans" in out and "sent 36 spans" in out
    with pytest.raises(SystemExit) as refused:                    # nowhere to put them: said, status 2
        main(["otlp", str(LOAD)])
    assert refused.value.code == 2 and "give --out FILE, --endpoint URL or both" in capsys.readouterr().err



def test_spans_go_to_a_collector_without_the_serving_api_key_and_a_refusal_is_one_line(tmp_path, monkeypatch):
    """Spans are sent by KVScope's own bounded client: the serving API key (``KVSCOPE_API_KEY``) belongs to the
    model server, never to a collector, and a collector's refusal is one line naming it."""
    from engine.output.otlp import OTLPError, send_spans

    monkeypatch.setenv("KVSCOPE_API_KEY", "sk-server-only")
    with ReplayServer({"POST /v1/traces": Route(body=b"", content_type="application/x-protobuf")}) as collector:
        assert send_spans(f"{collector.url}/v1/traces", [], timeout_s=5.0) == 0
        (_, _, _, headers), = collector.requests
    assert "Authorization" not in headers and headers["Content-Type"] == "application/x-protobuf"
    with ReplayServer({"POST /v1/traces": Route(status=503, body=b"busy")}) as collector:
        with pytest.raises(OTLPError) as refused:
            send_spans(f"{collector.url}/v1/traces", [], timeout_s=5.0)
    assert f"the collector at {collector.url}/v1/traces did not take the spans" in str(refused.value)
    assert "\n" not in str(refused.value)
