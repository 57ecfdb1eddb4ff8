"""llmesh.otlp's encoder: the exact bytes of the OTLP exporter's own encoder, for every kind of span."""

from __future__ import annotations

from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans as sdk_encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags, TraceState

from llmesh.otlp import encode_spans
from llmesh.spans import LeanTracerProvider


class Kept(SpanExporter):
    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.spans.extend(spans)
        return SpanExportResult.SUCCESS


def recorded() -> list[ReadableSpan]:
    kept = Kept()
    provider = LeanTracerProvider(resource=Resource.create({"service.name": "llmesh-test", "llmesh.service": "x"}))
    provider.add_span_processor(SimpleSpanProcessor(kept))
    server = provider.get_tracer("llmesh.server", "1.0", "https://opentelemetry.io/schemas/1.21.0")
    other = provider.get_tracer("llmesh.cache")
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(1), trace_state=TraceState([("k", "v")]))
    plain = {"rpc.system": "grpc", "net.peer.port": 5555, "llmesh.cache.hit": True, "llmesh.similarity": 0.93}
    top = server.start_child("llmesh.v1.Gateway/Generate", remote, SpanKind.SERVER, plain)
    top.set_attribute("text", "é 中文 \n")
    top.end()
    child = other.start_span("cache.redis.get", attributes={"llmesh.cache.tier": "exact"})
    child.set_status(Status(StatusCode.ERROR, "redis down"))
    child.end()
    listed = other.start_span("inference.decode", kind=SpanKind.CLIENT, attributes={"reasons": ["stop", "length"]})
    listed.end()
    evented = server.start_span("with.event", attributes={"n": -1})
    evented.add_event("exception", {"exception.type": "ValueError"})
    evented.end()
    linked = server.start_span("with.link", links=[Link(remote, {"why": "batch"})])
    linked.set_status(Status(StatusCode.OK))
    linked.end()
    server.start_span("bare").end()
    provider.force_flush()
    provider.shutdown()
    return kept.spans


def test_the_bytes_are_the_exporters_own_for_every_kind_of_span() -> None:
    spans = recorded()
    assert len(spans) == 6
    assert encode_spans(spans).SerializeToString() == sdk_encode_spans(spans).SerializeToString()
    for span in spans:  # each alone too: its resource and scope written once
        assert encode_spans([span]).SerializeToString() == sdk_encode_spans([span]).SerializeToString()


def test_spans_of_equal_resources_share_one_entry() -> None:
    spans = recorded()
    again = [
        ReadableSpan(
            name=s.name,
            context=s.context,
            parent=s.parent,
            resource=Resource.create(dict(s.resource.attributes)),  # equal, another object
            attributes=s.attributes,
            kind=s.kind,
            status=s.status,
            start_time=s.start_time,
            end_time=s.end_time,
            instrumentation_scope=s.instrumentation_scope,
        )
        for s in spans[:3]
    ]
    mixed = [*spans[:3], *again]
    request = encode_spans(mixed)
    assert len(request.resource_spans) == 1
    assert request.SerializeToString() == sdk_encode_spans(mixed).SerializeToString()
