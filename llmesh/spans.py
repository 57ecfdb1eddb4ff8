"""A lean recording path for OpenTelemetry spans.

The SDK's `Span` validates every attribute under a lock, keeps bounded collections with locks
of their own and calls the span processors when it starts and ends: about 40 µs for a server
span with a dozen attributes in a warm microbenchmark, and several times that in a busy service,
where it was most of what tracing added to a cache hit.

Here a span on the request path is a plain object: attributes go into a dict, `end` appends it
to a queue. A background thread turns finished spans into the SDK's `ReadableSpan` (cleaning and
bounding attributes, events and links as the SDK would) and hands them to the SDK span
processors, so sampling (`OTEL_TRACES_SAMPLER`), batching (`OTEL_BSP_*`), resources and the OTLP
exporter are the SDK's own and nothing about the exported data changes.

Processors see `on_end` only (off the request path, within `FLUSH_INTERVAL_S`); `on_start` is
not called, which the batch and simple processors do not need.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import traceback
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.context import Context
from opentelemetry.sdk.trace import Event, ReadableSpan, TracerProvider, sampling
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation import _SPAN_KEY  # where the API keeps the current span
from opentelemetry.util import types

log = logging.getLogger(__name__)

# How often the background thread hands finished spans to the processors (sooner when a batch
# of BATCH spans is waiting). The batch processor then exports on its own schedule.
FLUSH_INTERVAL_S = 0.2
BATCH = 512
# Finished spans waiting for the thread; beyond this they are dropped (and counted), as the
# SDK's batch processor drops beyond its queue.
MAX_QUEUED = 8192
MAX_EVENTS = 128
MAX_LINKS = 128

_UNSET = Status(StatusCode.UNSET)
# Attribute values that need no cleaning (string keys are the callers' side of the contract).
_PLAIN = frozenset({str, int, float, bool})
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)


class LeanSpan(trace.Span):
    """A recording span that only stores what it is told until it ends."""

    __slots__ = (
        "_context",
        "_provider",
        "attributes",
        "end_time",
        "events",
        "kind",
        "links",
        "name",
        "parent",
        "scope",
        "start_time",
        "status",
    )

    def __init__(
        self,
        provider: LeanTracerProvider,
        scope: InstrumentationScope,
        name: str,
        context: SpanContext,
        parent: SpanContext | None,
        kind: SpanKind,
        attributes: dict[str, Any],
        links: Sequence[Link],
        start_time: int | None,
    ) -> None:
        self._provider = provider
        self.scope = scope
        self.name = name
        self._context = context
        self.parent = parent
        self.kind = kind
        self.attributes = attributes
        self.links: list[Link] = list(links[:MAX_LINKS]) if links else []
        self.events: list[tuple[str, types.Attributes, int]] = []
        self.status = _UNSET
        self.start_time = start_time or time.time_ns()
        self.end_time: int | None = None

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return self.end_time is None

    def set_attribute(self, key: str, value: types.AnyValue) -> None:
        if self.end_time is None:
            self.attributes[key] = value

    def set_attributes(self, attributes: Mapping[str, types.AnyValue]) -> None:
        if self.end_time is None:
            self.attributes.update(attributes)

    def add_event(self, name: str, attributes: types.Attributes = None, timestamp: int | None = None) -> None:
        if self.end_time is None and len(self.events) < MAX_EVENTS:
            self.events.append((name, attributes, timestamp or time.time_ns()))

    def add_link(self, context: SpanContext, attributes: types.Attributes = None) -> None:
        if self.end_time is None and context.is_valid and len(self.links) < MAX_LINKS:
            self.links.append(Link(context, attributes))

    def update_name(self, name: str) -> None:
        if self.end_time is None:
            self.name = name

    def set_status(self, status: Status | StatusCode, description: str | None = None) -> None:
        # As the SDK: OK is final; a description only goes with ERROR.
        if self.end_time is not None or self.status.status_code is StatusCode.OK:
            return
        self.status = status if isinstance(status, Status) else Status(status, description)

    def record_exception(
        self,
        exception: BaseException,
        attributes: types.Attributes = None,
        timestamp: int | None = None,
        escaped: bool = False,
    ) -> None:
        event: dict[str, Any] = {
            "exception.type": type(exception).__qualname__,
            "exception.message": str(exception),
            "exception.stacktrace": "".join(traceback.format_exception(exception)),
            "exception.escaped": str(escaped),
        }
        if attributes:
            event.update(attributes)
        self.add_event("exception", event, timestamp)

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is None:
            self.end_time = end_time or time.time_ns()
            self._provider._finished(self)

    def __repr__(self) -> str:
        return f"LeanSpan(name={self.name!r}, context={self._context!r})"


class LeanTracer(trace.Tracer):
    def __init__(self, provider: LeanTracerProvider, scope: InstrumentationScope) -> None:
        self._provider = provider
        self._scope = scope

    def start_span(
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
    ) -> trace.Span:
        current = (context if context is not None else otel_context.get_current()).get(_SPAN_KEY)
        parent = current.get_span_context() if isinstance(current, trace.Span) else None
        return self.start_child(name, parent, kind, attributes, links, start_time, context)

    def start_child(
        self,
        name: str,
        parent: SpanContext | None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        context: Context | None = None,
    ) -> trace.Span:
        """`start_span` with the parent given directly (e.g. read from a request's traceparent)."""
        provider = self._provider
        if parent is not None and parent.is_valid:
            trace_id = parent.trace_id
        else:
            parent = None
            trace_id = provider.id_generator.generate_trace_id()
        links = links or ()
        recorded = dict(attributes) if attributes else {}
        sampler = provider.sampler
        # The two default samplers decide without building a SamplingResult.
        if sampler is sampling.ALWAYS_ON or sampler is sampling.DEFAULT_ON:
            sample = parent is None or sampler is sampling.ALWAYS_ON or parent.trace_flags.sampled
            record, trace_state = sample, parent.trace_state if parent is not None else None
        else:
            result = sampler.should_sample(context, trace_id, name, kind, attributes, links)
            sample, record = result.decision.is_sampled(), result.decision.is_recording()
            trace_state = result.trace_state
            if result.attributes:
                recorded.update(result.attributes)
        span_context = SpanContext(
            trace_id,
            provider.id_generator.generate_span_id(),
            is_remote=False,
            trace_flags=_SAMPLED if sample else _NOT_SAMPLED,
            trace_state=trace_state,
        )
        if not record or not provider.has_processors:
            # Nothing would receive it (no exporter configured): the ids still propagate.
            return trace.NonRecordingSpan(span_context)
        return LeanSpan(provider, self._scope, name, span_context, parent, kind, recorded, links, start_time)

    @contextlib.contextmanager
    def start_as_current_span(  # type: ignore[override]
        self,
        name: str,
        context: Context | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: types.Attributes = None,
        links: Sequence[Link] | None = None,
        start_time: int | None = None,
        record_exception: bool = True,
        set_status_on_exception: bool = True,
        end_on_exit: bool = True,
    ) -> Iterator[trace.Span]:
        span = self.start_span(name, context, kind, attributes, links, start_time)
        with trace.use_span(
            span,
            end_on_exit=end_on_exit,
            record_exception=record_exception,
            set_status_on_exception=set_status_on_exception,
        ) as current:
            yield current


class LeanTracerProvider(TracerProvider):
    """The SDK provider (sampler, resource, span processors, OTEL_SDK_DISABLED) with lean spans."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._queue: deque[LeanSpan] = deque()
        self._wake = threading.Event()
        self._drain_lock = threading.Lock()
        self._stopping = False
        self.dropped_spans = 0
        self._worker = threading.Thread(target=self._run, name="llmesh-spans", daemon=True)
        self._worker.start()

    def get_tracer(
        self,
        instrumenting_module_name: str,
        instrumenting_library_version: str | None = None,
        schema_url: str | None = None,
        attributes: types.Attributes = None,
    ) -> trace.Tracer:
        if getattr(self, "_disabled", False):
            return trace.NoOpTracer()
        scope = InstrumentationScope(
            instrumenting_module_name or "", instrumenting_library_version, schema_url, attributes
        )
        return LeanTracer(self, scope)

    def _finished(self, span: LeanSpan) -> None:
        queue = self._queue
        if len(queue) >= MAX_QUEUED:
            self.dropped_spans += 1
            return
        queue.append(span)
        if len(queue) >= BATCH and not self._wake.is_set():
            self._wake.set()

    def _readable(self, span: LeanSpan) -> ReadableSpan:
        limits = self._span_limits
        attributes: Mapping[str, Any] = span.attributes
        if (
            len(attributes) > (limits.max_span_attributes or len(attributes))
            or limits.max_span_attribute_length is not None
            or not all(type(value) in _PLAIN for value in attributes.values())
        ):
            # Cleaned and bounded as the SDK does (None and other invalid values are dropped).
            attributes = BoundedAttributes(
                limits.max_span_attributes,
                {key: value for key, value in attributes.items() if value is not None},
                immutable=True,
                max_value_len=limits.max_span_attribute_length,
            )
        return ReadableSpan(
            name=span.name,
            context=span.get_span_context(),
            parent=span.parent,
            resource=self.resource,
            attributes=attributes,
            events=tuple(
                Event(
                    name,
                    BoundedAttributes(
                        limits.max_event_attributes, attrs, immutable=True, max_value_len=limits.max_attribute_length
                    ),
                    ts,
                )
                for name, attrs, ts in span.events
            ),
            links=tuple(span.links),
            kind=span.kind,
            status=span.status,
            start_time=span.start_time,
            end_time=span.end_time,
            instrumentation_scope=span.scope,
        )

    def _drain(self) -> None:
        with self._drain_lock:
            processor = self._active_span_processor
            while True:
                try:
                    span = self._queue.popleft()
                except IndexError:
                    return
                try:
                    processor.on_end(self._readable(span))
                except Exception:  # one bad span must not stop the others
                    log.exception("could not hand span %r to the span processors", span.name)

    def _run(self) -> None:
        while not self._stopping:
            self._wake.wait(FLUSH_INTERVAL_S)
            self._wake.clear()
            self._drain()

    @property
    def has_processors(self) -> bool:
        return bool(getattr(self._active_span_processor, "_span_processors", True))

    def add_span_processor(self, span_processor: Any) -> None:
        # Spans that ended before the processor was added are not its business.
        self._drain()
        super().add_span_processor(span_processor)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self._drain()
        return super().force_flush(timeout_millis)

    def shutdown(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._worker.is_alive() and self._worker is not threading.current_thread():
            self._worker.join(5)
        self._drain()
        super().shutdown()
