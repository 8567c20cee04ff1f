"""OTLP/JSON read back with OpenTelemetry's own protobuf classes, for the tests of the spans KVScope writes."""

from __future__ import annotations

from pathlib import Path

from google.protobuf.json_format import Parse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


def read_back(path: Path) -> list:
    request = Parse(path.read_text(), ExportTraceServiceRequest())
    return [span for resource in request.resource_spans for scope in resource.scope_spans for span in scope.spans]


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        value = kv.value
        out[kv.key] = (value.string_value if value.HasField("string_value") else value.int_value
                       if value.HasField("int_value") else value.double_value if value.HasField("double_value")
                       else [v.string_value for v in value.array_value.values])
    return out
