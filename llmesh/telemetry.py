"""OpenTelemetry tracing (OTLP export from the standard OTEL_* variables) and JSON logs that
carry the active trace_id and span_id."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from llmesh.spans import LeanTracerProvider

_provider: TracerProvider | None = None


class JsonFormatter(logging.Formatter):
    """One JSON object per line; trace_id/span_id of the span active when the record was made."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            entry["trace_id"] = format(ctx.trace_id, "032x")
            entry["span_id"] = format(ctx.span_id, "016x")
        extra = getattr(record, "fields", None)
        if isinstance(extra, dict):
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("httpx", "urllib3", "filelock", "sentence_transformers", "transformers"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _otlp_configured() -> bool:
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup_tracing(service: str, exporter: SpanExporter | None = None) -> TracerProvider:
    """Installs the global tracer provider once per process. Sampling follows OTEL_TRACES_SAMPLER;
    OTLP/gRPC export only when an endpoint is configured (or an exporter is given, for tests)."""
    global _provider
    if _provider is not None:
        if exporter is not None:
            _provider.add_span_processor(BatchSpanProcessor(exporter))
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or f"llmesh-{service}"
    provider = LeanTracerProvider(resource=Resource.create({SERVICE_NAME: name, "llmesh.service": service}))
    if exporter is None and _otlp_configured():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # Short export timeout: an unreachable collector must never slow requests down;
        # export runs on the batch processor's thread, off the request path.
        exporter = OTLPSpanExporter(timeout=5)
    if exporter is not None:
        # Batch sizes and delays follow the standard OTEL_BSP_* variables.
        provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=5000)
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
