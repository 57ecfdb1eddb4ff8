"""gRPC spans for every hop, at a fraction of the cost of channel and server interceptors.

opentelemetry-instrumentation-grpc's aio interceptors wrap every call in extra tasks and
objects; on a cache hit that was a third of the CPU the mesh spent. Here the server span is
opened by the one runtime interceptor (`llmesh.server`), and client spans by a thin wrapper
around the channel's multicallables, so a call costs one span and one metadata injection.

Spans carry the attributes the OpenTelemetry instrumentation emits (`rpc.system`,
`rpc.service`, `rpc.method`, `rpc.grpc.status_code`, `net.peer.ip`/`net.peer.port` on the
server), are named `<package.Service>/<Method>` as the RPC semantic conventions say, and follow
W3C trace context (`traceparent`) through the global propagator.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from contextvars import Token
from functools import partial
from typing import Any

import grpc
from grpc._cython import cygrpc
from opentelemetry import baggage, propagate, trace
from opentelemetry import context as otel_context
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.trace import NonRecordingSpan, Span, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from llmesh.spans import LeanTracer

# Health checks and reflection are polled by orchestrators: no span for them.
UNTRACED_SERVICES = frozenset({"grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"})
# Server spans are errors only for these codes (the RPC semantic conventions): a refused bad
# request or a shed is the server working as designed.
SERVER_ERROR_CODES = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_CODES = {code.value[0]: code for code in grpc.StatusCode}
# A server span without a caller's trace starts a new trace, whatever context the handler runs in.
_ROOT = otel_context.Context()


def split_method(full: str) -> tuple[str, str]:
    """ "/pkg.Service/Method" -> ("pkg.Service", "Method")."""
    _, service, method = full.split("/", 2) if full.count("/") >= 2 else ("", "", full)
    return service, method


def _peer_attributes(peer: str | None) -> dict[str, Any]:
    # "ipv4:127.0.0.1:5555", "ipv6:[::1]:5555", "unix:/path"
    if not peer or not peer.startswith(("ipv4:", "ipv6:")):
        return {}
    host, _, port = peer[5:].rpartition(":")
    return {"net.peer.ip": host.strip("[]"), "net.peer.port": int(port)} if port.isdigit() else {}


# --- W3C trace context on the hot path --------------------------------------------------------
# With the default propagators (tracecontext, baggage) a plain `traceparent` is read and written
# here directly; anything else (tracestate, baggage, other versions or propagators) goes through
# the global propagator as before.

_default_textmap: tuple[Any, bool] = (None, False)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


def _is_default_textmap() -> bool:
    global _default_textmap
    textmap = propagate.get_global_textmap()
    if textmap is not _default_textmap[0]:
        kinds = [type(p) for p in getattr(textmap, "_propagators", ())]
        _default_textmap = (textmap, kinds == [TraceContextTextMapPropagator, W3CBaggagePropagator])
    return _default_textmap[1]


def _parent(metadata: Sequence[tuple[str, Any]] | None) -> tuple[SpanContext | None, otel_context.Context | None]:
    """The caller's span context read from a plain `traceparent`, or else the whole context the
    global propagator extracts (tracestate, baggage, other propagators); (None, None): no parent."""
    traceparent = None
    for key, value in metadata or ():
        if key == "traceparent":
            traceparent = value
        elif key in ("tracestate", "baggage"):
            traceparent = None
            break
    else:
        if traceparent is None:
            return (None, None) if _is_default_textmap() else (None, propagate.extract(_carrier(metadata)))
        match = _TRACEPARENT.fullmatch(traceparent) if isinstance(traceparent, str) else None
        if match is not None and _is_default_textmap():
            trace_id, span_id, flags = match.groups()
            parent = SpanContext(int(trace_id, 16), int(span_id, 16), True, TraceFlags(int(flags, 16)))
            return (parent, None) if parent.is_valid else (None, None)
    return None, propagate.extract(_carrier(metadata))


def _parent_context(metadata: Sequence[tuple[str, Any]] | None) -> otel_context.Context | None:
    """The caller's trace context from the call's metadata (None: no parent)."""
    parent, context = _parent(metadata)
    if parent is not None:
        return trace.set_span_in_context(NonRecordingSpan(parent))
    return context


_resolved: tuple[object, trace.Tracer] | None = None


def _tracer() -> trace.Tracer:
    """The RPC tracer of the installed provider, resolved once (not through a ProxyTracer)."""
    global _resolved
    provider = trace.get_tracer_provider()
    if _resolved is None or _resolved[0] is not provider:
        _resolved = (provider, provider.get_tracer("llmesh.rpc"))
    return _resolved[1]


def _carrier(metadata: Sequence[tuple[str, Any]] | None) -> dict[str, str]:
    return {key: value for key, value in metadata or () if isinstance(value, str)}


def _trace_headers(span: Span) -> list[tuple[str, str]]:
    """The metadata that carries `span` as the parent of the callee's spans."""
    if _is_default_textmap() and not baggage.get_all():
        ctx = span.get_span_context()
        if not ctx.is_valid:
            return []
        headers = [("traceparent", f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}")]
        if ctx.trace_state:
            headers.append(("tracestate", ctx.trace_state.to_header()))
        return headers
    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=trace.set_span_in_context(span))
    return list(carrier.items())


_peers: dict[str, dict[str, Any]] = {}
MAX_REMEMBERED_PEERS = 4096


def _peer_attributes_of(peer: str | None) -> dict[str, Any]:
    """`_peer_attributes`, remembered per peer address (a handful of long-lived channels)."""
    if peer is None:
        return {}
    attributes = _peers.get(peer)
    if attributes is None:
        attributes = _peer_attributes(peer)
        if len(_peers) < MAX_REMEMBERED_PEERS:
            _peers[peer] = attributes
    return attributes


def start_server_span(
    name: str, headers: Sequence[tuple[str, Any]] | None, attributes: dict[str, Any]
) -> tuple[Span, Token[otel_context.Context]]:
    """Opens a SERVER span continuing the caller's trace from its `traceparent` (gRPC metadata or
    HTTP headers, lower-case keys) and makes it current; returns it with the token to detach."""
    parent, extracted = _parent(headers)
    tracer = _tracer()
    if extracted is None and isinstance(tracer, LeanTracer):
        span: Span = tracer.start_child(name, parent, SpanKind.SERVER, attributes)
    else:
        if extracted is None:
            extracted = _ROOT if parent is None else trace.set_span_in_context(NonRecordingSpan(parent))
        span = tracer.start_span(name, context=extracted, kind=SpanKind.SERVER, attributes=attributes)
    # The caller's baggage, when it sent some, stays with the handler.
    return span, otel_context.attach(trace.set_span_in_context(span, extracted))


class ServerMethod:
    """Span name and RPC attributes of one served method, computed once per method."""

    __slots__ = ("attributes", "name")

    def __init__(self, full_method: str) -> None:
        service, method = split_method(full_method)
        self.name = f"{service}/{method}"
        self.attributes: dict[str, Any] = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


class ServerSpan:
    """The span of one served RPC, current while the handler runs."""

    __slots__ = ("_token", "span")

    def __init__(
        self,
        method: ServerMethod | str,
        context: grpc.aio.ServicerContext,
        metadata: Sequence[tuple[str, Any]] | None = None,
    ) -> None:
        """`metadata`: the caller's, where it is not the call's own (a generation started inside
        an Inference.GenerateMany stream carries its trace context in its start message)."""
        if isinstance(method, str):
            method = ServerMethod(method)
        attributes = {**method.attributes, **_peer_attributes_of(context.peer())}
        headers = context.invocation_metadata() if metadata is None else metadata
        self.span, self._token = start_server_span(method.name, headers, attributes)

    def finish(self, code: grpc.StatusCode, exc: BaseException | None = None) -> None:
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code in SERVER_ERROR_CODES:
            self.span.set_status(Status(StatusCode.ERROR, f"{code.name}: {exc}" if exc is not None else code.name))
        otel_context.detach(self._token)
        self.span.end()


def traced(full_method: str) -> bool:
    return split_method(full_method)[0] not in UNTRACED_SERVICES


def _call_code(call: Any) -> grpc.StatusCode | None:
    """The status of a finished aio call, read without awaiting (done callbacks are sync)."""
    status = getattr(getattr(call, "_cython_call", None), "_status", None)
    if isinstance(status, cygrpc.AioRpcStatus):
        return _CODES.get(int(status.code()))
    return None


def _end_client_span(span: Span, call: Any) -> None:
    code = _call_code(call)
    if code is None:
        code = grpc.StatusCode.CANCELLED if call.cancelled() else grpc.StatusCode.UNKNOWN
    end_client_span(span, code)


def start_client_span(full_method: str, attributes: dict[str, Any] | None = None) -> tuple[Span, list[tuple[str, str]]]:
    """A CLIENT span for one call of `full_method` that is not a call of its own (a generation
    inside an Inference.GenerateMany stream), with the metadata that makes it the callee's parent."""
    service, method = split_method(full_method)
    attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method, **(attributes or {})}
    span = _tracer().start_span(f"{service}/{method}", kind=SpanKind.CLIENT, attributes=attributes)
    return span, _trace_headers(span)


def end_client_span(span: Span, code: grpc.StatusCode) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code is not grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, code.name))
    span.end()


class _TracedMultiCallable:
    """Starts a client span, injects its context into the call's metadata, ends it when the
    call is done. Returns grpc's own call object, so callers await, iterate and cancel it."""

    def __init__(self, inner: Any, full_method: str, extra: Sequence[tuple[str, str]] = ()) -> None:
        self._inner = inner
        self._extra = tuple(extra)
        service, method = split_method(full_method)
        self._name = f"{service}/{method}"
        self._attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}

    def __call__(self, request: Any, *, metadata: Sequence[tuple[str, Any]] | None = None, **kwargs: Any) -> Any:
        span = _tracer().start_span(self._name, kind=SpanKind.CLIENT, attributes=self._attributes)
        call = self._inner(request, metadata=(*(metadata or ()), *self._extra, *_trace_headers(span)), **kwargs)
        call.add_done_callback(partial(_end_client_span, span))
        return call


class _WithMetadata:
    """A stream-stream callable whose calls carry `extra` metadata (each operation on such a
    stream traces itself)."""

    def __init__(self, inner: Any, extra: tuple[tuple[str, str], ...]) -> None:
        self._inner = inner
        self._extra = extra

    def __call__(self, *args: Any, metadata: Sequence[tuple[str, Any]] | None = None, **kwargs: Any) -> Any:
        return self._inner(*args, metadata=(*(metadata or ()), *self._extra), **kwargs)


class TracedChannel:
    """A grpc.aio channel whose stubs trace every call (unary and server-streaming); `metadata`
    goes with every call (the mesh credential)."""

    def __init__(self, channel: grpc.aio.Channel, metadata: Sequence[tuple[str, str]] = ()) -> None:
        self.channel = channel
        self.metadata = tuple(metadata)

    def unary_unary(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _TracedMultiCallable(self.channel.unary_unary(method, *args, **kwargs), method, self.metadata)

    def unary_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        return _TracedMultiCallable(self.channel.unary_stream(method, *args, **kwargs), method, self.metadata)

    def stream_stream(self, method: str, *args: Any, **kwargs: Any) -> Any:
        inner = self.channel.stream_stream(method, *args, **kwargs)
        return _WithMetadata(inner, self.metadata) if self.metadata else inner

    def __getattr__(self, name: str) -> Any:
        # close, get_state, channel_ready, wait_for_state_change, stream_* ...
        return getattr(self.channel, name)

    async def __aenter__(self) -> TracedChannel:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.channel.close()
