"""W3C trace context read and written on the RPC hot path agrees with the global propagator."""

from __future__ import annotations

from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState

from llmesh.rpc_tracing import _parent_context, _trace_headers

TRACE_ID = 0x0AF7651916CD43DD8448EB211C80319C
SPAN_ID = 0xB7AD6B7169203331
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def parent_of(metadata: list[tuple[str, str]]) -> SpanContext | None:
    ctx = _parent_context(metadata)
    return None if ctx is None else trace.get_current_span(ctx).get_span_context()


def test_a_plain_traceparent_is_read_as_the_propagator_reads_it() -> None:
    parent = parent_of([("user-agent", "x"), ("traceparent", TRACEPARENT)])
    expected = trace.get_current_span(propagate.extract({"traceparent": TRACEPARENT})).get_span_context()
    assert parent == expected
    assert parent is not None and parent.trace_id == TRACE_ID and parent.span_id == SPAN_ID
    assert parent.is_remote and parent.trace_flags.sampled


def test_no_traceparent_means_no_parent() -> None:
    assert _parent_context([("user-agent", "x")]) is None
    assert _parent_context(None) is None


def test_malformed_traceparents_start_a_new_trace() -> None:
    for bad in (
        TRACEPARENT.upper(),
        "00-" + "0" * 32 + "-b7ad6b7169203331-01",  # all-zero trace id
        "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
        "00-0af7651916cd43dd_448eb211c80319c-b7ad6b7169203331-01",
    ):
        parent = parent_of([("traceparent", bad)])
        assert parent is None or not parent.is_valid, bad


def test_tracestate_and_baggage_go_through_the_global_propagator() -> None:
    parent = parent_of([("traceparent", TRACEPARENT), ("tracestate", "vendor=abc")])
    assert parent is not None and parent.trace_id == TRACE_ID
    assert parent.trace_state.get("vendor") == "abc"
    ctx = _parent_context([("traceparent", TRACEPARENT), ("baggage", "user=alice")])
    assert ctx is not None and baggage.get_baggage("user", ctx) == "alice"


def test_headers_written_round_trip() -> None:
    span = NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, False, TraceFlags(1)))
    headers = _trace_headers(span)
    assert headers == [("traceparent", TRACEPARENT)]
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    assert dict(headers) == carrier
    assert parent_of(headers) == SpanContext(TRACE_ID, SPAN_ID, True, TraceFlags(1))


def test_headers_carry_tracestate_and_baggage() -> None:
    state = TraceState([("vendor", "abc")])
    span = NonRecordingSpan(SpanContext(TRACE_ID, SPAN_ID, False, TraceFlags(1), state))
    assert dict(_trace_headers(span)) == {"traceparent": TRACEPARENT, "tracestate": "vendor=abc"}
    token = otel_context.attach(baggage.set_baggage("user", "alice"))
    try:
        headers = dict(_trace_headers(span))
    finally:
        otel_context.detach(token)
    assert headers["traceparent"] == TRACEPARENT and headers["baggage"] == "user=alice"


def test_an_invalid_span_writes_no_headers() -> None:
    assert _trace_headers(NonRecordingSpan(SpanContext(0, 0, False))) == []
