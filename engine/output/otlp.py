"""Runs as OpenTelemetry spans, for the tracing a team already runs: every run in a trace (a local run, each
request of a load test) one span following OpenTelemetry's GenAI semantic conventions (``chat {model}``, with
``gen_ai.request.*``, ``gen_ai.usage.*``, ``gen_ai.response.finish_reasons`` and ``time_to_first_chunk``, every
name taken from the installed ``opentelemetry-semantic-conventions``), its latencies also under the names
vLLM and SGLang give theirs (``gen_ai.latency.time_to_first_token``, ``..._in_model_prefill``, ``..._decode``,
``e2e``, in seconds), and two child spans: until the first token (the prefill; a client sees only the wait) and
decode. Where a figure was measured is said (``kvscope.measured_by``: the engine here or a client of a server).

Written with the official SDK (``opentelemetry-sdk``, the optional extra ``otel``): to a file as OTLP/JSON (the
protobuf's JSON form, what a collector's OTLP receiver and its file exporter read), or sent to a collector's
OTLP/HTTP endpoint. Span times are the runs' own: the trace's events on one clock (``trace.OneClock``: a load
test's requests overlap), its zero placed by the first run's start (``RunStarted.started_at``).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from engine.facts.errors import EngineError
from engine.facts.events import ModelFacts, RunFailed, RunFinished, RunStarted
from engine.output.trace import OneClock
from engine.store.files import write_text

# vLLM's and SGLang's own span attributes for a request's phases, in seconds: no convention names them yet.
VLLM_LATENCY = "gen_ai.latency."


class OTLPError(EngineError):
    """Spans that cannot be made or sent, in one line."""


def _sdk() -> Any:
    try:
        from opentelemetry.sdk import trace as sdk_trace
        from opentelemetry.semconv._incubating.attributes import gen_ai_attributes  # noqa: F401 (the names)
    except ImportError:
        raise OTLPError("OpenTelemetry export needs the SDK: pip install 'kvscope[otel]' (opentelemetry-sdk, "
                        "opentelemetry-exporter-otlp-proto-http and opentelemetry-semantic-conventions)") from None
    return sdk_trace


def spans(events: Iterable[object]) -> Sequence[Any]:
    """Every finished or failed run in ``events`` as ended SDK spans (the request and its two phases)."""
    sdk_trace = _sdk()
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
    from opentelemetry.trace import SpanKind, set_span_in_context

    kept: list[Any] = []

    class Keep(SpanExporter):
        def export(self, batch):  # noqa: ANN001 (the SDK's signature)
            kept.extend(batch)
            return SpanExportResult.SUCCESS

    provider = sdk_trace.TracerProvider(resource=Resource.create({"service.name": "kvscope"}))
    provider.add_span_processor(SimpleSpanProcessor(Keep()))
    tracer = provider.get_tracer("kvscope")
    clock = OneClock()                   # every event on the trace's one clock (a load test's requests overlap)
    anchor: int | None = None            # the clock's zero, in epoch ns: placed by the first run's start
    started: dict[str, tuple[RunStarted, float]] = {}
    for event in events:                 # one pass: a trace streamed from its file is never held whole
        at = clock.place(event)
        if isinstance(event, RunStarted) and at is not None:
            if anchor is None:
                anchor = _epoch_ns(event.started_at) - int(at * 1e6)
            started[event.run_id] = (event, at)
        elif isinstance(event, (RunFinished, RunFailed)) and event.run_id in started and at is not None:
            run, at_start = started.pop(event.run_id)
            begin = (anchor or 0) + int(at_start * 1e6)
            end = (anchor or 0) + int(max(at, at_start) * 1e6)
            remote = not isinstance(run.model, ModelFacts)
            root = tracer.start_span(f"chat {run.model.name}", kind=SpanKind.CLIENT if remote else SpanKind.INTERNAL,
                                     start_time=begin, attributes=_attributes(run, event, remote))
            s = event.summary
            first = begin + int(s.ttft_ms * 1e6) if s.ttft_ms else None
            if first is not None and first <= end:
                context = set_span_in_context(root)
                phase = "waiting for the first token (client)" if remote else "prefill"
                tracer.start_span(phase, context=context, start_time=begin).end(end_time=first)
                if s.generated_tokens > 1:
                    tracer.start_span("decode", context=context, start_time=first).end(end_time=end)
                root.add_event("gen_ai.first_token", timestamp=first)
            if isinstance(event, RunFailed):
                from opentelemetry.trace import Status, StatusCode

                root.set_status(Status(StatusCode.ERROR, event.message[:200]))
            root.end(end_time=end)
    provider.shutdown()
    return kept


def _attributes(run: RunStarted, end: RunFinished | RunFailed, remote: bool) -> dict[str, Any]:
    """The span's attributes: the GenAI conventions' names from the installed package (never typed here), vLLM's
    ``gen_ai.latency.*`` beside them (what its and SGLang's own spans carry), and KVScope's own under ``kvscope.``."""
    from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai

    s, p = end.summary, run.params
    out: dict[str, Any] = {
        gen_ai.GEN_AI_OPERATION_NAME: gen_ai.GenAiOperationNameValues.CHAT.value,
        gen_ai.GEN_AI_PROVIDER_NAME: getattr(run.model, "engine", "") or "kvscope",
        gen_ai.GEN_AI_REQUEST_MODEL: run.model.name,
        gen_ai.GEN_AI_REQUEST_MAX_TOKENS: p.max_new_tokens, gen_ai.GEN_AI_REQUEST_TEMPERATURE: p.temperature,
        gen_ai.GEN_AI_REQUEST_TOP_P: p.top_p, gen_ai.GEN_AI_REQUEST_TOP_K: p.top_k,
        gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: s.generated_tokens,
        gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK: s.ttft_ms / 1000.0,
        VLLM_LATENCY + "time_to_first_token": s.ttft_ms / 1000.0,
        VLLM_LATENCY + "e2e": s.total_ms / 1000.0,
        VLLM_LATENCY + "time_in_model_decode": s.decode_ms / 1000.0,
        "kvscope.measured_by": "client of the server" if remote else "KVScope's engine",
        "kvscope.run_id": run.run_id,
    }
    if p.seed is not None:
        out[gen_ai.GEN_AI_REQUEST_SEED] = p.seed
    if isinstance(end, RunFinished):
        out[gen_ai.GEN_AI_RESPONSE_FINISH_REASONS] = [end.reason]
    prompt = s.server_timings.get("usage.prompt_tokens") if remote else (
        (s.prompt_tokens or 0) + (s.reused_tokens or 0))
    if prompt is not None:
        out[gen_ai.GEN_AI_USAGE_INPUT_TOKENS] = int(prompt)
    cached = s.server_cached_tokens if remote else s.reused_tokens
    if cached is not None:
        out[gen_ai.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = cached
    if s.prefill_ms is not None and not remote:
        out[VLLM_LATENCY + "time_in_model_prefill"] = s.prefill_ms / 1000.0
    if s.decode_runs:
        out["kvscope.time_per_output_token_ms"] = s.decode_ms / s.decode_runs
    for name, value in s.server_timings.items():       # the server's own figures, under its own names
        out[f"kvscope.server.{name}"] = value
    return out


def _epoch_ns(started_at: str) -> int:
    try:
        return int(datetime.fromisoformat(started_at).timestamp() * 1e9)
    except ValueError:
        return 0


def otlp_json(kept: Sequence[Any]) -> str:
    """The spans as one OTLP/JSON ``ExportTraceServiceRequest``."""
    from google.protobuf.json_format import MessageToJson
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    return MessageToJson(encode_spans(kept), indent=None) + "\n"


def write_otlp(path: str | os.PathLike, events: Iterable[object]) -> tuple[Path, int]:
    return write_spans(path, spans(events))


def write_spans(path: str | os.PathLike, kept: Sequence[Any]) -> tuple[Path, int]:
    return write_text(path, otlp_json(kept), "the OTLP file"), len(kept)


def send_spans(endpoint: str, kept: Sequence[Any], timeout_s: float = 10.0) -> int:
    """``kept`` (from ``spans``) to a collector's OTLP/HTTP endpoint (``http://HOST:4318/v1/traces``), as the
    protobuf the SDK's exporter sends, through KVScope's own client: the SDK's read the collector's whole answer
    and timed each read alone (a collector dripping its answer was waited on for ever); this one bounds the
    answer and the whole exchange by ``timeout_s``. Refused in one line."""
    from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans

    from engine.serve import client

    try:
        where = client.address(endpoint)
        client.post_bytes(where, "", encode_spans(kept).SerializeToString(), "application/x-protobuf", timeout_s,
                          api_key=False)              # the serving API key is the model server's, not the collector's
    except client.RemoteError as exc:
        raise OTLPError(f"the collector at {client.without_credentials(endpoint)} did not take the spans: "
                        f"{exc}") from None
    return len(kept)
