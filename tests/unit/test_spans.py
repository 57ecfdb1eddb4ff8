"""The lean span recording path exports what the SDK's own spans would."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, DEFAULT_ON
from opentelemetry.trace import SpanKind, StatusCode

from llmesh import spans
from llmesh.spans import LeanSpan, LeanTracerProvider
from llmesh.testing import wait_until


@pytest.fixture
def provider() -> LeanTracerProvider:
    p = LeanTracerProvider(resource=Resource.create({"service.name": "unit"}), sampler=DEFAULT_ON)
    yield p
    p.shutdown()


def exported(provider: LeanTracerProvider) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_spans_export_with_attributes_events_links_and_parents(provider: LeanTracerProvider) -> None:
    exporter = exported(provider)
    tracer = provider.get_tracer("unit.test", "1.0")
    with tracer.start_as_current_span("parent", kind=SpanKind.SERVER, attributes={"a": 1}) as parent:
        assert isinstance(parent, LeanSpan) and parent.is_recording()
        current = trace.get_current_span()
        current.set_attribute("b", "two")
        current.set_attributes({"c": [1.5, 2.5], "dropped": None})
        current.add_event("something", {"n": 3})
        with tracer.start_as_current_span("child") as child:
            child.add_link(parent.get_span_context(), {"why": "test"})
            child.set_status(StatusCode.ERROR, "bad")
    assert not parent.is_recording()
    parent.set_attribute("late", True)  # ignored once ended, as the SDK does
    provider.force_flush()
    by_name = {s.name: s for s in exporter.get_finished_spans()}
    assert set(by_name) == {"parent", "child"}
    p, c = by_name["parent"], by_name["child"]
    assert dict(p.attributes or {}) == {"a": 1, "b": "two", "c": (1.5, 2.5)}  # None dropped on export
    assert p.kind is SpanKind.SERVER and p.parent is None
    assert [(e.name, dict(e.attributes or {})) for e in p.events] == [("something", {"n": 3})]
    assert p.resource.attributes["service.name"] == "unit"
    assert p.instrumentation_scope is not None and p.instrumentation_scope.name == "unit.test"
    assert p.start_time is not None and p.end_time is not None and p.end_time >= p.start_time
    assert c.parent is not None and c.parent.span_id == p.context.span_id
    assert c.context.trace_id == p.context.trace_id
    assert [link.context.span_id for link in c.links] == [p.context.span_id]
    assert c.status.status_code is StatusCode.ERROR and c.status.description == "bad"


def test_exceptions_are_recorded_and_set_the_status(provider: LeanTracerProvider) -> None:
    exporter = exported(provider)
    tracer = provider.get_tracer("unit.test")
    with pytest.raises(ValueError), tracer.start_as_current_span("failing"):
        raise ValueError("boom")
    provider.force_flush()
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code is StatusCode.ERROR and "boom" in (span.status.description or "")
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "ValueError" and event.attributes["exception.message"] == "boom"
    assert "Traceback" in event.attributes["exception.stacktrace"]


def test_sampling_follows_the_configured_sampler() -> None:
    provider = LeanTracerProvider(sampler=ALWAYS_OFF)
    try:
        exporter = exported(provider)
        span = provider.get_tracer("unit.test").start_span("not sampled")
        assert not span.is_recording() and span.get_span_context().is_valid
        assert not span.get_span_context().trace_flags.sampled
        span.end()
        provider.force_flush()
        assert exporter.get_finished_spans() == ()
    finally:
        provider.shutdown()


def test_without_processors_spans_only_carry_ids(provider: LeanTracerProvider) -> None:
    span = provider.get_tracer("unit.test").start_span("nobody listens")
    assert not span.is_recording()
    assert span.get_span_context().is_valid and span.get_span_context().trace_flags.sampled


def test_a_sampled_remote_parent_is_continued(provider: LeanTracerProvider) -> None:
    exported(provider)
    remote = trace.SpanContext(
        0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331, is_remote=True, trace_flags=trace.TraceFlags(1)
    )
    span = provider.get_tracer("unit.test").start_span(
        "continued", context=trace.set_span_in_context(trace.NonRecordingSpan(remote))
    )
    assert span.get_span_context().trace_id == remote.trace_id
    assert isinstance(span, LeanSpan) and span.parent == remote


def test_the_background_thread_hands_spans_over_without_a_flush(provider: LeanTracerProvider) -> None:
    exporter = exported(provider)
    provider.get_tracer("unit.test").start_span("background").end()
    wait_until(exporter.get_finished_spans, 5 * spans.FLUSH_INTERVAL_S + 2, message="the span was never handed over")
    assert exporter.get_finished_spans()[0].name == "background"


def test_a_processor_sees_only_spans_ended_after_it_was_added(provider: LeanTracerProvider) -> None:
    tracer = provider.get_tracer("unit.test")
    tracer.start_span("before").end()
    exporter = exported(provider)
    tracer.start_span("after").end()
    provider.force_flush()
    assert [s.name for s in exporter.get_finished_spans()] == ["after"]


def test_a_full_queue_drops_and_counts(provider: LeanTracerProvider, monkeypatch: pytest.MonkeyPatch) -> None:
    exported(provider)
    monkeypatch.setattr(spans, "MAX_QUEUED", 0)
    provider.get_tracer("unit.test").start_span("dropped").end()
    assert provider.dropped_spans == 1


def test_disabled_sdk_gives_no_op_tracers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    provider = LeanTracerProvider()
    try:
        span = provider.get_tracer("unit.test").start_span("nothing")
        assert not span.is_recording()
    finally:
        provider.shutdown()
