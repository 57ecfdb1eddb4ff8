"""OTLP export of the spans llmesh records: the SDK's OTLP/gRPC exporter with a faster encoder.

The OTLP exporter's own encoder builds every attribute as a message of its own and copies them
into the span, and hashes the resource (a JSON dump of its attributes) once per span: about
ten times what recording the span costs, on the export thread, which holds the GIL meanwhile.
Here a span's fields are written in place; a span with events, links or attribute values other
than str, bool, int and float (rare) is encoded by the exporter's encoder. The bytes are the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind

_KINDS = {
    SpanKind.INTERNAL: trace_pb2.Span.SpanKind.SPAN_KIND_INTERNAL,
    SpanKind.SERVER: trace_pb2.Span.SpanKind.SPAN_KIND_SERVER,
    SpanKind.CLIENT: trace_pb2.Span.SpanKind.SPAN_KIND_CLIENT,
    SpanKind.PRODUCER: trace_pb2.Span.SpanKind.SPAN_KIND_PRODUCER,
    SpanKind.CONSUMER: trace_pb2.Span.SpanKind.SPAN_KIND_CONSUMER,
}
_HAS_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_HAS_IS_REMOTE_MASK
_IS_REMOTE = trace_pb2.SpanFlags.SPAN_FLAGS_CONTEXT_IS_REMOTE_MASK


def _plain_attributes(target: Any, attributes: Mapping[str, Any]) -> bool:
    """Writes `attributes` into the repeated KeyValue `target`; False (target partly written)
    at the first value that is not a str, bool, int or float."""
    for key, value in attributes.items():
        kind = type(value)
        entry = target.add()
        entry.key = key
        if kind is str:
            entry.value.string_value = value
        elif kind is bool:
            entry.value.bool_value = value
        elif kind is int:
            entry.value.int_value = value
        elif kind is float:
            entry.value.double_value = value
        else:
            return False
    return True


def _write_span(target: Any, span: ReadableSpan) -> bool:
    """Writes `span` into the Span message `target`; False where the exporter's encoder must."""
    if span.events or span.links:
        return False
    attributes = span.attributes or {}
    if not _plain_attributes(target.attributes, attributes):
        return False
    context = span.get_span_context()
    if context is None:
        return False
    target.trace_id = context.trace_id.to_bytes(16, "big")
    target.span_id = context.span_id.to_bytes(8, "big")
    if context.trace_state:
        target.trace_state = ",".join(f"{key}={value}" for key, value in context.trace_state.items())
    parent = span.parent
    if parent:
        target.parent_span_id = parent.span_id.to_bytes(8, "big")
    target.name = span.name
    target.kind = _KINDS[span.kind]
    if span.start_time:
        target.start_time_unix_nano = span.start_time
    if span.end_time:
        target.end_time_unix_nano = span.end_time
    dropped = getattr(attributes, "dropped", 0)
    if dropped:
        target.dropped_attributes_count = dropped
    status = target.status
    status.SetInParent()  # the exporter's encoder always sends a status, even an unset one
    if span.status.status_code.value:
        status.code = span.status.status_code.value
    if span.status.description:
        status.message = span.status.description
    target.flags = _HAS_IS_REMOTE | (_IS_REMOTE if parent and parent.is_remote else 0)
    return True


def encode_spans(spans: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
    """The OTLP export request of `spans`, byte for byte what the OTLP exporter's encoder makes
    (grouped by resource, then instrumentation scope, in the order first seen)."""
    request = ExportTraceServiceRequest()
    resources: list[tuple[Resource, Any, dict[Any, Any]]] = []
    by_id: dict[int, tuple[Resource, Any, dict[Any, Any]]] = {}  # hashing a Resource dumps it as JSON
    for span in spans:
        resource = span.resource
        found = by_id.get(id(resource))
        if found is None:
            found = next((r for r in resources if r[0] == resource), None)
        if found is None:
            resource_spans = request.resource_spans.add()
            resource_spans.resource.CopyFrom(sdk_encode_spans([span]).resource_spans[0].resource)
            if resource.schema_url:
                resource_spans.schema_url = resource.schema_url
            found = (resource, resource_spans, {})
            resources.append(found)
        by_id[id(resource)] = found
        _, resource_spans, scopes = found
        scope = span.instrumentation_scope or None
        scope_spans = scopes.get(scope)
        if scope_spans is None:
            scope_spans = scopes[scope] = resource_spans.scope_spans.add()
            scope_spans.scope.CopyFrom(sdk_encode_spans([span]).resource_spans[0].scope_spans[0].scope)
            if scope is not None and scope.schema_url:
                scope_spans.schema_url = scope.schema_url
        target = scope_spans.spans.add()
        if not _write_span(target, span):
            target.Clear()
            target.CopyFrom(sdk_encode_spans([span]).resource_spans[0].scope_spans[0].spans[0])
    return request


class LeanOtlpSpanExporter(OTLPSpanExporter):
    """The SDK's OTLP/gRPC span exporter (endpoint, headers, TLS and retries from the standard
    OTEL_EXPORTER_OTLP_* variables) with `encode_spans` as its encoder."""

    def _translate_data(self, data: Sequence[ReadableSpan]) -> ExportTraceServiceRequest:
        return encode_spans(data)
