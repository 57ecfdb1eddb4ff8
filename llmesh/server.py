"""Server bootstrap shared by every service.

A service supplies a `ServiceApp`: its servicers, the names it serves, a warm-up and a
cleanup. `ServiceHost` wraps it in a grpc.aio server with health (NOT_SERVING until the
warm-up is done), reflection, explicit message limits and keepalive, the error mapping
and metrics interceptor, and OpenTelemetry. `run_service` adds the process side: settings,
logging, the metrics endpoint and a graceful SIGTERM drain.
"""

from __future__ import annotations

import asyncio
import gc
import hmac
import inspect
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from llmesh import errors, memory, rpc_tracing, telemetry
from llmesh.channels import MESH_TOKEN_HEADER
from llmesh.metrics import (
    DEPENDENCY_UP,
    EVENT_LOOP_LAG,
    GRPC_HANDLED,
    GRPC_HANDLING,
    GRPC_STARTED,
    SERVING,
    MetricsEndpoint,
)
from llmesh.request_limits import RequestLimit
from llmesh.settings import RuntimeSettings, ServiceSettings, load_or_exit

log = logging.getLogger("llmesh.server")
# Lifecycle events (listening, serving, draining, stopped) are logged whatever the log level:
# supervisors read the bound ports from them.
lifecycle = logging.getLogger("llmesh.lifecycle")
lifecycle.setLevel(logging.INFO)
T = TypeVar("T")
S = TypeVar("S", bound=ServiceSettings)
HEALTH_DETAIL_INTERVAL_S = 1.0
LOOP_LAG_INTERVAL_S = 0.05


class ServiceApp(Protocol):
    """What a service gives the host."""

    @property
    def service_names(self) -> Sequence[str]:
        """Full gRPC service names, e.g. "llmesh.v1.Tokenizer"."""
        ...

    def register(self, server: grpc.aio.Server) -> None: ...

    async def start(self) -> None:
        """Load and warm up; the service reports SERVING once this returns."""

    async def stop(self) -> None:
        """Release resources after in-flight calls have drained."""


def server_options(runtime: RuntimeSettings) -> list[tuple[str, Any]]:
    size = runtime.max_message_bytes
    return [
        ("grpc.max_receive_message_length", size),
        ("grpc.max_send_message_length", size),
        ("grpc.keepalive_time_ms", 30_000),
        ("grpc.keepalive_timeout_ms", 10_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_pings_without_data", 0),
        # Clients reconnect periodically, so new replicas behind a DNS name get traffic.
        ("grpc.max_connection_age_ms", 300_000),
        ("grpc.max_connection_age_grace_ms", 60_000),
        ("grpc.so_reuseport", 0),
        # A stream's window opens for the message a handler reads, and no further: with the
        # bandwidth probe on, the window grows to megabytes on a fast link, so a call refused on
        # its metadata still had its whole body received and thrown away (7 ms of CPU per
        # refused 8 MiB call, against 0.7 ms). Loopback and LAN throughput hold without it.
        ("grpc.http2.bdp_probe", 0),
    ]


def server_credentials(runtime: RuntimeSettings) -> grpc.ServerCredentials | None:
    """TLS when a cert is set; mutual TLS (client certs required) when a client CA is set too."""
    if not runtime.tls_cert:
        return None
    client_ca = Path(runtime.tls_client_ca).read_bytes() if runtime.tls_client_ca else None
    return grpc.ssl_server_credentials(
        [(Path(runtime.tls_key).read_bytes(), Path(runtime.tls_cert).read_bytes())],
        root_certificates=client_ca,
        require_client_auth=client_ca is not None,
    )


def status_of(exc: BaseException, method: str) -> tuple[grpc.StatusCode, str, tuple[tuple[str, str | bytes], ...]]:
    """The one mapping of errors to statuses: (code, details, trailing metadata with the
    google.rpc details). Anything that is not a domain error is INTERNAL with a generic message,
    its traceback in the log. Used by the interceptor and by what carries a status inside a
    message (the generations of Inference.GenerateMany)."""
    if isinstance(exc, errors.LlmeshError):
        if exc.code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            log.error("%s failed: %s", method, exc.message)
        return exc.code, exc.message, tuple(exc.trailing_metadata())
    log.exception("unhandled error in %s", method, exc_info=exc)
    return grpc.StatusCode.INTERNAL, "internal error", ()


def set_status_for(exc: BaseException, context: grpc.aio.ServicerContext, method: str) -> None:
    """Sets the status of `exc` (`status_of`) on the call. The status goes out with the call's
    final batch when the handler returns: cheaper than `context.abort`, which sends it from inside
    the handler and unwinds with another exception (a shed is a status, and sheds come in floods)."""
    code, details, trailing = status_of(exc, method)
    context.set_code(code)
    context.set_details(details)
    if trailing:
        context.set_trailing_metadata(trailing)


class MethodMeter:
    """The gRPC server metrics of one method: started, handled by code, handling time. Built once
    per method (the label lookups are not free on a hot path)."""

    __slots__ = ("_handled", "_handling", "_labels", "_started")

    def __init__(self, kind: str, service: str, method: str) -> None:
        self._labels = (kind, service, method)
        self._started = GRPC_STARTED.labels(kind, service, method)
        self._handling = GRPC_HANDLING.labels(kind, service, method)
        self._handled: dict[grpc.StatusCode, Any] = {}

    def started(self) -> None:
        self._started.inc()

    def handled(self, code: grpc.StatusCode, seconds: float) -> None:
        counter = self._handled.get(code)
        if counter is None:
            counter = self._handled[code] = GRPC_HANDLED.labels(*self._labels, code.name)
        counter.inc()
        self._handling.observe(seconds)


#: Refuses a call before its request is read, from its method and metadata alone (raises a
#: domain error: a missing credential, an unknown API key).
CallGate = Callable[[str, Sequence[tuple[str, Any]]], None]
#: Told of each call the service refused as invalid (INVALID_ARGUMENT): its method and metadata.
RefusalObserver = Callable[[str, Sequence[tuple[str, Any]]], None]

HEALTH_PREFIX = "/grpc.health.v1.Health/"


def mesh_token_gate(token: str) -> CallGate:
    """Every call but a health check carries the mesh's credential (LLMESH_MESH_TOKEN): the
    internal services answer only the mesh's own processes, whoever else can reach their port."""
    expected = token.encode()

    def check(method: str, metadata: Sequence[tuple[str, Any]]) -> None:
        if method.startswith(HEALTH_PREFIX):
            return
        given = next((v for k, v in metadata if k == MESH_TOKEN_HEADER), "")
        given_bytes = given.encode() if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_bytes, expected):
            raise errors.Unauthenticated(
                "this service answers the mesh only: the call lacks the mesh credential", reason="MESH_TOKEN_INVALID"
            )

    return check


class RuntimeInterceptor(grpc.aio.ServerInterceptor):
    """The one server interceptor: the call gates (before the request is read), each method's
    request limit (on the request's bytes, before it is parsed), the RPC's span, domain errors
    mapped to statuses (one place) and the gRPC server metrics. Each method's wrapped handler is
    built once, not per call."""

    def __init__(
        self,
        gates: Sequence[CallGate] = (),
        limits: Mapping[str, RequestLimit] | None = None,
        refused: RefusalObserver | None = None,
    ) -> None:
        self._handlers: dict[str, _Method] = {}
        self._gates = tuple(gates)
        self._limits = dict(limits or {})
        self._refused = refused

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        full = handler_call_details.method
        method = self._handlers.get(full)
        if method is None:
            handler = await continuation(handler_call_details)
            if handler is None:
                return handler
            method = self._handlers[full] = _Method(full, handler, self._limits.get(full), self._refused)
        for gate in self._gates:
            try:
                gate(full, handler_call_details.invocation_metadata or ())
            except errors.LlmeshError as refused:
                return method.refusing(refused)
        return method.wrapped


class _Method:
    """One served method: its wrapped handler, and refusals that answer without reading the request."""

    def __init__(
        self, full: str, handler: grpc.RpcMethodHandler, limit: RequestLimit | None, refused: RefusalObserver | None
    ) -> None:
        self.full = full
        self.handler = handler
        self.wrapped = _wrap(full, handler, limit, refused)
        service, method = rpc_tracing.split_method(full)
        kind = "unary" if handler.unary_unary else "server_stream" if handler.unary_stream else "bidi_stream"
        self.meter = MethodMeter(kind, service, method)

    def refusing(self, refused: errors.LlmeshError) -> grpc.RpcMethodHandler:
        """A handler that answers `refused` without reading the request. It is served as a
        client-streaming handler whatever the method's kind (the wire format is the same): grpc
        reads a unary request whole before the handler runs, while a stream's messages are read
        only when asked for, so a refused caller's megabytes are never received."""
        full, meter, handler = self.full, self.meter, self.handler

        def answer(context: grpc.aio.ServicerContext) -> None:
            meter.started()
            set_status_for(refused, context, full)
            meter.handled(refused.code, 0.0)

        if handler.unary_unary or handler.stream_unary:

            async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                answer(context)
                return None

            return grpc.stream_unary_rpc_method_handler(unary, _unread, handler.response_serializer)

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            answer(context)
            return
            yield  # an async generator that yields nothing

        return grpc.stream_stream_rpc_method_handler(stream, _unread, handler.response_serializer)


def _unread(raw: bytes) -> None:
    return None


def _code_of(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    if isinstance(exc, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code
    if isinstance(exc, errors.LlmeshError):
        return exc.code
    return grpc.StatusCode.INTERNAL if exc is not None else grpc.StatusCode.OK


def _wrap(
    full: str, handler: grpc.RpcMethodHandler, limit: RequestLimit | None = None, refused: RefusalObserver | None = None
) -> grpc.RpcMethodHandler:
    service, method = rpc_tracing.split_method(full)
    traced_method = rpc_tracing.ServerMethod(full) if rpc_tracing.traced(full) else None
    kind = "unary" if handler.unary_unary else "server_stream" if handler.unary_stream else ""
    if not kind:
        # A bidirectional stream (Inference.GenerateMany) carries many operations, each with its
        # own span, metrics and status (`status_of`): the handler accounts for them itself.
        return handler
    meter = MethodMeter(kind, service, method)

    def begin(context: grpc.aio.ServicerContext) -> rpc_tracing.ServerSpan | None:
        meter.started()
        return rpc_tracing.ServerSpan(traced_method, context) if traced_method is not None else None

    def finish(started: float, context: Any, span: rpc_tracing.ServerSpan | None, exc: BaseException | None) -> None:
        code = _code_of(context, exc)
        meter.handled(code, time.perf_counter() - started)
        if refused is not None and code == grpc.StatusCode.INVALID_ARGUMENT:
            refused(full, context.invocation_metadata() or ())
        if span is not None:
            span.finish(code, exc)

    # grpc's own streaming servicers (Health.Watch) are coroutines writing with context.write
    # rather than async generators: they are awaited like a unary handler.
    writes = handler.unary_stream is not None and inspect.iscoroutinefunction(handler.unary_stream)
    if handler.unary_unary or writes:
        inner_uu = handler.unary_unary or handler.unary_stream

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            started = time.perf_counter()
            span = begin(context)
            exc: BaseException | None = None
            try:
                _refuse_unparsable(request)
                return await inner_uu(request, context)
            except BaseException as caught:
                exc = caught
                if isinstance(caught, Exception) and not _is_abort(caught):
                    set_status_for(caught, context, full)
                    return None
                raise
            finally:
                finish(started, context, span, exc)

        make = grpc.unary_stream_rpc_method_handler if writes else grpc.unary_unary_rpc_method_handler
        return make(unary_unary, _tolerant(handler.request_deserializer, full, limit), handler.response_serializer)
    inner_us = handler.unary_stream

    async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
        started = time.perf_counter()
        span = begin(context)
        exc: BaseException | None = None
        try:
            _refuse_unparsable(request)
            async for item in inner_us(request, context):
                yield item
        except BaseException as caught:
            exc = caught
            if isinstance(caught, Exception) and not _is_abort(caught):
                set_status_for(caught, context, full)
                return
            raise
        finally:
            finish(started, context, span, exc)

    return grpc.unary_stream_rpc_method_handler(
        unary_stream, _tolerant(handler.request_deserializer, full, limit), handler.response_serializer
    )


class _Unparsable:
    """Stands in for a request that is not parsed: its bytes did not parse, or its method's
    limit refused them; the handler refuses it with INVALID_ARGUMENT (grpc would otherwise answer
    UNKNOWN with a protobuf traceback)."""

    def __init__(self, error: errors.InvalidArgument) -> None:
        self.error = error


def _tolerant(
    deserializer: Callable[[bytes], Any] | None, full: str = "", limit: RequestLimit | None = None
) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    method = rpc_tracing.split_method(full)[1] if full else "this method"

    def parse(raw: bytes) -> Any:
        if limit is not None:
            refused = limit.refusal(raw, method)
            if refused is not None:
                return _Unparsable(refused)
        try:
            return deserializer(raw)
        except DecodeError as exc:
            return _Unparsable(errors.InvalidArgument([("", f"request is not a valid message: {exc}")]))

    return parse


def _refuse_unparsable(request: Any) -> None:
    if isinstance(request, _Unparsable):
        raise request.error


def _is_abort(exc: BaseException) -> bool:
    # grpc.aio signals context.abort() with this internal exception type.
    return type(exc).__name__ == "AbortError"


def call_gates(app: ServiceApp, settings: ServiceSettings) -> list[CallGate]:
    """The gates of a service's calls: the mesh credential on every service but the public
    gateway, where LLMESH_MESH_TOKEN is set; then the app's own (`admit_call`: the gateway's API
    keys, checked before a request's bytes are parsed)."""
    gates: list[CallGate] = []
    if settings.runtime.mesh_token and settings.service != "gateway":
        gates.append(mesh_token_gate(settings.runtime.mesh_token))
    admit = getattr(app, "admit_call", None)
    if admit is not None:
        gates.append(admit)
    return gates


class ServiceHost:
    """One gRPC server hosting one ServiceApp, with health and reflection."""

    def __init__(self, app: ServiceApp, settings: ServiceSettings) -> None:
        self.app = app
        self.settings = settings
        self.health = health_aio.HealthServicer()
        self.server = grpc.aio.server(
            interceptors=[
                RuntimeInterceptor(
                    call_gates(app, settings), getattr(app, "request_limits", None), getattr(app, "call_refused", None)
                )
            ],
            options=server_options(settings.runtime),
            maximum_concurrent_rpcs=None,
        )
        self.port = 0
        self.health_port = 0
        self._health_server: grpc.aio.Server | None = None
        self._details_task: asyncio.Task[None] | None = None

    async def start(self, on_listening: Callable[[int], None] | None = None) -> int:
        self.app.register(self.server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*self.app.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name]
        reflection.enable_server_reflection([*names, reflection.SERVICE_NAME], self.server)
        for name in ("", *self.app.service_names):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        credentials = server_credentials(self.settings.runtime)
        if credentials is None:
            self.port = self.server.add_insecure_port(self.settings.serving.listen)
        else:
            self.port = self.server.add_secure_port(self.settings.serving.listen, credentials)
        if self.port == 0:
            raise RuntimeError(f"could not bind {self.settings.serving.listen}")
        await self.server.start()
        if self.settings.runtime.health_listen:
            await self._start_health_listener(self.settings.runtime.health_listen)
        if on_listening is not None:
            on_listening(self.port)
        await self.app.start()
        await self.set_serving(True)
        if hasattr(self.app, "health_details") or hasattr(self.app, "serving"):
            self._details_task = asyncio.create_task(self._watch_details())
        return self.port

    async def _start_health_listener(self, address: str) -> None:
        """Health only, in plaintext, on its own server: probes that cannot present a client
        certificate (the kubelet's) read the status without opening the service's own port."""
        self._health_server = grpc.aio.server(options=server_options(self.settings.runtime))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._health_server)
        self.health_port = self._health_server.add_insecure_port(address)
        if self.health_port == 0:
            raise RuntimeError(f"could not bind {address}")
        await self._health_server.start()

    async def _watch_details(self) -> None:
        """Publishes the app's optional component health (e.g. the cache's Redis) as health entries
        named `<service>/<component>`: the service keeps SERVING while a part it can do without is down.
        An app with a `serving` property (inference on a remote backend) turns the whole service
        NOT_SERVING and back with it. An app with a `wait_changed` coroutine (returning when its
        health changed) has the change published at once, not at the next interval's look."""
        serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
        was_serving = True
        while True:
            if hasattr(self.app, "serving") and self.app.serving != was_serving:
                was_serving = self.app.serving
                await self.set_serving(was_serving)
            if hasattr(self.app, "health_details"):
                for component, ok in self.app.health_details().items():
                    DEPENDENCY_UP.labels(component).set(1 if ok else 0)
                    for name in self.app.service_names:
                        await self.health.set(f"{name}/{component}", serving if ok else not_serving)
            await self._next_details()

    async def _next_details(self) -> None:
        """Until the next look at the app's health: its announced change, or the interval."""
        wait = getattr(self.app, "wait_changed", None)
        if wait is None:
            await asyncio.sleep(HEALTH_DETAIL_INTERVAL_S)
            return
        try:
            async with asyncio.timeout(HEALTH_DETAIL_INTERVAL_S):
                await wait()
        except TimeoutError:
            pass

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.app.service_names):
            await self.health.set(name, status)
        SERVING.set(1 if serving else 0)

    async def stop(self, grace: float | None = None) -> None:
        """NOT_SERVING first (load balancers stop sending), then drain in-flight calls."""
        if self._details_task is not None:
            self._details_task.cancel()
        await self.set_serving(False)
        grace = self.settings.runtime.grace_seconds if grace is None else grace
        # An app serving another protocol too (the gateway's HTTP API) drains it alongside.
        drain = getattr(self.app, "drain", None)
        await asyncio.gather(self.server.stop(grace), *([drain(grace)] if drain is not None else []))
        if self._health_server is not None:
            await self._health_server.stop(0)
        await self.app.stop()


def apply_niceness(increment: int) -> int:
    """Adds LLMESH_NICE to this process's niceness (before any thread starts, so every thread
    inherits it) and returns the niceness it runs at. Raising priority (a negative increment)
    needs CAP_SYS_NICE: without it the service warns and keeps its niceness."""
    if increment:
        try:
            return os.nice(increment)
        except PermissionError:
            log.warning("LLMESH_NICE=%d needs CAP_SYS_NICE; keeping niceness %d", increment, os.nice(0))
    return os.nice(0)


def service_niceness(settings: ServiceSettings, environ: Mapping[str, str] = os.environ) -> int:
    """LLMESH_NICE, but 0 for an inference service on the openai backend when LLMESH_NICE is not
    set: that process computes nothing, it relays the tokens of an engine that runs at its own
    niceness (0 for a vLLM started by hand). Below a busy engine on the same cores it waits behind
    the engine's steps to pass each step's tokens on, and every stream's first token waits too."""
    inference = getattr(settings, "inference", None)
    if (
        settings.service == "inference"
        and "LLMESH_NICE" not in environ
        and getattr(inference, "backend", "builtin") == "openai"
    ):
        return 0
    return int(settings.serving.nice)


def run_service(model: type[S], factory: Callable[[S], ServiceApp]) -> None:
    """Entry point of `python -m services.<name>`: the service's settings model and its app."""
    settings = load_or_exit(model)
    service = settings.service
    telemetry.setup_logging(service, settings.runtime.log_level, settings.runtime.log_format)
    apply_niceness(service_niceness(settings))
    memory.map_large_buffers(settings.mmap_threshold_bytes)
    telemetry.setup_tracing(service)
    try:
        asyncio.run(_serve(service, factory, settings))
    finally:
        telemetry.shutdown_tracing()


async def watch_loop_lag(interval: float = LOOP_LAG_INTERVAL_S) -> None:
    """Samples how late the running loop wakes a timer into EVENT_LOOP_LAG, until cancelled:
    what every request on this loop waits for before its handler runs."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + interval
        await asyncio.sleep(interval)
        EVENT_LOOP_LAG.observe(max(0.0, loop.time() - due))


async def _serve(service: str, factory: Callable[[S], ServiceApp], settings: S) -> None:
    metrics = MetricsEndpoint(settings.runtime.metrics_host, settings.serving.metrics_port)
    host = ServiceHost(factory(settings), settings)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    started = time.perf_counter()

    def listening(port: int) -> None:
        fields = {"event": "listening", "port": port, "metrics_port": metrics.port, "health_port": host.health_port}
        lifecycle.info("listening", extra={"fields": fields})

    lag = asyncio.create_task(watch_loop_lag())
    startup = asyncio.create_task(host.start(listening))
    waiter = asyncio.create_task(stopping.wait())
    done, _ = await asyncio.wait({startup, waiter}, return_when=asyncio.FIRST_COMPLETED)
    if startup in done:
        startup.result()
        # Everything loaded so far (modules, models, descriptors) lives as long as the process:
        # out of the collector's sight, a full collection scans only what requests left behind,
        # which keeps its pause (20-30 ms in the gateway under load) off the latency tail.
        gc.collect()
        gc.freeze()
        # One machine-readable line: supervisors and tests read the bound ports from it.
        lifecycle.info(
            "serving",
            extra={
                "fields": {
                    "event": "serving",
                    "port": host.port,
                    "metrics_port": metrics.port,
                    "startup_seconds": round(time.perf_counter() - started, 3),
                }
            },
        )
        await waiter
    else:
        startup.cancel()
    lifecycle.info("draining", extra={"fields": {"event": "draining", "grace_seconds": settings.runtime.grace_seconds}})
    await host.stop()
    lag.cancel()
    metrics.close()
    lifecycle.info("stopped", extra={"fields": {"event": "stopped"}})


class Readiness(Generic[T]):
    """Holds what a servicer needs once warm-up is done. Servicers are registered before the
    server starts (grpc.aio allows nothing else), so a call arriving during warm-up gets
    UNAVAILABLE, which clients retry, instead of a crash."""

    def __init__(self) -> None:
        self._value: T | None = None

    def set(self, value: T) -> None:
        self._value = value

    def clear(self) -> None:
        self._value = None

    @property
    def ready(self) -> bool:
        return self._value is not None

    def get(self) -> T:
        if self._value is None:
            raise errors.Unavailable("service is warming up", reason="WARMING_UP", retry_after=1.0)
        return self._value
