"""OpenTelemetry tracing (OTLP export from the standard OTEL_* variables) and logs: JSON lines
that carry the active trace_id and span_id, or short colored lines for a person at a terminal
(LLMESH_LOG_FORMAT). The supervisor renders its children's JSON lines with the same code."""

from __future__ import annotations

import calendar
import json
import logging
import os
import re
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter

from llmesh.spans import LeanTracerProvider

_provider: TracerProvider | None = None

# Spans per OTLP export call (the SDK's default, 512, unless OTEL_BSP_MAX_EXPORT_BATCH_SIZE says):
# encoding a batch is pure Python that holds the GIL from start to end, and a request waiting for
# the GIL then waits for the whole batch. Smaller batches give it back at each call's network wait.
EXPORT_BATCH = 64
# How long a thread that holds the GIL keeps it from one that asks (CPython's default: 5 ms).
# The event loop gives the GIL up at every socket call; while the export threads encode, each of
# those calls waited up to this long to get it back, a request's dozen of them adding up to the
# tail. Set only in a process that exports spans.
EXPORT_SWITCH_INTERVAL_S = 0.0005


def log_entry(record: logging.LogRecord, service: str, exc_text: str = "") -> dict[str, Any]:
    """The fields of one log line: time, level, service, logger, message, the active trace and
    span ids, and the record's `extra={"fields": {...}}`."""
    entry: dict[str, Any] = {
        "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
        "level": record.levelname,
        "service": service,
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
    if exc_text:
        entry["exc"] = exc_text
    return entry


class JsonFormatter(logging.Formatter):
    """One JSON object per line; trace_id/span_id of the span active when the record was made."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        exc = self.formatException(record.exc_info) if record.exc_info else ""
        # ensure_ascii: every control character (C0, DEL, C1, U+2028/U+2029) is written escaped.
        return json.dumps(log_entry(record, self.service, exc), default=str)


# Console lines: `12:03:04.512 INFO  gateway   listening port=50051 metrics_port=9091`.
CONSOLE_HIDDEN = frozenset({"ts", "level", "service", "logger", "msg", "trace_id", "span_id", "exc"})
CONSOLE_MAX_FIELDS = 8
CONSOLE_MAX_VALUE = 80
SERVICE_WIDTH = 9
_RESET, _DIM, _BOLD = "\x1b[0m", "\x1b[2m", "\x1b[1m"
LEVEL_COLORS = {"DEBUG": "\x1b[34m", "INFO": "\x1b[32m", "WARNING": "\x1b[33m", "ERROR": "\x1b[31m"}
SERVICE_COLORS = {
    "gateway": "\x1b[36m",
    "tokenizer": "\x1b[33m",
    "inference": "\x1b[35m",
    "cache": "\x1b[32m",
    "retrieval": "\x1b[34m",
}


def _local_time(ts: str) -> str:
    """HH:MM:SS.mmm in local time from the JSON line's UTC `ts` (as is when it does not parse)."""
    try:
        seconds = calendar.timegm(time.strptime(ts[:19], "%Y-%m-%dT%H:%M:%S"))
        return time.strftime("%H:%M:%S", time.localtime(seconds)) + ts[19:23]
    except (ValueError, OverflowError):
        return ts


# What a terminal acts on, or a reader takes for a line break: C0 controls (newline, carriage
# return, tab, ESC ...), DEL, C1 controls, and the Unicode line and paragraph separators. Tenant
# names, models, document ids and messages can come from requests: escaped, they can neither
# start a forged log line nor send escape sequences to the terminal.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    return _NAMED_ESCAPES.get(char) or (f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}")


def escape_control(text: str) -> str:
    """`text` with its control characters written as escapes (`\\n`, `\\x1b`, `\\u2028`)."""
    return _CONTROL.sub(_escape_char, text) if _CONTROL.search(text) else text


def _console_value(value: object) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    if not text or " " in text or "=" in text:
        if len(text) > CONSOLE_MAX_VALUE:
            text = text[: CONSOLE_MAX_VALUE - 1] + "…"
        return json.dumps(text)  # escapes every control character, as `\n` or `\u001b`
    text = escape_control(text)
    if len(text) > CONSOLE_MAX_VALUE:
        text = text[: CONSOLE_MAX_VALUE - 1] + "…"
    return text


def _traceback_lines(exc: str) -> str:
    """A traceback's own line breaks kept, each line indented and escaped."""
    return "\n".join(f"  {escape_control(line)}" for line in exc.split("\n")) if exc else ""


def render_console(entry: Mapping[str, Any], color: bool) -> str:
    """One short line for a person: local time, level, service, message and the few fields the
    code chose to log (the trace and span ids stay in the JSON lines). Control characters are
    escaped everywhere (`escape_control`); a traceback follows on lines of its own, each indented,
    so none of them reads as a log line of its own."""
    level = escape_control(str(entry.get("level", "INFO")))
    service = escape_control(str(entry.get("service", "")))
    raw_msg = str(entry.get("msg", ""))
    msg = escape_control(raw_msg)
    fields = [
        f"{escape_control(str(key))}={_console_value(value)}"
        for key, value in entry.items()
        if key not in CONSOLE_HIDDEN and not (key == "event" and value == raw_msg)
    ][:CONSOLE_MAX_FIELDS]
    clock = escape_control(_local_time(str(entry.get("ts", ""))))
    exc = _traceback_lines(str(entry.get("exc") or ""))
    if not color:
        line = f"{clock} {level:<7} {service:<{SERVICE_WIDTH}} {msg}" + "".join(f" {f}" for f in fields)
        return line + (f"\n{exc}" if exc else "")
    tone = LEVEL_COLORS.get(level, "")
    line = (
        f"{_DIM}{clock}{_RESET} {tone}{level:<7}{_RESET} "
        f"{SERVICE_COLORS.get(service, _BOLD)}{service:<{SERVICE_WIDTH}}{_RESET} "
        f"{_BOLD if level in ('WARNING', 'ERROR') else ''}{msg}{_RESET}"
        + "".join(f" {_DIM}{f}{_RESET}" for f in fields)
    )
    return line + (f"\n{LEVEL_COLORS['ERROR']}{exc}{_RESET}" if exc else "")


def wants_color(stream: TextIO) -> bool:
    """Colors on a terminal unless NO_COLOR is set (https://no-color.org)."""
    return not os.environ.get("NO_COLOR") and stream.isatty()


class ConsoleFormatter(logging.Formatter):
    def __init__(self, service: str, color: bool) -> None:
        super().__init__()
        self.service = service
        self.color = color

    def format(self, record: logging.LogRecord) -> str:
        exc = self.formatException(record.exc_info) if record.exc_info else ""
        return render_console(log_entry(record, self.service, exc), self.color)


def console_format(log_format: str, stream: TextIO) -> bool:
    """Whether LLMESH_LOG_FORMAT (auto, console, json) means console lines on this stream."""
    if log_format == "auto":
        try:
            return stream.isatty()
        except (AttributeError, ValueError):
            return False
    return log_format == "console"


def quiet_progress_bars(environ: dict[str, str] | os._Environ[str] = os.environ) -> None:
    """Library progress bars (tqdm in transformers, huggingface_hub, sentence-transformers while
    a model loads) would interleave with the log lines: they are turned off, unless a variable
    already says otherwise."""
    environ.setdefault("TQDM_DISABLE", "1")
    environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if environ is os.environ and environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        # Libraries imported before this call read the variables already: tell them directly.
        hub = sys.modules.get("huggingface_hub.utils")
        if hub is not None:
            hub.disable_progress_bars()
        transformers_logging = sys.modules.get("transformers.utils.logging")
        if transformers_logging is not None:
            transformers_logging.disable_progress_bar()


def setup_logging(service: str, level: str = "INFO", log_format: str = "auto") -> None:
    quiet_progress_bars()
    handler = logging.StreamHandler(sys.stderr)
    if console_format(log_format, sys.stderr):
        handler.setFormatter(ConsoleFormatter(service, wants_color(sys.stderr)))
    else:
        handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # Library warnings (warnings.warn) become log lines in the same format, not raw stderr text.
    logging.captureWarnings(True)
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
            _provider.add_span_processor(batch_processor(exporter))
        return _provider
    name = os.environ.get("OTEL_SERVICE_NAME") or f"llmesh-{service}"
    provider = LeanTracerProvider(resource=Resource.create({SERVICE_NAME: name, "llmesh.service": service}))
    if exporter is None and _otlp_configured():
        from llmesh.otlp import LeanOtlpSpanExporter

        # Short export timeout: an unreachable collector must never slow requests down;
        # export runs on the batch processor's thread, off the request path.
        exporter = LeanOtlpSpanExporter(timeout=5)
    if exporter is not None:
        provider.add_span_processor(batch_processor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def batch_processor(exporter: SpanExporter, environ: Mapping[str, str] = os.environ) -> BatchSpanProcessor:
    """The SDK's batch processor: sizes and delays from the standard OTEL_BSP_* variables, with
    EXPORT_BATCH spans per export call where OTEL_BSP_MAX_EXPORT_BATCH_SIZE is unset. The
    process's GIL switch interval drops to EXPORT_SWITCH_INTERVAL_S (never raised)."""
    batch = None if environ.get("OTEL_BSP_MAX_EXPORT_BATCH_SIZE") else EXPORT_BATCH
    queue = environ.get("OTEL_BSP_MAX_QUEUE_SIZE", "")
    if batch is not None and queue.isdigit() and int(queue) > 0:
        batch = min(batch, int(queue))  # the SDK refuses a batch larger than its queue
    sys.setswitchinterval(min(sys.getswitchinterval(), EXPORT_SWITCH_INTERVAL_S))
    return BatchSpanProcessor(exporter, max_export_batch_size=batch)


def shutdown_tracing() -> None:
    if _provider is not None:
        _provider.force_flush(timeout_millis=5000)
        _provider.shutdown()


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def current_trace_id() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
